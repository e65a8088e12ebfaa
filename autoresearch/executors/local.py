"""Slots on this machine. `InlineExecutor`: one slot, the repository itself (the default: one experiment at
a time on the GPU the process sees). `LocalExecutor`: one git worktree per slot, CUDA_VISIBLE_DEVICES
pinned, one lock per GPU. Two slots on one GPU (`--gpus 0,0`) take turns (`GpuTurn`): a slot holds the GPU
from its training process's start to its exit, so one slot's proposal (an agent's thinking), workspace and
evaluation overlap the other's training, and no two training processes ever share the GPU.

Each slot's worktree is runs/<tag>/worktrees/slot-<i> (ignored with runs/), on a detached HEAD; it shares
the repository's objects and refs, so a commit made there is the commit the main branch moves to when it is
kept. The lock of each GPU (lock.gpu_lock_path, machine-wide under the cache) is held while the loop runs,
beside the repo lock, so two loops never share a GPU.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque

from autoresearch import faults
from autoresearch.trust import guards
from autoresearch.errors import GitError
from autoresearch.gitops import GitRepo, short
from autoresearch.harness.env import default_cache
from autoresearch.records.ledger import Status
from autoresearch.records.lock import RepoLock, gpu_lock_path
from autoresearch.experiment.metrics import DegradedWatch, parse_step
from autoresearch.experiment import settle
from autoresearch.experiment.context import Event, Experiment, SlotContext
from autoresearch.experiment.trial import run_trial
from autoresearch.slots import Slot

TAIL_LINES = 64     # the run's last output lines, kept for a log the size cap cut short


class GpuTurn:
    """The turn of the slots that share one GPU, first come, first served: `take()` waits for it (None when the
    session is stopping: then nothing may start), `give_back()` passes it on. Runs that wait are served in the
    order they asked (with three slots or more on a GPU, two may wait at once). A run may instead be told to start
    early (`early()` says when: experiment/headstart.py); the turn is then reserved for it, and its `take()` later
    (its first batch) gets it as soon as the holder gives it back. The holder says when its window closes
    (`opened`) and which processes are its (for the memory the next start-up must fit beside)."""

    def __init__(self, stopping: threading.Event):
        self.stopping = stopping
        self._cv = threading.Condition()
        self.holder = self.next = None            # the run holding the GPU; the one that started early
        self.window_end: float | None = None      # wall clock: the holder's window closes
        self.holder_pids = None                   # () -> the holder's process ids
        self.startups: list = []                  # each run's start-up here (go → first batch, less its wait),
        # and whether it ran beside a window (a head start)
        self.next_used = None                     # () -> GPU seconds the run that started early has used
        self.evaluators: dict = {}                # slot -> () -> the pids of its evaluator's processes
        self.line: list = []                      # the runs waiting in take(), in the order they asked

    def take(self, who, early=None, cancel: threading.Event | None = None) -> str | None:
        """Wait for the GPU: "turn" once it is `who`'s, "early" when `early()` allows a start beside the holder,
        None when stopping (or `cancel` is set)."""
        with self._cv:
            self.line.append(who)
            try:
                while not self.stopping.is_set() and not (cancel is not None and cancel.is_set()):
                    first = self.line[0] is who
                    if self.holder is None and (self.next is who or (self.next is None and first)):
                        self.holder, self.next, self.window_end, self.holder_pids = who, None, None, None
                        self.next_used = None
                        return "turn"
                    if early is not None and first and self.holder is not None and self.next is None and early():
                        self.next = who
                        return "early"
                    self._cv.wait(0.2)
                if self.next is who:
                    self.next, self.next_used = None, None
                return None
            finally:
                self.line.remove(who)
                self._cv.notify_all()

    def started_early(self, who, used) -> None:
        """The run that started early says how its GPU seconds are read (the holder's window gets them back)."""
        with self._cv:
            if self.next is who:
                self.next_used = used

    def lent(self) -> float:
        """GPU seconds the run that started early beside the holder has used so far (0 without one)."""
        with self._cv:
            used = self.next_used
        return float(used()) if used is not None else 0.0

    def opened(self, who, window_end: float, pids) -> None:
        with self._cv:
            if self.holder is who:
                self.window_end, self.holder_pids = window_end, pids

    def moved(self, who, window_end: float) -> None:
        """The holder's window closes later (seconds given back to it): the next head start is timed from then."""
        with self._cv:
            if self.holder is who and self.window_end is not None:
                self.window_end = max(self.window_end, window_end)

    def evaluating(self, slot, pids) -> None:
        """Slot `slot` scores its checkpoints on this GPU; `pids()` names its evaluator's processes now."""
        with self._cv:
            self.evaluators[slot] = pids

    def evaluator_pids(self) -> set[int]:
        """Every process of the evaluators of the slots on this GPU (what a window gets back: headstart.py)."""
        with self._cv:
            each = list(self.evaluators.values())
        return set().union(*(pids() for pids in each))

    def give_back(self, who) -> None:
        """The run `who` is done with the GPU (or, started early, gives up its place)."""
        with self._cv:
            if self.holder is who:
                self.holder, self.window_end, self.holder_pids = None, None, None
            if self.next is who:
                self.next, self.next_used = None, None
            self._cv.notify_all()


class InlineExecutor:
    """One slot working in the repository itself."""

    name = "inline"

    def __init__(self):
        self.slots = [Slot(0, None, "inline")]

    def open(self, loop) -> None:
        pass

    def worktree(self, loop, slot: Slot) -> GitRepo:
        return loop.git

    def holds(self, loop, ctx) -> bool:
        return False                  # one slot: nothing runs beside the baseline

    def train(self, loop, ctx, x, budget: float, seed: int):
        return train_here(loop, ctx, x, budget, seed)

    def close(self) -> None:
        pass


class LocalExecutor:
    name = "local"

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self._locks: list[RepoLock] = []
        self._turns: dict[int, GpuTurn] = {}

    def open(self, loop) -> None:
        """Take every slot's GPU lock, then make (or reuse) every slot's worktree."""
        gpus = [s.gpu for s in self.slots if s.gpu is not None]
        self._turns = {g: GpuTurn(loop.stopping) for g in set(gpus) if gpus.count(g) > 1}
        try:
            for gpu in dict.fromkeys(gpus):           # one lock per GPU, however many slots share it
                lock = RepoLock(gpu_lock_path(default_cache(), gpu), tag=loop.tag, command=loop.command,
                                extra={"repo": str(loop.root)}, label=f"on GPU {gpu}")
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

    def holds(self, loop, ctx) -> bool:
        """Whether a run of this slot waits for the baseline inside its training run, after its launcher's trusted
        start-up (which then overlaps the baseline's window): a slot taking turns on a GPU, training train.py."""
        return ctx.slot.gpu in self._turns and not loop.cfg.objective.custom

    def train(self, loop, ctx, x, budget: float, seed: int):
        hold = loop.gate if x.spec.kind != "baseline" else None    # called off if the baseline is not kept
        return train_here(loop, ctx, x, budget, seed, turn=self._turns.get(ctx.slot.gpu), hold=hold)

    def close(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()


def clean_worktree(repo: GitRepo, sha: str) -> None:
    """Put a slot's worktree at `sha` with no leftovers of the last experiment (ignored files kept)."""
    repo.clear_stale_index_lock()
    repo.reset_hard(sha)
    repo._git("clean", "-fdq")


def train_here(lp, ctx: SlotContext, x: Experiment, budget: float, seed: int, turn: GpuTurn | None = None,
               hold=None):
    """Step 5 on this machine (the local executors' train): train in a fresh sandboxed workspace on ar's
    clock, then the slot's trusted evaluator scores the checkpoint. Returns (run result, the status that
    stopped it early or None). `hold`: the baseline the run waits for (scheduler.BaselineGate); a baseline
    lets it go once it has trained cleanly, before its own evaluation."""
    req = lp.request(ctx, x, budget, seed)
    if turn is not None:
        turn.evaluating(ctx.slot.index, ctx.server.pids)
    watch = (DegradedWatch(min_mfu=lp.cfg.min_mfu, min_tokens_per_s=lp.cfg.min_tokens_per_s,
                           warmup_steps=lp.cfg.degraded_warmup_steps, patience=lp.cfg.degraded_patience)
             if lp.cfg.min_mfu is not None or lp.cfg.min_tokens_per_s is not None else None)
    monitor = lp.monitor_factory(x.spec) if lp.monitor_factory and x.spec.kind != "rerun" else None
    stopped_by: list[Status] = []
    x.tail = deque(maxlen=TAIL_LINES)
    shown = {"commit": short(x.sha), "description": x.description, "budget": budget}
    waiting = hold is not None and not hold.is_open()
    lp.events.phase(x, "waiting" if waiting else "training", **shown)

    def on_line(line: str) -> str | None:
        nonlocal waiting
        if waiting:                               # the first line of train.py: the baseline let it go
            waiting = False
            lp.events.phase(x, "training", **shown)
        x.tail.append(line)
        p = parse_step(line) if line.startswith("step ") else None
        if p is None:
            return None
        lp.emit(Event("step", spec=x.spec, step=p, time_budget=budget))
        faults.point("train")
        lp.events.step(x, p)
        for status, check in ((Status.DEGRADED, watch and watch.feed), (Status.PRUNED, monitor)):
            why = check(p) if check else None
            if why:
                stopped_by.append(status)
                return why
        return None

    x.t_run = time.time()
    scratch = ctx.guard_dir(lp.tag)  # a slot's own copy in its worktree, else the ledger's folder
    guard = guards.watch_run(ctx.git, scratch)

    def after_run() -> str | None:
        lp.events.phase(x, "evaluating")          # training is over; the evaluator scores the checkpoint next
        changed = guards.run_changes(ctx.git, guard, scratch, x.exp_dir.name)
        if changed:  # put .git and the records back before anything reads them
            guards.undo_run_changes(ctx.git, guard, scratch)
        return changed

    trial = run_trial(req, ctx.git, work_root=lp.paths.workspace(x.spec.id),
                      exp_dir=x.exp_dir, manifest=lp.fingerprint.eval_files, fingerprint=lp.fingerprint,
                      on_line=on_line, allowance=lambda: lp.allowance, after_run=after_run, server=ctx.server,
                      turn=turn, hold=hold, trained=(lambda out, cold: settle.baseline_trained(lp, x, out, cold))
                      if x.spec.kind == "baseline" else None)
    settle.take(lp, x, trial)
    out = trial.outcome
    if x.verdict.holdout_bpb is not None:
        settle.keep_private(lp, x, x.verdict.holdout_bpb)
    result = out.result
    if result.log_truncated:  # the cap dropped the end of the output: keep its last lines (the summary)
        with open(result.log_path, "a", encoding="utf-8", errors="replace") as f:
            tail = "".join(ln[:400] + "\n" for ln in x.tail)
            f.write(f"[ar] the last {len(x.tail)} lines of the output:\n{tail}")
    return result, (stopped_by[0] if stopped_by else None)
