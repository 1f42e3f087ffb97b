"""Per-endpoint latency statistics in bounded memory: the TTFT and end-to-end latency of the servers' spans,
kept as a time-decayed EWMA and as quantiles (P50/P95/P99) over a sliding window, for the latency scorers.

- `LogBuckets`: a fixed log-spaced bucket layout (default 1e-4 s .. 1e4 s, each bucket 5% wider than the one
  below it: 378 buckets). A quantile is the geometric midpoint of the bucket that holds the nearest-rank sample,
  so its relative error is at most ``sqrt(1 + relative_width) - 1`` (2.47% at 5%) for values within
  ``[min_value, max_value]``; values outside are clamped to the end buckets.
- `EndpointLatency`: for every endpoint of a pool (about 24 KB each), numpy counts in those buckets over a
  sliding window (a ring of slices, cleared as time moves on, so memory does not grow with traffic) and an
  exponentially weighted mean whose weights decay with elapsed time, not with the sample count; reads are
  vectorised. The mean it publishes is shrunk toward the fleet's as an endpoint's own evidence ages, so that an
  endpoint nobody sends requests to is not judged forever on its last samples.

These are not the bucketed counts of ``/metrics`` (scorer/histogram.py): they serve the latency scorers, on the
routing path, for all endpoints at once.

Values that are not positive finite numbers (NaN, infinities, zero, negatives) are ignored and counted in
``rejected``. Nothing here is thread-safe: each object belongs to the one event loop that feeds and reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["QUANTILES", "EndpointLatency", "LogBuckets"]

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


class _DecayedSums:
    """``n`` series of samples whose weights decay with time: per series, the weighted sum of its samples
    (``sums``) and the sum of their weights (``weights``), both as of the series' latest sample (``last``). A
    sample weighs 1 when it arrives and half as much every ``half_life_s`` after; a sample earlier than the
    series' latest counts at the latest's time. Values are not checked here. Not thread-safe."""

    __slots__ = ("decay_per_s", "last", "sums", "weights")

    def __init__(self, n: int, half_life_s: float) -> None:
        self.decay_per_s = math.log(2.0) / half_life_s
        self.sums = np.zeros(n)
        self.weights = np.zeros(n)
        self.last = np.zeros(n)

    def add(self, i: int, value: float, now: float) -> None:
        weight = float(self.weights[i])
        last = float(self.last[i])
        if weight == 0.0:  # the first sample (or every earlier one has decayed to nothing)
            self.sums[i], self.weights[i], self.last[i] = value, 1.0, now
        elif now > last:
            decay = math.exp((last - now) * self.decay_per_s)
            self.sums[i] = float(self.sums[i]) * decay + value
            self.weights[i] = weight * decay + 1.0
            self.last[i] = now
        else:
            self.sums[i] += value
            self.weights[i] = weight + 1.0


def _check_half_life(half_life_s: float) -> float:
    if not isinstance(half_life_s, int | float) or not 0 < half_life_s < _INF:
        raise ValueError(f"half_life_s must be a positive finite number of seconds, got {half_life_s!r}")
    return float(half_life_s)


_METRICS = ("ttft", "e2e")
_QUANTILE_KEYS = ("p50", "p95", "p99")  # the names of QUANTILES


class EndpointLatency:
    """TTFT and end-to-end latency statistics for the endpoints ``0 .. size - 1`` of one pool.

    ``observe(endpoint, ttft_s, e2e_s)`` records one span (either value may be None; values that are not
    positive finite seconds are counted in ``rejected``). ``arrays()`` returns fresh float64 arrays of length
    ``size``: ``{ttft,e2e}_ewma`` (the estimate to score on, below), ``{ttft,e2e}_p50/_p95/_p99`` (over a
    ``window_s`` window of ``slices`` slices, within ``buckets.max_relative_error`` of the exact quantile, NaN
    where the endpoint has no value in the window), and ``count`` (the spans in the window that carried an
    accepted value; 0.0 where none).

    The estimate ``{ttft,e2e}_ewma`` is each endpoint's own time-decayed mean (weights halving every ``half_life_s``)
    shrunk toward the fleet's: ``(w * own + w0 * fleet) / (w + w0)``. ``w`` is the endpoint's evidence, its
    samples' weights decayed to the read's ``now`` (1 per fresh sample, halving every half-life without one);
    ``w0`` is ``prior_weight`` (default 1.0: one sample's worth); ``fleet`` is the evidence-weighted mean of the
    endpoints' own means, i.e. the time-decayed mean of every sample in the pool. Samples of an endpoint with no
    value in the window count as no evidence (``w = 0``), so such an endpoint, or one never observed, reads
    ``fleet`` exactly; with one endpoint, or all alike, the estimate is the own mean. An endpoint that keeps
    sending samples keeps ``w`` in the tens or hundreds and its estimate stays its own; one that stopped drifts
    toward ``fleet`` as its evidence ages: after ``k`` half-lives without samples its distance from ``fleet`` is
    ``w_k / (w_k + w0)`` of its own mean's, with ``w_k = w * 2 ** -k`` (from one sample: 1/3 after one
    half-life, under 1/30 after five). Why: the picker is max-score, so an endpoint that once looked slow gets
    almost no requests, hence no samples; a mean that kept its value (or a NaN, which scores neutral, below the
    fleet's healthy endpoints) kept it starved indefinitely. An estimate that only approaches the fleet's would
    still lose every tied pick by its residue: the latency scorer's tolerance (`LatencyScorer`) is the other half
    of the fix. The quantiles are observations only and are not shrunk. The estimate is NaN only while no
    endpoint has a value in the window.

    Memory is fixed at construction, per endpoint: ``2 * slices * buckets.size`` int32 slice counters and
    ``2 * buckets.size`` int64 window sums (24 KB with the defaults: 6 slices of 378 buckets; ``nbytes`` says
    exactly) plus six floats of EWMA state; nothing grows with traffic. A pool that changes gets a new object
    (`moved`). A read recomputes the quantiles of only the endpoints observed since the last read (all of them
    when a slice expires) and the estimates of all of them (they change with time alone), vectorised. Not
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
        prior_weight: float = 1.0,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"EndpointLatency size must be an integer >= 0, got {size!r}")
        if not isinstance(prior_weight, int | float) or isinstance(prior_weight, bool) or not 0 < prior_weight < _INF:
            raise ValueError(f"prior_weight must be a positive finite number of samples, got {prior_weight!r}")
        self.size = size
        self.clock = clock
        self.buckets = _DEFAULT_BUCKETS if buckets is None else buckets
        self.half_life_s = _check_half_life(half_life_s)
        self.prior_weight = float(prior_weight)
        self._ring = _Ring(window_s, slices)
        self._qs = np.asarray(QUANTILES)
        shape = (len(_METRICS), size, self.buckets.size)
        # One histogram per slice (int32: overflow needs 2**31 spans to one endpoint in one slice) and their
        # running sum over the window, so that a read need not add the slices up.
        self._slices = np.zeros((slices, *shape), dtype=np.int32)
        self._window = np.zeros(shape, dtype=np.int64)
        self._spans = np.zeros((slices, size), dtype=np.int64)
        self._ewmas = tuple(_DecayedSums(size, self.half_life_s) for _ in _METRICS)
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
        """Bytes held in arrays (the counters dominate)."""
        arrays: list[np.ndarray] = [self._slices, self._window, self._spans, *self._cache.values()]
        for ewma in self._ewmas:
            arrays += [ewma.sums, ewma.weights, ewma.last]
        return sum(int(a.nbytes) for a in arrays)

    def moved(self, mapping: np.ndarray) -> EndpointLatency:
        """These statistics for the next pool after a membership change: endpoint j has what endpoint
        ``mapping[j]`` had here (its window, its mean and its evidence); one that joined (-1) has nothing yet and
        reads the fleet's estimate. Same settings and clock; this object is left as it was."""
        moved = EndpointLatency(
            len(mapping),
            window_s=self.window_s,
            half_life_s=self.half_life_s,
            slices=self._ring.slices,
            clock=self.clock,
            buckets=self.buckets,
            prior_weight=self.prior_weight,
        )
        kept = np.asarray(mapping) >= 0
        source = np.asarray(mapping)[kept]
        moved._ring.epoch = self._ring.epoch
        moved._slices[:, :, kept] = self._slices[:, :, source]
        moved._window[:, kept] = self._window[:, source]
        moved._spans[:, kept] = self._spans[:, source]
        for mine, theirs in zip(moved._ewmas, self._ewmas, strict=True):
            for name in ("sums", "weights", "last"):
                getattr(mine, name)[kept] = getattr(theirs, name)[source]
        moved._all_dirty = True
        moved.rejected = self.rejected
        return moved

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
            self._ewmas[metric].add(endpoint, value, now)
            accepted = True
        if accepted:
            self._spans[slot, endpoint] += 1
            self._dirty.add(endpoint)

    def arrays(self, now: float | None = None) -> dict[str, np.ndarray]:
        """The statistics as fresh float64 arrays of length ``size`` (keys: ``{ttft,e2e}_{ewma,p50,p95,p99}``
        and ``count``), as of ``now`` (default ``clock()``; earlier than a time already seen counts as that)."""
        if now is None:
            now = self.clock()
        self._advance(now)
        if self._all_dirty or self._dirty:
            self._refresh_quantiles()
        cache = self._cache
        for m, metric in enumerate(_METRICS):
            # The quantiles are NaN exactly where the window holds no value of the metric.
            cache[f"{metric}_ewma"] = self._estimates(m, ~np.isnan(cache[f"{metric}_p50"]), now)
        return {key: array.copy() for key, array in cache.items()}

    def _refresh_quantiles(self) -> None:
        """Recompute the cached quantiles and counts of the endpoints observed since the last read (of all of them
        when a slice has expired)."""
        rows: slice | np.ndarray
        rows = slice(None) if self._all_dirty else np.fromiter(self._dirty, dtype=np.intp, count=len(self._dirty))
        estimates, _ = _quantiles(self._window[:, rows], self._qs, self.buckets.midpoints)
        cache = self._cache
        cache["count"][rows] = self._spans[:, rows].sum(axis=0)
        for m, metric in enumerate(_METRICS):
            for j, key in enumerate(_QUANTILE_KEYS):
                cache[f"{metric}_{key}"][rows] = estimates[m, :, j]
        self._dirty.clear()
        self._all_dirty = False

    def _estimates(self, metric: int, known: np.ndarray, now: float) -> np.ndarray:
        """The shrunk estimates of one metric (see the class docstring); ``known``: the endpoints with a value in
        the window."""
        if not known.any():
            return np.full(self.size, np.nan)
        ewma = self._ewmas[metric]
        last = np.where(known, ewma.last, -_INF)
        newest = float(last.max())
        # Decayed to the newest sample first and to `now` after, so that the fleet's mean stays defined (no 0 / 0)
        # however many half-lives ago that sample was. exp(-inf) = 0 drops the endpoints without evidence.
        relative = np.exp((last - newest) * ewma.decay_per_s)
        sums = ewma.sums * relative
        weights = ewma.weights * relative
        fleet = float(sums.sum() / weights.sum())
        to_now = math.exp(-max(now - newest, 0.0) * ewma.decay_per_s)
        prior = self.prior_weight
        return np.asarray((sums * to_now + prior * fleet) / (weights * to_now + prior))
