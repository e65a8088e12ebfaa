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
