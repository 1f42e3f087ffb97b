"""The statistics every benchmark reports: percentiles, medians, means, spread and trend.

One definition per figure, on numpy. A percentile names its method, because the suites need different ones and a
figure must not change when its code moves:

- ``linear`` (numpy's default: interpolates between ranks): the routing-quality figures and the pick latencies;
- ``inverted_cdf`` (the nearest rank: the smallest value whose share of the sample reaches q%): the external
  load tool's rule, so that our columns compare with its own;
- ``higher`` (the rank above a linear index): what the simulator's speed table and the in-process timings
  report (``sorted(v)[int(q * n)]`` at q = 0.5, 0.9 and 0.99);
- ``closest_observation`` (the rounded nearest rank): the resilience figures.

Every function takes any sequence of real numbers and returns plain floats; an empty sample gives None (there
is no figure), never a sentinel or an exception.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

__all__ = ["Method", "cv", "mean", "mean_ci95", "median", "percentile", "percentiles", "rounded", "slope"]

Method = Literal["linear", "inverted_cdf", "higher", "closest_observation"]


def _array(values: Iterable[float]) -> np.ndarray:
    return np.asarray(values if isinstance(values, Sequence | np.ndarray) else list(values), dtype=float)


def percentile(values: Iterable[float], q: float, *, method: Method = "linear") -> float | None:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` by numpy's ``method``; None when there are none.
    ValueError for a q outside [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100; got {q}")
    array = _array(values)
    return float(np.percentile(array, q, method=method)) if array.size else None


def percentiles(
    values: Iterable[float], qs: Sequence[float], *, method: Method = "linear"
) -> dict[float, float | None]:
    """Several percentiles of one sample, keyed by q (one sort of the sample, not one per q)."""
    array = _array(values)
    if not array.size:
        return dict.fromkeys(qs)
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"a percentile is between 0 and 100; got {q}")
    found = np.percentile(array, list(qs), method=method)
    return {q: float(v) for q, v in zip(qs, found, strict=True)}


def median(values: Iterable[float]) -> float | None:
    """The median (the mean of the two middle values of an even sample); None for no values."""
    return percentile(values, 50)


def mean(values: Iterable[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    array = _array(values)
    return float(array.mean()) if array.size else None


# Student's t at 0.975 (two-sided 95%) by degrees of freedom; beyond the table, the next lower entry (wider).
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def mean_ci95(values: Iterable[float]) -> tuple[float, float | None] | None:
    """The mean of ``values`` and the half-width of its two-sided 95% Student t-interval (sample standard
    deviation, n - 1 degrees of freedom): the interval is mean -/+ half-width. The half-width is None for a single
    value (no spread to measure); the whole answer None for no values."""
    array = _array(values)
    if not array.size:
        return None
    average = float(array.mean())
    if array.size < 2:
        return average, None
    df = int(array.size - 1)
    t = _T975[max(k for k in _T975 if k <= df)]
    return average, t * float(array.std(ddof=1)) / math.sqrt(array.size)


def cv(values: Iterable[float]) -> float | None:
    """The coefficient of variation: the population standard deviation over the mean (0 when every value is
    equal). None for no values or a mean that is not above 0, where the ratio means nothing."""
    array = _array(values)
    if not array.size:
        return None
    average = float(array.mean())
    return float(array.std()) / average if average > 0 else None


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ys over xs; None for fewer than two points or xs that are all equal."""
    x, y = _array(xs), _array(ys)
    if x.size != y.size:
        raise ValueError(f"slope needs as many xs as ys; got {x.size} and {y.size}")
    if x.size < 2:
        return None
    dx = x - x.mean()
    spread = float(dx @ dx)
    if spread == 0 or not math.isfinite(spread):
        return None
    return float(dx @ (y - y.mean())) / spread


def rounded(value: float | None, digits: int, scale: float = 1.0) -> float | None:
    """``value * scale`` rounded to ``digits`` decimals (seconds to milliseconds: scale 1000); None stays None, so
    that a missing figure stays missing."""
    return None if value is None else round(value * scale, digits)
