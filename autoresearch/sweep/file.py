"""The sweep file: a grid of knob values × time budgets, one experiment (one commit) per point.

A sweep file (YAML) has these keys; anything else is an error:

    name: batch-budget             # branch autoresearch/sweep-<name>, results in runs/sweep-<name>/
    axes:                          # KNOB: [values]; values may be written as 2**17
      TOTAL_BATCH_SIZE: [2**16, 2**17]
      TIME_BUDGET: [300, 600]      # a runner axis (AR_TIME_BUDGET), not a train.py knob
    fixed: {DEPTH: 8}              # knobs set on every point (TIME_BUDGET allowed too)
    base: master                   # commit or branch whose train.py each point edits (default HEAD)
    seeds: [42]                    # each point once per seed (default: the runner's seed)
    order: cheap-first             # or listed (file order, itertools.product order)
    profile: gpu                   # the profile the points run with (default: the run config's)
    overhead_s: 30                 # per-run overhead for the plan (default: measured, else profile's)
    early_stop: {margin: 0.02, min_pct: 20, patience: 3, keep_fraction: 0.5}
    validate_seeds: [1, 2]         # seeds for --validate-top re-runs

Everything decided from the file without running lives here: parsing and validation against train.py's
knobs, expansion into points, ordering, a point's identity and resume key, and the dry-run plan (`plan`).
Running the points (early stopping, successive halving, --validate-top) is sweep/run.py.

A point's identity travels as data, never as text to parse back: the spec queued for it carries
`identity(...)` ({"name", "point", "axes", "base"}), the Loop copies it into the row's `sweep` column, and the
resume key, the report's points and every label are read from there.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from autoresearch.errors import ConfigError, GitError
from autoresearch.records.layout import META, RESULTS, RunsLayout
from autoresearch.records.rows import (FINISHED_STATUSES, _num, eval_value, norm_knobs, point_label, show_number,  # noqa: F401
                       show_value, status_of)

RUNNER_KNOBS = ("TIME_BUDGET",)
ORDERS = ("listed", "cheap-first")
DONE_STATUSES = frozenset({"keep", "discard", "pruned", "degraded", "rejected", "stale"})
FAILED_STATUSES = frozenset({"crash", "timeout"})  # retried only with --retry-crashed
DEFAULT_OVERHEAD_S = {"gpu": 30.0, "cpu": 10.0}
_KEYS = {"name", "description", "axes", "fixed", "base", "seeds", "order", "profile", "overhead_s",
         "early_stop", "validate_seeds"}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,57}$")


@dataclass(frozen=True)
class EarlyStop:
    """margin: relative gap to the best loss at equal progress that counts as clearly worse;
    min_pct: no decision before this much progress; patience: consecutive worse step lines needed;
    keep_fraction: share of configs promoted from one budget to the next (1.0 turns halving off)."""

    margin: float = 0.02
    min_pct: float = 20.0
    patience: int = 3
    keep_fraction: float = 0.5


@dataclass(frozen=True)
class Point:
    index: int                  # position in the file's (listed) order
    knobs: dict[str, Any]       # every train.py knob this point sets (axes + fixed)
    time_budget: float | None   # AR_TIME_BUDGET; None: the run config's
    seed: int | None
    axes: tuple[str, ...] = ()  # the sweep's axes, TIME_BUDGET included when it is one
    varying: tuple[str, ...] = ()  # the axes with more than one value (what a label shows), "seed" too if seeds vary
    grid: int = 0               # the grid point: the same for every seed of it

    @property
    def axis_values(self) -> dict[str, Any]:
        """The point on every axis, TIME_BUDGET always (the budget it runs with, axis or not)."""
        values = {k: self.knobs[k] for k in self.axes if k not in RUNNER_KNOBS}
        values["TIME_BUDGET"] = self.time_budget
        return values

    @property
    def label(self) -> str:
        parts = [point_label(self.axis_values, self.varying)]
        if "seed" in self.varying and self.seed is not None:
            parts.append(f"seed={self.seed}")
        return " ".join(p for p in parts if p)

    def config_key(self) -> tuple:
        """The point without its budget: the unit that successive halving promotes."""
        return (norm_knobs(self.knobs), self.seed)

    def key(self, base: str) -> tuple:
        """The resume key; `row_key` gives a ledger row's."""
        fixed = {k: v for k, v in self.knobs.items() if k not in self.axes}
        return (norm_knobs(self.axis_values), norm_knobs(fixed), base, self.seed)


@dataclass
class Sweep:
    name: str
    axes: dict[str, list]
    fixed: dict[str, Any] = field(default_factory=dict)
    base: str | None = None
    seeds: list[int | None] = field(default_factory=lambda: [None])
    order: str = "listed"
    profile: str | None = None
    overhead_s: float | None = None
    early_stop: EarlyStop = field(default_factory=EarlyStop)
    validate_seeds: list[int] = field(default_factory=lambda: [1, 2])
    description: str = ""

    @property
    def tag(self) -> str:
        return f"sweep-{self.name}"


# ---------------------------------------------------------------- parsing and validation

def check_value(name: str, current: Any, value: Any) -> Any:
    """Value for knob `name` whose value in train.py is `current`, coerced (int -> float for a float knob)."""
    def bad(kind: str):
        return ConfigError(f"sweep value {name}={value!r} is not {kind} (train.py has {name} = {current!r})")

    if current == "auto":  # "auto" or a concrete setting of whatever type train.py resolves it to
        if not isinstance(value, (str, int, float, bool)):
            raise bad("a plain value")
        return value
    if value == "auto" and name == "DEVICE_BATCH_SIZE":
        return value
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise bad("a boolean")
    elif isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif isinstance(current, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    elif isinstance(current, str):
        if not isinstance(value, str):
            raise bad("a string")
    elif current is not None and not isinstance(value, type(current)):
        raise bad(f"a {type(current).__name__}")
    return value


def parse_sweep(data: Any, *, knobs: dict[str, Any], seq_len: int | None, profile: str = "gpu",
                default_name: str = "") -> Sweep:
    """Validate a loaded sweep file against train.py's knobs. Every problem is one ConfigError line."""
    if not isinstance(data, dict):
        raise ConfigError("sweep file must be a YAML mapping with at least `axes`")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) in sweep file: {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    name = str(data.get("name") or default_name)
    if not _NAME_RE.match(name):
        raise ConfigError(f"sweep name {name!r} must be lower-case letters, digits, '.', '_' or '-' "
                          "(it names the branch autoresearch/sweep-<name>)")
    axes_raw = data.get("axes")
    if not isinstance(axes_raw, dict) or not axes_raw:
        raise ConfigError("sweep file needs `axes`: a mapping KNOB: [values, ...]")
    fixed_raw = data.get("fixed") or {}
    if not isinstance(fixed_raw, dict):
        raise ConfigError("`fixed` must be a mapping KNOB: value")

    def knob_value(name: str, v: Any) -> Any:
        v = eval_value(v)
        if name in RUNNER_KNOBS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"sweep value {name}={v!r} is not a positive number of seconds")
            return v
        if name not in knobs:
            raise ConfigError(f"unknown knob {name!r}: train.py has {', '.join(knobs) or 'no knobs'}"
                              f" (and the runner axis {', '.join(RUNNER_KNOBS)})")
        return check_value(name, knobs[name], v)

    axes: dict[str, list] = {}
    for k, vals in axes_raw.items():
        k = str(k)
        if not isinstance(vals, list):
            vals = [vals]
        if not vals:
            raise ConfigError(f"axis {k} is empty: give it at least one value")
        axes[k] = [knob_value(k, v) for v in vals]
    fixed = {str(k): knob_value(str(k), v) for k, v in fixed_raw.items()}
    both = sorted(set(axes) & set(fixed))
    if both:
        raise ConfigError(f"{', '.join(both)} is both an axis and fixed; keep one")

    seeds_raw = data.get("seeds")
    seeds: list[int | None] = [None]
    if seeds_raw is not None:
        seeds = seeds_raw if isinstance(seeds_raw, list) else [seeds_raw]
        if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ConfigError(f"`seeds` must be a list of integers, got {seeds_raw!r}")
    if data.get("profile") not in (None, "gpu", "cpu", "auto"):
        raise ConfigError(f"profile {data['profile']!r} is not one of: gpu, cpu, auto")
    order = str(data.get("order") or "listed")
    if order not in ORDERS:
        raise ConfigError(f"order {order!r} is not one of: {', '.join(ORDERS)}")
    es_raw = data.get("early_stop") or {}
    try:
        early_stop = EarlyStop(**{k: float(v) if k != "patience" else int(v) for k, v in dict(es_raw).items()})
    except (TypeError, ValueError):
        raise ConfigError(f"early_stop takes margin, min_pct, patience, keep_fraction (numbers); "
                          f"got {es_raw!r}") from None
    if not (0 < early_stop.keep_fraction <= 1) or early_stop.margin < 0 or early_stop.patience < 1:
        raise ConfigError("early_stop needs 0 < keep_fraction <= 1, margin >= 0 and patience >= 1")
    vseeds = data.get("validate_seeds", [1, 2])
    if not isinstance(vseeds, list) or not all(isinstance(s, int) for s in vseeds):
        raise ConfigError(f"`validate_seeds` must be a list of integers, got {vseeds!r}")
    overhead = data.get("overhead_s")
    if overhead is not None and (not isinstance(overhead, (int, float)) or overhead < 0):
        raise ConfigError(f"`overhead_s` must be a number of seconds >= 0, got {overhead!r}")

    sweep = Sweep(name=name, axes=axes, fixed=fixed, base=None if data.get("base") is None else str(data["base"]),
                  seeds=seeds, order=order, profile=data.get("profile"), overhead_s=overhead,
                  early_stop=early_stop, validate_seeds=vseeds, description=str(data.get("description") or ""))
    if seq_len is not None:
        check_batch(expand(sweep), knobs, seq_len, profile)
    return sweep


def check_batch(points: Iterable[Point], knobs: dict[str, Any], seq_len: int, profile: str = "gpu") -> None:
    """TOTAL_BATCH_SIZE must be a whole number of DEVICE_BATCH_SIZE × sequence-length micro-batches, as train.py
    computes them for the profile (the CPU profile divides the batch by CPU_BATCH_DIVISOR and the device batch
    by 8). With DEVICE_BATCH_SIZE "auto" only the sequence length has to divide the batch."""
    seen = set()
    for p in points:
        total = p.knobs.get("TOTAL_BATCH_SIZE", knobs.get("TOTAL_BATCH_SIZE"))
        dev = p.knobs.get("DEVICE_BATCH_SIZE", knobs.get("DEVICE_BATCH_SIZE"))
        divisor = p.knobs.get("CPU_BATCH_DIVISOR", knobs.get("CPU_BATCH_DIVISOR"))  # train.py's CPU rule, if any
        if (total, dev, divisor) in seen or not isinstance(total, int):
            continue
        seen.add((total, dev, divisor))
        eff_total, eff_dev, note = total, dev, ""
        if profile == "cpu" and isinstance(divisor, int) and divisor > 0:
            eff_total = max(1, total // divisor)
            eff_dev = max(1, dev // 8) if isinstance(dev, int) else dev
            note = f" (CPU profile: {total} // CPU_BATCH_DIVISOR {divisor} = {eff_total})"
        if not isinstance(eff_dev, int):  # "auto": train.py picks a divisor itself
            if eff_total % seq_len:
                raise ConfigError(f"TOTAL_BATCH_SIZE={total}{note} is not a multiple of the sequence length "
                                  f"{seq_len} ({profile} profile); use a power of two >= {seq_len}")
            continue
        if eff_dev <= 0 or eff_total % (eff_dev * seq_len):
            raise ConfigError(f"TOTAL_BATCH_SIZE={total}{note} is not divisible by DEVICE_BATCH_SIZE × sequence "
                              f"length = {eff_dev} × {seq_len} = {eff_dev * seq_len} ({profile} profile); "
                              f"change one of them")


def load_sweep(path: str | Path, *, knobs: dict[str, Any], seq_len: int | None, profile: str = "gpu") -> Sweep:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"sweep file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    stem = path.stem[len("sweep-"):] if path.stem.startswith("sweep-") else path.stem
    return parse_sweep(data, knobs=knobs, seq_len=seq_len, profile=profile, default_name=stem)


def read_header(path: str | Path) -> dict:
    """The few keys needed before train.py's knobs are known (name, base, profile), unvalidated."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"sweep file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------- expansion, order, resume

def expand(sweep: Sweep) -> list[Point]:
    """All points in listed order: itertools.product over the axes in file order, then seeds."""
    names = list(sweep.axes)
    varying = tuple(n for n in names if len({repr(_num(v)) for v in sweep.axes[n]}) > 1)
    if len(set(sweep.seeds)) > 1:
        varying += ("seed",)
    points = []
    for grid, combo in enumerate(itertools.product(*(sweep.axes[n] for n in names))):
        values = dict(zip(names, combo))
        budget = values.pop("TIME_BUDGET", sweep.fixed.get("TIME_BUDGET"))
        knobs = {**{k: v for k, v in sweep.fixed.items() if k not in RUNNER_KNOBS}, **values}
        for seed in sweep.seeds:
            points.append(Point(len(points), knobs, budget, seed, tuple(names), varying, grid))
    return points


def order_points(points: Sequence[Point], order: str) -> list[Point]:
    if order == "listed":
        return list(points)
    if order == "cheap-first":
        return sorted(points, key=lambda p: p.time_budget if p.time_budget is not None else math.inf)
    raise ConfigError(f"order {order!r} is not one of: {', '.join(ORDERS)}")


def describe(sweep: Sweep, point: Point) -> str:
    """The ledger description of a point: for people; the row's `sweep` column is what ar reads back."""
    return f"sweep {sweep.name}: {point.label}"


def identity(sweep: Sweep, point: Point, base: str) -> dict:
    """What the spec of a point carries into its ledger row's `sweep` column."""
    return {"name": sweep.name, "point": point.grid, "axes": point.axis_values, "base": base[:12]}


def same_commit(a: str | None, b: str | None) -> bool:
    """Two spellings of one commit (a short and a full SHA)."""
    return bool(a) and bool(b) and (a.startswith(b) or b.startswith(a))


def row_key(row, fixed: Iterable[str], base: str) -> tuple | None:
    """The resume key of a ledger row (`Point.key`'s), or None when the row is not a point of a sweep on
    `base`. The axes come from the row's sweep identity; the fixed knobs (`fixed`) from the knobs it ran with."""
    ident = getattr(row, "sweep", None) or {}
    if not isinstance(ident.get("axes"), dict) or not same_commit(ident.get("base"), base):
        return None
    knobs = row.knobs or {}
    if any(n not in knobs for n in fixed):
        return None
    return (norm_knobs(ident["axes"]), norm_knobs({n: knobs[n] for n in fixed}), base, row.seed)


def rows_by_point(points: Sequence[Point], rows: Sequence, base: str) -> dict[int, Any]:
    """index -> the latest ledger row of that point (validation re-runs left out)."""
    by_key: dict[tuple, Any] = {}
    fixed = [k for k in points[0].knobs if k not in points[0].axes] if points else []
    for row in rows:
        if status_of(row) == "validation":
            continue
        k = row_key(row, fixed, base)
        if k is not None:
            by_key[k] = row
    out = {}
    for p in points:
        k = p.key(base)
        row = by_key.get(k)
        if row is None and p.seed is None:  # the runner picked the seed: any seed matches
            row = next((r for kk, r in reversed(by_key.items()) if kk[:3] == k[:3]), None)
        if row is not None:
            out[p.index] = row
    return out


def point_states(points: Sequence[Point], rows: Sequence, base: str, *, retry_crashed: bool = False) -> dict[int, str]:
    """index -> 'done' | 'crashed' (left alone unless retry_crashed) | 'todo'. A later row wins over an earlier."""
    found = rows_by_point(points, rows, base)
    states = {}
    for p in points:
        status = status_of(found[p.index]) if p.index in found else None
        if status in DONE_STATUSES:
            states[p.index] = "done"
        elif status in FAILED_STATUSES:
            states[p.index] = "todo" if retry_crashed else "crashed"
        else:
            states[p.index] = "todo"
    return states


def estimate_overhead(rows: Sequence, default: float) -> tuple[float, str]:
    """Per-run seconds beyond the training budget (start-up, compile, evaluation, the runner's own work):
    the median over past runs of wall time (started_at -> finished_at) minus training seconds, else a default."""
    from datetime import datetime

    gaps = []
    for r in rows:
        if r.training_seconds is None:
            continue
        try:
            wall = (datetime.fromisoformat(r.finished_at) - datetime.fromisoformat(r.started_at)).total_seconds()
        except (TypeError, ValueError):
            wall = r.total_seconds
        if wall is not None and wall >= r.training_seconds:
            gaps.append(wall - r.training_seconds)
    if gaps:
        return float(statistics.median(gaps)), f"median of {len(gaps)} past run(s)"
    return default, "default estimate"


# ---------------------------------------------------------------- helpers

def _duration(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h {m % 60:02d}m" if m >= 60 else (f"{m} min" if m else f"{seconds:.0f} s")


# ---------------------------------------------------------------- the plan (what --dry-run prints)

@dataclass
class Plan:
    """A validated sweep on a resolved base, its points in dispatch order and what each still needs."""

    sweep: Sweep
    repo: Path
    base: str                  # full SHA whose train.py every point edits
    profile: str
    points: list[Point]        # dispatch order; budgets and seeds filled in from the run config
    states: dict[int, str]     # index -> done | crashed | todo
    overhead_s: float
    overhead_source: str
    retry_crashed: bool = False

    @property
    def tag(self) -> str:
        return self.sweep.tag

    @property
    def tag_dir(self) -> Path:
        return RunsLayout(self.repo).tag(self.tag).dir

    @property
    def todo(self) -> list[Point]:
        return [p for p in self.points if self.states[p.index] == "todo"]

    def seconds(self) -> tuple[float, float]:
        """(training seconds, overhead seconds) of the points still to run."""
        todo = self.todo
        return sum(p.time_budget or 0.0 for p in todo), len(todo) * self.overhead_s

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(#, state, budget, point) per point, in dispatch order."""
        return [(str(i), self.states[p.index], f"{show_number(p.time_budget)}s", p.label)
                for i, p in enumerate(self.points, 1)]

    def summary(self) -> str:
        train, over = self.seconds()
        n = len(self.todo)
        done = sum(s == "done" for s in self.states.values())
        crashed = sum(s == "crashed" for s in self.states.values())
        left = f"; {crashed} crashed left alone (--retry-crashed runs them)" if crashed else ""
        return (f"sweep {self.sweep.name} on {self.base[:7]} ({self.profile} profile), branch "
                f"autoresearch/{self.tag}: {n} of {len(self.points)} points to run, {done} already done{left}. "
                f"{self.profile.upper()} time ≈ {_duration(train + over)} = {_duration(train)} of training + {n} × "
                f"{self.overhead_s:.0f} s per-run overhead ({self.overhead_source}).")


def plan(path: str | Path, repo: str | Path, cfg, *, order: str | None = None, retry_crashed: bool = False) -> Plan:
    """Validate the sweep file against the base's train.py and work out what is left to run. Runs nothing."""
    from autoresearch.gitops import GitRepo
    from autoresearch.harness.env import PROFILES, resolve_profile
    from autoresearch.knobs import scan
    from autoresearch.records.ledger import read_results

    head = read_header(path)
    git = GitRepo(repo)
    git.ensure_commits()
    name = str(head.get("name") or "")
    tag_dir = RunsLayout(git.root).tag(f"sweep-{name or _stem(path)}").dir
    base = _resolve_base(git, head.get("base"), tag_dir)
    profile = head.get("profile") if head.get("profile") in PROFILES else resolve_profile(cfg.profile).name
    try:
        knobs = {k.name: k.value for k in scan(git.file_at(base, "train.py"), "train.py").values()}
    except GitError as e:
        raise ConfigError(f"no train.py at base {base[:7]}: {e}") from None
    sweep = load_sweep(path, knobs=knobs, seq_len=PROFILES[profile].seq_len, profile=profile)
    default_budget = cfg.time_budget or PROFILES[profile].time_budget
    points = [replace(p, time_budget=p.time_budget if p.time_budget is not None else default_budget,
                      seed=p.seed if p.seed is not None else cfg.seed) for p in expand(sweep)]
    points = order_points(points, order or sweep.order)
    rows = read_results(tag_dir / RESULTS)
    states = point_states(points, rows, base, retry_crashed=retry_crashed)
    if sweep.overhead_s is not None:
        overhead, source = float(sweep.overhead_s), "from the sweep file"
    else:
        overhead, source = estimate_overhead(rows, DEFAULT_OVERHEAD_S[profile])
    return Plan(sweep, git.root, base, profile, points, states, overhead, source, retry_crashed)


def _stem(path) -> str:
    stem = Path(path).stem
    return stem[len("sweep-"):] if stem.startswith("sweep-") else stem


def _resolve_base(git, base: str | None, tag_dir: Path) -> str:
    """The file's base, else the base this sweep's branch started from (runs/<tag>/meta.json), else HEAD."""
    import json

    try:
        started = json.loads((tag_dir / META).read_text())["base"]
    except (OSError, ValueError, KeyError, TypeError):
        started = None
    if base is None:
        return started or git.head_sha()
    try:
        sha = git.resolve(base)
    except GitError:
        raise ConfigError(f"base {base!r} is not a commit or branch in {git.root}") from None
    if started and started != sha:
        raise ConfigError(f"sweep {tag_dir.name} started from {started[:7]} but base {base!r} is now {sha[:7]}; "
                          f"give the sweep a new name to run it on the new base")
    return sha
