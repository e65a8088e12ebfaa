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
    g = GitRepo(repo)
    (g.git_dir / "index.lock").write_text("")
    assert g.clear_stale_index_lock() is True
    assert g.clear_stale_index_lock() is False
