"""Noise against budget (`ar noise`): which time budget tells real gains from noise fastest.

A longer window trains further and its runs usually agree better, but each run costs more. What a session can
decide in an hour is set by both: the keep rule needs its gain in standard errors, and a standard error shrinks
with the square root of the runs. So a budget is worth what it resolves per unit of GPU time: the smallest gain
the rule keeps 4 times in 5 (`SequentialRule.detectable`, from the measured σ) times the square root of the
seconds one run takes. The lowest wins. A budget whose window repeated its training data (more than one epoch)
is never recommended: its spread is the data's repetition, not the budget's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from autoresearch.decide import SequentialRule, pooled_sigma

N_BEST = 3          # the best's runs a candidate meets at first (measure.TOP_UP): what `detectable` assumes


@dataclass
class BudgetNoise:
    budget: float                                        # seconds of training window
    values: list[float] = field(default_factory=list)    # each scored run's value
    seconds: list[float] = field(default_factory=list)   # each run's wall time, start-up to score
    epochs: float = 0.0                                  # the most epochs of the training split a window served
    failed: list[str] = field(default_factory=list)      # why a run gave no value

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def sigma(self) -> float | None:
        return pooled_sigma([self.values])

    @property
    def run_seconds(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    def detectable(self, rule: SequentialRule) -> float | None:
        s = self.sigma
        return rule.detectable(s, N_BEST) if s else None

    def cost(self, rule: SequentialRule) -> float | None:
        """Smallest gain kept 4 in 5 × √(seconds a run): lower resolves more per hour of GPU."""
        g, t = self.detectable(rule), self.run_seconds
        return None if g is None or not t else g * math.sqrt(t)

    def why_not(self) -> str:
        """Why this budget cannot be recommended ("" when it can)."""
        if len(self.values) < 2:
            return f"{len(self.values)} scored run{'s' * (len(self.values) != 1)}: no noise measured"
        if self.epochs > 1:
            return f"its window trained {self.epochs:.1f} epochs: a bigger corpus first"
        if not self.sigma:
            return "its runs gave the same value: train.py does not use the seed ar gives (AR_SEED)"
        return ""


def recommend(rows: list[BudgetNoise], rule: SequentialRule | None = None) -> BudgetNoise | None:
    """The budget that resolves the smallest gains per hour of GPU, of those that can be recommended."""
    rule = rule or SequentialRule()
    ok = [r for r in rows if not r.why_not()]
    return min(ok, key=lambda r: (r.cost(rule), r.budget)) if ok else None


def table(rows: list[BudgetNoise], rule: SequentialRule | None = None, unit: str = "val_bpb") -> list[str]:
    """One line a budget, then the recommendation."""
    rule = rule or SequentialRule()
    out = []
    for r in rows:
        head = f"budget {r.budget:g} s: "
        if r.why_not() and len(r.values) < 2:
            out.append(head + r.why_not() + (f" ({'; '.join(r.failed)[:200]})" if r.failed else ""))
            continue
        runs = ", ".join(f"{v:.4f}" for v in r.values)
        line = (f"{head}{unit} {r.mean:.4f} ± {r.sigma or 0:.4f} (σ of {len(r.values)} runs: {runs}); "
                f"{r.run_seconds:.0f} s a run")
        if r.sigma:
            line += (f"; smallest gain kept 4 in 5: {r.detectable(rule):.4f}; "
                     f"{3600 / r.run_seconds:.0f} runs an hour")
        if r.why_not():
            line += f" — not recommended: {r.why_not()}"
        out.append(line)
    best = recommend(rows, rule)
    if best is None:
        out.append("no budget can be recommended: each needs two scored runs, different values, and a window "
                   "inside one epoch")
        return out
    out.append(f"recommended: --time-budget {best.budget:g} (the smallest gain told from noise per hour of GPU: "
               f"gain kept 4 in 5 × √(seconds a run) = {best.cost(rule):.3f}, the lowest)")
    few = min(len(r.values) for r in rows if not r.why_not())
    if few < 5:
        out.append(f"σ from {few} runs is rough (its 90 % interval spans about ×{_spread(few):.1f}): more runs "
                   f"(--runs) before a long session")
    return out


def _spread(n: int) -> float:
    """Ratio of the upper to the lower end of a 90 % interval for σ from n runs (chi-square, n - 1 df)."""
    lo, hi = {2: (0.0039, 3.84), 3: (0.103, 5.99), 4: (0.352, 7.81)}.get(n, (0.711, 9.49))
    return math.sqrt(hi / lo)
