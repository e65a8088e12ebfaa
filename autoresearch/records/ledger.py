"""results.tsv and the per-experiment folders under runs/<tag>/.

One row per experiment, tab-separated, upstream's five columns first (commit, val_bpb, memory_gb, status,
description) and ours after them. A missing number is an empty field, never 0. Columns are read by name, so
a file with an older header of ours still reads, and the first append to it migrates it (`_migrate`). Each
row is a single `write` + fsync of a complete line, so a kill leaves either the whole row or a partial last
line; the next append (or read) notices a partial last line, warns, and drops it rather than gluing it to the
next row.

Appends go through `durable.append_line`, as the queue's, the hooks journal's and the event stream's do.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path

from autoresearch.errors import ArError
from autoresearch.records.durable import LedgerError, Warn, append_line, write_atomic
from autoresearch.records.layout import TagLayout

log = logging.getLogger(__name__)


class Status(str, Enum):
    KEEP = "keep"
    DISCARD = "discard"
    CRASH = "crash"
    REJECTED = "rejected"
    TIMEOUT = "timeout"
    DEGRADED = "degraded"
    INTERRUPTED = "interrupted"
    PRUNED = "pruned"
    STALE = "stale"
    VALIDATION = "validation"
    TRIAL = "trial"          # `ar try` / `ar eval`: runs/<tag>/trials.tsv only, never results.tsv

    def __str__(self) -> str:
        return self.value


UPSTREAM_COLUMNS = ("commit", "val_bpb", "memory_gb", "status", "description")
COLUMNS = UPSTREAM_COLUMNS + (
    "exp_id", "tag", "parent", "mfu", "tokens_per_s", "training_seconds", "total_seconds", "num_steps",
    "total_tokens_M", "time_budget", "seed", "knobs", "reason", "started_at", "agent_tokens", "agent_usd", "sweep",
    "finished_at",
)  # finished_at stays last: a line cut short by a kill is told by its incomplete timestamp
HEADER = "\t".join(COLUMNS) + "\n"

# How each numeric column is written (digits after the point) and read back.
_FLOATS = {"val_bpb": 6, "memory_gb": 1, "mfu": 2, "tokens_per_s": 0, "training_seconds": 1,
           "total_seconds": 1, "total_tokens_M": 6, "agent_usd": 4}  # tokens to the unit: a CPU run reads thousands
_INTS = ("exp_id", "num_steps", "seed", "agent_tokens")
_TIMESTAMP_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:\d{2}|Z)$")


def now_iso() -> str:
    """Local time with its UTC offset, to the second: the format of started_at / finished_at."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


@dataclass
class Row:
    commit: str
    val_bpb: float | None
    memory_gb: float | None
    status: Status
    description: str
    exp_id: int | None = None
    tag: str = ""
    parent: str = ""
    mfu: float | None = None
    tokens_per_s: float | None = None
    training_seconds: float | None = None
    total_seconds: float | None = None
    num_steps: int | None = None
    total_tokens_M: float | None = None
    time_budget: float | None = None
    seed: int | None = None
    knobs: dict = field(default_factory=dict)
    reason: str = ""
    started_at: str = ""
    finished_at: str = ""
    sweep: dict = field(default_factory=dict)  # a sweep point's identity: name, point, axes, base (sweep/file.py)
    agent_tokens: int | None = None  # what the proposal's agent used (tokens in + out) and cost; None: not reported
    agent_usd: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = Status(self.status).value
        return d

    def to_fields(self) -> list[str]:
        out = []
        for name in COLUMNS:
            v = getattr(self, name)
            if name == "status":
                out.append(Status(v).value)
            elif name == "knobs":
                out.append(_json_field(v, sort_keys=True))
            elif name == "sweep":  # the axes in the sweep file's order: the order a label shows them in
                out.append(_json_field(v, sort_keys=False))
            elif v is None:
                out.append("")
            elif name in _FLOATS:
                out.append(f"{float(v):.{_FLOATS[name]}f}" if math.isfinite(float(v)) else "")
            elif name in _INTS:
                out.append(str(int(v)))
            elif name == "time_budget":
                out.append(f"{float(v):g}")
            else:  # text: one line per row, always
                out.append(" ".join(str(v).splitlines()))
        return out


def _json_field(v: dict, sort_keys: bool) -> str:
    return json.dumps(v, separators=(",", ":"), sort_keys=sort_keys) if v else ""


def _format_line(row: Row) -> str:
    return _format_line_fields(row.to_fields())


def _format_line_fields(fields: list[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, dialect="excel-tab", lineterminator="\n").writerow(fields)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- reading

def _num(name: str, raw: str, cast):
    raw = raw.strip()
    if raw == "":
        return None
    try:
        v = cast(raw)
    except ValueError:
        raise ValueError(f"{name} {raw!r} is not a number") from None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _status(raw: str) -> Status:
    try:
        return Status(raw.strip().lower())
    except ValueError:
        raise ValueError(f"status {raw.strip()!r} is not one of {', '.join(s.value for s in Status)}") from None


def _row_from_fields(header: tuple[str, ...], fields: list[str], upstream: bool) -> Row:
    if len(fields) != len(header):
        raise ValueError(f"{len(fields)} fields, the header has {len(header)}")
    d = dict(zip(header, fields))
    status = _status(d["status"])
    val_bpb = _num("val_bpb", d["val_bpb"], float)
    memory_gb = _num("memory_gb", d["memory_gb"], float)
    if upstream and val_bpb is not None and val_bpb <= 0:  # upstream writes 0.000000 for a crash
        val_bpb = None
    if upstream and status is Status.CRASH and memory_gb == 0:
        memory_gb = None
    row = Row(commit=d["commit"].strip(), val_bpb=val_bpb, memory_gb=memory_gb, status=status,
              description=d["description"])
    if upstream:
        return row  # upstream has no sweeps
    for name in _FLOATS:
        if name in d and name not in ("val_bpb", "memory_gb"):
            setattr(row, name, _num(name, d[name], float))
    for name in _INTS:
        if name in d:
            setattr(row, name, _num(name, d[name], int))
    if "time_budget" in d:
        row.time_budget = _num("time_budget", d["time_budget"], float)
    row.knobs = _json_object("knobs", d.get("knobs", ""))
    for name in ("tag", "parent", "reason", "started_at", "finished_at"):
        if name in d:
            setattr(row, name, d[name])
    row.sweep = _json_object("sweep", d["sweep"]) if "sweep" in d else legacy_sweep(row)
    return row


def _json_object(name: str, raw: str) -> dict:
    if not raw.strip():
        return {}
    try:
        v = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{name} {raw[:60]!r} is not JSON") from None
    if not isinstance(v, dict):
        raise ValueError(f"{name} is not a JSON object")
    return v


# An older ar wrote a sweep point's identity into its description, "sweep NAME: K=V ... budget=Ns seed=S base=SHA",
# and read it back from there. Rows of files without the `sweep` column get it from that text here, and nowhere else.
_LEGACY_SWEEP_RE = re.compile(
    r"^sweep (?P<name>[a-z0-9][a-z0-9._-]*): (?P<label>.*?)\s*\bbase=(?P<base>[0-9a-f]{7,40})\s*$")


def legacy_sweep(row: Row) -> dict:
    """The structured sweep identity of a row written before the `sweep` column existed ({} for other rows).
    Axis names come from the description, their values from the row's knobs (what the run really had)."""
    m = _LEGACY_SWEEP_RE.match(row.description.strip())
    if not m:
        return {}
    from autoresearch.knobs import parse_value

    axes: dict = {}
    for token in m["label"].split():
        name, _, text = token.partition("=")
        if name in ("budget", "seed") or not text:
            continue  # the budget and seed have their own columns
        try:
            axes[name] = row.knobs[name] if name in row.knobs else parse_value(text)
        except ArError:
            axes[name] = text
    if row.time_budget is not None:
        axes["TIME_BUDGET"] = row.time_budget
    return {"name": m["name"], "point": None, "axes": axes, "base": m["base"]}


def _split(line: str, upstream: bool) -> list[str]:
    if upstream:  # upstream's files are plain tab-separated: a stray quote is text, extra tabs are description
        return line.split("\t", 4)
    return next(csv.reader([line], dialect="excel-tab"))


def _parse_header(line: str, name: str) -> tuple[tuple[str, ...], bool]:
    cols = tuple(c.strip() for c in line.rstrip("\r\n").split("\t"))
    if cols[:5] != UPSTREAM_COLUMNS:
        raise LedgerError(f"{name} line 1: not a results.tsv header (it must start with "
                          f"{', '.join(UPSTREAM_COLUMNS)}); move the file aside")
    return cols, len(cols) == 5


def _parse_text(text: str, name: str, warn: Warn | None) -> list[Row]:
    """Rows of a results file. A corrupt line raises LedgerError, or with `warn` is reported and skipped."""
    lines = text.split("\n")
    unterminated = lines.pop() if lines else ""
    if unterminated.strip():
        lines.append(unterminated)
    first = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if first is None:
        return []
    if first == len(lines) - 1 and unterminated.strip() and HEADER.startswith(unterminated):
        return []  # a header cut short: nothing was recorded yet
    header, upstream = _parse_header(lines[first], name)
    rows = []
    for i in range(first + 1, len(lines)):
        line = lines[i].rstrip("\r")
        if not line.strip():
            continue
        cut = i == len(lines) - 1 and bool(unterminated.strip())
        try:
            row = _row_from_fields(header, _split(line, upstream), upstream)
            if cut and "finished_at" in header and not _TIMESTAMP_RE.match(row.finished_at):
                raise ValueError("finished_at is incomplete")
            rows.append(row)
        except (ValueError, csv.Error) as e:
            msg = f"{name} line {i + 1}{' (a partial last line, cut off by a kill mid-write)' if cut else ''}: {e}"
            if warn is None:
                raise LedgerError(msg + "; fix or delete that line") from None
            warn(msg + "; line skipped")
    return rows


def read_results(path: Path, *, warn: Warn | None = None) -> list[Row]:
    """Rows of a results.tsv, ours or upstream's five-column one. Missing, empty or header-only -> [].

    Without `warn`, a corrupt line raises LedgerError naming the line; with it, the line is reported
    through `warn` and skipped, and every valid row is kept.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    return _parse_text(text, path.name, warn)


# ------------------------------------------------------------------------------------------------ ledger

class Ledger:
    """runs/<tag>/results.tsv and runs/<tag>/<NNNN>-<sha7>/ folders."""

    def __init__(self, tag_dir: Path, *, warn: Warn | None = None, sign: float = 1.0):
        self.tag_dir = Path(tag_dir)
        self.sign = sign          # +1: lower values are better (val_bpb); -1: an objective to maximise
        self.paths = TagLayout(self.tag_dir)
        self.path = self.paths.results
        self._warn_cb = warn or log.warning
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._cache: tuple[tuple[int, int, int], list[Row]] | None = None
        self._header_ok = False

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            self._warn_cb(msg)

    def _check_header(self) -> None:
        if self._header_ok:
            return
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                first = f.readline()
        except FileNotFoundError:
            first = ""
        cols = tuple(first.rstrip("\r\n").split("\t"))
        if first.endswith("\n") and cols != COLUMNS:
            older = tuple(c for c in COLUMNS if c in cols)  # ours, fewer columns, in today's order
            if not (len(UPSTREAM_COLUMNS) < len(cols) < len(COLUMNS) and cols == older):
                raise LedgerError(f"{self.path} has other columns than ar writes ({first.strip()[:80]!r}); "
                                  "move it aside or use another tag")
            self._migrate(cols)
        self._header_ok = first.endswith("\n")

    def _migrate(self, old: tuple[str, ...]) -> None:
        """Bring a results.tsv written by an older ar (some of today's columns, in today's order) to today's
        header: each row gets the new fields (the sweep identity recovered from its description); its other
        fields are copied as they were written. A line that does not parse is kept as it was (reading still
        names and skips it); a partial last line is dropped, as an append would. Written beside the file, then
        renamed over it, so a reader sees the old file or the new one."""
        lines = self.path.read_text(encoding="utf-8", errors="replace").split("\n")
        cut = lines[-1].strip() != ""  # no newline at the end: the last line was cut by a kill mid-write
        out = [HEADER]
        for n, line in enumerate(lines[1:], 2):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            try:
                row = _row_from_fields(old, _split(line, False), False)
            except (ValueError, csv.Error):
                row = None
            if cut and n == len(lines) and (row is None or not _TIMESTAMP_RE.match(row.finished_at)):
                self._warn(f"{self.path.name}: dropped a partial last line (cut off by a kill mid-write): "
                           f"{line[:80]!r}")
                continue
            if row is None:
                out.append(line + "\n")
                continue
            have = dict(zip(old, _split(line, False)))
            out.append(_format_line_fields([have[c] if c in have else v for c, v in zip(COLUMNS, row.to_fields())]))
        try:
            write_atomic(self.path, "".join(out), sync=True)
        except OSError as e:
            raise LedgerError(f"cannot rewrite {self.path} with today's columns: {e.strerror or e}; free disk "
                              "space or fix permissions, then run again (nothing recorded was lost)") from e
        self._warn(f"{self.path.name}: added the column(s) {', '.join(c for c in COLUMNS if c not in old)} "
                   "(it was written by an older ar)")

    def _is_whole(self, line: str) -> bool:
        try:
            row = _row_from_fields(COLUMNS, _split(line, False), False)
        except (ValueError, csv.Error):
            return False
        return bool(_TIMESTAMP_RE.match(row.finished_at))

    def append(self, row: Row) -> None:
        """Append one row (the commit point of an experiment). finished_at is filled in when empty."""
        if not row.finished_at:
            row.finished_at = now_iso()
        line = _format_line(row)
        with self._lock:
            self.tag_dir.mkdir(parents=True, exist_ok=True)
            self._check_header()
            append_line(self.path, line, header=HEADER, is_whole=self._is_whole, warn=self._warn)
            self._header_ok = True
            self._cache = None

    def rows(self) -> list[Row]:
        """Every valid row; corrupt lines are reported once (through `warn`) and skipped."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return []
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, read_results(self.path, warn=self._warn))
            return list(self._cache[1])

    def best_kept(self) -> Row | None:
        """The best: the last kept row, or None. A keep is decided against the best of its time, so the last one
        is the best: on one run past a threshold it has the best value too, but on several runs (decide.py) a row's
        value is the mean of the runs that kept it, chosen for being good, and an older keep's can be lower than
        a newer keep that beat its fresh runs."""
        kept = [r for r in self.rows() if r.status is Status.KEEP and r.val_bpb is not None]
        return kept[-1] if kept else None

    def exp_dir(self, exp_id: int, commit: str) -> Path:
        """runs/<tag>/<NNNN>-<sha7>/, created. An experiment with no commit (rejected) gets NNNN-none."""
        d = self.paths.exp_dir(exp_id, commit)
        d.mkdir(parents=True, exist_ok=True)
        return d
