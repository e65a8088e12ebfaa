"""Several experiments at once: N slots in flight, decisions one at a time in dispatch order.

`ParallelLoop` is the Loop with the path of one experiment split in two:
  prepare + run (in the slot, in parallel): take the best commit into the slot's worktree, propose (or apply
      the knobs), guard, commit there, train with the slot's CUDA_VISIBLE_DEVICES, parse, cross-check;
  decide + record (here, serially, in queue order): decide against the best *now*, move the branch when kept,
      append the row, mark the spec done, fire the hooks.
A result that finishes early waits for the ones dispatched before it; results.tsv stays one file in decision
order. A win whose parent is no longer the best (another slot's win was decided first) is not merged: with
`stale_policy: rerun` (default) it is recorded `stale` and queued again on top of the new best (the same
knobs, or the same diff); with `record` it is only recorded `stale`. A baseline runs alone: nothing is
dispatched before it is decided.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
import psutil

from . import guards
from .config import RunConfig
from .decide import decide
from .errors import ConfigError, GitError
from .executors import Slot, parse_gpus
from .executors.local import LocalExecutor, clean_worktree
from .gitops import short
from .ledger import Row, Status, now_iso
from .loop import (DIFF_CAP, FAILURES, MAX_STARTS, Event, Loop, Summary, _Exp, _message, _restore_sigterm,
                   _safe_knobs, _sigterm_as_interrupt, _Stop)
from .queue import Spec
from .runner import STOP_INTERRUPTED


def make_executor(cfg: RunConfig):
    """The executor for cfg.gpus / cfg.executor."""
    if cfg.executor == "ray":
        from .executors.ray import RayExecutor
        return RayExecutor(cfg)
    slots = parse_gpus(cfg.gpus or "")
    if any(s.kind == "ray" for s in slots):
        raise ConfigError("--gpus ray:N needs --executor ray")
    return LocalExecutor(slots)


def make_loop(cfg: RunConfig, *args, **kw) -> Loop:
    """A Loop for one experiment at a time, or a ParallelLoop when the config names slots or Ray."""
    if cfg.gpus or cfg.executor == "ray":
        return ParallelLoop(cfg, *args, **kw)
    return Loop(cfg, *args, **kw)


BUILTIN_PROPOSERS = ("grid", "random", "strategy")


class _FlightRows:
    """The ledger as a proposer in a slot sees it: every result, then the proposals still in flight (no
    val_bpb, reason `in flight`), so that two slots do not try the same point."""

    def __init__(self, ledger, flying: dict[int, tuple[dict, str]]):
        self._ledger, self._flying = ledger, flying

    def rows(self) -> list[Row]:
        extra = [Row(commit="", val_bpb=None, memory_gb=None, status=Status.DISCARD, exp_id=i,
                     description=f"(in flight) {desc}", knobs=knobs, reason="in flight")
                 for i, (knobs, desc) in sorted(dict(self._flying).items())]
        return self._ledger.rows() + extra

    def __getattr__(self, name):
        return getattr(self._ledger, name)


@dataclass
class _Flight:
    """One dispatched experiment: its slot, its future, and when its run finished."""

    x: _Exp
    slot: Slot
    future: cf.Future
    finished_at: float = 0.0


class ParallelLoop(Loop):
    def __init__(self, cfg: RunConfig, *args, executor=None, **kw):
        super().__init__(cfg, *args, **kw)
        if cfg.confirm_new_best:
            raise ConfigError("confirm_new_best is not available with several slots yet; set it to false or "
                              "run without --gpus")
        self.executor = executor or make_executor(cfg)
        self._slot: Slot | None = None        # set on a slot's view
        self._main: ParallelLoop = self
        self._views: dict[int, ParallelLoop] = {}
        self._hook_lock = threading.Lock()
        self._interrupted_at = 0.0
        self._propose_lock = threading.Lock()
        self._flying: dict[int, tuple[dict, str]] = {}   # spec id -> (knobs, description) of proposals in flight

    @property
    def slots(self) -> list[Slot]:
        return self.executor.slots

    # ---------------------------------------------------------------------------------- open / close
    def open(self) -> None:
        if self._open:
            return
        super().open()
        try:
            self.executor.open(self)
        except BaseException:
            super().close()
            raise
        self.say(f"{len(self.slots)} slots ({', '.join(s.label for s in self.slots)}) on the {self.executor.name} "
                 f"executor; a win on a stale parent is {'re-run' if self.cfg.stale_policy == 'rerun' else 'recorded'}")
        self._write_status(slots=[self._slot_doc(s) for s in self.slots])

    def close(self) -> None:
        if self._open:
            self.executor.close()
        super().close()

    def _view(self, slot: Slot) -> "ParallelLoop":
        """This loop seen from a slot: the slot's worktree as root and git, the slot's environment."""
        view = self._views.get(slot.index)
        if view is None:
            view = copy.copy(self)
            view.__dict__.pop("_eval_server", None)   # each slot evaluates on its own server
            view.git = self.executor.worktree(self, slot)
            view.root = view.git.root
            view._slot, view._main = slot, self
            view.slot_env = dict(slot.env)
            view.ledger = _FlightRows(self.ledger, self._flying)
            view._status_at = 0.0
            self.executor.prepare_view(view)
            self._views[slot.index] = view
        return view

    # -------------------------------------------------------------------------------------------- run
    def run(self, max_experiments: int | None = None, max_hours: float | None = None) -> Summary:
        opened_here = not self._open
        self.open()
        t0, n, kept, failures = time.monotonic(), 0, 0, 0
        session = f"{now_iso()}-{os.getpid()}"
        old_term = _sigterm_as_interrupt()
        stop, failed, interrupted = "", False, False
        flights: deque[_Flight] = deque()
        pool = cf.ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="ar-slot")
        free = list(self.slots)
        no_more = ""   # why nothing more is dispatched (a limit, an empty queue); the loop ends when flights drain
        try:
            try:
                while True:
                    if not no_more:
                        no_more = self._dispatch(flights, free, pool, n, t0, max_experiments, max_hours)
                    if not flights:
                        raise _Stop(no_more or "the queue is empty")
                    self._wait(flights, free)
                    while flights and flights[0].future.done():
                        f = flights.popleft()
                        row = self._settle(f)
                        if row is None:
                            if f.x.spec.kind == "propose" and self.proposer is not None:
                                no_more = f"the {self.proposer.name} proposer has nothing left to try"
                            continue
                        n += 1
                        kept += row.status is Status.KEEP
                        failures = failures + 1 if row.status in FAILURES else 0 if row.status in (
                            Status.KEEP, Status.DISCARD) else failures
                        if self.halted:
                            raise _Stop(f"{self.halted}; restore them (reinstall ar, `ar prepare` the data) before "
                                        "running again", failed=True)
                        if f.x.spec.kind == "baseline" and row.status is not Status.KEEP:
                            raise _Stop(f"the baseline did not run cleanly ({row.status.value}: {row.reason}); "
                                        f"fix train.py or the setup, see {self._exp_dir_of(row)}/train.log",
                                        failed=True)
                        if failures >= self.cfg.max_consecutive_crashes:
                            raise _Stop(f"{failures} crashed, timed-out or rejected experiments in a row "
                                        f"(--max-consecutive-crashes {self.cfg.max_consecutive_crashes}); last: "
                                        f"{row.reason}", failed=True)
            except KeyboardInterrupt:
                self._interrupt(flights)
                raise _Stop("interrupted; the experiments in flight are recorded as `interrupted`",
                            interrupted=True) from None
        except _Stop as s:
            stop, failed, interrupted = str(s), s.failed, s.interrupted
            if flights:
                if not interrupted:
                    self.say(f"stopping: {stop}; finishing the {len(flights)} experiment(s) in flight")
                n += self._drain(flights)
        finally:
            pool.shutdown(wait=True)
            _restore_sigterm(old_term)
            self._wind_up(session, stop, n, kept, opened_here)
        return self._summary(n, kept, stop, failed, interrupted)

    def _dispatch(self, flights: deque, free: list[Slot], pool, n: int, t0: float, max_experiments, max_hours) -> str:
        """Fill the free slots from the queue (proposing when it is empty); a reason when nothing more will go."""
        while free:
            if max_experiments is not None and n + len(flights) >= max_experiments:
                return f"reached --max-experiments {max_experiments}"
            if max_hours is not None and time.monotonic() - t0 >= max_hours * 3600:
                return f"reached --max-hours {max_hours:g}"
            if flights and flights[0].x.spec.kind == "baseline":
                return ""       # everything else starts from the baseline's result
            flying = {f.x.spec.id for f in flights}
            spec = next((s for s in self.queue.pending() if s.id not in flying), None)
            if spec is None:
                if self.proposer is None:
                    return "" if flights else "the queue is empty"
                spec = self.queue.add("propose", {"proposer": self.proposer.name})
            if spec.kind == "baseline" and flights:
                return ""
            slot = free.pop(0)
            x = self._start(spec)
            if x.row is not None:          # recorded without running (started too often)
                free.insert(0, slot)
                continue
            fut = pool.submit(self._prepare_and_run, self._view(slot), x)
            flight = _Flight(x, slot, fut)
            fut.add_done_callback(lambda _f, fl=flight: setattr(fl, "finished_at", time.time()))
            flights.append(flight)
            self._status_slot(slot, {"id": spec.id, "kind": spec.kind, "phase": "proposing",
                                     "description": spec.payload.get("description") or "", "commit": "",
                                     "started_at": x.started_at, "time_budget": None}, None)
        return ""

    def _start(self, spec: Spec) -> _Exp:
        """Step 1, here: mark the spec started (or record it when it keeps taking ar down)."""
        for d in self.tag_dir.glob(f"{spec.id:04d}-*"):
            shutil.rmtree(d, ignore_errors=True)
        x = _Exp(spec, parent=self.best_sha, started_at=now_iso(), stage=self.ledger.exp_dir(spec.id, ""))
        if self.queue.starts(spec.id) >= MAX_STARTS:
            x.description = spec.payload.get("description") or spec.kind
            self._record(x, self._row(x, Status.INTERRUPTED, reason=f"ar stopped during this experiment "
                                                                     f"{MAX_STARTS} times; not run again"))
            return x
        self.queue.start(spec.id)
        self._emit(Event("start", spec.payload.get("description") or "", spec=spec))
        return x

    def _wait(self, flights: deque, free: list[Slot]) -> None:
        """Wait until the oldest experiment is done (or any, to refill its slot); free the slots of finished runs."""
        pending = [f.future for f in flights if not f.future.done()]
        if pending and not flights[0].future.done():
            cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
        for f in flights:
            if f.future.done() and f.slot not in free and not any(
                    g.slot == f.slot and not g.future.done() for g in flights):
                free.append(f.slot)
                free.sort(key=lambda s: s.index)
                self._status_slot(f.slot, None, None)

    # ------------------------------------------------------------------------- in the slot (parallel)
    def _prepare_and_run(self, view: "ParallelLoop", x: _Exp) -> tuple:
        """Steps 2-6 in the slot's worktree. Returns ("ran", run...), ("rejected", reason), ("skipped",) or
        ("missing", reason) for the main thread to decide and record."""
        spec = x.spec
        clean_worktree(view.git, x.parent)
        if spec.kind == "rerun":
            p = spec.payload
            x.seed, x.time_budget = p.get("seed"), p.get("time_budget")
            try:
                x.sha = view.git.resolve(str(p.get("commit")))
            except GitError:
                x.description = f"re-run of {p.get('commit')}"
                return ("missing", f"commit {p.get('commit')} not found")
            x.description = p.get("description") or f"re-run of {short(x.sha)} with seed {x.seed}"
            clean_worktree(view.git, x.sha)
            return ("ran", *view._train_and_classify(x))
        if spec.kind == "baseline":
            x.sha, x.description = x.parent, spec.payload.get("description") or "baseline"
            return ("ran", *view._train_and_classify(x))
        guard_dir = view.root / "runs" / self.tag     # the slot's own; other slots' logs change the main one
        snap = guards.snapshot(view.git, x.parent, guard_dir)
        view._status_exp(x, "proposing")
        if spec.payload.get("replay"):
            proposal = view._replay(x)
        else:   # built-in proposers one at a time, each seeing the others' points in flight as tried
            builtin = self.proposer is not None and self.proposer.name in BUILTIN_PROPOSERS
            with self._propose_lock if builtin else contextlib.nullcontext():
                proposal = view._propose(x)
                if proposal is not None and not isinstance(proposal, str):
                    self._flying[spec.id] = (_safe_knobs(view.root / self.train_file), x.description)
        if proposal is None:
            return ("skipped",)
        reason = self._integrity_after_proposal() or (proposal if isinstance(proposal, str) else None)
        if reason is None:
            changed, reason = guards.check_scope(view.git, snap, self.cfg.allowed_paths, guard_dir,
                                                 exclude_prefix=x.stage.name + "/")
            x.changed = changed
            if not reason and not changed and spec.kind == "propose":
                reason = "the proposal changed nothing"
            reason = reason or guards.check_files(view.git, x.parent, changed)
        if reason:
            try:
                x.stage.mkdir(parents=True, exist_ok=True)
                (x.stage / "diff.patch").write_text(view.git.diff(x.parent)[:DIFF_CAP])
            except (GitError, OSError):
                pass
            guards.restore(view.git, snap, guard_dir)
            return ("rejected", reason)
        x.sha = view.git.commit([*x.changed] or [self.train_file], _message(x, self.tag), allow_empty=not x.changed)
        return ("ran", *view._train_and_classify(x))

    def _replay(self, x: _Exp):
        """A stale win again, on top of the new best: apply the same diff; a str when it does not apply."""
        p = x.spec.payload
        x.description = p.get("description") or f"replay of {short(p['replay'])}"
        try:
            self.git._git("cherry-pick", "--no-commit", "--strategy=recursive", "-X", "theirs", p["replay"])
        except GitError as e:
            self.git._git("cherry-pick", "--abort") if (self.git.git_dir / "CHERRY_PICK_HEAD").exists() else None
            return f"the change of {short(p['replay'])} does not apply on the new best: {e}"
        self.git._git("reset", "--quiet")          # unstaged, like an agent's edit
        return x.description

    # ------------------------------------------------------------------------- here (serial, in order)
    def _settle(self, f: _Flight) -> Row | None:
        """Decide and record one finished experiment (None: nothing was recorded, the proposer had nothing)."""
        x = f.x
        self._flying.pop(x.spec.id, None)
        try:
            outcome = f.future.result()
        except Exception as e:  # a bug or an environment failure in the slot: record it, keep the loop going
            self.git.reset_hard(self.best_sha)
            return self._record(x, self._row(x, Status.CRASH, reason=f"the slot failed: {type(e).__name__}: {e}"))
        cut = self._interrupted_at and f.finished_at >= self._interrupted_at
        kind = outcome[0]
        if kind == "skipped":
            self.queue.done(x.spec.id, "skipped")
            return None
        if kind == "missing":
            return self._record(x, self._row(x, Status.VALIDATION, reason=outcome[1]))
        if kind == "rejected":
            return self._record(x, self._row(x, Status.REJECTED, reason=outcome[1]))
        result, status, reason, m, budget, seed = outcome[1:]
        if cut or result.stop_reason == STOP_INTERRUPTED:
            x.time_budget, x.seed = budget, seed
            return self._interrupted(x, None, m)
        if status is None and x.spec.kind not in ("rerun", "baseline") and x.parent != self.best_sha:
            best = self.ledger.best_kept()
            d = decide(best.val_bpb if best else None, m.val_bpb, self.noise)
            if d.keep:
                return self._stale(x, m, budget, seed, d.reason)
        return self._decide_and_record(x, result, status, reason, m, budget, seed)

    def _stale(self, x: _Exp, m, budget: float, seed: int, why: str) -> Row:
        """A win on a parent that is no longer the best: recorded `stale`; with rerun, queued on the new best."""
        x.time_budget, x.seed, x.val_bpb = budget, seed, m.val_bpb
        reason = f"{why}, but its parent {short(x.parent)} is no longer the best ({short(self.best_sha)} is)"
        if self.cfg.stale_policy == "rerun":
            p = x.spec.payload
            if x.spec.kind == "knobs":
                again = self.queue.add("knobs", {**p, "replay_of": x.spec.id})
            else:
                again = self.queue.add("propose", {"proposer": p.get("proposer"), "replay": x.sha,
                                                   "replay_of": x.spec.id, "description": x.description})
            reason += f"; re-run on top of it as experiment {again.id:04d}"
        else:
            reason += "; not merged (stale_policy: record)"
        self.git.reset_hard(self.best_sha)
        return self._record(x, self._row(x, Status.STALE, m=m, reason=reason))

    def _drain(self, flights: deque) -> int:
        """Record what is still in flight, in order (after a stop or Ctrl-C)."""
        n = 0
        while flights:
            f = flights.popleft()
            try:
                cf.wait([f.future])
            except KeyboardInterrupt:
                self._interrupt(flights)
                cf.wait([f.future])
            if self._settle(f) is not None:
                n += 1
        return n

    def _interrupt(self, flights) -> None:
        """Ctrl-C: stop every training run in flight (their whole process trees); they record as interrupted."""
        self._interrupted_at = self._interrupted_at or time.time()
        self._stop_runs()

    def _stop_runs(self) -> None:
        stop = getattr(self.executor, "interrupt", None)
        if stop is not None:
            stop()
            return
        for p in psutil.Process().children(recursive=True):
            try:
                p.terminate()
            except psutil.Error:
                pass

    # --------------------------------------------------------------------------------------- helpers
    def _fire_event(self, event: str, exp_id, payload: dict) -> None:
        with self._hook_lock:   # run_started fires from the slots
            super()._fire_event(event, exp_id, payload)

    # ------------------------------------------------------------------------------------ status.json
    def _slot_doc(self, slot: Slot, experiment: dict | None = None, step: dict | None = None) -> dict:
        return {"slot": slot.index, "label": slot.label, "gpu": slot.gpu, "kind": slot.kind,
                "experiment": experiment, "step": step}

    def _status_slot(self, slot: Slot, experiment: dict | None, step: dict | None, keep_experiment=False,
                     node: str | None = None) -> None:
        main = self._main
        with main._status_lock:
            slots = list(main._status_doc.get("slots") or [main._slot_doc(s) for s in main.slots])
            cur = slots[slot.index]
            doc = main._slot_doc(slot, cur.get("experiment") if keep_experiment else experiment, step)
            if node or cur.get("node"):
                doc["node"] = node or cur.get("node")
            slots[slot.index] = doc
            main._write_status_locked({"slots": slots})

    def _status_exp(self, x: _Exp, phase: str, budget: float | None = None) -> None:
        if self._slot is None:
            return super()._status_exp(x, phase, budget)
        self._status_slot(self._slot, {"id": x.spec.id, "kind": x.spec.kind, "phase": phase,
                                       "description": x.description, "commit": short(x.sha) if x.sha else "",
                                       "started_at": x.started_at, "time_budget": budget}, None)

    def _status_step(self, p) -> None:
        if self._slot is None:
            return super()._status_step(p)
        now = time.monotonic()
        if now - self._status_at >= 0.5:
            self._status_at = now
            self._status_slot(self._slot, None, p.__dict__, keep_experiment=True)

    def _write_status(self, **changes) -> None:
        if self._slot is not None:
            return self._main._write_status(**changes)
        super()._write_status(**changes)


def slots_of(status: dict | None) -> list[dict]:
    """The slots in a status.json document (empty for a loop of one experiment at a time)."""
    return list((status or {}).get("slots") or [])

