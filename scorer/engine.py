"""The scheduling pipeline: filters drop endpoints, weighted scorers rank the rest, a picker chooses.

Extension points are one small ``Protocol`` each. Scorers return a float array in [0, 1] aligned with the
candidates they were given; the engine clamps, weights and sums, so a scorer never has to know its weight
and a misbehaving scorer cannot push a score out of range. A scorer that raises is counted and treated as
neutral (0.5 for every candidate) for that request: one broken signal must not stop routing. A NaN score
counts as 0, the worst.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from inferlb.scorer.errors import NoEndpointError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.membership import slow_start
from inferlb.scorer.pool import Endpoint, Pool
from inferlb.scorer.saturation import Saturation
from inferlb.scorer.signals import Signals

logger = logging.getLogger(__name__)

NEUTRAL_SCORE = 0.5

# numpy's float64 dtype is one object: an identity test is half the cost of comparing dtypes (a float64 array whose
# dtype is another object, if numpy ever makes one, is only converted to itself).
_FLOAT64 = np.dtype(np.float64)

# Decisions over at most this many candidates keep every candidate's scores (`Decision.per_scorer`), for the
# decision log's rankings; beyond it memory stays bounded and only the chosen endpoint's scores are kept.
RANKED_UP_TO_CANDIDATES = 64

# A decision's reason by the picker that made it (a picker of a plugin's own gives its name).
_PICKER_REASONS = {
    "max-score": "best-score",
    "weighted-random": "sampled",
    "power-of-two": "sampled",
    "round-robin": "rotation",
}


@dataclass(frozen=True, slots=True)
class State:
    """What plugins may read: the pool, the live in-flight counters, the latest server signals (``signals.snapshot``
    is replaced, never changed, by the collectors; ``signals.clock`` is the routing core's clock) and the
    saturation rule. Read-only for plugins: only the routing unit (`scorer.router.Router`) changes the counters."""

    pool: Pool
    inflight: InFlight
    signals: Signals
    saturation: Saturation = field(default_factory=Saturation)


class Filter(Protocol):
    """Drops candidates. Returns the subset of ``candidates`` (endpoint indices) that may serve the request."""

    name: str

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray: ...


class Scorer(Protocol):
    """Scores candidates in [0, 1], higher is better; returns an array aligned with ``candidates``.

    A scorer may set a class attribute ``bounded = True`` to promise a float64 ndarray in [0, 1] without NaN;
    the engine then skips its clamp (numpy's per-call cost is most of a pick on a small pool). A scorer or filter
    may also be a `PickObserver` or a `PrefillEstimator`.
    """

    name: str

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class PickObserver(Protocol):
    """A filter or scorer with state of its own, told of every decision (the prefix index learns where prompts
    went this way). ``on_pick`` must not raise."""

    def on_pick(self, request: RequestFeatures, endpoint: int) -> None: ...


@runtime_checkable
class PrefillEstimator(Protocol):
    """A filter or scorer that estimated, for the decision just made, the request's tokens still to prefill on
    the chosen endpoint and that endpoint's prefill rate (tokens/s); None when it has no estimate for this
    request. The first estimate of a profile goes into `Decision.prefill`, and the request's lease adds it to the
    endpoint's prefill backlog."""

    def prefill(self, request: RequestFeatures, endpoint: int) -> tuple[float, float] | None: ...


@runtime_checkable
class PrefillPredictor(Protocol):
    """A filter or scorer that can estimate, outside a decision of its own, a request's tokens still to prefill on
    ``endpoint`` and that endpoint's prefill rate: for a request another profile routed there (an experiment's arm),
    whose prompt still delays what comes after it on that server."""

    def estimate_prefill(self, request: RequestFeatures, state: State, endpoint: int) -> tuple[float, float] | None: ...


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


class Decision(NamedTuple):
    """The outcome of one pick: the chosen endpoint and how it was reached. Immutable (a named tuple: built on
    every request, it costs a quarter of a frozen dataclass; `_replace` makes a changed copy).

    ``reason`` says why this endpoint (the ``reason`` label of the picker's decision counter):

    * ``best-score``: the highest weighted score (ties broken at random);
    * ``sampled``: drawn at random by score (weighted-random, power-of-two);
    * ``rotation``: next in turn (round-robin);
    * ``only-candidate``: the filters left one endpoint;
    * ``no-fresh-metrics``: metrics are scraped, but no candidate's are fresh, so the pick ran on in-flight
      counts and whatever else was known;
    * ``saturated``: every candidate was saturated and the request had waited as long as its class allows
      (set by the routing unit, which holds waiting requests).

    ``scores`` maps each scorer's name to the score (before weighting) the chosen endpoint got; ``per_scorer``
    holds every candidate's scores, aligned with ``candidates``, for decisions over at most
    `RANKED_UP_TO_CANDIDATES` candidates (empty beyond). ``ranked`` lists every candidate, best first (the chosen
    one first); it is computed on demand. ``prefill``: the profile's estimate of (the request's tokens still to
    prefill on the chosen endpoint, its prefill rate), or None (see `PrefillEstimator`).
    """

    endpoint: Endpoint
    profile: str
    reason: str
    candidates: np.ndarray
    totals: np.ndarray
    per_scorer: tuple[tuple[str, np.ndarray], ...] = ()
    prefill: tuple[float, float] | None = None
    position: int = 0  # the chosen endpoint's place in candidates
    # The chosen endpoint's scores where per_scorer is not kept (more candidates than RANKED_UP_TO_CANDIDATES).
    kept_scores: dict[str, float] | None = None

    @property
    def scores(self) -> dict[str, float]:
        """Each scorer's score for the chosen endpoint, by the scorer's name (taken when asked: the decision log
        reads them only when someone looks)."""
        if self.kept_scores is not None:
            return self.kept_scores
        position = self.position
        return {name: float(s[position]) for name, s in self.per_scorer}

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
        self,
        pool: Pool,
        profile: Profile,
        inflight: InFlight | None = None,
        signals: Signals | None = None,
        saturation: Saturation | None = None,
    ) -> None:
        self.pool = pool
        self.profile = profile
        self.signals = signals if signals is not None else Signals(len(pool))
        self.inflight = inflight if inflight is not None else InFlight(len(pool), clock=self.signals.clock)
        self.saturation = saturation if saturation is not None else Saturation()
        self.state = State(pool, self.inflight, self.signals, self.saturation)
        self.scorer_errors: Counter[str] = Counter()
        # Looked up once here rather than on every request.
        plugins = (*profile.filters, *(ws.scorer for ws in profile.scorers))
        self._observers = tuple(p.on_pick for p in plugins if isinstance(p, PickObserver))
        self._estimators = tuple(p.prefill for p in plugins if isinstance(p, PrefillEstimator))
        self._predictors = tuple(p.estimate_prefill for p in plugins if isinstance(p, PrefillPredictor))
        self._filters = tuple(profile.filters)
        self._reason = _PICKER_REASONS.get(profile.picker.name, profile.picker.name)
        # Each weight other than 1 as a 0-d array: numpy 2 takes a Python float operand through its scalar promotion,
        # which costs more than the product of a few values (the same product either way).
        self._scorers = tuple(
            (
                ws.scorer.name,
                ws.scorer,
                None if ws.weight == 1.0 else np.array(ws.weight, dtype=np.float64),
                bool(getattr(ws.scorer, "bounded", False)),
            )
            for ws in profile.scorers
        )

    def rank(
        self, request: RequestFeatures, *, thin: bool = True
    ) -> tuple[np.ndarray, list[tuple[str, np.ndarray]], np.ndarray]:
        """The candidates the filters leave for ``request`` (and, with ``thin``, the slow start: this counts as a
        decision for the ramps), each scorer's scores and the weighted totals, aligned with the candidates; no
        pick, and nothing learned. Raises like `decide`."""
        state = self.state
        candidates = self.pool.all_indices
        for flt in self._filters:
            candidates = flt.filter(request, state, candidates)
            if not len(candidates):
                raise NoEndpointError(f"no endpoint left after filter {flt.name!r}")
        if thin and self.pool.ramping:  # endpoints that joined recently take a rising share (scorer.membership)
            candidates = slow_start(self.pool, candidates, state.signals.clock(), state.signals.snapshot.waiting)
        per_scorer = []
        totals: np.ndarray | None = None
        owned = False  # whether totals is an array of the engine's own, to add into in place
        shape = candidates.shape
        for name, scorer, weight, bounded in self._scorers:
            # The call and its checks inline: on a small pool they cost more than the scoring itself.
            try:
                scores = scorer.score(request, state, candidates)
                if type(scores) is not np.ndarray or scores.dtype is not _FLOAT64:
                    scores = np.asarray(scores, dtype=np.float64)
                if scores.shape != shape:
                    raise ValueError(f"returned shape {scores.shape}, expected {shape}")
                if not bounded:
                    # fmax/fmin (not clip) so that a NaN, from a scorer dividing by zero say, becomes 0 instead of
                    # poisoning the sum; they are also several times cheaper than clip on small arrays.
                    scores = np.fmin(np.fmax(scores, 0.0), 1.0)
            except Exception:
                scores = self._failed(scorer, len(candidates))
            per_scorer.append((name, scores))
            weighted = scores if weight is None else weight * scores
            if totals is None:
                totals = weighted
                owned = weighted is not scores
            elif owned:
                totals += weighted  # the same sums, in the same order, without a new array each time
            else:
                totals = totals + weighted
                owned = True
        if totals is None:
            totals = np.zeros(len(candidates))
        return candidates, per_scorer, totals

    def decide(self, request: RequestFeatures) -> Decision:
        """Choose an endpoint. Raises ``UnknownModelError`` or ``NoEndpointError`` (both ``RoutingError``)."""
        state = self.state
        candidates, per_scorer, totals = self.rank(request)
        profile = self.profile
        position = profile.picker.pick(request, candidates, totals)
        chosen = int(candidates[position])
        for observe in self._observers:
            observe(request, chosen)
        prefill = None
        for estimate in self._estimators:
            prefill = estimate(request, chosen)
            if prefill is not None:
                break
        signals = state.signals
        if len(candidates) == 1:
            reason = "only-candidate"
        elif (
            signals.scraped_any
            and (now := signals.clock()) > signals.all_fresh_until
            and (now > signals.any_fresh_until or not (signals.fresh_until[candidates] >= now).any())
        ):
            reason = "no-fresh-metrics"
        else:
            reason = self._reason
        if len(candidates) <= RANKED_UP_TO_CANDIDATES:
            return Decision(
                self.pool.endpoints[chosen],
                profile.name,
                reason,
                candidates,
                totals,
                tuple(per_scorer),
                prefill,
                position,
            )
        kept = {name: float(s[position]) for name, s in per_scorer}
        return Decision(
            self.pool.endpoints[chosen], profile.name, reason, candidates, totals, (), prefill, position, kept
        )

    def prefill_at(self, request: RequestFeatures, endpoint: int) -> tuple[float, float] | None:
        """This profile's estimate of ``request``'s prefill on ``endpoint`` (as `Decision.prefill`) for a request that
        another profile routed there; None when none of its plugins estimates one. Learns nothing."""
        for estimate in self._predictors:
            prefill = estimate(request, self.state, endpoint)
            if prefill is not None:
                return prefill
        return None

    def observe_pick(self, request: RequestFeatures, endpoint: int) -> None:
        """Tell the plugins that keep state of decisions (the prefix index) that ``request`` went to ``endpoint``
        after all: the data plane served it there instead of where `decide` sent it."""
        for observe in self._observers:
            observe(request, endpoint)

    def adopt(self, old: Engine, mapping: np.ndarray, restarted: Sequence[int] = ()) -> None:
        """Take over the learned state of ``old``'s plugins (the prefix index) after a membership change or a
        reload: endpoint j of this pool is endpoint ``mapping[j]`` of the old one (-1: joined); ``restarted``
        (indices here) start with no prefix credit. Call it before the first decision."""
        old_indices = _prefix_indices(old)
        for index in _prefix_indices(self):
            if old_indices:
                index.adopt(old_indices[0], mapping)
            for endpoint in restarted:
                index.forget(endpoint)

    def _failed(self, scorer: Scorer, count: int) -> np.ndarray:
        if not self.scorer_errors[scorer.name]:
            logger.exception("scorer %r failed; scoring it neutral (logged once per scorer)", scorer.name)
        self.scorer_errors[scorer.name] += 1
        return np.full(count, NEUTRAL_SCORE)


@runtime_checkable
class EndpointMemory(Protocol):
    """Per-endpoint state a plugin learned (the prefix index), carried to the next pool by `Engine.adopt`."""

    def adopt(self, old: Any, mapping: np.ndarray) -> None: ...

    def forget(self, endpoint: int) -> None: ...


def _prefix_indices(engine: Engine) -> list[EndpointMemory]:
    """The prefix indices of an engine's plugins, each once (the prefix-affinity and predicted-TTFT scorers share
    one)."""
    found: list[EndpointMemory] = []
    plugins = (*engine.profile.filters, *(ws.scorer for ws in engine.profile.scorers))
    for plugin in plugins:
        for holder in (plugin, getattr(plugin, "predictor", None)):
            index = getattr(holder, "index", None) or getattr(holder, "prefix_match", None)
            if isinstance(index, EndpointMemory) and all(index is not f for f in found):
                found.append(index)
    return found
