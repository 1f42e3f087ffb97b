"""The one histogram type: counts of observations over fixed upper bounds.

Every bucketed count in the project is one: the picker's pick latency, the per-endpoint TTFT and E2E histograms of
``/metrics``, the heatmap's cells and rows, the emulator's vLLM histograms. The bucket rule is Prometheus's ``le``:
a value equal to a bound counts in that bucket, and values above the last bound go to an overflow bucket (``+Inf``).
Exposition is the reader's business (inferlb/metrics.py turns these into prometheus_client metric families at
scrape time), so observing costs a bisect and three additions, with no lock and no allocation.

The sliding-window latency statistics the latency scorers read (otel/latency.py) are not this type: they are
numpy arrays over all endpoints at once, built for vectorised quantiles on the routing path.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["Histogram", "check_bounds"]


@lru_cache(maxsize=64)
def _checked(bounds: tuple[float, ...]) -> tuple[float, ...]:
    # A pure memo: a few bound sets exist, and some owners (the heatmap's cells) make many histograms of one.
    if not bounds:
        raise ValueError("histogram bounds must have at least one upper bound")
    if not all(math.isfinite(b) for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"histogram bounds must be finite and strictly increasing; got {list(bounds)}")
    return bounds


def check_bounds(bounds: Sequence[float]) -> tuple[float, ...]:
    """``bounds`` as a tuple of floats; ValueError, naming them, unless they are finite and strictly increasing."""
    try:
        values = tuple(float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"histogram bounds must be numbers; got {bounds!r}") from None
    return _checked(values)


class Histogram:
    """Counts of observations in the buckets of ``bounds`` (upper bounds, finite and strictly increasing; ValueError
    otherwise) plus an overflow bucket: ``counts[i]`` is how many observed values were ``<= bounds[i]`` and above
    the bound before (not cumulative); ``counts[-1]`` those above the last bound. ``count`` and ``sum`` are the
    number and the sum of the observed values.

    ``observe`` takes any number; the caller keeps NaN and values it does not mean to count out (a NaN would land
    in the first bucket and make ``sum`` NaN). Not thread-safe: one owner, or the owner's lock.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = check_bounds(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` once (on the request path: kept to the three additions)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def observe_many(self, value: float, times: int) -> None:
        """Count ``value`` ``times`` times (``times >= 0``)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.count += times
        self.sum += value * times

    def copy(self) -> Histogram:
        """A histogram of its own with the same bounds and counts (what a reader on another thread is given)."""
        other = Histogram.__new__(Histogram)
        other.bounds, other.counts, other.count, other.sum = self.bounds, self.counts[:], self.count, self.sum
        return other

    def cumulative(self) -> list[int]:
        """The running totals of ``counts``, as Prometheus's ``_bucket`` series print them (the last is ``count``)."""
        return list(itertools.accumulate(self.counts))

    def __repr__(self) -> str:
        return f"Histogram(bounds={self.bounds!r}, counts={self.counts!r}, sum={self.sum!r})"
