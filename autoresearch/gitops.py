"""Git for the loop, always by SHA: the experiment branch, commits, resets, changed paths, experiment refs.

Experiments live on `autoresearch/<tag>`. Every experiment commit also gets a ref
`refs/ar/<tag>/<NNNN>`, so a discarded commit (reset away from the branch) stays reachable and its diff
can still be read. Commits made here skip the repo's own git hooks.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import time
from pathlib import Path

import git

from autoresearch.errors import GitError

RUNS_DIR = "runs"
IGNORED = (f"/{RUNS_DIR}/", "__pycache__/", "*.pyc", ".aider*", "/.claude/", "/.codex/")
_IDENTITY = {"GIT_AUTHOR_NAME": "ar", "GIT_AUTHOR_EMAIL": "ar@localhost",
             "GIT_COMMITTER_NAME": "ar", "GIT_COMMITTER_EMAIL": "ar@localhost"}
TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
LOCK_WAIT = 5.0     # seconds a git write waits for another git's lock file (an editor's `git status` holds the
                    # index's for milliseconds; one left by a killed git is cleared under ar's lock: session/loop.py)


def default_tag(today: _dt.date | None = None) -> str:
    """Upstream's tag style: lower-case month and day, like `nov30`."""
    d = today or _dt.date.today()
    return d.strftime("%b").lower() + str(d.day)


def check_tag(tag: str) -> str:
    if not TAG_RE.match(tag) or ".." in tag or tag.endswith(".lock"):
        raise GitError(f"tag {tag!r} must be lower-case letters, digits, '.', '_' or '-' (like nov30)")
    return tag


def branch_name(tag: str) -> str:
    return f"autoresearch/{tag}"


def short(sha: str) -> str:
    return sha[:7]


class GitRepo:
    """A git working tree that ar drives."""

    def __init__(self, path: str | Path):
        try:
            self.repo = git.Repo(Path(path), search_parent_directories=False)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise GitError(f"{path} is not a git repository with a commit; `ar init DIR` makes a workspace, or make "
                           "this one: git init && git add train.py && git commit -m baseline (or pass --repo)"
                           ) from None
        if self.repo.bare:
            raise GitError(f"{path} is a bare repository; ar needs a working tree")
        self.root = Path(self.repo.working_tree_dir).resolve()
        self.git_dir = Path(self.repo.git_dir).resolve()
        # `git status` takes no lock to refresh the index (an `ar` reading the tree before its repo lock refused it
        # held .git/index.lock while the holder checked out); `git diff` still may, so writes wait (_git)
        self.repo.git.update_environment(GIT_OPTIONAL_LOCKS="0")
        self._env = None if self._has_identity() else _IDENTITY

    def _has_identity(self) -> bool:
        try:
            self.repo.git.config("user.email")
            self.repo.git.config("user.name")
            return True
        except git.GitCommandError:
            return False

    def _git(self, *args: str, **kw) -> str:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                return self.repo.git.execute(["git", "-c", "core.hooksPath=/dev/null", *args],
                                             env=self._env, **kw)
            except git.GitCommandError as e:
                msg = (e.stderr or e.stdout or str(e)).strip().replace("stderr: ", "")
                if ".lock': File exists" in msg and time.monotonic() < deadline:
                    time.sleep(0.05)          # another git holds it: it did nothing here, so try again
                    continue
                raise GitError(f"git {' '.join(args[:2])} failed in {self.root}: {msg}") from None

    # -- state -------------------------------------------------------------------------------------------
    def ensure_commits(self) -> None:
        if not self.repo.head.is_valid():
            raise GitError(f"{self.root} has no commits yet; commit train.py first (git add train.py && git commit)")

    def head_sha(self) -> str:
        return self._git("rev-parse", "HEAD")

    def resolve(self, rev: str) -> str:
        """Full SHA of a commit-ish (a short SHA from results.tsv works)."""
        return self._git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")

    def current_branch(self) -> str | None:
        try:
            return self.repo.active_branch.name
        except TypeError:  # detached HEAD
            return None

    def dirty_paths(self) -> list[str]:
        """Tracked files that differ from HEAD (staged or not)."""
        out = self._git("status", "--porcelain", "--untracked-files=no", "-z")
        return [e[3:] for e in out.split("\0") if e]

    def tracked_changes(self, sha: str) -> list[str]:
        """Tracked paths where the working tree differs from commit `sha` (untracked files not included)."""
        out = self._git("diff", "--name-only", "-z", "--no-renames", sha, "--")
        return sorted(filter(None, out.split("\0")))

    def ensure_clean(self, command: str = "ar run") -> None:
        """Refuse a dirty tree, naming the `command` that needs it clean."""
        dirty = self.dirty_paths()
        if dirty:
            shown = ", ".join(dirty[:5]) + (" …" if len(dirty) > 5 else "")
            commit = "git commit -am '…'" if self._env is None else (
                "git -c user.name=you -c user.email=you@example.com commit -am '…' (git has no identity here; "
                "`git config --global user.name/user.email` sets one)")
            raise GitError(f"the working tree has uncommitted changes ({shown}); commit them ({commit}), put them "
                           f"aside (git stash), or score them first with `ar try`, before `{command}`")

    def ensure_ignored(self, patterns: tuple[str, ...] = None) -> None:
        """Make sure runs/ and agents' scratch files are ignored, through .git/info/exclude (nothing committed)."""
        patterns = patterns or IGNORED
        exclude = self.git_dir / "info" / "exclude"
        text = exclude.read_text() if exclude.exists() else ""
        missing = [p for p in patterns if p not in text.splitlines()]
        if missing:
            exclude.parent.mkdir(parents=True, exist_ok=True)
            sep = "" if text.endswith("\n") or not text else "\n"
            lines = "".join(p + "\n" for p in missing)
            exclude.write_text(f"{text}{sep}# ar: experiment results and agents' scratch files\n{lines}")

    def clear_stale_index_lock(self, settle: float = 1.0) -> bool:
        """Remove .git/index.lock left by a killed git process; call only while holding ar's repo lock. A lock
        younger than `settle` seconds may be a live git's (a `git diff` or an editor's `git status` refreshing
        the index holds it for milliseconds, then renames it over the index by name): it is waited for, and
        removed only if it is still there once that old. One that keeps being taken anew is left alone (False):
        a write then waits for it, or says it is there (_git)."""
        lock = self.git_dir / "index.lock"
        deadline = time.monotonic() + settle + 0.5
        while time.monotonic() < deadline:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                return False
            if age >= settle:
                lock.unlink(missing_ok=True)
                return True
            time.sleep(0.05)
        return False

    # -- branch ------------------------------------------------------------------------------------------
    def branch_exists(self, tag: str) -> bool:
        return branch_name(tag) in [h.name for h in self.repo.heads]

    def checkout_branch(self, tag: str) -> bool:
        """Check out autoresearch/<tag>, creating it from HEAD if missing. True when it was created."""
        name = branch_name(check_tag(tag))
        if self.branch_exists(tag):
            if self.current_branch() != name:
                self._git("checkout", "--quiet", name)
            return False
        self._git("checkout", "--quiet", "-b", name)
        return True

    # -- changes -----------------------------------------------------------------------------------------
    def untracked(self) -> dict[str, tuple[int, int]]:
        """Untracked, not ignored files -> (size, mtime_ns)."""
        out = self._git("ls-files", "--others", "--exclude-standard", "-z")
        snap = {}
        for p in filter(None, out.split("\0")):
            try:
                st = (self.root / p).stat()
                snap[p] = (st.st_size, st.st_mtime_ns)
            except OSError:
                continue
        return snap

    def changed_paths(self, sha: str, untracked_before: dict[str, tuple[int, int]] | None = None) -> list[str]:
        """Paths where the working tree differs from commit `sha`: tracked changes, deletions, and untracked
        files (those not in `untracked_before`, or changed since), ignored files excluded."""
        out = self._git("diff", "--name-only", "-z", "--no-renames", sha, "--")
        paths = set(filter(None, out.split("\0")))
        # `git diff <sha>` compares against the index for untracked-but-staged; add staged-only entries too
        staged = self._git("diff", "--name-only", "-z", "--no-renames", "--cached", sha, "--")
        paths |= set(filter(None, staged.split("\0")))
        before = untracked_before or {}
        for p, st in self.untracked().items():
            if before.get(p) != st:
                paths.add(p)
        return sorted(paths)

    def diff(self, a: str, b: str | None = None, paths: list[str] | None = None) -> str:
        """Unified diff a..b (b None: the working tree)."""
        args = ["diff", "--no-color", a] + ([b] if b else []) + ["--"] + list(paths or [])
        return self._git(*args, strip_newline_in_stdout=False)

    # -- writing -----------------------------------------------------------------------------------------
    def commit(self, paths: list[str], message: str, *, allow_empty: bool = False) -> str:
        """Stage `paths` (additions, edits, deletions) and commit them; returns the new SHA."""
        self._git("add", "--all", "--", *paths)
        args = ["commit", "--quiet", "--no-verify", "-m", message]
        if allow_empty:
            args.append("--allow-empty")
        self._git(*args)
        return self.head_sha()

    def reset_hard(self, sha: str) -> None:
        """Move the current branch and the working tree to `sha` (a full SHA, never a relative rev)."""
        assert re.fullmatch(r"[0-9a-f]{7,40}", sha), sha
        self._git("reset", "--quiet", "--hard", sha)

    def remove_untracked(self, paths: list[str]) -> None:
        """Delete the given untracked files (a proposal's new files); ignored files are never touched."""
        for p in paths:
            f = self.root / p
            if f.is_file() or f.is_symlink():
                f.unlink()
            for parent in f.parents:
                if parent == self.root or not parent.is_dir() or any(parent.iterdir()):
                    break
                parent.rmdir()

    def checkout_paths(self, sha: str, paths: list[str]) -> None:
        """Write the files at `paths` from commit `sha` into the working tree (and index)."""
        self._git("checkout", sha, "--", *paths)

    # -- experiment refs ---------------------------------------------------------------------------------
    def keep_ref(self, tag: str, exp_id: int, sha: str) -> None:
        self._git("update-ref", f"refs/ar/{tag}/{exp_id:04d}", sha)

    def exp_refs(self, tag: str) -> dict[int, str]:
        out = self._git("for-each-ref", "--format=%(refname) %(objectname)", f"refs/ar/{tag}/")
        refs = {}
        for line in filter(None, out.splitlines()):
            name, sha = line.split()
            refs[int(name.rsplit("/", 1)[1])] = sha
        return refs

    def delete_ref(self, tag: str, exp_id: int) -> None:
        self._git("update-ref", "-d", f"refs/ar/{tag}/{exp_id:04d}")

    def is_ancestor(self, a: str, b: str) -> bool:
        """Whether commit a is b or one of b's ancestors."""
        try:
            self._git("merge-base", "--is-ancestor", a, b)
            return True
        except GitError:
            return False

    def paths_between(self, a: str, b: str) -> list[str]:
        """Paths that differ between commits a and b."""
        return sorted(filter(None, self._git("diff", "--name-only", "-z", "--no-renames", a, b, "--").split("\0")))

    def commits_since(self, base: str) -> list[str]:
        """SHAs on HEAD after `base`, oldest first."""
        out = self._git("rev-list", "--reverse", f"{base}..HEAD")
        return out.split()

    def file_at(self, sha: str, path: str) -> str:
        return self._git("show", f"{sha}:{path}", strip_newline_in_stdout=False)


_GIT_FILES = ("config", "HEAD", "packed-refs", "info/exclude", "info/attributes", "info/grafts", "shallow")
_GIT_DIRS = ("hooks", "refs/heads", "refs/tags", "refs/ar")


def git_state(git_dir: Path) -> dict[str, bytes]:
    """What a proposal must never touch inside .git (config, hooks, HEAD, refs, info/): path -> bytes."""
    state = {}
    for rel in _GIT_FILES:
        f = git_dir / rel
        if f.is_file():
            state[rel] = f.read_bytes()
    for sub in _GIT_DIRS:
        d = git_dir / sub
        if d.is_dir():
            for f in sorted(d.rglob("*")):
                if f.is_file() and not f.name.endswith(".lock"):
                    try:
                        state[str(f.relative_to(git_dir))] = f.read_bytes()
                    except OSError:
                        continue
    return state


def restore_git_state(git_dir: Path, state: dict[str, bytes]) -> None:
    """Put back what git_state saw: rewrite changed files, delete files that appeared since."""
    now = git_state(git_dir)
    for rel in set(now) - set(state):
        (git_dir / rel).unlink(missing_ok=True)
    for rel, data in state.items():
        if now.get(rel) != data:
            f = git_dir / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(data)


def environ_without_git() -> dict[str, str]:
    """os.environ minus GIT_* variables that would redirect a child's git to another repo."""
    return {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
