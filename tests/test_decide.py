import math
import statistics

import pytest

from autoresearch.decide import Decision, decide, noise_from_repeats


def test_first_result_is_kept():
    d = decide(None, 1.0, 0.01)
    assert d == Decision(True, d.reason) and "baseline" in d.reason


@pytest.mark.parametrize("candidate", [None, float("nan"), float("inf")])
def test_no_candidate_is_never_kept(candidate):
    assert not decide(1.0, candidate, 0.0).keep
    assert not decide(None, candidate, 0.0).keep


def test_beats_by_more_than_noise():
    d = decide(1.0, 0.98, 0.01)
    assert d.keep and "0.020000" in d.reason


def test_exactly_at_the_noise_margin_is_not_kept():
    # 1.0 - 0.01 is not exactly 0.99 in floating point; the margin is compared at 1e-9
    assert not decide(1.0, 0.99, 0.01).keep
    assert not decide(0.997900, 0.995900, 0.002).keep
    assert decide(0.997900, 0.995899, 0.002).keep


def test_within_noise_says_so():
    d = decide(1.0, 0.995, 0.01)
    assert not d.keep and "within the noise" in d.reason


def test_zero_noise_needs_a_strict_improvement():
    assert not decide(1.0, 1.0, 0.0).keep
    assert "equals" in decide(1.0, 1.0, 0.0).reason
    assert decide(1.0, 0.999999, 0.0).keep


def test_worse_is_discarded_with_the_gap():
    d = decide(1.0, 1.25, 0.01)
    assert not d.keep and "worse" in d.reason and "0.250000" in d.reason


@pytest.mark.parametrize("noise", [-0.1, float("nan"), None])
def test_bad_noise_is_an_error(noise):
    with pytest.raises(ValueError):
        decide(1.0, 0.9, noise)


def test_noise_is_two_sample_stds():
    xs = [1.0, 1.002, 0.998, 1.001]
    assert math.isclose(noise_from_repeats(xs), 2 * statistics.stdev(xs))
    assert noise_from_repeats([1.0, 1.0, 1.0]) == 0.0


def test_noise_needs_two_finite_values():
    with pytest.raises(ValueError):
        noise_from_repeats([1.0])
    with pytest.raises(ValueError):
        noise_from_repeats([1.0, float("nan")])
    assert noise_from_repeats([1.0, None, 1.1]) > 0


# ------------------------------------------------------------------------------------------ the sequential rule
import pytest  # noqa: E402

from autoresearch.decide import Evidence, SequentialRule, pooled_sigma  # noqa: E402

RULE = SequentialRule()
BEST = (1.00, 1.01, 0.99, 1.00)       # mean 1.0, four runs


@pytest.mark.parametrize("runs, action, says", [
    ((1.001,), "discard", "worse than the best"),                  # one run, worse than the best's mean: one run
    ((0.999,), "discard", "not worth another run"),                # better by 0.09 SE: under the first bar (0.3)
    ((0.995,), "more", "not yet decided"),                         # 0.45 SE better: another run
    ((0.90,), "more", "not yet decided"),                          # one run never keeps, however good
    ((0.999, 0.998), "discard", "not worth another run"),          # two runs, z under 1.0
    ((0.985, 0.985), "more", "run again"),                         # z 1.7: between the bars (1.0, 2.3)
    ((0.96, 0.96), "keep", "past the keep bar"),                   # z 4.6
    ((0.988, 0.988, 0.988), "more", "run again"),
    ((0.985, 0.985, 0.985, 0.985), "keep", "kept: "),              # z 2.1 on the last look: past 1.6
    ((0.99, 0.99, 0.99, 0.99), "discard", "under the bar"),        # z 1.4: the last look decides
])
def test_sequential_steps(runs, action, says):
    st = RULE.step(Evidence(BEST, runs, 0.01))
    assert st.action == action, st.reason
    assert says in st.reason
    assert st.reason.count("\n") == 0 and f"over {len(runs)} run" in st.reason


@pytest.mark.parametrize("sign, runs, action", [(-1.0, (1.05, 1.05), "keep"), (-1.0, (0.99,), "discard"),
                                                (1.0, (1.05, 1.05), "discard"), (1.0, (0.98,), "more")])
def test_sequential_direction(sign, runs, action):
    assert RULE.step(Evidence(BEST, runs, 0.01, sign)).action == action


def test_the_keep_bar_falls_with_runs_and_rises_with_a_thinly_measured_best():
    assert RULE.keep_bar(1, 4) == float("inf")
    bars = [RULE.keep_bar(n, 4) for n in (2, 3, 4)]
    assert bars == sorted(bars, reverse=True)
    assert RULE.keep_bar(4, 2) > RULE.keep_bar(4, 4) > RULE.keep_bar(4, 12)
    assert RULE.discard_bar(1) == 0.3 and RULE.discard_bar(4) == float("inf")


@pytest.mark.parametrize("alpha, n_best", [(0.05, 3), (0.05, 6), (0.01, 4), (0.2, 3)])
def test_a_change_that_gains_nothing_is_kept_at_the_stated_rate(alpha, n_best):
    assert SequentialRule(alpha=alpha).keep_chance(0.0, 1.0, n_best) == pytest.approx(alpha, abs=0.003)


@pytest.mark.parametrize("gain, n_best, at_least", [(1.5, 3, 0.59), (1.5, 4, 0.62), (1.5, 8, 0.70), (2.0, 4, 0.82),
                                                   (3.0, 3, 0.975)])
def test_real_gains_are_found(gain, n_best, at_least):
    assert RULE.keep_chance(gain, 1.0, n_best) >= at_least


def test_detectable_gain_and_minimal_gain():
    assert RULE.detectable(1.0, 3) > RULE.detectable(1.0, 8) > 1.0
    assert RULE.detectable(0.5, 4) == pytest.approx(RULE.detectable(1.0, 4) / 2, rel=1e-3)
    strict = SequentialRule(min_gain=0.5)
    assert strict.keep_chance(0.5, 1.0, 4) == pytest.approx(0.05, abs=0.003)     # kept past the minimal gain
    assert strict.keep_chance(0.0, 1.0, 4) < 0.02
    assert strict.detectable(1.0, 4) == pytest.approx(RULE.detectable(1.0, 4) + 0.5, rel=1e-3)


@pytest.mark.parametrize("groups, sigma", [
    ([[1.0, 1.0]], 0.0), ([[1.0, 3.0]], 2 ** 0.5), ([[1.0, 3.0], [5.0]], 2 ** 0.5),
    ([[0.0, 2.0], [10.0, 10.0, 10.0]], (2 / 3) ** 0.5), ([[1.0], [2.0]], None), ([], None)])
def test_pooled_sigma(groups, sigma):
    got = pooled_sigma(groups)
    assert got == sigma if sigma is None or sigma == 0 else got == pytest.approx(sigma)


def test_the_rule_refuses_no_noise():
    with pytest.raises(ValueError, match="sigma"):
        RULE.step(Evidence(BEST, (0.9,), 0.0))
    with pytest.raises(ValueError, match="alpha"):
        SequentialRule(alpha=1.5).keep_bar(2, 4)
