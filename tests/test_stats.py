"""eval.stats: t intervals widen with few seeds; paired gaps cancel what seeds share."""

import pytest

from eval.stats import paired_gap, t_interval


def test_t_interval_uses_the_t_quantile_of_its_degrees_of_freedom():
    lo, hi = t_interval([1.0, 2.0, 3.0])  # mean 2, s.e. 1/sqrt(3), t(0.975, 2) = 4.3027
    assert (lo, hi) == pytest.approx((2 - 4.3027 / 3**0.5, 2 + 4.3027 / 3**0.5), abs=1e-4)
    five = [0.1, 0.3, 0.2, 0.4, 0.0]
    lo5, hi5 = t_interval(five)
    assert (hi5 - lo5) / 2 == pytest.approx(2.7764 * (0.025 / 5) ** 0.5, abs=1e-4)
    assert all(v != v for v in t_interval([1.0]))  # nan for one value


def test_paired_gap_pairs_by_seed():
    a = {0: 5.0, 1: 4.5, 2: 4.8, 7: 1.0}  # seed 7 has no partner
    b = {0: 5.1, 1: 4.6, 2: 4.9}
    gap = paired_gap(a, b)
    assert gap["seeds"] == [0, 1, 2]
    assert gap["gap"] == pytest.approx((-0.1, 0.0))
    assert gap["gap_ci95"] == pytest.approx((-0.1, -0.1))
    assert paired_gap({0: 1.0}, {0: 2.0}) is None
