"""Paired-difference confidence intervals against closed forms and textbook t quantiles."""
import math
import statistics

import pytest

from megatron_mech.studies.paired import paired_ci, t_quantile


@pytest.mark.parametrize("p", [0.9, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms_for_one_and_two_degrees_of_freedom(p):
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-6)  # Cauchy
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-6)


def test_t_quantile_tends_to_the_normal_quantile():
    # large df: Cornish-Fisher first correction z + (z³ + z)/(4 df), z = 1.959964 (the 97.5% normal quantile)
    z = 1.959963985
    assert t_quantile(0.975, 400) == pytest.approx(z + (z ** 3 + z) / 1600, rel=2e-5)


def test_paired_ci_interval_and_verdict():
    diffs = [0.01, -0.02, 0.03, 0.0, 0.005]
    ci = paired_ci(diffs)
    assert ci.mean == pytest.approx(statistics.fmean(diffs))
    assert ci.half_width == pytest.approx(t_quantile(0.975, 4) * statistics.stdev(diffs) / math.sqrt(5))
    assert ci.excludes_zero is False and "includes 0" in ci.text()
    shifted = paired_ci([d - 0.1 for d in diffs])
    assert shifted.excludes_zero is True and shifted.high < 0
    one = paired_ci([0.3])
    assert one.half_width is None and one.excludes_zero is None
    with pytest.raises(ValueError, match="finite"):
        paired_ci([0.1, float("nan")])
    with pytest.raises(ValueError, match="at least one"):
        paired_ci([])
