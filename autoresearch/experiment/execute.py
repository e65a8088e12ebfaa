"""Execute: one training run of a committed proposal, in a fresh workspace, in the sandbox, on ar's clock.

1. The workspace is made anew for every run: the commit's tree exported (`git archive`: tracked files only,
   so no untracked file, __pycache__ or stray checkpoint of an earlier run survives), an empty checkpoint
   folder, a scratch folder that is HOME, TMPDIR and every cache, and a view of the data: meta.json and the
   tokenizer, no tokens.
2. train.py runs there under the sandbox (harness/sandbox.py): it can read the interpreter, the libraries, its
   own tree and that view; it can write its tree, the checkpoint folder and scratch; nothing else — not the
   training or validation split, not the token-bytes table, not runs/, not .git, not the installed package.
3. ar owns the clock (clock.py): the training tokens come only from ar's feed (harness/feed.py, a socket the
   run inherits), whose first batch opens the run's window and which serves none after its end; the checkpoint
   (its files' ctime, which no process can set back) must be written by the window's end + what the baseline's
   finish allows (clock.finish_allowance: its step and its save, in CPU seconds on the CPU), so no tolerance buys
   training.
   Start-up beyond what the baseline's allows comes off the window. Which step line the run prints moves
   nothing.
4. The process group, everything it spawned, and anything re-parented below the sandbox's supervisor is
   killed before the result is returned (runner.run_training + the supervisor).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from .. import compile_cache
from ..gitops import GitRepo
from ..harness import launcher, sandbox
from ..harness.feed import Feed
from ..harness.data import hidden_sources, train_view
from ..request import RunRequest
from ..runner import STOP_INTERRUPTED, RunResult, run_training
from . import clock


@dataclass(frozen=True)
class Workspace:
    root: Path              # runs/<tag>/work/<NNNN>: deleted after the experiment
    src: Path               # the commit's tree
    checkpoint: Path
    scratch: Path
    data: Path              # the data view: meta.json and the tokenizer (the tokens come from the feed)
    job: Path               # the evaluator's folder for this experiment (buffers, eval.log)
    compile: Path | None = None   # the run's compile caches (compile_cache.run_root); None: scratch/cache

    @classmethod
    def at(cls, root: Path, compile: Path | None = None) -> "Workspace":
        return cls(root, root / "src", root / "checkpoint", root / "scratch", root / "data", root / "eval", compile)

    @property
    def caches(self) -> Path:
        return self.compile or self.scratch / "cache"


def make_workspace(git: GitRepo, commit: str, root: Path, tok_dir: Path | None,
                   compile_root: Path | None = None) -> tuple[Workspace, list[Path]]:
    """A fresh workspace for `commit`; also the real data files the run may read."""
    shutil.rmtree(root, ignore_errors=True)
    ws = Workspace.at(root, compile_root)
    for d in (ws.src, ws.checkpoint, ws.scratch, ws.job, ws.caches):
        d.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(git.root), "archive", "--format=tar", commit], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(ws.src)], input=archive, check=True)
    sandbox.give_to_sandbox(ws.src, ws.checkpoint, ws.scratch, ws.job)    # root: the run is `nobody` (sandbox.py)
    return ws, (train_view(tok_dir, ws.data) if tok_dir is not None else [])   # None: a command objective


def seed_compile_cache(req: RunRequest, ws: Workspace) -> int:
    """Copy the trusted compile store into the run's compile folder (bytes copied; 0 without a store)."""
    copied = compile_cache.seed(req.compile_store, ws.caches) if req.compile_store else 0
    sandbox.give_to_sandbox(ws.caches)          # root: the run is `nobody`, and compiles into its copy
    return copied


def remove_workspace(ws: Workspace) -> None:
    shutil.rmtree(ws.root, ignore_errors=True)
    if ws.compile is not None:
        shutil.rmtree(ws.compile, ignore_errors=True)


def train_policy(req: RunRequest, ws: Workspace, data_files: list[Path]) -> dict:
    p = sandbox.base_policy()
    p["read"] += [str(ws.data), *map(str, data_files), str(req.cache / "probe")]
    p["write"] += [str(ws.src), str(ws.checkpoint), str(ws.scratch), str(ws.caches)]
    p["hide"] = hidden_sources(req.tok_dir)      # the raw files validation text comes from (a builtin corpus's)
    return p


def checkpoint_written(folder: Path) -> float | None:
    """When anything in the checkpoint folder last changed (the latest ctime: a write, a rename or a utime all
    move it to now, and nothing sets it back), or None when there is nothing there."""
    times = [p.lstat().st_ctime for p in folder.rglob("*")]
    return max(times) if times else None


@dataclass
class TrainOutcome:
    result: RunResult
    startup: float | None                 # ar's clock: its start -> the first batch the feed served (the window)
    trained: float                        # ar's clock: the window's start -> checkpoint, at most to the window's end
    step_interval: float | None           # median gap between step lines as they arrived
    over_budget: str | None               # why the run counts as past its budget, or None
    sandboxed: bool
    started_at: float = 0.0               # wall clock: ar's clock started (the process, or its turn on the GPU)
    window_start: float | None = None     # wall clock: the feed served the first batch
    phases: dict = field(default_factory=dict)   # wall clock of other marks: spawned, model built, first/last step
    checkpoint_at: float | None = None    # wall clock: the checkpoint last changed
    tail_cpu: float | None = None         # CPU seconds of the run's processes from its window's end to its checkpoint
    finish: tuple[float | None, float | None] = (None, None)   # one step + the time past the window (wall, CPU)
    startup_cpu: float | None = None      # CPU seconds of the run's processes from ar's clock start to the window
    window: float | None = None           # the window it was given (the budget, less what its start-up cost)
    window_note: str | None = None        # why that window was shorter than the budget (clock.start_up_cost)


def launchable(cmd: list[str]) -> bool:
    """Whether a training command is `python SCRIPT.py`, which harness/launcher.py can start before its turn."""
    return len(cmd) == 2 and Path(cmd[0]).name.startswith("python") and cmd[1].endswith(".py")


_TICK = os.sysconf("SC_CLK_TCK")          # /proc's CPU times are in clock ticks


def tree_cpu(proc) -> float | None:
    """CPU seconds a process and everything below it have used (reaped children included), or None once it is
    gone. Walks the tree through /proc/<pid>/task/*/children: ar samples this many times a second, and psutil's
    children() reads every process on the host each time (psutil's walk where the kernel lacks those files)."""
    total, todo = 0.0, [proc.pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()       # from field 3 (state) on: the name may hold ")"
            total += sum(int(x) for x in fields[11:15]) / _TICK   # utime, stime, cutime, cstime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if pid != proc.pid:
                continue                                   # a process that ended during the walk
            return _tree_cpu_psutil(proc) if os.path.exists(f"/proc/{pid}") else None
        except (OSError, ValueError, IndexError):
            if pid == proc.pid:
                return None
    return total


def _tree_cpu_psutil(proc) -> float | None:
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def cpu_between(samples: list[tuple[float, float]], a: float, b: float) -> float:
    """CPU seconds used between wall clocks a and b, from (wall clock, CPU seconds) samples in time order: each
    end read at the first sample at or after it (the last sample when none is): a finish is never counted short
    by more than the time between two samples."""
    def at(t: float) -> float:
        return next((cpu for when, cpu in samples if when >= t), samples[-1][1])
    return max(0.0, at(b) - at(a)) if samples and b > a else 0.0


def run(req: RunRequest, ws: Workspace, data_files: list[Path], *, log_path: Path,
        on_line: Callable[[str], str | None] | None = None, allowance: clock.Credit | None = None,
        turn=None, near_end: Callable[[], None] | None = None) -> TrainOutcome:
    """Train once; `allowance` is the baseline's start-up so far (clock.py; empty until the baseline has run).
    `turn`: the slot's turn on a shared GPU (executors/local.GpuTurn), held from the clock's start to the
    process's exit; the process starts before it (harness/launcher.py: only trusted imports run until the turn
    is taken, and ar's clock starts with the turn). The training tokens come from `Feed` (harness/feed.py),
    which opens the window at the first batch and ends it after the budget, less what clock.py charges.
    `near_end` is called `req.eval_prestart` seconds before the window's end (the evaluator's workers start then)."""
    cmd = list(req.train_command)
    credit = allowance or clock.Credit()
    go_r = go_w = None
    if turn is not None and launchable(cmd):
        go_r, go_w = os.pipe()
        cmd = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.launcher", str(go_r), cmd[1]]
    if req.sandbox:
        policy = ws.root / "train-policy.json"
        policy.write_text(json.dumps(train_policy(req, ws, data_files)))
        cmd = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(policy), "--", *cmd]
    env = req.to_environ(tok_view=ws.data, checkpoint_dir=ws.checkpoint, scratch=ws.scratch, cache=ws.caches)
    arrivals: list[float] = []
    built: list[float] = []           # when the model line arrived (a phase mark for `timing.json` only)
    t_start = [time.monotonic(), time.time()]   # ar's clock starts here, or when the turn is taken
    procs: list = []
    cpu0: list[float] = [0.0]         # the run's CPU seconds when ar's clock started (the launcher's are not its)
    start_cost: list = []
    taken: list[bool] = []
    timers: list[threading.Timer] = []
    ready = threading.Event()
    samples: list[tuple[float, float]] = []     # (wall clock, the run's CPU seconds) from its window's start
    sampled = threading.Event()

    def sample() -> None:
        """The run's CPU seconds through its window (every 0.25 s, and at its end) and after it (every 0.05 s)
        until it exits: what its finish cost, in the currency of the CPU (clock.finish_allowance)."""
        while not sampled.is_set():
            cpu = tree_cpu(procs[0])
            if cpu is None:
                return
            samples.append((time.time(), cpu))
            left = (feed.deadline or 0.0) - time.time()
            sampled.wait(min(0.25, left) if left > 0.01 else 0.05)

    def opened() -> float:
        """The feed's first batch: what the start-up costs the window (clock.py)."""
        cpu = tree_cpu(procs[0]) if procs else None
        wall, used = time.time() - t_start[1], (cpu - cpu0[0] if cpu is not None else None)
        cost, why = clock.start_up_cost(credit, req.device, wall, used)
        start_cost[:] = [used, cost, why]
        if cpu is not None:
            samples.append((time.time(), cpu))
            threading.Thread(target=sample, name="ar-cpu", daemon=True).start()
        if near_end is not None and req.eval_prestart > 0:
            timers.append(threading.Timer(max(0.0, req.time_budget - cost - req.eval_prestart), near_end))
            timers[-1].daemon = True
            timers[-1].start()
        return cost

    feed = Feed(req.tok_dir, seed=req.seed, budget=req.time_budget, on_open=opened) if req.tok_dir else None
    if feed is not None:
        env["AR_DATA_FD"] = str(feed.child_fd)

    def gate(proc=None) -> bool:
        """Wait for the launcher's trusted start-up, then for the GPU; then start the clock and let it run the
        script. A launcher that dies first goes on at once (its exit is the run's result)."""
        while proc is not None and not ready.wait(0.2):
            if proc.poll() is not None:
                break
            if turn.stopping.is_set():
                return False
        if not turn.take():
            return False
        taken.append(True)
        if proc is not None:
            cpu0[0] = tree_cpu(proc) or 0.0
        t_start[:] = [time.monotonic(), time.time()]
        if go_w is not None:
            try:
                os.write(go_w, b"go\n")
            except OSError:
                pass                 # the launcher is gone already: the run ends as it ended
        return True

    def clocked(line: str) -> str | None:
        if not ready.is_set() and go_w is not None and line == launcher.READY:
            ready.set()          # before the clock: the launcher's own line, said before the proposal is loaded
            return None
        t0 = t_start[0]
        if line.startswith("model:") and not built:       # train.py's line once the model is built
            built.append(time.monotonic() - t0)
        if line.startswith("step "):
            arrivals.append(time.monotonic() - t0)
        return on_line(line) if on_line else None

    spawned = time.time()
    fds = tuple(fd for fd in (go_r, feed.child_fd if feed else None) if fd is not None)
    try:
        if turn is not None and go_r is None and not gate():    # not launchable: the turn comes before the start
            log_path.write_text("[ar] stopped before this run started (it was waiting for its turn on the GPU)\n")
            result = RunResult(None, False, STOP_INTERRUPTED, 0.0, log_path, False)
        else:
            result = run_training(cmd, cwd=ws.src, env=env, log_path=log_path, timeout=req.hard_limit(),
                                  on_line=clocked, max_log_bytes=req.max_log_bytes,
                                  gate=gate if go_r is not None else None, pass_fds=fds,
                                  on_start=lambda proc: (procs.append(proc), feed and feed.close_child_end()))
    finally:
        sampled.set()
        for t in timers:                  # a run that ended early: the evaluator's workers start at "go"
            t.cancel()
            t.join()
        for fd in (go_r, go_w):
            if fd is not None:
                os.close(fd)
        if feed is not None:
            feed.close()
        if taken:
            turn.give_back()
    t0, t0_wall = t_start
    written = checkpoint_written(ws.checkpoint)   # training ends when the checkpoint was last changed, not at exit
    opened_at = feed.opened_at if feed is not None else None
    marks = ([opened_at - t0_wall] if opened_at is not None else []) + arrivals   # the window's start, each step
    marks = [m for m in marks if opened_at is None or m >= opened_at - t0_wall]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    interval = statistics.median(gaps) if gaps else None
    # the last step may finish past the window, if it is no longer than 3 of its typical steps (and saving takes 2 s),
    # in wall seconds; once the baseline's finish is known, also within what that allows (clock.finish_allowance)
    last = min(gaps[-1], 3 * statistics.median(gaps[:-1] or gaps)) if gaps else 0.0
    slack = min(req.step_slack_cap(), 2.0 + last)
    startup = opened_at - t0_wall if opened_at is not None else None
    over = tail_cpu = None
    finish: tuple = (None, None)
    if opened_at is not None:
        end = feed.deadline
        trained = max(0.0, min(written, end) - opened_at) if written else 0.0
        if written:
            tail_cpu = cpu_between(samples, end, written) if samples else None   # none: the wall rule
            in_window = [a for a in arrivals if opened_at - t0_wall <= a <= end - t0_wall]
            step_cpu = (cpu_between(samples, opened_at, t0_wall + in_window[-1]) / len(in_window)
                        if in_window and samples else None)
            finish = (interval + max(0.0, written - end) if interval is not None else None,
                      step_cpu + tail_cpu if step_cpu is not None and tail_cpu is not None else None)
        allowed = clock.finish_allowance(credit, req.device if tail_cpu is not None else "wall")
        if result.stop_reason or not written:
            pass
        elif written - end > slack:         # a wall bound, whatever the currency below (a run that sleeps)
            over = (f"wrote its checkpoint {written - end:.1f}s after its training window closed, past the "
                    f"budget (the window: {end - opened_at:.1f}s from its first batch; the last step and "
                    f"saving may take {slack:.1f}s)")
        elif allowed is not None and (tail_cpu if allowed[1] == "cpu" else written - end) > allowed[0]:
            spent = f"{tail_cpu:.1f} CPU-s" if allowed[1] == "cpu" else f"{written - end:.1f}s"
            base = credit.finish_cpu if allowed[1] == "cpu" else credit.finish
            over = (f"trained past the budget: wrote its checkpoint {written - end:.1f}s after its training window "
                    f"closed and used {spent} after it, more than the {allowed[0]:.1f} the baseline's finish allows "
                    f"(its last step and "
                    f"save took {base:.1f}; × {clock.FINISH_FACTOR:g} + {clock.FINISH_SLACK:g}): training "
                    f"ends inside the window (train.py plans its last step so)")
    else:                           # it never asked for a batch (or no feed: a command objective's run)
        trained = 0.0
        ended = min(result.wall_seconds, written - t0_wall) if written else result.wall_seconds
        limit = req.startup_allowance + req.time_budget + slack
        if not result.stop_reason and ended > limit:
            over = (f"ran {ended:.1f}s by ar's clock (start to checkpoint), past the start-up allowance "
                    f"{req.startup_allowance:g}s + budget {req.time_budget:g}s + last-step slack {slack:.1f}s")
    if over and interval and interval > req.step_slack_cap() / 2:   # the budget fits a few steps at best
        over += (f"; its steps take {interval:.1f}s each: raise the time budget or make the steps smaller "
                 f"(TOTAL_BATCH_SIZE)")
    phases = {"spawned": spawned, "model_built": t0_wall + built[0] if built else None,
              "first_step": t0_wall + arrivals[0] if arrivals else None,
              "last_step": t0_wall + arrivals[-1] if arrivals else None,
              "window_end": feed.deadline if feed is not None else None,
              "feed_batches": feed.batches if feed is not None else 0,
              "feed_refused": feed.refused if feed is not None else 0}
    used, cost, why = start_cost or (None, 0.0, None)
    return TrainOutcome(result, startup, trained, interval, over, req.sandbox, started_at=t0_wall,
                        window_start=opened_at, checkpoint_at=written, phases=phases, startup_cpu=used,
                        tail_cpu=tail_cpu, finish=finish,
                        window=(feed.deadline - opened_at) if opened_at is not None else None, window_note=why)
