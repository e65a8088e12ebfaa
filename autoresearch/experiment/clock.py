"""ar's clock: a run's training window, and what its start-up may cost before the window is cut.

The window opens with the first batch ar's feed serves the run (harness/feed.py: the training split is readable
only through it) and lasts the budget; the feed serves nothing after it, and the checkpoint must be written by
its end + a last-step slack (execute.py). So every run trains on real data for the same window, whatever its
start-up took, and nothing trains on real data before the clock.

Start-up (ar's clock start → the first batch: imports, building the model, compiling) is free up to what the
baseline's allows; beyond that, the excess comes off the window (the feed's deadline moves in), said in the row:
- on the CPU, in CPU seconds of the run's processes: `CPU_FACTOR` × the baseline's smallest + `CPU_SLACK` (1.3 × +
  1 s: at most 0.3 × that start-up + 1 s of compute before the first batch goes uncharged). Load
  stretches an honest start-up's wall time, and its CPU time less, but not nothing on a small VM whose cores share
  caches (1.1 × + 0.5 s left an honest start-up 0.4 s short on a machine running 1.7 times slower than usual, and
  an honest stand-in used 1.9 × the baseline's CPU seconds beside a busy test worker), so a busy machine costs a
  candidate little; while
  compute moved before the first batch — training on other text the run can read (the `builtin` corpus's
  training text is the interpreter's own files) — is counted and paid from the window;
- on a GPU, in GPU seconds of the run's processes (harness/gputime.py: the driver's per-process samples):
  `GPU_FACTOR` × the baseline's smallest + `GPU_SLACK`, as on the CPU. Warm-up steps and autotuning are GPU work
  an honest start-up does too, and the allowance covers them: `GPU_SLACK` is a new shape's cold autotuning, on
  top of a baseline that started warm (the compile store held kernels). Where every run of the baseline compiled
  cold (an empty store: the first session on a machine, or `compile_cache: false`), its start-up holds that
  autotuning, and the slack is `GPU_COLD_SLACK`: otherwise a warm candidate would get the autotuning's GPU seconds
  free twice (on an H100, 5.3 GPU-s of steps before the window went unpaid; 2.9 with it; trial.py says which runs
  were cold). Steps taken before the window on text the run can read are GPU work past the allowance, paid
  from the window: at most about 0.3 × the baseline's + the slack goes unpaid, under 1 % of a 300-s window on an
  H100 (docs/benchmarks.md, "The GPU clock"). A compile is CPU work:
  on top, the wall clock allows the baseline's start-up + max(`GPU_ROOM`, that start-up), room for a new shape's
  cold compile (33 s on an H100). Where GPU time cannot be read (no NVML, a refusal: said at the session's start), the wall clock is
  all there is and its room is tight: the baseline's + max(`BLIND_ROOM`, a quarter of it); a new shape's cold
  compile then costs some of its window (said in its row), and compute before the first batch is bounded by
  that room (docs/reliability.md).
Before the baseline has run, start-up is free up to `startup_allowance` wall seconds (then the run is killed).

The finish: a run's training may not go on past its window's end. Its last step may, and saving takes time, so
the checkpoint may be written after the window by what the baseline's finish allows: `FINISH_FACTOR` × (one of
the baseline's steps + the baseline's own time from its window's end to its checkpoint) + `FINISH_SLACK`, in the
same currency as start-up (CPU seconds of the run's processes on the CPU, wall seconds on a GPU). It is measured
by ar (the feed's window, the run's CPU, the checkpoint's ctime), never from what a run prints: a run that
prints its step lines far apart, or takes its batches in big gulps before the window closes, cannot make its
steps look long enough to train on past the window. train.py plans its last step to end inside the window, so a
candidate whose steps are longer than the baseline's loses at most one of them, and never its result. Before
the baseline has run, the last-step slack is the run's own (execute.py).

The baseline's start-ups (the baseline commit and its noise-calibration reruns) are kept in runs/<tag>/clock.json
("credit": wall seconds, "cpu": CPU seconds, "gpu": GPU seconds; each the smallest so far; "finish", "finish_cpu": the largest
finish so far, step + tail), so a resumed session keeps them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from autoresearch.records.durable import write_atomic

FILE = "clock.json"
CPU_FACTOR, CPU_SLACK = 1.3, 1.0
GPU_ROOM = 60.0             # wall seconds beyond the baseline's start-up where GPU time is read: a cold compile
                            # (33 s on an H100) is CPU work, and the GPU's work is counted on its own
WALL_ROOM = 30.0            # the CPU's fallback where the run's CPU time could not be read
BLIND_ROOM = 10.0           # ... where it cannot be read: then the wall clock is the only bound on GPU work
GPU_FACTOR, GPU_SLACK = 1.3, 2.5   # start-up GPU seconds free: 1.3 × the baseline's + 2.5 s: a new shape's cold
                                   # compile autotunes on the GPU (2.1 GPU-s on an H100 against a warm 0.26)
GPU_COLD_SLACK = 0.5               # ... + 0.5 s where the baseline's own start-up was cold (it holds that autotuning)
FINISH_FACTOR, FINISH_SLACK = 1.5, 1.0     # what the finish may take: 1.5 × the baseline's + 1 s (or CPU-s)
SHORT_WINDOW = 0.5          # a run whose window was under this share of its budget is never kept


@dataclass(frozen=True)
class Credit:
    """The baseline's smallest start-up so far: wall, CPU and GPU seconds (None before the baseline, or where not
    read), and its largest finish (one step + its window's end to its checkpoint), in wall and CPU seconds."""
    wall: float | None = None
    cpu: float | None = None
    finish: float | None = None
    finish_cpu: float | None = None
    gpu: float | None = None
    gpu_cold: bool = False      # every run of the baseline compiled cold: `gpu` holds the autotuning


def load(tag_dir: Path) -> Credit:
    try:
        doc = json.loads((Path(tag_dir) / FILE).read_text())
        return Credit(float(doc["credit"]), *(float(doc[k]) if doc.get(k) is not None else None
                                              for k in ("cpu", "finish", "finish_cpu", "gpu")),
                      gpu_cold=doc.get("gpu_cold") is True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return Credit()


def note_baseline(tag_dir: Path, wall: float, cpu: float | None, finish: float | None = None,
                  finish_cpu: float | None = None, gpu: float | None = None, cold: bool = False) -> Credit:
    """Record one run of the baseline commit; returns the credit from now on (a start-up only ever tightens it,
    a finish only ever widens it: the baseline is the user's code, each of its runs honest). `cold`: this run
    compiled from nothing (trial.Trial); one warm run of the baseline makes the credit warm for good."""
    old = load(tag_dir)
    new = Credit(min(x for x in (old.wall, wall) if x is not None),
                 min((x for x in (old.cpu, cpu) if x is not None), default=None),
                 max((x for x in (old.finish, finish) if x is not None), default=None),
                 max((x for x in (old.finish_cpu, finish_cpu) if x is not None), default=None),
                 min((x for x in (old.gpu, gpu) if x is not None), default=None),
                 (old.gpu is None or old.gpu_cold) and (gpu is None or cold))
    doc = {"credit": round(new.wall, 3)} | {k: round(v, 3) for k, v in (
        ("cpu", new.cpu), ("finish", new.finish), ("finish_cpu", new.finish_cpu), ("gpu", new.gpu)) if v is not None}
    if new.gpu is not None and new.gpu_cold:
        doc["gpu_cold"] = True
    write_atomic(Path(tag_dir) / FILE, json.dumps(doc))
    return new


def start_up_cost(credit: Credit, device: str, wall: float, cpu: float | None,
                  gpu: float | None = None) -> tuple[float, str | None]:
    """(seconds to take off the window, why) for a start-up of `wall` seconds, `cpu` CPU seconds and `gpu` GPU
    seconds (None: not read)."""
    if credit.wall is None:
        return 0.0, None                          # before the baseline: the allowance (a kill) is the bound
    if device == "cpu" and credit.cpu is not None and cpu is not None:
        allowed = CPU_FACTOR * credit.cpu + CPU_SLACK
        excess = cpu - allowed
        what = (f"its start-up used {cpu:.1f} CPU-s before its first batch, more than the {allowed:.1f} the "
                f"baseline's {credit.cpu:.1f} allows")
    else:
        read = device != "cpu" and gpu is not None and credit.gpu is not None
        allowed = credit.wall + (max(GPU_ROOM, credit.wall) if read else
                                 max(WALL_ROOM, credit.wall) if device == "cpu" else max(BLIND_ROOM, credit.wall / 4))
        excess = wall - allowed
        what = (f"its first batch came {wall:.1f}s after its start, later than the {allowed:.1f}s the baseline's "
                f"{credit.wall:.1f}s allows" + ("" if read or device == "cpu" else " (GPU time unread: wall rule)"))
        if read:
            allowed_gpu = gpu_allowance(credit)
            if gpu - allowed_gpu > excess:
                excess = gpu - allowed_gpu
                what = (f"its start-up used {gpu:.1f} GPU-s before its first batch, more than the {allowed_gpu:.1f} "
                        f"the baseline's {credit.gpu:.1f} allows")
    if excess <= 0:
        return 0.0, None
    return excess, f"{what}: its training window was cut by {excess:.1f}s"


def gpu_allowance(credit: Credit) -> float:
    """The start-up GPU seconds free, given a baseline whose GPU time was read."""
    return GPU_FACTOR * credit.gpu + (GPU_COLD_SLACK if credit.gpu_cold else GPU_SLACK)


def finish_allowance(credit: Credit, device: str) -> tuple[float, str] | None:
    """(how long a run may take from its window's end to its checkpoint, "cpu" or "wall"), or None before the
    baseline's finish is known (then the run's own last-step slack applies: execute.py)."""
    if device == "cpu" and credit.finish_cpu is not None:
        return FINISH_FACTOR * credit.finish_cpu + FINISH_SLACK, "cpu"
    if credit.finish is not None:
        return FINISH_FACTOR * credit.finish + FINISH_SLACK, "wall"
    return None


def short_window_note(window: float | None, budget: float) -> str | None:
    """Why a run is not kept on its val_bpb: ar's window for it (None: it never asked for a batch) was under
    half its budget. (A run may stop early by itself: that only costs it.)"""
    if budget <= 0 or (window is not None and window >= SHORT_WINDOW * budget):
        return None
    if window is None:
        return "it never asked ar's feed for a batch, so it trained on no training data: not kept on its val_bpb"
    return (f"its training window was {window:.1f}s of its {budget:g}s budget (less than {SHORT_WINDOW:.0%}): "
            f"not kept on its val_bpb")


# The verdict: what ar's clock says of one run once it has exited, from what ar saw of it (its timeline). A pure
# function of that timeline and the baseline's credit, so every rule is a row in tests/test_clock.py.

LAST_STEP_SAVE = 2.0         # before the baseline's finish is known: the last step and saving may take 2 s +
LAST_STEP_STEPS = 3          # up to 3 of the run's typical steps past the window, in wall seconds


@dataclass(frozen=True)
class Timeline:
    """What ar saw of one run, in seconds from ar's clock start (the process, or its turn on the GPU)."""
    budget: float                          # the time budget
    slack_cap: float                       # the most a last step may run past the window (RunRequest)
    startup_allowance: float               # before the baseline: start-up allowed before the run is killed
    wall: float                            # the process's life
    opened: float | None = None            # the feed served its first batch (the window opens); None: never
    deadline: float | None = None          # the window's end, as the feed held it (the budget less any charge)
    steps: tuple[float, ...] = ()          # each step line's arrival
    written: float | None = None           # the checkpoint last changed (its ctime)
    samples: tuple[tuple[float, float], ...] = ()   # (when, the run's CPU seconds) from the window's start
    stopped: bool = False                  # ar stopped it (a kill, Ctrl-C): its own reason stands


@dataclass(frozen=True)
class Verdict:
    trained: float                         # the window's start → checkpoint, at most to the window's end
    interval: float | None                 # the median gap between step lines in the window
    over: str | None                       # why the run counts as past its budget, or None
    tail_cpu: float | None = None          # CPU seconds from the window's end to the checkpoint (None: unknown)
    finish: tuple[float | None, float | None] = (None, None)   # one step + the time past the window (wall, CPU)


def cpu_between(samples, a: float, b: float) -> float:
    """CPU seconds used between times a and b, from (time, CPU seconds) samples in time order: each end read at
    the first sample at or after it (the last sample when none is), so a finish is never counted short by more
    than the time between two samples."""
    def at(t: float) -> float:
        return next((cpu for when, cpu in samples if when >= t), samples[-1][1])
    return max(0.0, at(b) - at(a)) if samples and b > a else 0.0


def own_slack(t: Timeline, gaps: list[float]) -> float:
    """The run's own last-step slack (wall seconds): 2 s + its last step, at most 3 of its typical steps, capped."""
    last = min(gaps[-1], LAST_STEP_STEPS * statistics.median(gaps[:-1] or gaps)) if gaps else 0.0
    return min(t.slack_cap, LAST_STEP_SAVE + last)


def verdict(t: Timeline, credit: Credit, device: str) -> Verdict:
    """The clock's verdict on one run: how long it trained, and whether it trained past its budget."""
    marks = ([t.opened] if t.opened is not None else []) + list(t.steps)
    marks = [m for m in marks if t.opened is None or m >= t.opened]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    interval = statistics.median(gaps) if gaps else None
    slack = own_slack(t, gaps)
    over = tail_cpu = None
    finish: tuple = (None, None)
    if t.opened is None:           # it never asked for a batch (or no feed: a command objective's run)
        ended = min(t.wall, t.written) if t.written is not None else t.wall
        limit = t.startup_allowance + t.budget + slack
        if not t.stopped and ended > limit:
            over = (f"ran {ended:.1f}s by ar's clock (start to checkpoint), past the start-up allowance "
                    f"{t.startup_allowance:g}s + budget {t.budget:g}s + last-step slack {slack:.1f}s")
        return Verdict(0.0, interval, _hint(over, interval, t.slack_cap))
    end = t.deadline if t.deadline is not None else t.opened + t.budget
    written = t.written
    trained = max(0.0, min(written, end) - t.opened) if written is not None else 0.0
    if written is not None:
        tail_cpu = cpu_between(t.samples, end, written) if t.samples else None    # none: the wall rule
        in_window = [s for s in t.steps if t.opened <= s <= end]
        step_cpu = (cpu_between(t.samples, t.opened, in_window[-1]) / len(in_window)
                    if in_window and t.samples else None)
        finish = (interval + max(0.0, written - end) if interval is not None else None,
                  step_cpu + tail_cpu if step_cpu is not None and tail_cpu is not None else None)
    allowed = finish_allowance(credit, device if tail_cpu is not None else "wall")
    if t.stopped or written is None:
        pass
    elif written - end > slack:         # a wall bound, whatever the currency below (a run that sleeps)
        over = (f"wrote its checkpoint {written - end:.1f}s after its training window closed, past the "
                f"budget (the window: {end - t.opened:.1f}s from its first batch; the last step and "
                f"saving may take {slack:.1f}s)")
    elif allowed is not None and (tail_cpu if allowed[1] == "cpu" else written - end) > allowed[0]:
        spent = f"{tail_cpu:.1f} CPU-s" if allowed[1] == "cpu" else f"{written - end:.1f}s"
        base = credit.finish_cpu if allowed[1] == "cpu" else credit.finish
        over = (f"trained past the budget: wrote its checkpoint {written - end:.1f}s after its training window "
                f"closed and used {spent} after it, more than the {allowed[0]:.1f} the baseline's finish allows "
                f"(its last step and save took {base:.1f}; × {FINISH_FACTOR:g} + {FINISH_SLACK:g}): training "
                f"ends inside the window (train.py plans its last step so)")
    return Verdict(trained, interval, _hint(over, interval, t.slack_cap), tail_cpu, finish)


def _hint(over: str | None, interval: float | None, slack_cap: float) -> str | None:
    if over and interval and interval > slack_cap / 2:       # the budget fits a few steps at best
        over += (f"; its steps take {interval:.1f}s each: raise the time budget or make the steps smaller "
                 f"(TOTAL_BATCH_SIZE)")
    return over

