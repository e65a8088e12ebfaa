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
- on a GPU, in wall seconds: the baseline's smallest start-up + max(`GPU_ROOM`, that start-up): room for a new
  shape's cold compile (~30 s on an H200). GPU kernels leave no CPU time to count, so compute before the first
  batch is bounded by that room only (docs/reliability.md: what it can buy on which dataset).
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
("credit": wall seconds, "cpu": CPU seconds; each the smallest so far; "finish", "finish_cpu": the largest
finish so far, step + tail), so a resumed session keeps them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FILE = "clock.json"
CPU_FACTOR, CPU_SLACK = 1.3, 1.0
GPU_ROOM = 30.0
FINISH_FACTOR, FINISH_SLACK = 1.5, 1.0     # what the finish may take: 1.5 × the baseline's + 1 s (or CPU-s)
SHORT_WINDOW = 0.5          # a run whose window was under this share of its budget is never kept


@dataclass(frozen=True)
class Credit:
    """The baseline's smallest start-up so far: wall seconds and CPU seconds (None before the baseline), and
    its largest finish (one step + its window's end to its checkpoint), in both."""
    wall: float | None = None
    cpu: float | None = None
    finish: float | None = None
    finish_cpu: float | None = None


def load(tag_dir: Path) -> Credit:
    try:
        doc = json.loads((Path(tag_dir) / FILE).read_text())
        return Credit(float(doc["credit"]), *(float(doc[k]) if doc.get(k) is not None else None
                                              for k in ("cpu", "finish", "finish_cpu")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return Credit()


def note_baseline(tag_dir: Path, wall: float, cpu: float | None, finish: float | None = None,
                  finish_cpu: float | None = None) -> Credit:
    """Record one run of the baseline commit; returns the credit from now on (a start-up only ever tightens it,
    a finish only ever widens it: the baseline is the user's code, each of its runs honest)."""
    old = load(tag_dir)
    new = Credit(min(x for x in (old.wall, wall) if x is not None),
                 min((x for x in (old.cpu, cpu) if x is not None), default=None),
                 max((x for x in (old.finish, finish) if x is not None), default=None),
                 max((x for x in (old.finish_cpu, finish_cpu) if x is not None), default=None))
    tmp = Path(tag_dir) / f".{FILE}.tmp-{os.getpid()}"
    doc = {"credit": round(new.wall, 3)} | {k: round(v, 3) for k, v in (
        ("cpu", new.cpu), ("finish", new.finish), ("finish_cpu", new.finish_cpu)) if v is not None}
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, Path(tag_dir) / FILE)
    return new


def start_up_cost(credit: Credit, device: str, wall: float, cpu: float | None) -> tuple[float, str | None]:
    """(seconds to take off the window, why) for a start-up of `wall` seconds and `cpu` CPU seconds."""
    if credit.wall is None:
        return 0.0, None                          # before the baseline: the allowance (a kill) is the bound
    if device == "cpu" and credit.cpu is not None and cpu is not None:
        allowed = CPU_FACTOR * credit.cpu + CPU_SLACK
        excess = cpu - allowed
        what = (f"its start-up used {cpu:.1f} CPU-s before its first batch, more than the {allowed:.1f} the "
                f"baseline's {credit.cpu:.1f} allows")
    else:
        allowed = credit.wall + max(GPU_ROOM, credit.wall)
        excess = wall - allowed
        what = (f"its first batch came {wall:.1f}s after its start, later than the {allowed:.1f}s the baseline's "
                f"{credit.wall:.1f}s allows")
    if excess <= 0:
        return 0.0, None
    return excess, f"{what}: its training window was cut by {excess:.1f}s"


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
