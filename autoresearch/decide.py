"""Keep or discard: a pure function of (best, candidate, noise), and the noise measured from repeats."""

from __future__ import annotations

import functools
import math
import random
import statistics
from dataclasses import dataclass

# val_bpb is printed to 6 decimals; differences closer than this count as equal.
_EPS = 5e-7     # half the ledger's last digit (6 decimals): a gain it cannot show is no gain


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str


def decide(best: float | None, candidate: float | None, noise: float, *, name: str = "val_bpb",
           sign: float = 1.0) -> Decision:
    """Keep iff there is a candidate and it beats the best kept value by MORE than `noise`: lower is better
    (val_bpb), or higher with `sign` -1 (an objective to maximise). `name` is what the reason calls the value.

    Equal to best - noise is not enough: a change must clear the noise floor to be kept.
    """
    if noise is None or not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a number >= 0, not {noise!r}")
    if candidate is None or not math.isfinite(candidate):
        return Decision(False, f"no {name}")
    if best is None:
        return Decision(True, f"first result: {name} {candidate:.6f} is the baseline")
    gain = sign * (best - candidate)
    if gain - noise > _EPS:
        return Decision(True, f"{name} {candidate:.6f} beats the best {best:.6f} by {gain:.6f} "
                              f"(noise {noise:.6f})")
    if gain > _EPS:
        return Decision(False, f"{name} {candidate:.6f} beats the best {best:.6f} by only {gain:.6f}, "
                               f"within the noise {noise:.6f}")
    if gain < -_EPS:
        return Decision(False, f"{name} {candidate:.6f} is worse than the best {best:.6f} by {-gain:.6f}")
    return Decision(False, f"{name} {candidate:.6f} equals the best {best:.6f}")


def noise_from_repeats(values: list[float]) -> float:
    """The noise threshold from K runs of one unchanged config: 2 x the sample standard deviation.

    Two standard deviations of one run, so a single lucky run of an unchanged config beats the best by
    more than this only rarely (about 2.5% one-sided for normal noise, 8% for the difference of two such
    runs). Needs at least two finite values.
    """
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if len(xs) < 2:
        raise ValueError(f"noise needs at least 2 finite repeats, got {len(xs)}")
    return 2.0 * statistics.stdev(xs)


# ------------------------------------------------------------------------------------------ sequential
# One run of a changed train.py is one draw: on a GPU a 2 % learning-rate change moves val_bpb as much as a new
# seed. So a candidate is measured until the evidence decides: one run screens (a clear loser costs one), more
# runs follow while it is not clearly worse, and it is kept only when its mean beats the best's mean (the best
# is the mean of its own runs) by enough standard errors that a change gaining nothing is kept at most `alpha`
# of the time. The bars are group-sequential: a z-score bar that falls as runs accumulate, c * sqrt(N / n),
# with c set by simulation for this alpha and this many runs of the best; the discard bars are fixed.

MAX_RUNS = 4                      # runs of one candidate at most
DISCARD_BARS = (0.3, 1.0, 1.2)    # z below this after run n (1, 2, 3) discards: after one run, not 0.3 SE better
                                  # (bench_decisions' simulation of the whole loop: more power per run than 0/0.8/1.0)
_TRIALS = 20000                   # simulated null paths that set the keep bar (a fixed seed: the same bar each time)


@dataclass(frozen=True)
class Evidence:
    """Runs of the best and of one candidate, in the objective's unit (`sign` 1: lower is better)."""
    best: tuple[float, ...]
    runs: tuple[float, ...]
    sigma: float                  # the noise of one run: a standard deviation
    sign: float = 1.0

    @property
    def gain(self) -> float:
        return self.sign * (statistics.fmean(self.best) - statistics.fmean(self.runs))

    @property
    def se(self) -> float:
        return self.sigma * math.sqrt(1 / len(self.best) + 1 / len(self.runs))


@dataclass(frozen=True)
class Step:
    action: str                   # "keep", "discard" or "more"
    reason: str
    z: float | None = None
    bar: float | None = None


@dataclass(frozen=True)
class SequentialRule:
    alpha: float = 0.05           # the share of changes that gain nothing and are kept anyway
    max_runs: int = MAX_RUNS
    min_gain: float = 0.0         # a keep must beat the best by this much (in the unit) at the stated alpha

    def keep_bar(self, n: int, n_best: int) -> float:
        """The z-score a candidate's mean must reach after its n-th run (no keep on one run)."""
        if n < 2:
            return math.inf
        return _keep_constant(self.alpha, self.max_runs, n_best) * math.sqrt(self.max_runs / n)

    def discard_bar(self, n: int) -> float:
        if n >= self.max_runs:
            return math.inf       # the last run decides: what is not kept is discarded
        return DISCARD_BARS[min(n, len(DISCARD_BARS)) - 1]

    def step(self, ev: Evidence, *, name: str = "val_bpb") -> Step:
        """Keep, discard, or run once more. The reason is one line a person can read."""
        if ev.sigma <= 0 or not math.isfinite(ev.sigma):
            raise ValueError(f"sigma must be a number > 0, not {ev.sigma!r}")
        n, nb = len(ev.runs), len(ev.best)
        z = (ev.gain - self.min_gain) / ev.se
        keep, drop = self.keep_bar(n, nb), self.discard_bar(n)
        runs = ", ".join(f"{v:.6f}" for v in ev.runs)
        said = (f"{name} {statistics.fmean(ev.runs):.6f} over {n} run{'s' * (n > 1)} ({runs}) against the best's "
                f"{statistics.fmean(ev.best):.6f} over {nb}: gain {ev.gain:+.6f} = {ev.gain / ev.se:+.2f} SE "
                f"(σ {ev.sigma:.6f}")
        said += f", minimal gain {self.min_gain:g})" if self.min_gain else ")"
        if z >= keep:
            return Step("keep", f"kept: {said}, past the keep bar {keep:.2f} (false keeps ≤ {self.alpha:.0%})", z, keep)
        if z < drop:
            why = "worse than the best" if n == 1 and ev.gain < 0 else f"under the bar {keep:.2f}" if n >= self.max_runs \
                else f"below {drop:.2f}: not worth another run"
            return Step("discard", f"discarded: {said}, {why}", z, keep)
        return Step("more", f"not yet decided: {said}; the keep bar is {keep:.2f}, run again", z, keep)

    def keep_chance(self, gain: float, sigma: float, n_best: int) -> float:
        """The share of changes of this true gain (in the unit) that the rule keeps, by simulation."""
        c = _keep_constant(self.alpha, self.max_runs, n_best)
        shift = (gain - self.min_gain) / sigma
        return sum(_kept(p, shift, c, self.max_runs, n_best) for p in _paths(self.max_runs, n_best)) / _TRIALS

    def detectable(self, sigma: float, n_best: int, chance: float = 0.8) -> float:
        """The smallest true gain (in the unit) kept with this probability."""
        return _detectable_sigmas(self.alpha, self.max_runs, n_best, chance) * sigma + self.min_gain


def pooled_sigma(groups: list[list[float]]) -> float | None:
    """The noise of one run: the pooled standard deviation of groups of runs of one config each (None: fewer
    than two runs in any group)."""
    ss = df = 0.0
    for g in groups:
        xs = [float(v) for v in g if v is not None and math.isfinite(float(v))]
        if len(xs) >= 2:
            m = statistics.fmean(xs)
            ss += sum((v - m) ** 2 for v in xs)
            df += len(xs) - 1
    return math.sqrt(ss / df) if df else None


@functools.lru_cache(maxsize=64)
def _paths(max_runs: int, n_best: int) -> tuple[tuple[float, ...], ...]:
    """Simulated paths of z-scores under no gain (σ 1), with a fixed seed: the same bar on every machine."""
    rng = random.Random(20261204)
    out = []
    for _ in range(_TRIALS):
        best = rng.gauss(0.0, 1.0 / math.sqrt(n_best))
        total, zs = 0.0, []
        for n in range(1, max_runs + 1):
            total += rng.gauss(0.0, 1.0)
            zs.append((best - total / n) / math.sqrt(1 / n_best + 1 / n))
        out.append(tuple(zs))
    return tuple(out)


def _kept(path: tuple[float, ...], gain_sigmas: float, c: float, max_runs: int, n_best: int) -> bool:
    for n, z0 in enumerate(path, start=1):
        z = z0 + gain_sigmas / math.sqrt(1 / n_best + 1 / n)
        if n >= 2 and z >= c * math.sqrt(max_runs / n):
            return True
        if n >= max_runs or z < DISCARD_BARS[min(n, len(DISCARD_BARS)) - 1]:
            return False
    return False


@functools.lru_cache(maxsize=64)
def _detectable_sigmas(alpha: float, max_runs: int, n_best: int, chance: float) -> float:
    """The smallest true gain, in σ (the rule is the same at every σ), kept with probability `chance`."""
    lo, hi = 0.0, 10.0
    c = _keep_constant(alpha, max_runs, n_best)
    paths = _paths(max_runs, n_best)
    for _ in range(20):
        mid = (lo + hi) / 2
        if sum(_kept(p, mid, c, max_runs, n_best) for p in paths) / _TRIALS >= chance:
            hi = mid
        else:
            lo = mid
    return hi


@functools.lru_cache(maxsize=64)
def _keep_constant(alpha: float, max_runs: int, n_best: int) -> float:
    """c such that a change gaining nothing is kept with probability alpha: a null path is kept iff c is at most
    the largest z_n * sqrt(n / N) over the runs it reaches (n >= 2) before a discard bar stops it."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1, not {alpha!r}")
    tops = []
    for path in _paths(max_runs, n_best):
        top = -math.inf
        for n, z in enumerate(path, start=1):
            if n >= 2:
                top = max(top, z * math.sqrt(n / max_runs))
            if n >= max_runs or z < DISCARD_BARS[min(n, len(DISCARD_BARS)) - 1]:
                break
        tops.append(top)
    tops.sort()
    return tops[min(len(tops) - 1, int(math.ceil((1 - alpha) * len(tops))))]
