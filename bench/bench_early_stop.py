"""Benchmark: early stopping on a grid whose full answer is known (target: the full grid's best point for
at most 50 % of the full grid's training seconds). Not a test.

The grid is configs/sweep-batch-budget.yaml's shape: TOTAL_BATCH_SIZE [2**16 .. 2**19] × TIME_BUDGET
[300, 600, 1200] × LR_MULT [0.5, 1.0, 2.0], 36 points. Each point's training loss follows a simulated curve
(a power law in tokens seen, scaled by how well the batch size and learning rate suit the model, with an
extra drop during the LR warm-down and a little step noise); its val_bpb is the curve's end. The best point
is 2**17 / 1200 s / LR ×1.0, as in the RTX 5090 report.

The sweep is dispatched with the sweep modules' own pieces, exactly as `ar sweep --order cheap-first
--early-stop` dispatches it: rounds by budget, successive halving between rounds (`halving_verdict`), and
`prune_decision` fed every step line against the finished points of the same budget. A pruned point costs
the training seconds it ran. Only the training itself is simulated.

    python bench/bench_early_stop.py [--margin 0.02] [--keep-fraction 0.5] [--noise 0.002]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoresearch.sweep import run as sw  # noqa: E402
from autoresearch.sweep import file as sf  # noqa: E402

GRID = {"name": "bench", "order": "cheap-first",
        "axes": {"TOTAL_BATCH_SIZE": ["2**16", "2**17", "2**18", "2**19"], "TIME_BUDGET": [300, 600, 1200],
                 "LR_MULT": [0.5, 1.0, 2.0]}}
KNOBS = {"TOTAL_BATCH_SIZE": 2**19, "LR_MULT": 1.0, "DEVICE_BATCH_SIZE": "auto"}
BATCH_FIT = {2**16: 0.80, 2**17: 1.00, 2**18: 0.88, 2**19: 0.62}   # how well each batch size uses a second
LR_FIT = {0.5: 0.82, 1.0: 1.00, 2.0: 0.74}
STEPS = 200                                                          # step lines per run


def loss(point: sf.Point, pct: float, rnd: random.Random | None = None, noise: float = 0.0) -> float:
    """Training loss at progress pct (0..100) of the point's budget."""
    seconds = point.time_budget * pct / 100
    fit = BATCH_FIT[point.knobs["TOTAL_BATCH_SIZE"]] * LR_FIT[point.knobs["LR_MULT"]]
    base = 2.6 + 3.0 * (1 + seconds * fit / 8) ** -0.45
    warmdown = 0.06 * max(0.0, (pct / 100 - 0.5) / 0.5)             # the LR decay pays off at the end
    return base - warmdown + (rnd.gauss(0, noise) if rnd else 0.0)


def val_bpb(point: sf.Point) -> float:
    return round(loss(point, 100.0) / 3.2, 6)


def simulate(points: list[sf.Point], settings: sf.EarlyStop | None, noise: float) -> tuple[float, sf.Point, int]:
    """(training seconds spent, best finished point, points pruned or left out)."""
    rnd = random.Random(0)
    curves: dict[float, list[list[tuple[float, float]]]] = {}
    finished: list[tuple[tuple, float | None, float | None]] = []
    results: dict[int, float] = {}
    spent, stopped = 0.0, 0
    for group in sw.rounds(points, settings is not None):
        lower = list(finished)  # halving looks at the rounds before this one
        for p in group:
            if settings and sw.halving_verdict(p.config_key(), p.time_budget, lower, settings.keep_fraction):
                stopped += 1
                continue
            refs = curves.get(p.time_budget, [])
            curve, strikes, reason = [], 0, None
            for i in range(1, STEPS + 1):
                pct = 100 * i / STEPS
                l = loss(p, pct, rnd, noise)
                curve.append((pct, l))
                if settings:
                    strikes, reason = sw.prune_decision(refs, pct, l, strikes, settings)
                    if reason:
                        break
            spent += p.time_budget * curve[-1][0] / 100
            if reason:
                stopped += 1
                finished.append((p.config_key(), p.time_budget, None))
                continue
            curves.setdefault(p.time_budget, []).append(curve)
            results[p.index] = val_bpb(p)
            finished.append((p.config_key(), p.time_budget, results[p.index]))
    best = min(results, key=results.get)
    return spent, next(p for p in points if p.index == best), stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--min-pct", type=float, default=20.0)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--keep-fraction", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.002, help="step-to-step loss noise (absolute)")
    a = ap.parse_args()
    sweep = sf.parse_sweep(GRID, knobs=KNOBS, seq_len=2048, profile="gpu")
    settings = replace(sweep.early_stop, margin=a.margin, min_pct=a.min_pct, patience=a.patience,
                       keep_fraction=a.keep_fraction)
    points = sf.order_points(sf.expand(sweep), "cheap-first")
    full_s, full_best, _ = simulate(points, None, a.noise)
    es_s, es_best, stopped = simulate(points, settings, a.noise)
    known = min(points, key=val_bpb)
    assert full_best == known, "the full grid must find the known answer"
    print(f"grid: {len(points)} points; known best {known.label} (val_bpb {val_bpb(known):.6f})")
    print(f"full grid:      {full_s:>8.0f} training seconds, best {full_best.label}")
    print(f"early stopping: {es_s:>8.0f} training seconds, best {es_best.label} "
          f"({stopped} points pruned or left out)")
    ratio = es_s / full_s
    same = es_best == full_best
    print(f"early stopping used {ratio:.1%} of the full grid's training seconds and "
          f"{'reached' if same else 'MISSED'} the full grid's best point")
    if not same or ratio > 0.5:
        sys.exit(1)


if __name__ == "__main__":
    main()
