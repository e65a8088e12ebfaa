"""The scheduler: N slots in flight (one GPU is N = 1), dispatch in queue order, settle in dispatch order.

Every experiment, whatever runs it, takes the same path (docs/architecture.md):
  in its slot, in parallel:   propose (or apply knobs), guard, commit → execute → evaluate
  here, one at a time:        settle (decide against the best *now*, reset, record, hooks)
A result that finishes early waits for the ones dispatched before it, so results.tsv is one file in
decision order. A baseline trains alone: what is dispatched beside it prepares (an agent proposes, a knob edit
is committed) but starts its run only once the baseline has trained cleanly (`BaselineGate`): every later
run's clock is measured against the baseline's start-up, and the first candidate is ready when the GPU frees;
it is called off if the baseline is then not kept. A win whose parent is no
longer the best (another slot's win was settled first) is not merged: with `stale_policy: rerun` (default)
it is recorded `stale` and queued again on top of the new best (the same knobs, or the same diff); with
`record` it is only recorded `stale`. With one slot the parent is always the best, so nothing is stale.

Executors (executors/) say where a slot's process runs; they import nothing from here.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import psutil

from autoresearch.config import RunConfig
from autoresearch.errors import ArError, ConfigError
from autoresearch.slots import Slot, parse_gpus
from autoresearch.records.ledger import Row, Status, now_iso
from autoresearch.process import STOP_INTERRUPTED
from autoresearch.experiment import again, propose, settle
from autoresearch.experiment.context import Experiment, Outcome
from autoresearch.session.limits import Limits, Stop



def make_executor(cfg: RunConfig):
    """The executor for cfg.gpus / cfg.executor: the repo itself when neither names slots."""
    if cfg.executor == "ray":
        from autoresearch.executors.ray import RayExecutor
        return RayExecutor(cfg)
    from autoresearch.executors.local import InlineExecutor, LocalExecutor
    if not cfg.gpus:
        return InlineExecutor()
    slots = parse_gpus(cfg.gpus)
    if any(s.kind == "ray" for s in slots):
        raise ConfigError("--gpus ray:N needs --executor ray")
    return LocalExecutor(slots)


class BaselineGate:
    """Held shut while a baseline is in flight: a run dispatched beside it waits here after its proposal and
    commit (with two slots on one GPU, after its launcher's trusted start-up too, executors/local.py). Opened
    as soon as the baseline has trained cleanly (`trained`: its start-up is noted as every later run's credit
    and its compile artefacts are in the store, so what waited starts while the baseline is evaluated), and
    at its decision (`open`); `ok` says whether it was kept. A run started early is called off when it was not
    (`called_off`): nothing is measured against a baseline that was not kept."""

    def __init__(self, stopping: threading.Event):
        self.stopping = stopping                  # the session's stop: a run waiting here then never starts
        self._open = threading.Event()
        self._open.set()
        self._decided = threading.Event()
        self._decided.set()
        self.ok = True

    def close(self) -> None:
        self.ok = True
        self._open.clear()
        self._decided.clear()

    def trained(self) -> None:
        self._open.set()

    def open(self, ok: bool) -> None:
        self.ok = ok
        self._open.set()
        self._decided.set()

    def is_open(self) -> bool:
        return self._open.is_set()

    def called_off(self) -> bool:
        return not self.ok

    def _until(self, event: threading.Event) -> bool:
        """Wait for `event`; False when the session is stopping first."""
        while not event.wait(0.2):
            if self.stopping.is_set():
                return False
        return True

    def wait_decided(self) -> bool:
        """Wait for the baseline's decision (a run that started early asks before it weighs its runs against the
        best); False when the session is stopping first."""
        return self._until(self._decided)

    def wait(self) -> bool:
        """Whether a run may start: False when the session is stopping or the baseline was not kept."""
        return self._until(self._open) and self.ok and not self.stopping.is_set()


@dataclass
class Flight:
    """One dispatched experiment: its slot, its future (the slot's outcome), and when that finished."""

    x: Experiment
    slot: Slot
    future: "cf.Future | None"
    finished_at: float = 0.0


class Scheduler:
    """Runs a Loop's queue on its executor's slots until one of its limits (limits.py) says stop."""

    def __init__(self, loop, max_experiments: int | None, max_hours: float | None):
        self.loop = loop
        self.limits = Limits(loop, max_experiments, max_hours)
        self.flights: deque[Flight] = deque()
        self.free = list(loop.slots)
        self.interrupted_at = 0.0

    def run(self) -> tuple[str, bool, bool]:
        """(why it stopped, failed, interrupted)."""
        lp = self.loop
        no_more = ""   # why nothing more is dispatched (a limit, an empty queue); the loop ends when flights drain
        self.limits.say_budget()
        with cf.ThreadPoolExecutor(max_workers=len(lp.slots), thread_name_prefix="ar-slot") as pool:
            try:
                try:
                    while True:
                        if not no_more:
                            no_more = self._dispatch(pool)
                        if not self.flights:
                            raise Stop(no_more or "the queue is empty")
                        self._wait()
                        while self.flights and self.flights[0].future.done():
                            f = self.flights.popleft()
                            row = self._settle(f)
                            if row is None:
                                if f.x.spec.kind == "propose" and lp.proposer is not None:
                                    no_more = f"the {lp.proposer.name} proposer has nothing left to try"
                                continue
                            self.limits.count(f.x.spec.kind, row)
                except KeyboardInterrupt:
                    self._interrupt()
                    raise Stop("interrupted; the experiments in flight are recorded as `interrupted`",
                               interrupted=True) from None
                except OSError as e:   # a full or read-only disk under runs/, most often
                    self._interrupt()
                    self._drain()
                    raise file_error(e) from e
            except Stop as s:
                if self.flights:
                    if not s.interrupted:
                        lp.say(f"stopping: {s}; finishing the {len(self.flights)} experiment(s) in flight")
                    self._drain()
                return str(s), s.failed, s.interrupted

    def _dispatch(self, pool) -> str:
        """Fill the free slots from the queue (proposing when it is empty); a reason when nothing more will go."""
        lp = self.loop
        while self.free:
            full = self.limits.no_room(len(self.flights))
            if full:
                return full
            if self.flights and self.flights[0].x.spec.kind == "baseline" and len(self.flights) >= len(lp.slots):
                return ""       # one each beside the baseline: nothing is settled (or stopped) until it is
            flying = {f.x.spec.id for f in self.flights}
            spec = next((s for s in lp.queue.pending() if s.id not in flying), None)
            if spec is None:
                if lp.proposer is None:
                    return "" if self.flights else "the queue is empty"
                spec = lp.queue.add("propose", {"proposer": lp.proposer.name})
            if spec.kind == "baseline" and self.flights:
                return ""
            x = lp.start(spec)
            if x.row is not None:          # recorded without running (started too often)
                self.limits.n += 1
                continue
            if spec.kind == "baseline":
                lp.gate.close()        # what goes beside it prepares, then waits for its decision
            slot = self.free.pop(0)
            ctx = lp.slot_context(slot)
            lp.events.started(ctx, x)
            flight = Flight(x, slot, None)
            flight.future = pool.submit(_timed, flight, propose.propose_and_run, lp, ctx, x)
            self.flights.append(flight)
        return ""

    def _wait(self) -> None:
        """Wait until the oldest experiment is done (or any, to refill its slot); free the slots of finished runs."""
        pending = [f.future for f in self.flights if not f.future.done()]
        if pending and not self.flights[0].future.done():
            cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
        for f in self.flights:
            if f.future.done() and f.slot not in self.free and not any(
                    g.slot == f.slot and not g.future.done() for g in self.flights):
                self.free.append(f.slot)
                self.free.sort(key=lambda s: s.index)

    def _settle(self, f: Flight) -> Row | None:
        """Decide and record one finished experiment (None: nothing was recorded, the proposer had nothing); a
        baseline's decision opens the gate for the runs waiting beside it (or tells them it was not kept)."""
        row = None
        try:
            row = self._decide(f)
            return row
        finally:
            if f.x.spec.kind == "baseline":
                self.loop.gate.open(row is not None and row.status is Status.KEEP)

    def _decide(self, f: Flight) -> Row | None:
        lp, x = self.loop, f.x
        lp.flying.pop(x.spec.id, None)
        try:
            out: Outcome = f.future.result()
        except Exception as e:  # a bug or an environment failure in the slot: record it, keep the loop going
            if isinstance(e, OSError):
                raise file_error(e) from e
            lp.git.reset_hard(lp.best_sha)
            why = f"the slot failed: {type(e).__name__}: {e}"
            row = settle.record_as(lp, x, Status.CRASH, reason=why)
            again.queue_again(lp, x, f"failed outside the proposal: {why}")
            return row
        ran = out.run if out.kind == "ran" else None
        try:
            if out.kind == "interrupted" or (self.interrupted_at and f.finished_at >= self.interrupted_at) or (
                    ran and ran[0].stop_reason == STOP_INTERRUPTED):
                if ran:
                    x.time_budget, x.seed = ran[4], ran[5]
                row = settle.interrupted(lp, x, ran[3] if ran else None)
                again.queue_again(lp, x, again.INTERRUPTED)       # cut off by the user's stop: once more
                return row
            if out.kind == "held":      # waited beside a baseline that was not kept: its run never started
                row = settle.interrupted(lp, x, reason=out.reason)
                again.queue_again(lp, x, again.HELD)
                return row
            if out.kind == "skipped":
                lp.queue.done(x.spec.id, "skipped")
                lp.events.settled(x, None)
                return None
            if out.kind == "missing":
                return settle.record_as(lp, x, Status.VALIDATION, reason=out.reason)
            if out.kind == "rejected":
                return settle.record_as(lp, x, Status.REJECTED, reason=out.reason)
            result, status, reason, m, budget, seed = ran
            stale = settle.stale_win(lp, x, status, m)
            if stale:
                return settle.record_stale(lp, x, m, budget, seed, stale)
            row = settle.decide_and_record(lp, x, result, status, reason, m, budget, seed)
            outside = again.outside_the_proposal(lp, x, row)
            if outside:
                again.queue_again(lp, x, outside)
            return row
        except OSError as e:   # a full or read-only disk under runs/, most often: stop, say so in one line
            raise file_error(e) from e

    def _drain(self) -> None:
        """Record what is still in flight, in order (after a stop or Ctrl-C)."""
        while self.flights:
            f = self.flights.popleft()
            try:
                cf.wait([f.future])
            except KeyboardInterrupt:
                self._interrupt()
                cf.wait([f.future])
            if self._settle(f) is not None:
                self.limits.n += 1

    def _interrupt(self) -> None:
        """Ctrl-C: stop every run and agent in flight (their whole process trees); they record as interrupted."""
        self.interrupted_at = self.interrupted_at or time.time()
        self.loop.stopping.set()
        stop = getattr(self.loop.executor, "interrupt", None)
        if stop is not None:
            stop()
            return
        for p in psutil.Process().children(recursive=True):
            try:
                p.terminate()
            except psutil.Error:
                pass


def _timed(flight: Flight, fn, *args):
    """Run fn in the slot and note when it ended before its future completes: a waiter woken by the future
    (cf.wait) may run before the future's done-callbacks do, and an end read as 0 would make a run cut off by
    Ctrl-C look as if it had ended before it (a crash, not `interrupted`)."""
    try:
        return fn(*args)
    finally:
        flight.finished_at = time.time()


def session_id() -> str:
    return f"{now_iso()}-{os.getpid()}"


def file_error(e: OSError) -> ArError:
    """A failed write under runs/ (a full or read-only disk, most often) as one line that says what to do."""
    where = f" ({e.filename})" if e.filename else ""
    return ArError(f"ar stopped: {e.strerror or e}{where}; free disk space or fix permissions, then run again "
                   "(nothing recorded is lost; a cut-short experiment runs again)")
