"""The scheduling pipeline: filters drop endpoints, weighted scorers rank the rest, a picker chooses.

Extension points are one small ``Protocol`` each. Scorers return a float array in [0, 1] aligned with the
candidates they were given; the engine clamps, weights and sums, so a scorer never has to know its weight
and a misbehaving scorer cannot push a score out of range. A scorer that raises is counted and treated as
neutral (0.5 for every candidate) for that request: one broken signal must not stop routing. A NaN score
counts as 0, the worst.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from inferlb.scorer.errors import NoEndpointError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.pool import Endpoint, Pool
from inferlb.scorer.signals import Signals

logger = logging.getLogger(__name__)

NEUTRAL_SCORE = 0.5

# A decision's reason by the picker that made it (a picker of a plugin's own gives its name).
_PICKER_REASONS = {
    "max-score": "best-score",
    "weighted-random": "sampled",
    "power-of-two": "sampled",
    "round-robin": "rotation",
}


@dataclass(frozen=True, slots=True)
class State:
    """What plugins may read: the pool, the live in-flight counters and the latest server signals (read-only
    for plugins; ``signals.snapshot`` is replaced, never changed, by the collectors)."""

    pool: Pool
    inflight: InFlight
    signals: Signals


class Filter(Protocol):
    """Drops candidates. Returns the subset of ``candidates`` (endpoint indices) that may serve the request."""

    name: str

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray: ...


class Scorer(Protocol):
    """Scores candidates in [0, 1], higher is better; returns an array aligned with ``candidates``.

    A scorer may set a class attribute ``bounded = True`` to promise a float64 ndarray in [0, 1] without NaN;
    the engine then skips its clamp (numpy's per-call cost is most of a pick on a small pool). A scorer (or
    filter) with state of its own may define ``on_pick(request, endpoint_index)``: the engine calls it with
    every decision (the prefix index learns where prompts went this way). It must not raise.
    """

    name: str

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray: ...


class Picker(Protocol):
    """Chooses one candidate from the weighted total scores; returns its position in ``candidates``."""

    name: str

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    """A named scheduling profile: filters, then weighted scorers, then a picker."""

    name: str
    filters: Sequence[Filter]
    scorers: Sequence[WeightedScorer]
    picker: Picker


@dataclass(slots=True)
class Decision:
    """The outcome of one pick: the chosen endpoint and how it was reached. Treat as read-only.

    ``reason`` says why this endpoint (the ``reason`` label of the picker's decision counter):

    * ``best-score``: the highest weighted score (ties broken at random);
    * ``sampled``: drawn at random by score (weighted-random, power-of-two);
    * ``rotation``: next in turn (round-robin);
    * ``only-candidate``: the filters left one endpoint;
    * ``no-fresh-metrics``: metrics are scraped, but no candidate's are fresh, so the pick ran on in-flight
      counts and whatever else was known;
    * ``saturated``: every candidate was saturated and the request had waited as long as its class allows
      (set by the filter, which does the waiting).

    ``scores`` maps each scorer's name to the score (before weighting) the chosen endpoint got; ``per_scorer``
    holds every candidate's scores, aligned with ``candidates``. ``ranked`` lists every candidate, best first
    (the chosen one first); it is computed on demand.
    """

    endpoint: Endpoint
    profile: str
    reason: str
    scores: dict[str, float]
    candidates: np.ndarray
    totals: np.ndarray
    per_scorer: tuple[tuple[str, np.ndarray], ...] = ()

    @property
    def ranked(self) -> tuple[int, ...]:
        order = np.argsort(-self.totals, kind="stable")
        ranked = [int(self.candidates[i]) for i in order]
        ranked.remove(self.endpoint.index)
        return (self.endpoint.index, *ranked)


class Engine:
    """Runs a profile over the pool for each request. ``decide`` is synchronous, does no I/O and never awaits.

    Not thread-safe (pickers keep state such as a round-robin cursor); use it from one event loop.
    """

    def __init__(
        self, pool: Pool, profile: Profile, inflight: InFlight | None = None, signals: Signals | None = None
    ) -> None:
        self.pool = pool
        self.profile = profile
        self.inflight = inflight if inflight is not None else InFlight(len(pool))
        self.signals = signals if signals is not None else Signals(len(pool))
        self.state = State(pool, self.inflight, self.signals)
        self.scorer_errors: Counter[str] = Counter()
        # Looked up once here rather than on every request.
        self._observers = tuple(
            plugin.on_pick
            for plugin in (*profile.filters, *(ws.scorer for ws in profile.scorers))
            if hasattr(plugin, "on_pick")
        )
        self._filters = tuple(profile.filters)
        self._reason = _PICKER_REASONS.get(profile.picker.name, profile.picker.name)
        self._scorers = tuple(
            (ws.scorer.name, ws.scorer, ws.weight, bool(getattr(ws.scorer, "bounded", False))) for ws in profile.scorers
        )

    def decide(self, request: RequestFeatures) -> Decision:
        """Choose an endpoint. Raises ``UnknownModelError`` or ``NoEndpointError`` (both ``RoutingError``)."""
        state = self.state
        candidates = self.pool.all_indices
        for flt in self._filters:
            candidates = flt.filter(request, state, candidates)
            if not len(candidates):
                raise NoEndpointError(f"no endpoint left after filter {flt.name!r}")
        per_scorer = []
        totals: np.ndarray | None = None
        for name, scorer, weight, bounded in self._scorers:
            scores = self._run_scorer(scorer, bounded, request, candidates)
            per_scorer.append((name, scores))
            weighted = scores if weight == 1.0 else weight * scores
            totals = weighted if totals is None else totals + weighted
        if totals is None:
            totals = np.zeros(len(candidates))
        profile = self.profile
        position = profile.picker.pick(request, candidates, totals)
        chosen = int(candidates[position])
        for observe in self._observers:
            observe(request, chosen)
        signals = state.signals
        if len(candidates) == 1:
            reason = "only-candidate"
        elif (
            signals.scraped_any
            and (now := time.monotonic()) > signals.all_fresh_until
            and not (signals.fresh_until[candidates] >= now).any()
        ):
            reason = "no-fresh-metrics"
        else:
            reason = self._reason
        return Decision(
            self.pool.endpoints[chosen],
            profile.name,
            reason,
            {name: float(s[position]) for name, s in per_scorer},
            candidates,
            totals,
            tuple(per_scorer),
        )

    def _run_scorer(
        self, scorer: Scorer, bounded: bool, request: RequestFeatures, candidates: np.ndarray
    ) -> np.ndarray:
        try:
            scores = scorer.score(request, self.state, candidates)
            if type(scores) is not np.ndarray or scores.dtype != np.float64:
                scores = np.asarray(scores, dtype=np.float64)
            if scores.shape != candidates.shape:
                raise ValueError(f"returned shape {scores.shape}, expected {candidates.shape}")
            if bounded:
                return scores
            # fmax/fmin (not clip) so that a NaN, from a scorer dividing by zero say, becomes 0 instead of
            # poisoning the sum; they are also several times cheaper than clip on small arrays.
            return np.fmin(np.fmax(scores, 0.0), 1.0)
        except Exception:
            if not self.scorer_errors[scorer.name]:
                logger.exception("scorer %r failed; scoring it neutral (logged once per scorer)", scorer.name)
            self.scorer_errors[scorer.name] += 1
            return np.full(len(candidates), NEUTRAL_SCORE)
