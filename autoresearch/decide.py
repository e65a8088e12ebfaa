"""Keep or discard: a pure function of (best, candidate, noise), and the noise measured from repeats."""

from __future__ import annotations

import math
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
