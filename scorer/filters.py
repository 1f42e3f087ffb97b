"""Filters on server state. Each drops candidates that should not get the request; none ever empties the list
on its own judgement of load: when every candidate would be dropped, all are kept (a pick on imperfect data
beats a 503 while servers may well be able to serve)."""

from __future__ import annotations

import math

import numpy as np

from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.loadscorers import ATTENTION_TOKENS, Predicting, TtftPredictor
from inferlb.scorer.signals import Snapshot

__all__ = [
    "MemoryFitFilter",
    "SaturationFilter",
    "SpeedClassFilter",
    "StalenessFilter",
    "TtftGapFilter",
    "TtftSloFilter",
]


def _keep(candidates: np.ndarray, keep: np.ndarray) -> np.ndarray:
    return candidates[keep] if keep.any() else candidates


class StalenessFilter:
    """Drops endpoints whose metrics are stale (no successful scrape within the signals' ``stale_after_s``, or
    the last scrape failed): a stale endpoint counts as saturated. If every candidate is stale, keeps them all."""

    name = "staleness"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        signals = state.signals
        now = signals.clock()
        if now <= signals.all_fresh_until or now > signals.any_fresh_until:  # all fresh, or none: keep all
            return candidates
        return _keep(candidates, signals.fresh_until[candidates] >= now)


class SaturationFilter:
    """Drops saturated endpoints, by the rule admission control uses (`Saturation`, configured once in the
    config's ``admission`` section): more than ``max_waiting`` queued requests, counting the growth of the
    requests in flight there since the scrape began, or KV-cache use above ``max_kv_usage``. Unknown values pass.
    If every candidate is saturated, keeps them all."""

    name = "saturation"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        saturation = state.saturation
        if not saturation.any_over(state.signals, state.inflight):
            return candidates
        return _keep(candidates, ~saturation.over(state.signals, state.inflight)[candidates])


class MemoryFitFilter:
    """Drops endpoints whose free GPU memory is below ``margin`` x the request's estimated KV memory
    (prompt + max output tokens, x ``bytes_per_token``). Unknown memory passes. If none fits, keeps all."""

    name = "memory-fit"

    def __init__(self, bytes_per_token: float = 131072, margin: float = 1.3, default_output_tokens: int = 256) -> None:
        self.bytes_per_token = bytes_per_token
        self.margin = margin
        self.default_output_tokens = default_output_tokens

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        free = state.signals.snapshot.gpu_free_bytes[candidates]
        output = request.max_tokens if request.max_tokens is not None else self.default_output_tokens
        output *= request.output_copies
        need = self.margin * self.bytes_per_token * (request.prompt_tokens + output)
        fits = np.isnan(free) | (free >= need)
        return _keep(candidates, fits) if not math.isnan(need) else candidates


class TtftSloFilter(Predicting):
    """Drops endpoints predicted to miss the request's time-to-first-token objective (its class's
    ``ttft_slo_s``; see `TtftPredictor` for the prediction). Requests without an objective pass untouched. If
    every candidate would miss it, keeps them all: the scorers then choose the least bad."""

    name = "ttft-slo"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        slo = request.ttft_slo_s
        if slo is None:
            return candidates
        return _keep(candidates, self.predictor.seconds(request, state, candidates, reuse=True) <= slo)


def _peaks(snapshot: Snapshot) -> np.ndarray:
    """Per endpoint, its idle prefill rate (`ServerSpeeds.peak_tokens_per_s`); where that is not learned but another
    endpoint's is, its learned rate under load, which is at most its idle rate; NaN where nothing is known.

    A slow server on a mixed fleet is seldom found idle, so its idle rate may never be learned (in the simulator, 4
    L4s beside 12 faster servers got 50 of 2,000 Mooncake requests, and two of them had no idle rate by the run's
    end): judged unknown, it was never dropped. While no endpoint's idle rate is known (a picker just started),
    nothing is judged slower."""
    peak = snapshot.peak_tokens_per_s
    known = np.isfinite(peak)
    if known.all() or not known.any():
        return peak
    return np.where(known, peak, snapshot.prefill_tokens_per_s)


class TtftGapFilter(Predicting):
    """Drops endpoints predicted to keep the request waiting for its first token far longer than the best candidate
    would: more than ``factor`` times as long and at least ``seconds`` longer (`TtftPredictor`), on a slower server:
    one whose prefill rate when idle (`ServerSpeeds.peak_tokens_per_s`, or its learned rate where that is not known:
    `_peaks`) is under ``slower`` times the best candidate's. Applies to every request.

    The load scorers count requests, tokens and queued requests alike on every server. On a fleet of unequal
    servers (an L4 beside an H100) they can favour the slow server that holds fewer requests by more than the
    ``predicted-ttft`` scorer's weight, even where the prediction is several times worse there (in the simulator,
    seconds in an L4's queue where an H100 would have started at once); this filter keeps that pick from being
    made. Both bounds must be passed, so it leaves alone the sub-second differences that ordinary load makes."""

    name = "ttft-gap"

    def __init__(
        self,
        prefix_match: object | None = None,
        block_tokens: int = 64,
        guard: float = 2.0,
        factor: float = 2.0,
        seconds: float = 1.0,
        slower: float = 0.5,
        *,
        attention_tokens: float = ATTENTION_TOKENS,
        predictor: TtftPredictor | None = None,
    ) -> None:
        super().__init__(prefix_match, block_tokens, guard, attention_tokens=attention_tokens, predictor=predictor)
        self.factor = factor
        self.seconds = seconds
        self.slower = slower
        self._for: Snapshot | None = None
        self._peak = np.zeros(0)
        self._unequal = False  # whether that snapshot's pool has a server slower than another (by the idle rates)

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        snapshot = state.signals.snapshot
        if snapshot is not self._for:  # once per snapshot: a pool of equal servers is never filtered
            self._for = snapshot
            self._peak = _peaks(snapshot)
            known = self._peak[np.isfinite(self._peak)]
            self._unequal = known.size > 1 and known.min() < self.slower * known.max()
        if not self._unequal or len(candidates) < 2:
            return candidates
        predictor = self.predictor
        cost = predictor.seconds(request, state, candidates, reuse=True)
        best = cost.argmin()  # argmin/argmax: cheaper than min()/max() on a small pool
        least = float(cost[best])
        bound = max(self.factor * least, least + self.seconds)
        if cost[cost.argmax()] <= bound:
            return candidates
        # Only a slower server is dropped, by the rate it prefills at when idle (the learned rate of a busy server
        # says as much about its queue as about its hardware): among equal servers a gap is the backlog estimate's,
        # which the other scorers weigh better (in the simulator, dropping those made homogeneous fleets worse at
        # full load). Unknown peaks (NaN) compare false: nothing is dropped until some are learned.
        peak = self._peak[candidates]
        drop = (cost > bound) & (peak < self.slower * peak[best])
        return candidates[~drop] if drop.any() else candidates  # never empty: the best stays


class SpeedClassFilter(Predicting):
    """On a fleet of unequal servers (``speeds``: the pool's declared relative speeds, ``pool.speeds``), when the
    request is predicted to wait ``min_wait_s`` or more for its first token even where it would get it soonest
    (`TtftPredictor`), keeps the endpoints of that one kind of server (declared speed); the scorers then choose among
    those. Below that wait it keeps every candidate.

    The load scorers count requests and tokens alike on every kind of server, so on a mixed fleet they favour the
    slow servers, which hold fewer; which kind gets a request is a question in seconds, which only the prediction
    answers. It answers it well where the wait is long: the prefill backlog then makes most of it, and the estimate
    of that backlog is close to the truth (in the simulator's mixed fleet, 0.93-0.99 of the exact backlog on the
    Azure code trace, with spans). Where the wait is short the first token waits mostly on the servers' decode steps,
    which the prediction does not see (the estimate was half the exact backlog on the Azure conversation trace, and
    the predicted TTFT 2.5-4 times too low), and choosing the kind on it herds requests onto one kind; the load
    scorers then choose better. In the simulator (8 H100s, 4 A100s and 4 L4s; bench/results/quality/fleets, three
    seeds) acting only from 0.75 s took the runs over 1.15x the oracle's TTFT p99 from 11 of 36 to 5 with spans
    (where the filter had kept every candidate) and from 5 to 1 with the responses timed (where it had acted on
    every request). A fleet of one kind, or no declared speeds: every candidate stays."""

    name = "speed-class"

    def __init__(
        self,
        prefix_match: object | None = None,
        block_tokens: int = 64,
        guard: float = 2.0,
        min_wait_s: float = 0.75,
        *,
        attention_tokens: float = ATTENTION_TOKENS,
        predictor: TtftPredictor | None = None,
        speeds: np.ndarray | None = None,
    ) -> None:
        super().__init__(prefix_match, block_tokens, guard, attention_tokens=attention_tokens, predictor=predictor)
        self.min_wait_s = float(min_wait_s)
        self.speeds = speeds

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        speeds = self.speeds
        if speeds is None or len(candidates) < 2:
            return candidates
        if len(speeds) != len(state.inflight.requests):
            return candidates  # declared for another pool (a reload is building this one's)
        kinds = speeds[candidates]
        if kinds[kinds.argmin()] == kinds[kinds.argmax()]:
            return candidates
        cost = self.predictor.seconds(request, state, candidates, reuse=True)
        soonest = int(cost.argmin())
        if cost[soonest] < self.min_wait_s:
            return candidates
        return candidates[kinds == kinds[soonest]]
