"""gitops.py on real temporary repositories."""

import datetime as dt
import subprocess

import pytest

from autoresearch.errors import GitError
from autoresearch.gitops import GitRepo, branch_name, check_tag, default_tag, git_state, restore_git_state


def sh(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text("DEPTH = 8\n")
    (root / "prepare.py").write_text("X = 1\n")
    sh(root, "init", "-q")
    sh(root, "add", "-A")
    sh(root, "commit", "-qm", "start")
    return root


def test_default_tag_and_tag_check():
    assert default_tag(dt.date(2025, 11, 30)) == "nov30"
    assert default_tag(dt.date(2025, 3, 4)) == "mar4"
    assert check_tag("nov30") == "nov30"
    for bad in ("Nov30", "a/b", "", "x..y", "-x"):
        with pytest.raises(GitError):
            check_tag(bad)
    assert branch_name("nov30") == "autoresearch/nov30"


@pytest.mark.integration
def test_not_a_repo_and_no_commits(tmp_path):
    with pytest.raises(GitError, match="not a git repository"):
        GitRepo(tmp_path)
    sh(tmp_path, "init", "-q")
    with pytest.raises(GitError, match="no commits yet"):
        GitRepo(tmp_path).ensure_commits()


@pytest.mark.integration
def test_dirty_tree_is_refused_with_the_fix(repo):
    g = GitRepo(repo)
    g.ensure_clean()
    (repo / "notes.txt").write_text("untracked is fine\n")
    g.ensure_clean()
    (repo / "train.py").write_text("DEPTH = 9\n")
    with pytest.raises(GitError, match="git stash"):
        g.ensure_clean()


@pytest.mark.integration
def test_branch_commit_reset_by_sha_and_experiment_refs(repo):
    g = GitRepo(repo)
    start = g.head_sha()
    assert g.checkout_branch("t1") is True
    assert g.current_branch() == "autoresearch/t1"
    assert g.checkout_branch("t1") is False
    (repo / "train.py").write_text("DEPTH = 9\n")
    sha = g.commit(["train.py"], "depth 9")
    g.keep_ref("t1", 2, sha)
    g.reset_hard(start)
    assert g.head_sha() == start and (repo / "train.py").read_text() == "DEPTH = 8\n"
    assert g.exp_refs("t1") == {2: sha}
    assert "+DEPTH = 9" in g.diff(start, sha)            # the discarded commit is still reachable
    assert g.resolve(sha[:7]) == sha
    g.delete_ref("t1", 2)
    assert g.exp_refs("t1") == {}
    with pytest.raises(AssertionError):
        g.reset_hard("HEAD~1")


@pytest.mark.integration
def test_changed_paths_sees_untracked_but_not_ignored_runs(repo):
    g = GitRepo(repo)
    g.ensure_ignored()
    g.ensure_ignored()  # idempotent
    assert (repo / ".git/info/exclude").read_text().count("/runs/") == 1
    (repo / "old.txt").write_text("there before\n")
    before = g.untracked()
    (repo / "runs/t").mkdir(parents=True)
    (repo / "runs/t/results.tsv").write_text("x\n")
    (repo / "train.py").write_text("DEPTH = 7\n")
    (repo / "new.py").write_text("y = 1\n")
    (repo / "prepare.py").unlink()
    head = g.head_sha()
    assert g.changed_paths(head, before) == ["new.py", "prepare.py", "train.py"]
    assert "old.txt" in g.changed_paths(head)              # without a snapshot every untracked file counts
    assert g.tracked_changes(head) == ["prepare.py", "train.py"]


@pytest.mark.integration
def test_commits_skip_the_repos_hooks(repo):
    hook = repo / ".git/hooks/pre-commit"
    hook.write_text("#!/bin/sh\nexit 1\n")
    hook.chmod(0o755)
    g = GitRepo(repo)
    (repo / "train.py").write_text("DEPTH = 10\n")
    sha = g.commit(["train.py"], "passes despite the hook")
    assert g.head_sha() == sha


@pytest.mark.integration
def test_git_state_restore(repo):
    g = GitRepo(repo)
    state = git_state(g.git_dir)
    (g.git_dir / "hooks/post-commit").write_text("#!/bin/sh\necho pwned\n")
    (g.git_dir / "config").write_text((g.git_dir / "config").read_text() + "[user]\n\tname = evil\n")
    assert git_state(g.git_dir) != state
    restore_git_state(g.git_dir, state)
    assert git_state(g.git_dir) == state
    assert not (g.git_dir / "hooks/post-commit").exists()


@pytest.mark.integration
def test_stale_index_lock(repo):
    """A lock a killed git left is removed; one a live git holds for a moment is waited out, never removed."""
    import os
    import threading
    g = GitRepo(repo)
    lock = g.git_dir / "index.lock"
    lock.write_text("")
    os.utime(lock, (lock.stat().st_mtime - 5, lock.stat().st_mtime - 5))      # left 5 s ago
    assert g.clear_stale_index_lock() is True and not lock.exists()
    assert g.clear_stale_index_lock() is False
    lock.write_text("a live git's")
    threading.Timer(0.2, lock.rename, (g.git_dir / "index.new",)).start()   # it finishes: renamed away by name
    assert g.clear_stale_index_lock() is False
    assert (g.git_dir / "index.new").read_text() == "a live git's"
    lock.write_text("")                                   # fresh, and it stays: removed once a second old
    assert g.clear_stale_index_lock(settle=0.3) is True and not lock.exists()


@pytest.mark.integration
def test_status_takes_no_index_lock(repo):
    """`ar run` and `ar sweep` started together: the one refused by the repo lock has read the tree first; a git
    status that refreshed the index then held .git/index.lock while the holder checked out its branch, which
    failed on it. ar's status takes no optional lock: it never writes the index."""
    import os
    g = GitRepo(repo)
    index = g.git_dir / "index"

    def stale_stat():                          # a tracked file touched: its cached stat no longer matches
        t = (repo / "train.py").stat().st_mtime + 5
        os.utime(repo / "train.py", (t, t))
        return index.stat().st_mtime_ns

    before = stale_stat()
    assert g.dirty_paths() == []
    g.ensure_clean()
    assert index.stat().st_mtime_ns == before
    before = stale_stat()
    sh(repo, "status", "--porcelain")         # what a plain read does: it refreshes and rewrites the index
    assert index.stat().st_mtime_ns != before


@pytest.mark.integration
def test_a_write_waits_out_another_gits_lock_and_says_so_when_it_stays(repo, monkeypatch):
    import threading

    import autoresearch.gitops as gitops
    g = GitRepo(repo)
    lock = g.git_dir / "index.lock"
    lock.write_text("")
    threading.Timer(0.3, lock.unlink).start()                   # another git's, gone in a moment
    (repo / "train.py").write_text("DEPTH = 9\n")
    sha = g.commit(["train.py"], "deeper")
    assert g.file_at(sha, "train.py") == "DEPTH = 9\n"
    monkeypatch.setattr(gitops, "LOCK_WAIT", 0.3)
    lock.write_text("")                                          # one left by a killed git: it stays
    (repo / "train.py").write_text("DEPTH = 10\n")
    with pytest.raises(GitError, match="index.lock"):
        g.commit(["train.py"], "deeper still")
