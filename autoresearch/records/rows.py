"""How a tag's rows read, for every part that reads them: a row's status, a sweep point's knob identity and
label, numbers as people write them, and the statistics of a commit over its seeds. The one reader the views
(report, plots) and the sweep planner share; it reads rows, never a plan.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from autoresearch.knobs import safe_eval

FINISHED_STATUSES = frozenset({"keep", "discard", "degraded"})  # ran to the end: has a val_bpb


def status_of(row) -> str:
    """A row's status as its string value (ledger.Status or a plain string)."""
    s = row.status
    return getattr(s, "value", s)


def _num(v):
    if isinstance(v, bool) or v is None:
        return v
    return float(v) if isinstance(v, (int, float)) else v


def norm_knobs(knobs: dict) -> tuple:
    return tuple(sorted((k, _num(eval_value(v))) for k, v in knobs.items()))


def eval_value(v: Any) -> Any:
    """`2**17`, `1e-3`, `3*2**16` -> numbers; any other string stays a string."""
    if not isinstance(v, str):
        return v
    try:
        return safe_eval(v)
    except ValueError:
        return v


def show_value(v) -> str:
    """A knob value for people: floats as written (1.0), powers of two as 2**N."""
    return repr(v) if isinstance(v, float) else show_number(v)


def show_number(v) -> str:
    """A number for people: whole floats without the point (300 for 300.0), powers of two as 2**N."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, int) and v >= 2**10 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"
    return str(v)


def point_label(axes: dict[str, Any], varying: Sequence[str]) -> str:
    """`K=V ... budget=Ns` over the axes that vary (the knob axes when none does). The budget is shown whenever
    it varies: two points that differ only in it must not read the same."""
    shown = [k for k in axes if k in varying] or [k for k in axes if k != "TIME_BUDGET"] or list(axes)
    parts = []
    for k in shown:
        v = axes[k]
        if k == "TIME_BUDGET":
            parts.append(f"budget={'-' if v is None else show_number(float(v))}s")
        else:
            parts.append(f"{k}={show_value(v)}")
    return " ".join(parts)


@dataclass(frozen=True)
class SeedStats:
    commit: str
    label: str
    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def spread(self) -> float:
        """Sample standard deviation; 0.0 with a single value (unknown spread)."""
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0


WORSE_Z = 1.645       # a point is called worse than the best past this many standard errors (5 % one-sided)


def verdicts(stats: Sequence[SeedStats]) -> list[tuple[SeedStats, str]]:
    """Rank by mean; each point against the best: 'best', 'worse' (its mean is more than `WORSE_Z` standard errors
    of the difference behind: a point as good as the best is called worse at most 5 % of the time, for one
    comparison) or 'tie'. σ of one run is pooled over every point's seeds (decide.pooled_sigma), so the standard
    error shrinks with each point's runs; with no point run twice, the sample spreads are all 0 and any
    difference is 'worse' (one run each cannot call a tie)."""
    from autoresearch.decide import pooled_sigma
    ranked = sorted(stats, key=lambda s: s.mean)
    if not ranked:
        return []
    best = ranked[0]
    sigma = pooled_sigma([list(s.values) for s in ranked]) or 0.0
    out = [(best, "best")]
    for s in ranked[1:]:
        se = sigma * (1 / len(s.values) + 1 / len(best.values)) ** 0.5
        worse = s.mean - best.mean > WORSE_Z * se
        out.append((s, "worse" if worse else "tie"))
    return out


def seed_stats(rows: Sequence, commits: Sequence[str], labels: dict[str, str] | None = None) -> list[SeedStats]:
    """val_bpb of each commit over its original run and its `validation` re-runs."""
    out = []
    for c in commits:
        vals = tuple(r.val_bpb for r in rows if r.commit == c and r.val_bpb is not None
                     and status_of(r) in FINISHED_STATUSES | {"validation"})
        if vals:
            out.append(SeedStats(c, (labels or {}).get(c, c[:7]), vals))
    return out
