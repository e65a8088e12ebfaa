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

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from autoresearch.gitops import GitRepo
from autoresearch.harness import gputime, launcher, sandbox
from autoresearch.harness.feed import Feed
from autoresearch.harness.data import hidden_sources, train_view
from autoresearch.experiment.request import RunRequest
from autoresearch.process import STOP_INTERRUPTED, RunResult, run_training
from autoresearch.experiment import clock, compile_cache, headstart


@dataclass(frozen=True)
class Workspace:
    root: Path              # runs/<tag>/work/<NNNN>: deleted after the experiment
    src: Path               # the commit's tree
    checkpoint: Path
    scratch: Path
    data: Path              # the data view: meta.json and the tokenizer (the tokens come from the feed)
    job: Path               # the evaluator's folder for this experiment (buffers, eval.log)
    compile: Path | None = None   # the run's compile caches (compile_cache.run_root); None: scratch/cache
    tmp: Path | None = None       # TMPDIR when it is not scratch (sandbox.reachable_by_others); None: scratch

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
    if sandbox.sandbox_ids() is not None and not sandbox.reachable_by_others(ws.scratch):
        ws = dataclasses.replace(ws, tmp=Path(tempfile.mkdtemp(prefix="ar-tmp-", dir="/tmp")))   # reachable by all
    sandbox.give_to_sandbox(ws.src, ws.checkpoint, ws.scratch, ws.job, *([ws.tmp] if ws.tmp else []))
    return ws, (train_view(tok_dir, ws.data) if tok_dir is not None else [])   # None: a command objective


def seed_compile_cache(req: RunRequest, ws: Workspace, new_only: bool = False) -> int:
    """Copy the trusted compile store into the run's compile folder (bytes copied; 0 without a store)."""
    copied = compile_cache.seed(req.compile_store, ws.caches, new_only) if req.compile_store else 0
    sandbox.give_to_sandbox(ws.caches)          # root: the run is `nobody`, and compiles into its copy
    return copied


def remove_workspace(ws: Workspace) -> None:
    shutil.rmtree(ws.root, ignore_errors=True)
    for d in (ws.compile, ws.tmp):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def train_policy(req: RunRequest, ws: Workspace, data_files: list[Path]) -> dict:
    p = sandbox.base_policy()
    p["read"] += [str(ws.data), *map(str, data_files), str(req.cache / "probe")]
    p["write"] += [str(ws.src), str(ws.checkpoint), str(ws.scratch), str(ws.caches), *([str(ws.tmp)] if ws.tmp else [])]
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
    window_note: str | None = None        # why that window was shorter than the budget (clock.start_up_cost), or longer
    startup_gpu: float | None = None      # GPU seconds of the run's processes from ar's clock start to the window


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


def tree_pids(proc) -> set[int]:
    """The pids of a process and everything below it now (the sandbox's supervisor is a subreaper: a daemonized
    grandchild stays below it)."""
    out, todo = set(), [proc.pid]
    while todo:
        pid = todo.pop()
        out.add(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


class TrainingRun:
    """One training run on ar's clock; its phases are methods: `gate` (the launcher's trusted start-up, then the
    baseline and the GPU turn: ar's clock starts), `opened` (the feed's first batch: the start-up's charge,
    clock.start_up_cost), `sample` (the run's CPU through its window and finish), `line` (each line the run
    prints), then `outcome` (clock.verdict on what ar saw). `run` strings them together around
    runner.run_training.
    `turn`: the slot's turn on a shared GPU (executors/local.GpuTurn), held from the clock's start to the
    process's exit; the process starts before it (harness/launcher.py: only trusted imports run until the turn
    is taken), or a head start before it (headstart.py: "go" in the holder's last seconds, the first batch held
    until the turn is taken). `hold`: the baseline this run waits for (scheduler.BaselineGate), before its turn
    (or its start, without one); the run is stopped if that baseline is then not kept. `allowance`: the
    baseline's start-up (clock.Credit), or what gives it, read when the clock starts: a run that waited for the
    baseline gets the credit the baseline left. `near_end` is called `req.eval_prestart` seconds before the
    window's end."""

    def __init__(self, req: RunRequest, ws: Workspace, data_files: list[Path], *, log_path: Path,
                 on_line: Callable[[str], str | None] | None = None,
                 allowance: clock.Credit | Callable[[], clock.Credit] | None = None, turn=None, hold=None,
                 near_end: Callable[[], None] | None = None):
        self.req, self.ws, self.data_files, self.log_path = req, ws, data_files, log_path
        self.on_line, self.turn, self.hold, self.near_end = on_line, turn, hold, near_end
        self.allowance = allowance
        self.credit = self.credit_now()
        self.steps: list[float] = []          # each step line's arrival, from ar's clock start (monotonic)
        self.built: float | None = None       # the model line's arrival (a phase mark for `timing.json` only)
        self.t0, self.t0_wall = time.monotonic(), time.time()   # ar's clock: here, or when the turn is taken
        self.proc = None
        self.cpu0 = 0.0                       # the run's CPU seconds at ar's clock start (the launcher's are not its)
        self.start_cost: tuple[float | None, float, str | None] = (None, 0.0, None)
        self.meter = gputime.open_meter()[0] if req.device == "cuda" else None   # None: GPU time unread
        self.startup_gpu: float | None = None
        self.taken = False                    # the turn is this run's (given back at its exit)
        self.early_by: float | None = None    # it went this long before the holder's window closed (a head start)
        self.turn_wait = 0.0                  # ... and its first batch then waited this long for the turn
        self.memory_seen: tuple[int, int, int] | None = None   # the GPU's memory when the head start was weighed
        self.eval_meter: gputime.GpuMeter | None = None   # the evaluators' GPU seconds through the window
        self.window_end0: float | None = None             # when the window closes, before anything is given back
        self.given = (0.0, 0.0)               # seconds given back to the window: (head start, evaluations)
        self.closing = threading.Event()
        self.gone = False                     # past its gate: ar's clock runs
        # its workspace was seeded before the baseline's compile reached the store: it takes that when it goes
        self.reseed = hold is not None and not hold.is_open()
        self.seeded_late = 0                  # compile-store bytes copied in after the wait for the baseline
        self.timers: list[threading.Timer] = []
        self.ready = threading.Event()        # the launcher's trusted start-up is done
        self.samples: list[tuple[float, float]] = []     # (wall clock, the run's CPU seconds) from the window
        self.sampled = threading.Event()
        self.go_r = self.go_w = None
        self.feed = (Feed(req.tok_dir, seed=req.seed, budget=req.time_budget, on_open=self.opened,
                          before_open=self.wait_turn if turn is not None else None,
                          extension=self.lent if turn is not None and req.device == "cuda" else None,
                          extension_cap=headstart.LEAD_CAP + headstart.EVAL_CAP) if req.tok_dir else None)

    def command(self) -> list[str]:
        cmd = list(self.req.train_command)
        if self.turn is not None and launchable(cmd):
            self.go_r, self.go_w = os.pipe()
            cmd = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.launcher", str(self.go_r), cmd[1]]
        if self.req.sandbox:
            policy = self.ws.root / "train-policy.json"
            policy.write_text(json.dumps(train_policy(self.req, self.ws, self.data_files)))
            cmd = [sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(policy), "--", *cmd]
        return cmd

    def sample(self) -> None:
        """The run's CPU seconds through its window (every 0.25 s, and at its end) and after it (every 0.05 s)
        until it exits: what its finish cost, in the currency of the CPU (clock.finish_allowance)."""
        while not self.sampled.is_set():
            cpu = tree_cpu(self.proc)
            if cpu is None:
                return
            self.samples.append((time.time(), cpu))
            left = (self.feed.deadline or 0.0) - time.time()
            self.sampled.wait(min(0.25, left) if left > 0.01 else 0.05)

    def metering(self) -> None:
        """Count the GPU seconds of the run's processes from ar's clock start (harness/gputime.py)."""
        if self.meter is not None and self.proc is not None:
            self.meter.start(lambda: tree_pids(self.proc))

    def opened(self) -> float:
        """The feed's first batch: what the start-up costs the window (clock.py)."""
        cpu = tree_cpu(self.proc) if self.proc is not None else None
        wall, used = time.time() - self.t0_wall - self.turn_wait, (cpu - self.cpu0 if cpu is not None else None)
        if self.meter is not None:
            self.startup_gpu = self.meter.seconds()
            self.meter.stop()
        cost, why = clock.start_up_cost(self.credit, self.req.device, wall, used, self.startup_gpu)
        self.start_cost = (used, cost, why)
        if self.turn is not None and self.taken:     # for the next run's head start: when this window closes
            self.turn.startups.append((wall, self.early_by is not None))
            self.window_end0 = time.time() + self.req.time_budget - cost
            self.turn.opened(self, self.window_end0, lambda: tree_pids(self.proc))
            if self.meter is not None:   # the evaluations beside the window, from its opening (on the run's own
                # meter's bindings: no second NVML start while the first batch waits)
                self.eval_meter = gputime.GpuMeter(self.meter.nv, self.meter.handles, floor_exits=False)
                self.eval_meter.start(self.turn.evaluator_pids)
        if cpu is not None:
            self.samples.append((time.time(), cpu))
            threading.Thread(target=self.sample, name="ar-cpu", daemon=True).start()
        if self.near_end is not None and self.req.eval_prestart > 0:
            timer = threading.Timer(max(0.0, self.req.time_budget - cost - self.req.eval_prestart), self.near_end)
            timer.daemon = True
            self.timers.append(timer)
            timer.start()
        return cost

    def gated(self) -> bool:
        return self.turn is not None or self.hold is not None

    def credit_now(self) -> clock.Credit:
        a = self.allowance() if callable(self.allowance) else self.allowance
        return a or clock.Credit()

    def may_start_early(self, credit: clock.Credit) -> bool:
        """Whether this run may take a head start (headstart.py): asked for (`head_start`: "auto" means on a GPU),
        and only where its start-up is charged in its own device seconds, which the baseline's credit holds."""
        if self.turn is None or not headstart.asked(self.req.head_start, self.req.device):
            return False
        if self.req.device == "cuda":
            return self.meter is not None and credit.gpu is not None
        return credit.cpu is not None

    def early(self) -> bool:
        """Asked while another run holds the GPU: whether its window is within one start-up of its end and, on a
        GPU, whether the memory holds this start-up beside it."""
        end, now = self.turn.window_end, time.time()
        if not headstart.due(now, end, headstart.lead(self.turn.startups)):
            return False
        if self.req.device == "cuda":
            pids = self.turn.holder_pids() if self.turn.holder_pids else set()
            self.memory_seen = self.meter.memory(pids) if pids else None
            if self.memory_seen is None or not headstart.fits(*self.memory_seen, cap=self.memory_cap()):
                return False
        self.early_by = end - now
        return True

    def memory_cap(self) -> int | None:
        """The emulated card's size (AR_GPU_MEMORY_GB), in bytes, or None."""
        value = {**os.environ, **self.req.slot_env}.get("AR_GPU_MEMORY_GB")
        try:
            return int(float(value) * 2**30) if value else None
        except ValueError:
            return None

    def lent(self) -> float:
        """While this run holds the GPU: what a run that started early beside its window has used of the GPU (its
        own meter), and what the evaluators of the slots on this GPU have used since the window opened, added to
        this window (harness/feed.py; each capped: headstart.given_back). A start-up that takes the GPU from its
        neighbour gives the neighbour's window nothing less, and pays past its allowance from its own; the last
        run's evaluation leaves a candidate's window as long as the baseline's, which had none beside it."""
        if not self.taken:
            return 0.0
        self.given = headstart.given_back(self.turn.lent(),
                                          self.eval_meter.seconds() if self.eval_meter is not None else 0.0)
        if self.window_end0 is not None:
            self.turn.moved(self, self.window_end0 + sum(self.given))
        return sum(self.given)

    def wait_turn(self) -> bool:
        """The feed's first request: a run that took a head start waits here for its turn (the window opens
        after, and the wait is not its start-up's); False when the session stops or the run is being closed."""
        if self.taken or self.turn is None:
            return True
        t = time.monotonic()
        self.taken = self.turn.take(self, cancel=self.closing) == "turn"
        self.turn_wait = time.monotonic() - t
        return self.taken

    def gate(self, proc=None) -> bool:
        """Wait for the launcher's trusted start-up, then for the baseline and the GPU; then start the clock and
        let it run the script. A launcher that dies first goes on at once (its exit is the run's result)."""
        stopping = self.turn.stopping if self.turn is not None else self.hold.stopping
        while proc is not None and not self.ready.wait(0.2):
            if proc.poll() is not None:
                break
            if stopping.is_set():
                return False
        if self.hold is not None:
            if not self.hold.wait():
                return False
            if self.reseed:
                self.seeded_late = seed_compile_cache(self.req, self.ws, new_only=True)
        if self.turn is not None:
            how = self.turn.take(self, early=self.early if self.may_start_early(self.credit_now()) else None,
                                 cancel=self.closing)
            if how is None:
                return False
            self.taken = how == "turn"
        self.gone = True
        self.credit = self.credit_now()           # what the baseline left by now (it may have just trained)
        if proc is not None:
            self.cpu0 = tree_cpu(proc) or 0.0
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.metering()
        if self.turn is not None and not self.taken and self.meter is not None:
            self.turn.started_early(self, self.meter.seconds)
        if self.go_w is not None:
            try:
                os.write(self.go_w, b"go\n")
            except OSError:
                pass                 # the launcher is gone already: the run ends as it ended
        return True

    def called_off(self) -> str | None:
        """Why the run stops now: the baseline it ran beside was not kept."""
        if self.hold is not None and self.hold.called_off():
            return "called off: the baseline it ran beside was not kept"
        return None

    def line(self, line: str) -> str | None:
        if not self.ready.is_set() and self.go_w is not None and line == launcher.READY:
            self.ready.set()     # before the clock: the launcher's own line, said before the proposal is loaded
            return None
        if line.startswith("model:") and self.built is None:     # train.py's line once the model is built
            self.built = time.monotonic() - self.t0
        if line.startswith("step "):
            self.steps.append(time.monotonic() - self.t0)
        return self.on_line(line) if self.on_line else None

    def started(self, proc) -> None:
        self.proc = proc
        if self.go_r is None and (not self.gated() or self.gone):      # no gate: ar's clock runs from here
            self.metering()
        if self.feed is not None:
            self.feed.close_child_end()

    def run(self) -> TrainOutcome:
        cmd = self.command()
        req, feed = self.req, self.feed
        env = req.to_environ(tok_view=self.ws.data, checkpoint_dir=self.ws.checkpoint, scratch=self.ws.scratch,
                             cache=self.ws.caches)
        if self.ws.tmp is not None:
            env["TMPDIR"] = str(self.ws.tmp)
        if feed is not None:
            env["AR_DATA_FD"] = str(feed.child_fd)
        spawned = time.time()
        fds = tuple(fd for fd in (self.go_r, feed.child_fd if feed else None) if fd is not None)
        try:
            if self.gated() and self.go_r is None and not self.gate():   # the baseline and the turn before the start
                why = "the baseline it waited for was not kept" if self.called_off() else "it was waiting for " \
                    "the baseline or its turn on the GPU"
                self.log_path.write_text(f"[ar] stopped before this run started ({why})\n")
                result = RunResult(None, False, STOP_INTERRUPTED, 0.0, self.log_path, False)
            else:
                result = run_training(cmd, cwd=self.ws.src, env=env, log_path=self.log_path,
                                      timeout=req.hard_limit(), on_line=self.line, max_log_bytes=req.max_log_bytes,
                                      gate=self.gate if self.go_r is not None else None, pass_fds=fds,
                                      on_start=self.started, called_off=self.called_off if self.hold else None)
        finally:
            self.close()
        return self.outcome(result, spawned)

    def close(self) -> None:
        self.closing.set()
        self.sampled.set()
        for meter in (self.meter, self.eval_meter):
            if meter is not None:
                meter.stop()
        for t in self.timers:                  # a run that ended early: the evaluator's workers start at "go"
            t.cancel()
            t.join()
        for fd in (self.go_r, self.go_w):
            if fd is not None:
                os.close(fd)
        if self.feed is not None:
            self.feed.close()
        if self.turn is not None and self.gone:
            self.turn.give_back(self)          # the GPU, or the place a head start kept

    def timeline(self, result: RunResult, written: float | None) -> clock.Timeline:
        """What ar saw, in seconds from its clock's start (clock.verdict's input)."""
        t0, feed = self.t0_wall, self.feed
        opened = feed.opened_at if feed is not None else None
        return clock.Timeline(
            budget=self.req.time_budget, slack_cap=self.req.step_slack_cap(),
            startup_allowance=self.req.startup_allowance, wall=result.wall_seconds,
            opened=opened - t0 if opened is not None else None,
            deadline=feed.deadline - t0 if opened is not None else None,
            steps=tuple(self.steps), written=written - t0 if written else None,
            samples=tuple((when - t0, cpu) for when, cpu in self.samples), stopped=bool(result.stop_reason))

    def outcome(self, result: RunResult, spawned: float) -> TrainOutcome:
        t0, feed = self.t0_wall, self.feed
        written = checkpoint_written(self.ws.checkpoint)   # training ends when the checkpoint last changed
        v = clock.verdict(self.timeline(result, written), self.credit, self.req.device)
        opened_at = feed.opened_at if feed is not None else None
        phases = {"spawned": spawned, "model_built": t0 + self.built if self.built is not None else None,
                  "first_step": t0 + self.steps[0] if self.steps else None,
                  "last_step": t0 + self.steps[-1] if self.steps else None,
                  "window_end": feed.deadline if feed is not None else None,
                  "feed_batches": feed.batches if feed is not None else 0,
                  "feed_refused": feed.refused if feed is not None else 0,
                  "feed_tokens": feed.tokens_served if feed is not None else 0,     # ar's count: epochs trained
                  "train_tokens": len(feed.tokens) if feed is not None else 0,
                  "cache_seeded_late": self.seeded_late, "head_start": self.early_by, "turn_wait": self.turn_wait,
                  "window_extended": feed.extended if feed is not None else 0.0,
                  "given_back_head_start": self.given[0], "given_back_evaluations": self.given[1],
                  "memory_seen": list(self.memory_seen) if self.memory_seen else None}
        used, _, why = self.start_cost
        lent = headstart.given_back_note(*self.given) if feed is not None and feed.extended > 0 else None
        why = f"{why}; {lent}" if why and lent else why or lent
        startup = opened_at - t0 - self.turn_wait if opened_at is not None else None     # a head start's wait is not it
        return TrainOutcome(result, startup, v.trained, v.interval, v.over, self.req.sandbox, started_at=t0,
                            window_start=opened_at, checkpoint_at=written, phases=phases, startup_cpu=used,
                            tail_cpu=v.tail_cpu, finish=v.finish,
                            window=(feed.deadline - opened_at) if opened_at is not None else None, window_note=why,
                            startup_gpu=self.startup_gpu)


def run(req: RunRequest, ws: Workspace, data_files: list[Path], *, log_path: Path,
        on_line: Callable[[str], str | None] | None = None,
        allowance: clock.Credit | Callable[[], clock.Credit] | None = None, turn=None, hold=None,
        near_end: Callable[[], None] | None = None) -> TrainOutcome:
    """Train once (TrainingRun); `allowance` is the baseline's start-up so far (clock.py; empty until the
    baseline has run). The training tokens come from `Feed` (harness/feed.py), which opens the window at the
    first batch and ends it after the budget, less what clock.py charges."""
    return TrainingRun(req, ws, data_files, log_path=log_path, on_line=on_line, allowance=allowance, turn=turn,
                       hold=hold, near_end=near_end).run()
