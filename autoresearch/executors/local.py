"""Slots on this machine. `InlineExecutor`: one slot, the repository itself (the default: one experiment at
a time on the GPU the process sees). `LocalExecutor`: one git worktree per slot, CUDA_VISIBLE_DEVICES
pinned, one lock per GPU.

Each slot's worktree is runs/<tag>/worktrees/slot-<i> (ignored with runs/), on a detached HEAD; it shares
the repository's objects and refs, so a commit made there is the commit the main branch moves to when it is
kept. The lock of each GPU (lock.gpu_lock_path, machine-wide under the cache) is held while the loop runs,
beside the repo lock, so two loops never share a GPU.
"""

from __future__ import annotations

import shutil

from ..errors import GitError
from ..gitops import GitRepo
from ..harness.env import default_cache
from ..lock import RepoLock, gpu_lock_path
from . import Slot


class InlineExecutor:
    """One slot working in the repository itself."""

    name = "inline"

    def __init__(self):
        self.slots = [Slot(0, None, "inline")]

    def open(self, loop) -> None:
        pass

    def worktree(self, loop, slot: Slot) -> GitRepo:
        return loop.git

    def train(self, loop, ctx, x, budget: float, seed: int):
        return loop.train_here(ctx, x, budget, seed)

    def close(self) -> None:
        pass


class LocalExecutor:
    name = "local"

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self._locks: list[RepoLock] = []

    def open(self, loop) -> None:
        """Take every slot's GPU lock, then make (or reuse) every slot's worktree."""
        try:
            for s in self.slots:
                if s.gpu is not None:
                    lock = RepoLock(gpu_lock_path(default_cache(), s.gpu), tag=loop.tag, command=loop.command,
                                    extra={"repo": str(loop.root)}, label=f"on GPU {s.gpu}")
                    lock.acquire()
                    self._locks.append(lock)
        except BaseException:
            self.close()
            raise
        loop.git._git("worktree", "prune")

    def worktree(self, loop, slot: Slot) -> GitRepo:
        """The slot's worktree at the best commit (created on first use)."""
        path = loop.paths.worktree(slot.index)
        if path.exists():
            try:
                repo = GitRepo(path)
                if repo.root == path.resolve():
                    return repo
            except GitError:
                pass
            shutil.rmtree(path, ignore_errors=True)
            loop.git._git("worktree", "prune")
        path.parent.mkdir(parents=True, exist_ok=True)
        loop.git._git("worktree", "add", "--quiet", "--detach", str(path), loop.best_sha)
        return GitRepo(path)

    def train(self, loop, ctx, x, budget: float, seed: int):
        return loop.train_here(ctx, x, budget, seed)

    def close(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()


def clean_worktree(repo: GitRepo, sha: str) -> None:
    """Put a slot's worktree at `sha` with no leftovers of the last experiment (ignored files kept)."""
    repo.clear_stale_index_lock()
    repo.reset_hard(sha)
    repo._git("clean", "-fdq")
