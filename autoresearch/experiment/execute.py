"""Execute: one training run of a committed proposal, in a fresh workspace, in the sandbox, on ar's clock.

1. The workspace is made anew for every run: the commit's tree exported (`git archive`: tracked files only,
   so no untracked file, __pycache__ or stray checkpoint of an earlier run survives), an empty checkpoint
   folder, a scratch folder that is HOME, TMPDIR and every cache, and a train-only view of the data.
2. train.py runs there under the sandbox (harness/sandbox.py): it can read the interpreter, the libraries, its
   own tree and the training split; it can write its tree, the checkpoint folder and scratch; nothing else —
   not the validation split, not the token-bytes table, not runs/, not .git, not the installed package.
3. ar owns the clock: the whole run, from process start to when the checkpoint was last changed (its files'
   ctime, which no process can set back; the process may take a while to exit), must fit the session's startup
   credit + the budget + a last-step slack (clock.py: the credit is the baseline's smallest startup, the same
   for every candidate). Which step line the run prints moves nothing: compute moved before the first timed
   step or into the warm-up steps is paid from the budget. train.py is told the deadline (AR_DEADLINE).
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

from .. import compile_cache
from ..gitops import GitRepo
from ..harness import launcher, sandbox
from ..harness.data import hidden_sources, train_view
from ..request import RunRequest
from ..metrics import parse_step
from ..runner import STOP_INTERRUPTED, RunResult, run_training
from . import clock


@dataclass(frozen=True)
class Workspace:
    root: Path              # runs/<tag>/work/<NNNN>: deleted after the experiment
    src: Path               # the commit's tree
    checkpoint: Path
    scratch: Path
    data: Path              # the train-only view
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
    startup: float | None                 # ar's clock: process start -> the first timed step line (= window_start)
    trained: float                        # ar's clock: the first timed step line (or start) -> checkpoint
    step_interval: float | None           # median gap between step lines as they arrived
    over_budget: str | None               # why the run counts as past its budget, or None
    sandboxed: bool
    started_at: float = 0.0               # wall clock: ar's clock started (the process, or its turn on the GPU)
    window_start: float | None = None     # wall clock: the first timed step's line arrived
    phases: dict = field(default_factory=dict)   # wall clock of other marks: spawned, model built, first/last step
    checkpoint_at: float | None = None    # wall clock: the checkpoint last changed
    credit: float | None = None           # the startup credit the run had (the session's, clock.py)


def launchable(cmd: list[str]) -> bool:
    """Whether a training command is `python SCRIPT.py`, which harness/launcher.py can start before its turn."""
    return len(cmd) == 2 and Path(cmd[0]).name.startswith("python") and cmd[1].endswith(".py")


def run(req: RunRequest, ws: Workspace, data_files: list[Path], *, log_path: Path,
        on_line: Callable[[str], str | None] | None = None, allowance: float | None = None,
        turn=None) -> TrainOutcome:
    """Train once; `allowance` is the session's startup credit (clock.py; the configured allowance until the
    baseline has run). `turn`: the slot's turn on a shared GPU (executors/local.GpuTurn), held from the clock's
    start to the process's exit; the process starts before it (harness/launcher.py: only trusted imports run
    until the turn is taken, and ar's clock starts with the turn)."""
    cmd = list(req.train_command)
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
    timed_from: list[float] = []      # when the first timed step's line arrived (shown; the clock does not use it)
    credit = req.startup_allowance if allowance is None else min(allowance, req.startup_allowance)
    grace = clock.tolerance(credit)                                     # load jitter (clock.py)
    built: list[float] = []           # when the model line arrived (a phase mark for `timing.json` only)
    t_start = [time.monotonic(), time.time()]   # ar's clock starts here, or when the turn is taken
    taken: list[bool] = []
    ready = threading.Event()

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
        t_start[:] = [time.monotonic(), time.time()]
        if go_w is not None:
            try:
                os.write(go_w, f"go {t_start[1] + credit + req.time_budget:.3f}\n".encode())   # AR_DEADLINE
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
            now = time.monotonic() - t0
            arrivals.append(now)
            p = parse_step(line)
            if not timed_from and (p is None or p.step >= req.untimed_steps):
                timed_from.append(now)
        return on_line(line) if on_line else None

    spawned = time.time()
    try:
        if turn is not None and go_r is None and not gate():    # not launchable: the turn comes before the start
            log_path.write_text("[ar] stopped before this run started (it was waiting for its turn on the GPU)\n")
            result = RunResult(None, False, STOP_INTERRUPTED, 0.0, log_path, False)
        else:
            if go_r is None:     # train.py stops by then (RunEnv.progress); through the launcher, `go` says it
                env["AR_DEADLINE"] = f"{t_start[1] + credit + req.time_budget:.3f}"
            result = run_training(cmd, cwd=ws.src, env=env, log_path=log_path, timeout=req.hard_limit(),
                                  on_line=clocked, max_log_bytes=req.max_log_bytes,
                                  gate=gate if go_r is not None else None,
                                  pass_fds=(go_r,) if go_r is not None else ())
    finally:
        for fd in (go_r, go_w):
            if fd is not None:
                os.close(fd)
        if taken:
            turn.give_back()
    t0, t0_wall = t_start
    startup = timed_from[0] if timed_from else None
    written = checkpoint_written(ws.checkpoint)   # training ends when the checkpoint was last changed, not at exit
    ended = min(result.wall_seconds, written - t0_wall) if written else result.wall_seconds
    trained = ended - startup if startup is not None else 0.0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    interval = statistics.median(gaps) if gaps else None
    # the last step may finish past the budget, if it is no longer than 3 typical steps (and saving takes 2 s)
    last = min(gaps[-1], 3 * statistics.median(gaps[:-1] or gaps)) if gaps else 0.0
    slack = min(req.step_slack_cap(), 2.0 + last)
    limit = credit + grace + req.time_budget + slack
    over = None
    if not result.stop_reason and ended > limit:
        over = (f"ran {ended:.1f}s by ar's clock (process start to checkpoint), past the budget: startup credit "
                f"{credit:.1f}s (+{grace:.1f}s for load) + budget {req.time_budget:g}s + last-step slack {slack:.1f}s")
        if startup is not None and startup > credit + grace:
            over += (f"; its first timed step came {startup - credit:.1f}s later than the baseline's: whatever "
                     f"runs before it is paid from the budget")
    if over and interval and interval > req.step_slack_cap() / 2:   # the budget fits a few steps at best
        over += (f"; its steps take {interval:.1f}s each: raise the time budget or make the steps smaller "
                 f"(TOTAL_BATCH_SIZE)")
    phases = {"spawned": spawned, "model_built": t0_wall + built[0] if built else None,
              "first_step": t0_wall + arrivals[0] if arrivals else None,
              "last_step": t0_wall + arrivals[-1] if arrivals else None}
    return TrainOutcome(result, startup, trained, interval, over, req.sandbox, started_at=t0_wall,
                        window_start=t0_wall + startup if startup is not None else None, checkpoint_at=written,
                        phases=phases, credit=credit)
