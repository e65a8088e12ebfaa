"""runs/<tag>/status.json: what `ar status` shows from any shell while a loop runs — the lock holder's tag,
the experiment (or each slot's experiment) and its phase, the latest step, the best so far.

Best-effort and throttled: a write that fails is skipped (the ledger is what counts), and step lines are
written at most twice a second per slot.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from .executors import Slot
from .gitops import short
from .ledger import Row, now_iso
from .metrics import StepPoint
from .experiment.context import Experiment, SlotContext, write_json


class LiveStatus:
    def __init__(self, path: Path, header: dict, slots: Callable[[], list[Slot]], by_slot: bool,
                 best: Callable[[], Row | None]):
        """`slots` and `best` are read when written: an executor knows its slots only once it is open."""
        self.path, self.header, self.slots, self.by_slot, self.best = path, header, slots, by_slot, best
        self._doc: dict = {}
        self._lock = threading.Lock()

    def exp(self, ctx: SlotContext, x: Experiment, phase: str, budget: float | None = None) -> None:
        doc = {"id": x.spec.id, "kind": x.spec.kind, "phase": phase, "description": x.description,
               "commit": short(x.sha) if x.sha else "", "started_at": x.started_at, "time_budget": budget}
        if self.by_slot:
            self.slot(ctx.slot, experiment=doc, step=None)
        else:
            self.write(experiment=doc, step=None)

    def step(self, ctx: SlotContext, p: StepPoint, node: str | None = None) -> None:
        now = time.monotonic()
        if now - ctx.status_at < 0.5:
            return
        ctx.status_at = now
        if self.by_slot:
            self.slot(ctx.slot, step=p.__dict__, node=node)
        else:
            self.write(step=p.__dict__)

    def idle(self, slot: Slot) -> None:
        if self.by_slot:
            self.slot(slot, experiment=None, step=None)

    def slot(self, slot: Slot, node: str | None = None, **changes) -> None:
        """Update one slot's entry (its experiment, its step, the node it runs on)."""
        with self._lock:
            slots = list(self._doc.get("slots") or [slot_doc(s) for s in self.slots()])
            doc = dict(slots[slot.index])
            doc.update(changes)
            if node:
                doc["node"] = node
            slots[slot.index] = doc
            self._write_locked({"slots": slots})

    def write(self, **changes) -> None:
        with self._lock:
            self._write_locked(changes)

    def _write_locked(self, changes: dict) -> None:
        doc = self._doc
        if not doc:
            doc.update(self.header, pid=os.getpid(), host=socket.gethostname())
        doc.update(changes)
        best = self.best()
        doc["best"] = None if best is None else {"commit": best.commit, "val_bpb": best.val_bpb,
                                                 "exp_id": best.exp_id, "description": best.description}
        doc["updated_at"] = now_iso()
        try:
            write_json(self.path, doc)
        except OSError:
            pass  # the live view is best-effort; the ledger is what counts


def slot_doc(slot: Slot) -> dict:
    return {"slot": slot.index, "label": slot.label, "gpu": slot.gpu, "kind": slot.kind, "experiment": None,
            "step": None}
