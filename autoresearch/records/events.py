"""runs/<tag>/events.jsonl: what a session does, as it happens — the one source `ar status` and `ar serve` fold.

One JSON object per line, `{"t": unix time, "type": ..., fields}`:

    session_started     tag, branch, profile, slots [{slot, label, gpu, kind}], by_slot, budget (None: a sweep,
                        whose points carry theirs), noise, pid, host
    settings            a setting that changed since: noise (the calibrated threshold)
    experiment_started  exp_id, kind, slot, parent, commit, description, budget
    phase               exp_id, phase (proposing, committing, waiting (for the baseline's decision), training,
                        evaluating, settling), and what has become known since: commit, description, budget
    step                exp_id, step, pct, loss, tokens_per_s, mfu, dt_ms, remaining_s (node on Ray)
    experiment_settled  exp_id, status, value, reason, commit   (written after the ledger row, the commit point)
    session_stopped     why

Writing: the rare events go through durable.append_line (one write + fsync; a line cut by a kill is dropped
before the next one). Step events are one unsynced write: the next step supersedes a lost one within
seconds, and an fsync per step would cost the training machine more than the line is worth. Steps are
throttled to one per experiment every STEP_EVERY_S, plus the last one before the experiment's next phase.
Every write is best-effort: a failure is skipped, never stops the loop (results.tsv is what counts).

Bound: `fold` needs only the current session — its start, the in-flight experiments' start, phases and last
step, the last settled experiment, the stop. When the file passes MAX_BYTES the writer rewrites it to exactly
those lines (`compact`: the same fold, a handful of lines per slot; a temporary file, then a rename), so it
stays under MAX_BYTES plus one session's in-flight lines however long the night. The history is results.tsv.

Reading: `read` skips a partial last line (a writer killed mid-line) and any line that is not a JSON object;
`fold` is a pure function of the events; `against_lock` corrects the state of a writer that died without a
session_stopped (kill -9): a session runs only while the repo lock's holder is that session.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from autoresearch.gitops import short
from autoresearch.records.durable import LedgerError, append_line, is_json_object, write_atomic

STEP_EVERY_S = 2.0
MAX_BYTES = 1 << 20
KILLED = "killed mid-session (kill -9, or a crash: no stop was written)"
_EXP = ("experiment_started", "phase", "step", "experiment_settled")


def slot_fields(slot) -> dict:
    return {"slot": slot.index, "label": slot.label, "gpu": slot.gpu, "kind": slot.kind}


class EventLog:
    """The writer: one per session (the lock holder's), shared by its slots' threads."""

    def __init__(self, path: Path, *, step_every: float = STEP_EVERY_S, max_bytes: int = MAX_BYTES, clock=time):
        """`clock`: what stamps each event and throttles the step lines (the `time` module, or a test's clock)."""
        self.path, self.step_every, self.max_bytes, self.clock = Path(path), step_every, max_bytes, clock
        self._lock = threading.Lock()
        self._step_at: dict[int, float] = {}      # exp_id -> when its last step was written (monotonic)
        self._pending: dict[int, dict] = {}       # exp_id -> its latest step not yet written (throttled)
        self._size: int | None = None
        self._dirty = False                       # an unsynced write failed: the next goes through append_line
        self._why = ""
        self._stopped = True

    # ----------------------------------------------------------------------------------- the session
    def session_started(self, **fields) -> None:
        self._why, self._stopped = "", False
        self.write("session_started", pid=os.getpid(), host=socket.gethostname(), **fields)

    def settings(self, **fields) -> None:
        """A session setting that changed since session_started (the noise threshold once calibrated)."""
        self.write("settings", **fields)

    def stopping(self, why: str) -> None:
        """The reason the next session_stopped gives (a run's stop; the session may run again, in a sweep)."""
        self._why = why

    def session_stopped(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._lock:
            for exp_id in list(self._pending):
                self._flush_locked(exp_id)
        self.write("session_stopped", why=self._why or "closed")

    # ------------------------------------------------------------------------------ one experiment
    def started(self, ctx, x) -> None:
        self.write("experiment_started", exp_id=x.spec.id, kind=x.spec.kind, slot=ctx.slot.index, parent=short(x.parent),
                   commit=x.sha, description=x.description or x.spec.payload.get("description") or "",
                   budget=x.time_budget)

    def phase(self, x, phase: str, **known) -> None:
        """x's next phase, with what is known of it by now (commit, description, budget, node)."""
        self.write("phase", exp_id=x.spec.id, phase=phase, **{k: v for k, v in known.items() if v is not None})

    def step(self, x, p, node: str | None = None) -> None:
        fields = {"exp_id": x.spec.id, **p.__dict__, **({"node": node} if node else {})}
        with self._lock:
            now = self.clock.monotonic()
            if now - self._step_at.get(x.spec.id, -1e9) < self.step_every:
                self._pending[x.spec.id] = fields
                return
            self._step_at[x.spec.id] = now
            self._pending.pop(x.spec.id, None)
            self._append_locked({"t": self.clock.time(), "type": "step", **fields}, durable=False)

    def settled(self, x, row) -> None:
        """x is recorded as `row` (None: skipped, the proposer had nothing; no row)."""
        if row is None:
            self.write("experiment_settled", exp_id=x.spec.id, status="skipped", value=None, reason="", commit="")
        else:
            self.write("experiment_settled", exp_id=x.spec.id, status=row.status.value, value=row.val_bpb,
                       reason=row.reason, commit=row.commit)

    # ---------------------------------------------------------------------------------------- writing
    def write(self, type: str, **fields) -> None:
        with self._lock:
            if "exp_id" in fields:
                self._flush_locked(fields["exp_id"])      # the last step goes before the phase that ends it
            if type == "experiment_settled":
                self._step_at.pop(fields["exp_id"], None)
            self._append_locked({"t": self.clock.time(), "type": type, **fields}, durable=True)

    def _flush_locked(self, exp_id: int) -> None:
        fields = self._pending.pop(exp_id, None)
        if fields is not None:
            self._append_locked({"t": self.clock.time(), "type": "step", **fields}, durable=False)

    def _append_locked(self, event: dict, durable: bool) -> None:
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        try:
            if self._size is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._size = self.path.stat().st_size if self.path.exists() else 0
            if durable or self._dirty:
                append_line(self.path, line, is_whole=is_json_object, warn=lambda m: None)
                self._dirty = False
            else:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    if os.write(fd, line.encode()) != len(line.encode()):
                        self._dirty = True
                finally:
                    os.close(fd)
            self._size += len(line.encode())
            if self._size > self.max_bytes:
                self._compact_locked()
        except (OSError, LedgerError):
            self._dirty = True       # best-effort: the view may lag; the ledger is what counts

    def _compact_locked(self) -> None:
        kept = compact(read(self.path))
        text = "".join(json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in kept)
        write_atomic(self.path, text, sync=True)
        self._size = len(text.encode())


# ------------------------------------------------------------------------------------------ reading

def read(path: Path) -> list[dict]:
    """The file's events; a partial last line (a writer killed mid-line) and garbage lines are skipped."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    lines = data.split(b"\n")
    out = []
    for raw in lines[:-1]:             # the piece after the last newline is partial (or empty)
        try:
            e = json.loads(raw)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get("type"), str):
            out.append(e)
    return out


def fold(events: Iterable[dict]) -> dict:
    """The state a view shows, from the events alone: the session (state running/stopped, why), the in-flight
    experiments (by slot when the session has several), their phase and last step, the last settled one.
    State keys as status.json had them: experiment {id, kind, phase, description, commit, ...}, step, slots."""
    head: dict = {}
    live: dict[int, dict] = {}       # exp_id -> experiment doc (in flight), "step" inside
    last = None
    for e in events:
        typ, i = e.get("type"), e.get("exp_id")
        if typ == "session_started":
            head = {k: v for k, v in e.items() if k not in ("type", "t")} | {
                "state": "running", "why": None, "since": e.get("t")}
            live = {}
        elif typ == "session_stopped":
            head = head | {"state": "stopped", "why": e.get("why")}
            live = {}
        elif typ == "settings":
            head = head | {k: v for k, v in e.items() if k not in ("type", "t")}
        elif typ in _EXP and isinstance(i, int):
            if typ == "experiment_settled":
                live.pop(i, None)
                last = {k: e.get(k) for k in ("exp_id", "status", "value", "reason", "commit")} | {"t": e.get("t")}
                continue
            x = live.setdefault(i, {"id": i, "kind": None, "slot": 0, "phase": None, "description": "", "commit": "",
                                    "started_at": e.get("t"), "time_budget": None, "step": None})
            if typ == "experiment_started":
                x.update(kind=e.get("kind"), slot=e.get("slot", 0), parent=e.get("parent"),
                         description=e.get("description") or "", commit=e.get("commit") or "",
                         time_budget=e.get("budget"), started_at=e.get("t"), phase=x["phase"] or "started")
            elif typ == "phase":
                x.update(phase=e.get("phase"), phase_since=e.get("t"))
                x.update({k: e[k] for k in ("commit", "description") if e.get(k)})
                if e.get("budget") is not None:
                    x["time_budget"] = e["budget"]
            else:
                x["step"] = {k: v for k, v in e.items() if k not in ("type", "t", "exp_id", "node")}
            if e.get("node"):
                x["node"] = e["node"]
        else:
            continue
        head["updated"] = e.get("t")
    return _view(head, live, last)


def _view(head: dict, live: dict[int, dict], last: dict | None) -> dict:
    state = {k: v for k, v in head.items() if k not in ("slots", "by_slot")}
    state.setdefault("state", None)
    state["last"] = last
    xs = sorted(live.values(), key=lambda x: x["id"])
    if head.get("by_slot"):
        slots = []
        for s in head.get("slots") or []:
            mine = [x for x in xs if x["slot"] == s.get("slot")]
            doc = _strip(mine[-1]) if mine else None
            slots.append({**s, "experiment": doc, "step": mine[-1]["step"] if mine else None,
                          **({"node": doc["node"]} if doc and doc.get("node") else {})})
        state["slots"] = slots
    else:
        state["experiment"] = _strip(xs[-1]) if xs else None
        state["step"] = xs[-1]["step"] if xs else None
    return state


def _strip(x: dict) -> dict:
    return {k: v for k, v in x.items() if k != "step"}


def against_lock(state: dict, holder: dict | None) -> dict:
    """`state` as it is: a session the fold says runs, but whose writer no longer holds the repo lock (kill -9
    leaves no session_stopped), is stopped, with nothing in flight. `holder` is lock.read_holder's answer."""
    if state.get("state") != "running" or _holds(state, holder):
        return state
    out = state | {"state": "stopped", "why": KILLED}
    if "slots" in out:
        out["slots"] = [s | {"experiment": None, "step": None} for s in out["slots"]]
    else:
        out["experiment"], out["step"] = None, None
    return out


def _holds(state: dict, holder: dict | None) -> bool:
    if not holder:
        return False
    if holder.get("pid") is None:          # held, its metadata not readable yet: cannot tell, trust the fold
        return True
    if holder.get("tag") != state.get("tag"):
        return False
    return holder.get("host") != state.get("host") or holder.get("pid") == state.get("pid")


def compact(events: list[dict]) -> list[dict]:
    """The lines `fold` needs, in their order: fold(compact(ev)) == fold(ev). The current session's start and
    stop, its in-flight experiments' start and phases and last step, and the last settled experiment."""
    start = max((n for n, e in enumerate(events) if e.get("type") == "session_started"), default=0)
    tail = events[start:]
    settled = {e.get("exp_id") for e in tail if e.get("type") == "experiment_settled"}
    last_settled = max((n for n, e in enumerate(events) if e.get("type") == "experiment_settled"), default=None)
    last_step = {e.get("exp_id"): n for n, e in enumerate(tail) if e.get("type") == "step"}
    out = [events[last_settled]] if last_settled is not None and last_settled < start else []
    for n, e in enumerate(tail):
        typ, i = e.get("type"), e.get("exp_id")
        if typ in ("session_started", "session_stopped", "settings") or start + n == last_settled or (
                typ in ("experiment_started", "phase") and i not in settled) or (
                typ == "step" and i not in settled and last_step.get(i) == n):
            out.append(e)
    return out
