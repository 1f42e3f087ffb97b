"""Tests for scorer/histogram.py: the one histogram type (Prometheus `le` buckets, sum, count)."""

from __future__ import annotations

import math

import pytest

from inferlb.scorer.histogram import Histogram, check_bounds


def test_a_value_on_a_bound_counts_in_that_bucket_and_larger_ones_overflow() -> None:
    histogram = Histogram((1.0, 2.0, 5.0))
    for value in (0.5, 1.0, 1.5, 2.0, 5.0, 5.1, 100.0):
        histogram.observe(value)
    assert histogram.counts == [2, 2, 1, 2]
    assert histogram.cumulative() == [2, 4, 5, 7]
    assert (histogram.count, histogram.sum) == (7, pytest.approx(115.1))


def test_observe_many_counts_a_value_several_times() -> None:
    histogram = Histogram((1.0,))
    histogram.observe_many(0.25, 4)
    histogram.observe_many(3.0, 0)
    assert (histogram.counts, histogram.count, histogram.sum) == ([4, 0], 4, 1.0)


def test_an_empty_histogram() -> None:
    histogram = Histogram([0.1, 1])
    assert histogram.bounds == (0.1, 1.0)
    assert (histogram.counts, histogram.cumulative(), histogram.count, histogram.sum) == ([0, 0, 0], [0, 0, 0], 0, 0.0)


@pytest.mark.parametrize(
    "bounds",
    [
        pytest.param((), id="empty"),
        pytest.param((1.0, 1.0), id="repeated"),
        pytest.param((2.0, 1.0), id="decreasing"),
        pytest.param((1.0, math.inf), id="infinite"),
        pytest.param((math.nan,), id="nan"),
        pytest.param(("a",), id="not-a-number"),
    ],
)
def test_bad_bounds_are_refused(bounds: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="histogram bounds must"):
        Histogram(bounds)
    with pytest.raises(ValueError, match="histogram bounds must"):
        check_bounds(bounds)


def test_a_copy_does_not_follow_the_original() -> None:
    histogram = Histogram((1.0,))
    histogram.observe(0.5)
    copy = histogram.copy()
    histogram.observe(2.0)
    assert (copy.bounds, copy.counts, copy.count, copy.sum) == ((1.0,), [1, 0], 1, 0.5)
    assert histogram.counts == [1, 1]
