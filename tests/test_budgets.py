"""Noise against budget (`ar noise`): the recommendation as a pure rule, as a table."""

from __future__ import annotations

import pytest

from autoresearch.budgets import BudgetNoise, recommend, table
from autoresearch.decide import SequentialRule


def b(budget, values, seconds, epochs=0.5):
    return BudgetNoise(budget, list(values), [seconds] * len(values), epochs)


RULE = SequentialRule()
CASES = [
    # (what, rows, recommended budget or None)
    ("the same noise: the cheaper run", [b(60, (1.0, 1.02, 0.98), 80), b(150, (0.9, 0.92, 0.88), 170)], 60),
    ("half the noise for twice the time: the longer (√2 < 2)",
     [b(60, (1.0, 1.04, 0.96), 80), b(150, (0.9, 0.92, 0.88), 160)], 150),
    ("half the noise for five times the time: the shorter (√5 > 2)",
     [b(60, (1.0, 1.04, 0.96), 80), b(300, (0.9, 0.92, 0.88), 400)], 60),
    ("a window past one epoch is never recommended, however quiet",
     [b(60, (1.0, 1.04, 0.96), 80), b(150, (0.9, 0.9001, 0.8999), 170, epochs=1.4)], 60),
    ("one scored run measures no noise", [b(60, (1.0,), 80), b(150, (0.9, 0.92, 0.88), 170)], 150),
    ("the same value at every seed: the seed is not used", [b(60, (1.0, 1.0, 1.0), 80)], None),
    ("nothing recommendable", [b(60, (1.0,), 80), b(150, (0.9, 0.91), 170, epochs=2.0)], None),
]


@pytest.mark.parametrize("what,rows,want", CASES, ids=[c[0] for c in CASES])
def test_the_recommended_budget(what, rows, want):
    got = recommend(rows, RULE)
    assert (got.budget if got else None) == want, [(r.budget, r.sigma, r.cost(RULE), r.why_not()) for r in rows]
    lines = table(rows, RULE)
    assert len([ln for ln in lines if ln.startswith("budget ")]) == len(rows)
    if want is None:
        assert lines[-1].startswith("no budget can be recommended")
    else:
        assert any(ln.startswith(f"recommended: --time-budget {want:g} ") for ln in lines), lines


def test_the_cost_is_the_detectable_gain_times_the_root_of_a_runs_seconds():
    r = b(60, (1.0, 1.02, 0.98), 100)
    assert r.sigma == pytest.approx(0.02)
    assert r.cost(RULE) == pytest.approx(RULE.detectable(0.02, 3) * 10)
    assert b(60, (1.0, 1.02), 100).why_not() == "" and "2.0 epochs" in b(60, (1.0, 1.02), 100, 2.0).why_not()
    assert "AR_SEED" in b(60, (1.0, 1.0), 100).why_not()
