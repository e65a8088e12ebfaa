"""A durable, ordered queue of experiment specs: runs/<tag>/queue.jsonl, an append-only event log.

Events, one JSON object per line, each a single write + fsync (durable.append_line):
    {"op": "add",   "id": 3, "kind": "knobs", "payload": {...}, "at": "..."}
    {"op": "start", "id": 3, "at": "..."}
    {"op": "done",  "id": 3, "status": "keep", "at": "..."}
Specs are dispatched in id order. A spec started but never done is still pending (it is re-run after a
crash of `ar`, or recorded by the loop); a done spec is never pending again. A partial last line (a kill
mid-write) or a garbage line is reported with its line number and skipped; every valid event is kept.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autoresearch.records.durable import LedgerError, append_line, is_json_object
from autoresearch.records.ledger import now_iso

log = logging.getLogger(__name__)

KINDS = ("baseline", "propose", "knobs", "rerun", "commit")  # commit: the user's own, found on the branch


@dataclass
class Spec:
    id: int
    kind: str
    payload: dict


class ExperimentQueue:
    def __init__(self, path: Path, *, warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._warn = warn or log.warning
        self._specs: dict[int, Spec] = {}
        self._starts: dict[int, int] = {}
        self._done: dict[int, str] = {}
        self._load()

    # ------------------------------------------------------------------------------------------ reading
    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            raise LedgerError(f"cannot read {self.path}: {e.strerror}") from e
        lines = raw.decode("utf-8", errors="replace").split("\n")
        tail = lines.pop()  # "" when the file ends with a newline
        if tail.strip():
            lines.append(tail)
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            problem = self._apply_line(line)
            if problem:
                cut = " (a partial last line, cut off by a kill mid-write)" if n == len(lines) and tail.strip() else ""
                self._warn(f"{self.path.name} line {n}{cut}: {problem}; skipped")

    def _apply_line(self, line: str) -> str | None:
        try:
            ev = json.loads(line)
        except ValueError:
            return f"not JSON: {line[:60]!r}"
        if not isinstance(ev, dict) or not isinstance(ev.get("id"), int) or isinstance(ev.get("id"), bool):
            return f"not a queue event: {line[:60]!r}"
        op, i = ev.get("op"), ev["id"]
        if op == "add":
            if i in self._specs:
                return f"spec {i} added twice"
            kind, payload = ev.get("kind"), ev.get("payload", {})
            if not isinstance(kind, str) or not kind or not isinstance(payload, dict):
                return f"bad spec {line[:60]!r}"
            self._specs[i] = Spec(i, kind, payload)
        elif op in ("start", "done"):
            if i not in self._specs:
                return f"{op} of unknown spec {i}"
            if op == "start":
                self._starts[i] = self._starts.get(i, 0) + 1
            else:
                self._done.setdefault(i, str(ev.get("status", "")))
        else:
            return f"unknown op {op!r}"
        return None

    # ------------------------------------------------------------------------------------------ writing
    def _append(self, event: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(event, separators=(",", ":")) + "\n"
        append_line(self.path, line, is_whole=is_json_object, warn=self._warn)

    def add(self, kind: str, payload: dict) -> Spec:
        if kind not in KINDS:
            raise ValueError(f"spec kind {kind!r} is not one of {', '.join(KINDS)}")
        spec = Spec(max(self._specs, default=0) + 1, kind, dict(payload))
        self._append({"op": "add", "id": spec.id, "kind": kind, "payload": spec.payload, "at": now_iso()})
        self._specs[spec.id] = spec
        return spec

    def start(self, spec_id: int) -> None:
        self._known(spec_id)
        if spec_id in self._done:
            raise ValueError(f"spec {spec_id} is already done ({self._done[spec_id]}); it is never run again")
        self._append({"op": "start", "id": spec_id, "at": now_iso()})
        self._starts[spec_id] = self._starts.get(spec_id, 0) + 1

    def done(self, spec_id: int, status: str) -> None:
        """Mark a spec done. Marking a done spec again is a no-op (resume may repeat it)."""
        self._known(spec_id)
        if spec_id in self._done:
            return
        self._append({"op": "done", "id": spec_id, "status": str(status), "at": now_iso()})
        self._done[spec_id] = str(status)

    def _known(self, spec_id: int) -> None:
        if spec_id not in self._specs:
            raise ValueError(f"no spec {spec_id} in {self.path}")

    # ------------------------------------------------------------------------------------------ queries
    def pending(self) -> list[Spec]:
        """Specs not done, in id order (started-but-not-done included)."""
        return [self._specs[i] for i in sorted(self._specs) if i not in self._done]

    def next(self) -> Spec | None:
        p = self.pending()
        return p[0] if p else None

    def is_started(self, spec_id: int) -> bool:
        return self._starts.get(spec_id, 0) > 0

    def is_done(self, spec_id: int) -> bool:
        return spec_id in self._done

    def starts(self, spec_id: int) -> int:
        """How many times a spec was started (more than once: ar stopped during it before)."""
        return self._starts.get(spec_id, 0)

    def status(self, spec_id: int) -> str | None:
        """The status a spec was marked done with, or None while pending."""
        return self._done.get(spec_id)

    def get(self, spec_id: int) -> Spec:
        self._known(spec_id)
        return self._specs[spec_id]

    def all(self) -> list[Spec]:
        return [self._specs[i] for i in sorted(self._specs)]

    def __len__(self) -> int:
        return len(self._specs)
