"""bench/stats.py against numpy and the standard library, and against the rules the suites used before it."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from inferlb.bench.stats import Method, cv, mean, mean_ci95, median, percentile, percentiles, rounded, slope

METHODS: tuple[Method, ...] = ("linear", "inverted_cdf", "higher", "closest_observation")


def _samples() -> list[list[float]]:
    rng = random.Random(7)
    sizes = [*range(1, 40), 99, 100, 101, 1000, 1001]
    return [[rng.lognormvariate(0, 1) for _ in range(n)] for n in sizes]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_is_numpys(method: Method, q: float) -> None:
    for values in _samples():
        assert percentile(values, q, method=method) == float(np.percentile(values, q, method=method))


@pytest.mark.parametrize("q", [50, 90, 99])
def test_higher_is_the_sorted_index_the_simulator_table_used(q: float) -> None:
    for values in _samples():
        ordered = sorted(values)
        assert percentile(values, q, method="higher") == ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@pytest.mark.parametrize("q", [50, 90, 99])
def test_closest_observation_is_the_rounded_rank_resilience_used(q: float) -> None:
    for values in _samples():
        ordered = sorted(values)
        rank = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
        assert percentile(values, q, method="closest_observation") == ordered[rank]


def test_percentiles_match_one_at_a_time() -> None:
    values = _samples()[-1]
    found = percentiles(values, (50, 90, 99), method="inverted_cdf")
    assert found == {q: percentile(values, q, method="inverted_cdf") for q in (50, 90, 99)}


def test_an_empty_sample_has_no_figures() -> None:
    assert percentile([], 50) is None
    assert percentiles([], (50, 99)) == {50: None, 99: None}
    assert (median([]), mean([]), cv([]), slope([], [])) == (None, None, None, None)


@pytest.mark.parametrize("q", [-1, 100.5, float("nan")])
def test_a_percentile_outside_0_to_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0, 2.0], q)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentiles([1.0, 2.0], (50, q))


def test_median_and_mean_are_the_standard_librarys() -> None:
    for values in _samples():
        assert median(values) == pytest.approx(statistics.median(values), rel=1e-12)
        assert mean(values) == pytest.approx(statistics.fmean(values), rel=1e-12)


def test_generators_and_arrays_are_samples_too() -> None:
    assert median(x for x in (3.0, 1.0, 2.0)) == 2.0
    assert percentile(np.array([1.0, 2.0, 3.0, 4.0]), 50) == 2.5


def test_cv_is_the_population_spread_over_the_mean() -> None:
    values = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]
    assert cv(values) == pytest.approx(statistics.pstdev(values) / statistics.fmean(values))
    assert cv([3.0, 3.0]) == 0.0
    assert cv([0.0, 0.0]) is None  # no mean to divide by


def test_slope_is_the_least_squares_slope() -> None:
    rng = random.Random(3)
    xs = [float(i) for i in range(50)]
    ys = [0.25 * x + rng.gauss(0, 1) for x in xs]
    assert slope(xs, ys) == pytest.approx(statistics.linear_regression(xs, ys).slope, rel=1e-9)
    assert slope([1.0], [2.0]) is None
    assert slope([1.0, 1.0], [2.0, 3.0]) is None
    with pytest.raises(ValueError, match="as many xs as ys"):
        slope([1.0, 2.0], [1.0])


def test_rounded_scales_and_keeps_a_missing_figure_missing() -> None:
    assert rounded(0.0123456, 1, 1000) == 12.3
    assert rounded(2.34567, 2) == 2.35
    assert rounded(None, 1, 1000) is None


def test_the_95_percent_interval_is_students_t() -> None:
    values = [10.0, 12.0, 14.0]  # mean 12, sample sd 2, t(0.975, 2 df) = 4.303
    found = mean_ci95(values)
    assert found is not None
    assert found[0] == 12.0 and found[1] == pytest.approx(4.303 * 2 / 3**0.5)
    assert mean_ci95([5.0, 5.0]) == (5.0, 0.0)


def test_one_value_has_no_interval_and_none_has_no_mean() -> None:
    assert mean_ci95([3.0]) == (3.0, None)
    assert mean_ci95([]) is None


def test_beyond_the_table_the_interval_takes_the_wider_entry() -> None:
    values = [float(k % 7) for k in range(36)]  # 35 df: the table's 30 (2.042)
    found = mean_ci95(values)
    assert found is not None and found[1] == pytest.approx(2.042 * float(np.std(values, ddof=1)) / 6)
