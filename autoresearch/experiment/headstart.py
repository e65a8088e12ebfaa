"""The head start: where slots take turns on one GPU, the next run's start-up runs beside the last seconds of the
running window instead of after it.

Without it the GPU idles through each run's own start-up (the proposal's imports, its model, its compile from the
store and its warm-up steps: 7–9 s on an H100), because "go" waits for the turn. With it, the runner writes "go"
when the running window has about one start-up left (`lead`): ar's clock starts there, and ar's feed holds the run's
first batch until the turn is really its own (the other run has exited). What keeps that fair:
- the training split reaches a run only through the feed, so nothing of it is trained on before the turn;
- the start-up is charged as every start-up is (clock.py): in GPU seconds of the run's own processes from "go"
  (the driver tells processes apart, so the neighbour's are not its), or CPU seconds on the CPU; its wall time
  less the wait for its turn. It is given only where that charge is read, never under the wall-clock rule, where
  the wait could hide work;
- at most `LEAD_CAP` seconds early; on a GPU the neighbour's window is lengthened by the GPU seconds the start-up
  has used beside it (harness/feed.py, at most `LEAD_CAP`), so a start-up that takes the GPU from its neighbour
  leaves it no shorter a window (an honest warm start-up uses about 0.3 GPU-s: its warm-up steps), and pays past
  its allowance from its own;
- only where the GPU's memory holds both: its free memory must hold the running run's again and the evaluator's
  workers (a warm-up allocates what a window holds; an out-of-memory in the neighbour's evaluation would lose
  its result). `AR_GPU_MEMORY_GB` (an emulated smaller card) counts as the card's size.

The other neighbour of a window is the evaluation of the run before it: that run's window closed when this one
opened, and its evaluator scores the checkpoint (10–20 s on an H100) while this window trains. A baseline never has
one beside it, so every candidate would train a little less than the baseline did. Its GPU seconds during the window
are given back too (`given_back`, at most `EVAL_CAP`), read from the driver for the processes of the evaluators of
the slots on this GPU only: never "every other process", which a proposal could join by double-forking a GPU
worker out of its own tree, and only what the driver reported (an evaluator's worker that exits is not charged to
its exit, as a run's helper is: gputime.GpuMeter.floor_exits).
"""

from __future__ import annotations

import statistics
from typing import Sequence

LEAD_CAP = 15.0             # seconds: the most a run starts before the running window's end
MEMORY_FACTOR = 1.1         # the next run's start-up may take what the running run holds (its warm-up steps) ...
EVAL_ROOM = 8 * 2**30       # ... + the evaluator's two model workers (logits buffers of 2 GiB each, activations)
EVAL_CAP = 30.0             # seconds: the most a window gets back for the evaluations beside it
BESIDE_FACTOR = 2.0         # a start-up beside a training window against one alone (H100: 15.5 s against 7.6–8.0)
SAID_FROM = 1.0             # seconds given back to a window from which its row says so (a warm-up lends about 0.3)


def asked(mode: bool | str, device: str) -> bool:
    """Whether the `head_start` setting asks for one on this device ("auto": on a GPU only, where the
    neighbour's window does not share the cores). Where it is then given: TrainingRun.may_start_early."""
    return mode is True or (mode == "auto" and device == "cuda")


def lead(startups: Sequence[tuple[float, bool]]) -> float | None:
    """How long before the running window's end the next run starts: the median of the last three start-ups on
    this GPU (go → first batch asked, less any wait for the turn) that ran beside a window, as the next one will;
    before any did, `BESIDE_FACTOR` × the median of the last three that ran alone. At most LEAD_CAP; None before
    any start-up. `startups`: (seconds, beside a window) in the order they were seen."""
    for beside, factor in ((True, 1.0), (False, BESIDE_FACTOR)):
        recent = [s for s, b in startups if b is beside and s >= 0][-3:]
        if recent:
            return min(LEAD_CAP, factor * statistics.median(recent))
    return None


def due(now: float, window_end: float | None, lead_s: float | None) -> bool:
    """Whether a run may start now beside a window that closes at `window_end` (wall clock; None: not open)."""
    return window_end is not None and lead_s is not None and now >= window_end - lead_s


def fits(free: int, total: int, held: int, cap: int | None = None) -> bool:
    """Whether a start-up fits beside a run holding `held` bytes on a GPU with `free` of `total` bytes free;
    `cap`: the card's emulated size (the rest of the real card counts as taken)."""
    if cap is not None and cap < total:
        free -= total - cap
    return free >= MEMORY_FACTOR * held + EVAL_ROOM


def given_back(head_start: float, evaluations: float) -> tuple[float, float]:
    """The seconds a window gets back, each capped: what the next run's head start, and the evaluators' processes,
    used of the GPU during it."""
    return min(max(head_start, 0.0), LEAD_CAP), min(max(evaluations, 0.0), EVAL_CAP)


def given_back_note(head_start: float, evaluations: float = 0.0) -> str | None:
    """What a run's row says of the seconds its window ran past its budget (given_back's two parts), or None."""
    if head_start + evaluations < SAID_FROM:
        return None
    parts = [f"{what} {s:.1f}s" for what, s in (("the next run's head start", head_start),
                                                  ("the evaluation beside it", evaluations)) if s >= 0.05]
    return (f"its window ran {head_start + evaluations:.1f}s past its budget: the GPU seconds used beside it "
            f"({', '.join(parts)}), given back")
