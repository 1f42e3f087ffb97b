"""Per-endpoint latency statistics in bounded memory: the TTFT and end-to-end latency of the servers' spans,
kept as a time-decayed EWMA and as quantiles (P50/P95/P99) over a sliding window, for the latency scorers.

The building blocks:

- `LogBuckets`: a fixed log-spaced bucket layout (default 1e-4 s .. 1e4 s, each bucket 5% wider than the one
  below it: 378 buckets), shared by any number of histograms.
- `LogHistogram`: counts per bucket. A quantile is the geometric midpoint of the bucket that holds the
  nearest-rank sample, so its relative error is at most ``sqrt(1 + relative_width) - 1`` (2.47% at 5%) for
  values within ``[min_value, max_value]``; values outside are clamped to the end buckets.
- `WindowedQuantiles`: a ring of histograms, one per slice of the window; old slices are cleared as time
  moves on, so memory does not grow with traffic.
- `Ewma`: an exponentially weighted mean whose weights decay with elapsed time, not with the sample count.
- `EndpointLatency`: all of the above for every endpoint of a pool (about 24 KB each), with vectorised reads.

Values that are not positive finite numbers (NaN, infinities, zero, negatives) are ignored and counted in
``rejected``. Nothing here is thread-safe: each object belongs to the one event loop that feeds and reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["QUANTILES", "EndpointLatency", "Ewma", "LogBuckets", "LogHistogram", "WindowedQuantiles"]

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
"""The quantiles `EndpointLatency.arrays` reports, as ``p50``, ``p95`` and ``p99``."""

_INF = math.inf
_MAX_BUCKETS = 10_000  # about 80 KB per histogram; a layout that needs more is a configuration mistake


@dataclass(frozen=True)
class LogBuckets:
    """An immutable log-spaced bucket layout for positive values.

    Bucket ``i`` holds ``[min_value * g**i, min_value * g**(i + 1))`` with ``g = 1 + relative_width``; there are
    ``size = ceil(log(max_value / min_value) / log(g))`` of them, so the last bucket reaches ``max_value``.
    Values below ``min_value`` go to the first bucket and values above ``max_value`` to the last.
    Two layouts are equal when their three parameters are equal.
    """

    min_value: float = 1e-4
    max_value: float = 1e4
    relative_width: float = 0.05
    size: int = field(init=False)
    midpoints: np.ndarray = field(init=False, repr=False, compare=False)
    """Read-only float64 array: the geometric midpoint of each bucket, the value a quantile reports."""
    _log_min: float = field(init=False, repr=False, compare=False)
    _inv_log_growth: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("min_value", "max_value", "relative_width"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < _INF:
                raise ValueError(f"LogBuckets.{name} must be a positive finite number, got {value!r}")
        if self.max_value <= self.min_value:
            raise ValueError(
                f"LogBuckets.max_value ({self.max_value}) must be greater than min_value ({self.min_value})"
            )
        log_growth = math.log1p(self.relative_width)
        size = math.ceil(math.log(self.max_value / self.min_value) / log_growth)
        if size > _MAX_BUCKETS:
            raise ValueError(
                f"LogBuckets would need {size} buckets (more than {_MAX_BUCKETS}): "
                "raise relative_width or narrow [min_value, max_value]"
            )
        midpoints = self.min_value * np.exp((np.arange(size, dtype=np.float64) + 0.5) * log_growth)
        midpoints.setflags(write=False)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "midpoints", midpoints)
        object.__setattr__(self, "_log_min", math.log(self.min_value))
        object.__setattr__(self, "_inv_log_growth", 1.0 / log_growth)

    @property
    def max_relative_error(self) -> float:
        """The bound on ``|estimate / true - 1|`` for a quantile whose true value is in [min_value, max_value]."""
        return math.sqrt(1.0 + self.relative_width) - 1.0

    def edges(self) -> np.ndarray:
        """The ``size + 1`` bucket bounds (the last one is at or above ``max_value``)."""
        return np.asarray(self.min_value * np.exp(np.arange(self.size + 1) / self._inv_log_growth))

    def index(self, value: float) -> int:
        """The bucket of a positive finite ``value`` (clamped to the end buckets)."""
        i = int((math.log(value) - self._log_min) * self._inv_log_growth)
        if i <= 0:
            return 0
        return i if i < self.size else self.size - 1


_DEFAULT_BUCKETS = LogBuckets()


def _quantiles(counts: np.ndarray, qs: np.ndarray, midpoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest-rank quantiles of histograms ``counts`` (shape ``(..., buckets)``): returns the estimates, shape
    ``(..., len(qs))`` and NaN for empty histograms, and the totals, shape ``(...)``.

    The rank of quantile ``q`` among ``n`` values is ``max(1, ceil(n * q))``, as numpy's ``inverted_cdf``."""
    buckets = counts.shape[-1]
    cum = np.cumsum(counts.reshape(-1, buckets), axis=-1, dtype=np.int64)
    rows = cum.shape[0]
    totals = cum[:, -1].copy()
    ranks = np.maximum(np.ceil(totals[:, None] * qs), 1.0).astype(np.int64)
    # Shift each row above the one before it, so that one searchsorted over the flattened rows finds, for every
    # row and rank, the first bucket whose cumulative count reaches the rank.
    shift = np.arange(rows, dtype=np.int64) * (int(totals.max(initial=0)) + 1)
    cum += shift[:, None]
    found = np.searchsorted(cum.ravel(), (ranks + shift[:, None]).ravel()).reshape(rows, qs.size)
    index = np.minimum(found - (np.arange(rows) * buckets)[:, None], buckets - 1)
    estimates = np.where(totals[:, None] > 0, midpoints[index], np.nan)
    return estimates.reshape(*counts.shape[:-1], qs.size), totals.reshape(counts.shape[:-1])


def _check_qs(qs: Iterable[float]) -> np.ndarray:
    array = np.asarray(tuple(qs), dtype=np.float64)
    if array.ndim != 1 or not np.all((array >= 0.0) & (array <= 1.0)):
        raise ValueError(f"quantiles must be numbers in [0, 1], got {array.tolist()!r}")
    return array


class LogHistogram:
    """Counts of positive values in the buckets of a `LogBuckets` layout (an int64 array of fixed size).

    ``quantile(q)`` is the geometric midpoint of the bucket that holds the nearest-rank sample (the
    ``ceil(n * q)``-th smallest), so for values within the layout's range it is within a factor
    ``sqrt(1 + relative_width)`` of the exact sample quantile: relative error at most
    ``buckets.max_relative_error`` (2.47% with the default 5% buckets). NaN when empty.
    Values that are not positive finite numbers are ignored and counted in ``rejected``. Not thread-safe.
    """

    __slots__ = ("_counts", "buckets", "count", "rejected")

    def __init__(self, buckets: LogBuckets | None = None) -> None:
        self.buckets = _DEFAULT_BUCKETS if buckets is None else buckets
        self._counts = np.zeros(self.buckets.size, dtype=np.int64)
        self.count = 0
        self.rejected = 0

    @property
    def counts(self) -> np.ndarray:
        """A read-only view of the per-bucket counts."""
        view = self._counts.view()
        view.setflags(write=False)
        return view

    @property
    def nbytes(self) -> int:
        return int(self._counts.nbytes)

    def add(self, value: float) -> None:
        if not 0.0 < value < _INF:  # NaN fails the comparison too
            self.rejected += 1
            return
        self._counts[self.buckets.index(value)] += 1
        self.count += 1

    def merge(self, other: LogHistogram) -> None:
        """Add ``other``'s counts (and its rejections) to this histogram; the layouts must be equal."""
        if other.buckets != self.buckets:
            raise ValueError(f"cannot merge histograms with different layouts: {self.buckets} and {other.buckets}")
        self._counts += other._counts
        self.count += other.count
        self.rejected += other.rejected

    def quantile(self, q: float) -> float:
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Sequence[float] = QUANTILES) -> tuple[float, ...]:
        estimates, _ = _quantiles(self._counts, _check_qs(qs), self.buckets.midpoints)
        return tuple(estimates.tolist())

    def clear(self) -> None:
        """Forget every value, and the rejection count."""
        self._counts.fill(0)
        self.count = 0
        self.rejected = 0


class _Ring:
    """The slice arithmetic of a sliding window: slice ``e`` covers ``[e * slice_s, (e + 1) * slice_s)`` and
    lives in slot ``e % slices``. Time never runs backwards: a ``now`` before the newest slice seen counts as
    the newest slice."""

    __slots__ = ("epoch", "slice_s", "slices", "window_s")

    def __init__(self, window_s: float, slices: int) -> None:
        if not isinstance(window_s, int | float) or not 0 < window_s < _INF:
            raise ValueError(f"window_s must be a positive finite number of seconds, got {window_s!r}")
        if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
            raise ValueError(f"slices must be an integer >= 1, got {slices!r}")
        self.window_s = float(window_s)
        self.slices = slices
        self.slice_s = self.window_s / slices
        self.epoch: int | None = None

    def advance(self, now: float) -> list[int]:
        """Move to the slice that holds ``now``; return the slots whose contents fell out of the window."""
        epoch = int(now // self.slice_s)
        old = self.epoch
        if old is not None and epoch <= old:
            return []
        self.epoch = epoch
        if old is None:
            return []
        steps = min(epoch - old, self.slices)
        return [e % self.slices for e in range(epoch - steps + 1, epoch + 1)]

    @property
    def slot(self) -> int:
        return 0 if self.epoch is None else self.epoch % self.slices


class WindowedQuantiles:
    """Quantiles of the values added in the last ``window_s`` seconds, in a fixed ring of ``slices`` histograms.

    Each histogram holds one slice of ``window_s / slices`` seconds; when time enters a new slice the oldest is
    cleared, so a read covers between ``window_s - window_s / slices`` and ``window_s`` seconds of values, and
    memory is ``slices`` histograms whatever the traffic. ``now`` defaults to ``clock()``; a ``now`` earlier
    than one already seen counts as the latest (time never runs backwards). The error bound of `LogHistogram`
    holds. Rejected values are counted in ``rejected``. Not thread-safe.
    """

    __slots__ = ("_histograms", "_ring", "buckets", "clock", "rejected")

    def __init__(
        self,
        window_s: float = 60.0,
        slices: int = 6,
        clock: Callable[[], float] = time.monotonic,
        *,
        buckets: LogBuckets | None = None,
    ) -> None:
        self._ring = _Ring(window_s, slices)
        self.buckets = _DEFAULT_BUCKETS if buckets is None else buckets
        self.clock = clock
        self._histograms = [LogHistogram(self.buckets) for _ in range(slices)]
        self.rejected = 0

    @property
    def window_s(self) -> float:
        return self._ring.window_s

    @property
    def slices(self) -> int:
        return self._ring.slices

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._histograms)

    def _advance(self, now: float | None) -> None:
        for slot in self._ring.advance(self.clock() if now is None else now):
            self._histograms[slot].clear()

    def add(self, value: float, now: float | None = None) -> None:
        if not 0.0 < value < _INF:
            self.rejected += 1
            return
        self._advance(now)
        self._histograms[self._ring.slot].add(value)

    def quantiles(self, qs: Sequence[float] = QUANTILES, now: float | None = None) -> tuple[float, ...]:
        """The quantiles ``qs`` (each in [0, 1]) of the values in the window; NaN each when it is empty."""
        self._advance(now)
        counts = self._histograms[0]._counts.copy()
        for histogram in self._histograms[1:]:
            counts += histogram._counts
        estimates, _ = _quantiles(counts, _check_qs(qs), self.buckets.midpoints)
        return tuple(estimates.tolist())

    def count(self, now: float | None = None) -> int:
        """How many values the window holds."""
        self._advance(now)
        return sum(h.count for h in self._histograms)


class Ewma:
    """An exponentially weighted moving average whose weights decay with time: after samples ``x_i`` at times
    ``t_i``, ``value = sum(w_i * x_i) / sum(w_i)`` with ``w_i = 2 ** (-(t - t_i) / half_life_s)`` and ``t`` the
    latest sample's time. A sample's weight halves every ``half_life_s`` seconds however many samples follow,
    and samples at the same instant weigh the same. ``value`` is NaN until the first sample; it does not change
    between samples. A ``now`` earlier than the latest sample counts as that sample's time. Values that are not
    positive finite numbers are ignored and counted in ``rejected``. Not thread-safe.
    """

    __slots__ = ("_decay_per_s", "_last", "_sum", "_weight", "clock", "half_life_s", "rejected")

    def __init__(self, half_life_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(half_life_s, int | float) or not 0 < half_life_s < _INF:
            raise ValueError(f"half_life_s must be a positive finite number of seconds, got {half_life_s!r}")
        self.half_life_s = float(half_life_s)
        self.clock = clock
        self._decay_per_s = math.log(2.0) / self.half_life_s
        self._sum = 0.0
        self._weight = 0.0
        self._last: float | None = None
        self.rejected = 0

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight > 0.0 else math.nan

    def add(self, value: float, now: float | None = None) -> None:
        if not 0.0 < value < _INF:
            self.rejected += 1
            return
        self._update(value, self.clock() if now is None else now)

    def _update(self, value: float, now: float) -> None:
        last = self._last
        if last is None:
            self._last = now
        elif now > last:
            decay = math.exp((last - now) * self._decay_per_s)
            self._sum *= decay
            self._weight *= decay
            self._last = now
        self._sum += value
        self._weight += 1.0


_METRICS = ("ttft", "e2e")
_QUANTILE_KEYS = ("p50", "p95", "p99")  # the names of QUANTILES


class EndpointLatency:
    """TTFT and end-to-end latency statistics for the endpoints ``0 .. size - 1`` of one pool.

    ``observe(endpoint, ttft_s, e2e_s)`` records one span (either value may be None; values that are not
    positive finite seconds are counted in ``rejected``). ``arrays()`` returns fresh float64 arrays of length
    ``size``: ``{ttft,e2e}_ewma`` (an `Ewma` with ``half_life_s``), ``{ttft,e2e}_p50/_p95/_p99`` (over a
    ``window_s`` window of ``slices`` slices, within ``buckets.max_relative_error`` of the exact quantile), and
    ``count`` (the spans in the window that carried an accepted value). A metric with no value in the window is
    NaN, its EWMA included, so a scorer never acts on stale latency; ``count`` is 0.0 there.

    Memory is fixed at construction, per endpoint: ``2 * slices * buckets.size`` int32 slice counters and
    ``2 * buckets.size`` int64 window sums (24 KB with the defaults: 6 slices of 378 buckets; ``nbytes`` says
    exactly) plus two `Ewma` objects; nothing grows with traffic. A pool that changes gets a new object. A read
    recomputes only the endpoints observed since the last read (all of them when a slice expires). Not
    thread-safe: owned by the event loop that receives the spans.
    """

    def __init__(
        self,
        size: int,
        *,
        window_s: float = 60.0,
        half_life_s: float = 10.0,
        slices: int = 6,
        clock: Callable[[], float] = time.monotonic,
        buckets: LogBuckets | None = None,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"EndpointLatency size must be an integer >= 0, got {size!r}")
        self.size = size
        self.clock = clock
        self.buckets = _DEFAULT_BUCKETS if buckets is None else buckets
        self._ring = _Ring(window_s, slices)
        self._qs = np.asarray(QUANTILES)
        shape = (len(_METRICS), size, self.buckets.size)
        # One histogram per slice (int32: overflow needs 2**31 spans to one endpoint in one slice) and their
        # running sum over the window, so that a read need not add the slices up.
        self._slices = np.zeros((slices, *shape), dtype=np.int32)
        self._window = np.zeros(shape, dtype=np.int64)
        self._spans = np.zeros((slices, size), dtype=np.int64)
        self._ewmas = [[Ewma(half_life_s, clock=clock) for _ in range(size)] for _ in _METRICS]
        self._dirty: set[int] = set()
        self._all_dirty = False
        self._cache: dict[str, np.ndarray] = {}
        for metric in _METRICS:
            for key in ("ewma", *_QUANTILE_KEYS):
                self._cache[f"{metric}_{key}"] = np.full(size, np.nan)
        self._cache["count"] = np.zeros(size)
        self.rejected = 0

    @property
    def window_s(self) -> float:
        return self._ring.window_s

    @property
    def nbytes(self) -> int:
        """Bytes held in arrays (the counters dominate; the per-endpoint `Ewma` objects add ~0.2 KB each)."""
        arrays: list[np.ndarray] = [self._slices, self._window, self._spans, *self._cache.values()]
        return sum(int(a.nbytes) for a in arrays)

    def _advance(self, now: float) -> int:
        expired = self._ring.advance(now)
        if expired:
            for slot in expired:
                self._window -= self._slices[slot]
                self._slices[slot] = 0
                self._spans[slot] = 0
            self._all_dirty = True
        return self._ring.slot

    def observe(self, endpoint: int, ttft_s: float | None, e2e_s: float | None, now: float | None = None) -> None:
        if not 0 <= endpoint < self.size:
            raise IndexError(f"endpoint {endpoint} is not in this pool of {self.size}")
        if now is None:
            now = self.clock()
        slot = self._advance(now)
        accepted = False
        for metric, value in enumerate((ttft_s, e2e_s)):
            if value is None:
                continue
            if not 0.0 < value < _INF:
                self.rejected += 1
                continue
            bucket = self.buckets.index(value)
            self._slices[slot, metric, endpoint, bucket] += 1
            self._window[metric, endpoint, bucket] += 1
            self._ewmas[metric][endpoint]._update(value, now)
            accepted = True
        if accepted:
            self._spans[slot, endpoint] += 1
            self._dirty.add(endpoint)

    def arrays(self, now: float | None = None) -> dict[str, np.ndarray]:
        """The statistics as fresh float64 arrays of length ``size`` (keys: ``{ttft,e2e}_{ewma,p50,p95,p99}``
        and ``count``); NaN where a metric has no value in the window."""
        self._advance(self.clock() if now is None else now)
        rows: slice | np.ndarray
        if self._all_dirty:
            rows = slice(None)
        elif self._dirty:
            rows = np.fromiter(self._dirty, dtype=np.intp, count=len(self._dirty))
        else:
            return {key: array.copy() for key, array in self._cache.items()}
        ids = range(self.size) if isinstance(rows, slice) else rows.tolist()
        estimates, totals = _quantiles(self._window[:, rows], self._qs, self.buckets.midpoints)
        cache = self._cache
        cache["count"][rows] = self._spans[:, rows].sum(axis=0)
        for m, metric in enumerate(_METRICS):
            ewmas = self._ewmas[m]
            values = np.fromiter((ewmas[i].value for i in ids), dtype=np.float64, count=len(ids))
            cache[f"{metric}_ewma"][rows] = np.where(totals[m] > 0, values, np.nan)
            for j, key in enumerate(_QUANTILE_KEYS):
                cache[f"{metric}_{key}"][rows] = estimates[m, :, j]
        self._dirty.clear()
        self._all_dirty = False
        return {key: array.copy() for key, array in cache.items()}
