"""The built-in filters, scorers and pickers. Each is small, stateless or with state of its own only."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import FEW_AS_LIST


class ModelFilter:
    """Keeps the endpoints that serve the request's model (and belong to its class's pool, if it has one);
    raises ``UnknownModelError`` if none in the pool serves the model."""

    name = "model"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        pool = state.pool
        if candidates is pool.all_indices:  # the usual case, first in the chain: a precomputed answer
            candidates = pool.model_indices(request.model)
        else:
            mask = pool.model_mask(request.model)
            candidates = candidates[mask[candidates]]
        if request.pool_mask is not None:  # the request's class may use only part of the pool
            candidates = candidates[request.pool_mask[candidates]]
        return candidates


class InFlightScorer:
    """Fewer in-flight requests scores higher: 1 / (1 + requests above the least loaded candidate).

    The least loaded candidates score 1, one request more 0.5, two more 0.33: a difference of one request
    matters a lot when queues are short and little when they are long.
    """

    name = "in-flight"
    bounded = True

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        inflight = state.inflight
        if len(candidates) <= FEW_AS_LIST:
            values = inflight.few(inflight.requests, candidates)
            least = min(values) - 1
            return np.array([1.0 / (v - least) for v in values])
        load = inflight.requests[candidates]
        # The least by argmin, and 1.0 / rather than np.reciprocal: the same numbers at a third less of the cost.
        return 1.0 / (load - (load[load.argmin()] - 1))


class MaxScorePicker:
    """Picks the highest total score; ties are broken uniformly at random (so equal endpoints share load).

    A jitter below ``TIE`` is added before the argmax, which breaks ties at random in two vectorised steps;
    totals closer than that count as equal. It is drawn in blocks, because drawing a few random numbers per
    request costs more than the rest of the pick. Totals must stay below ~1e4 (the sum of a profile's weights)
    for the jitter to survive float64 rounding.
    """

    name = "max-score"
    TIE = 1e-9
    BLOCK = 1 << 16

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self._rng = rng if rng is not None else np.random.default_rng()
        self._jitter = np.empty(0)
        self._cursor = 0

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int:
        n = len(totals)
        if n == 1:
            return 0
        start = self._cursor
        if start + n > len(self._jitter):
            self._jitter = self._rng.random(max(self.BLOCK, n)) * self.TIE
            start = 0
        self._cursor = start + n
        return int((totals + self._jitter[start : start + n]).argmax())


class RoundRobinPicker:
    """Ignores scores and cycles through the candidates, with one cursor per model so that interleaved models
    do not skew each other's rotation. At most 4096 cursors are kept (pools with endpoints that accept any
    model see arbitrary names); further names share one cursor."""

    name = "round-robin"

    def __init__(self) -> None:
        self._cursors: dict[Hashable, int] = {}

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int:
        key = request.model if request.model is not None else ""
        if key not in self._cursors and len(self._cursors) >= 4096:
            key = "*"
        cursor = self._cursors.get(key, 0)
        self._cursors[key] = cursor + 1
        return cursor % len(candidates)
