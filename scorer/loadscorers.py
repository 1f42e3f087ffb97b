"""Scorers built on server signals (the scraped snapshot, the GPU view, spans) and the picker's own counts.

Every scorer returns, for the candidates it is given, a float array in [0, 1] (higher is better). A candidate
whose signal is unknown (NaN: never scraped, metric missing) scores `NEUTRAL_SCORE`, so missing data neither
attracts nor repels traffic; the staleness filter is what keeps traffic off endpoints with stale data.
"""

from __future__ import annotations

import numpy as np

from inferlb.scorer.engine import NEUTRAL_SCORE, State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import DRAIN_SHARE, FEW_AS_LIST
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.signals import Snapshot

__all__ = [
    "ATTENTION_TOKENS",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "GpuFreeMemoryScorer",
    "GpuUtilScorer",
    "InFlightTokensScorer",
    "KVCacheScorer",
    "LatencyScorer",
    "LoraAffinityScorer",
    "PredictedTTFTScorer",
    "Predicting",
    "QueueScorer",
    "RunningScorer",
    "SeedFormulaScorer",
    "fewer_is_better",
    "min_max_low",
]

# The prefill rate to predict with where none is known (tokens/s). An 8B model on one H100 prefills ~40k alone,
# less beside a decode batch; in the simulator the backlog estimate routed better at 20k than at 40k (the
# Azure conversation TTFT p99 at full load: 196 ms against 495) or 10k.
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
# How long after a prediction another plugin of the same decision may take it instead of predicting again: the
# filters and the scorer of one decision run within microseconds, a later decision finds the counters changed.
REUSE_S = 0.001
# A prompt token's prefill costs its share of the model's linear layers (the same for every token) plus its attention
# over the tokens before it (growing with its position). This is the context length at which the two are equal:
# 2 x non-embedding parameters / (4 x layers x attention heads x head dimension), a property of the model: Llama
# 3.1 8B 26,600, Llama 3.2 3B 16,400, Llama 3.1 70B 58,700. Prefilling u tokens after c cached ones is then the
# work of u x (1 + (c + u / 2) / ATTENTION_TOKENS) tokens at the short-prompt rate: a 100,000-token prompt takes
# nearly 3 times what 100,000 / rate says. In the simulator (bench/results/quality/fleets) counting it took the
# default's runs over 1.15x the oracle's TTFT p99 on the mixed fleet from 5 of 36 (three seeds) to 1: a prompt of
# 135,000 tokens held an H100 for 12 s where 5 were predicted, and the requests sent there after it waited.
ATTENTION_TOKENS = 26_000.0
# The weight of the delay a request's prefill would add to a request already waiting for its own on a candidate
# (`PredictedTTFTScorer`), against that request's own predicted wait: 1 prices both seconds alike.
DELAY_TO_WAITING = 1.0


def min_max_low(values: np.ndarray) -> np.ndarray:
    """Lower is better, scaled over the candidates: the lowest 1, the highest 0, all equal 1; NaN neutral."""
    known = ~np.isnan(values)
    if not known.any():
        return np.full(len(values), NEUTRAL_SCORE)
    low, high = np.nanmin(values), np.nanmax(values)
    scores = np.ones(len(values)) if high == low else (high - values) / (high - low)
    return np.where(known, scores, NEUTRAL_SCORE)


def fewer_is_better(values: np.ndarray, unit: float = 1.0) -> np.ndarray:
    """1 / (1 + (x - min) / unit): the least loaded 1, one ``unit`` more 0.5, two more 0.33; NaN neutral.

    A difference of one request matters a lot when queues are short and little when they are long.
    """
    known = ~np.isnan(values)
    if not known.any():
        return np.full(len(values), NEUTRAL_SCORE)
    scores = 1.0 / (1.0 + (values - np.nanmin(values)) / unit)
    return np.where(known, scores, NEUTRAL_SCORE)


class _SnapshotScorer:
    """A scorer that reads only the snapshot: its scores are computed once per (snapshot, candidates) and reused
    until the next scrape (the candidates array is usually the pool's precomputed one for the model). The
    returned array is read-only."""

    name = "snapshot"
    bounded = True

    def __init__(self) -> None:
        self._for: tuple[Snapshot, np.ndarray] | None = None
        self._scores = np.zeros(0)

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        snapshot = state.signals.snapshot
        cached = self._for
        if cached is not None and cached[0] is snapshot and cached[1] is candidates:
            return self._scores
        scores = np.asarray(self._compute(snapshot, candidates), dtype=np.float64)
        scores.setflags(write=False)
        self._for, self._scores = (snapshot, candidates), scores
        return scores

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class QueueScorer(_SnapshotScorer):
    """Fewer waiting requests (``vllm:num_requests_waiting``) scores higher; `fewer_is_better` per request."""

    name = "queue"

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        return fewer_is_better(snapshot.waiting[candidates])


class RunningScorer(_SnapshotScorer):
    """Fewer running requests (the decode batch) scores higher, scaled over the candidates (`min_max_low`)."""

    name = "running"

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        return min_max_low(snapshot.running[candidates])


class KVCacheScorer(_SnapshotScorer):
    """More free KV cache scores higher: 1 - ``kv_cache_usage_perc``; a full cache means preemptions soon."""

    name = "kv-cache"

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        usage = snapshot.kv_usage[candidates]
        return np.where(np.isnan(usage), NEUTRAL_SCORE, 1.0 - np.clip(usage, 0.0, 1.0))


class InFlightTokensScorer:
    """Fewer prompt tokens in flight (sent by this picker, not finished) scores higher; real time, no scrape lag.

    ``unit`` tokens of difference halve the score (default 4096: one long prompt)."""

    name = "in-flight-tokens"
    bounded = True

    def __init__(self, unit: float = 4096.0) -> None:
        self.unit = float(unit)

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        inflight = state.inflight  # tokens: integers, never unknown (`fewer_is_better` without the NaNs)
        unit = self.unit
        if len(candidates) <= FEW_AS_LIST:
            values = inflight.few(inflight.tokens, candidates)
            least = min(values)
            return np.array([1.0 / (1.0 + (v - least) / unit) for v in values])
        tokens = inflight.tokens[candidates]
        return 1.0 / (1.0 + (tokens - tokens[tokens.argmin()]) / unit)  # argmin: cheaper than min()


class RecentPrefillScorer:
    """Fewer prompt tokens sent to prefill lately scores higher: `InFlight.recent_prefill`, each prompt's uncached
    tokens fading with a half-life of `RECENT_HALF_LIFE_S`; ``unit`` tokens of difference halve the score.

    The prefill backlog forgets a prompt once it is estimated prefilled, and the in-flight counts weigh a request
    the same until it ends, however long ago it came; this says which servers were given the most work in the last
    seconds, which spreads a burst of long prompts before any of it shows in a scrape. Tokens measure work only
    between servers that do it at the same speed: with ``speeds`` (the pool's declared relative speeds,
    ``pool.speeds``; None where none differ) the candidates are compared within each speed, each one's least
    scoring 1, and which speed gets the request is left to ``predicted-ttft``, which counts in seconds.

    Not in the default preset: a server that turned slow, or slower hardware whose speed is not declared, is given
    fewer tokens, and this scorer then sends it more (bench/results/quality/fleets/README.md, "Recent prefill work").
    """

    name = "recent-prefill"
    bounded = True

    def __init__(self, unit: float = 4096.0, *, speeds: np.ndarray | None = None) -> None:
        self.unit = float(unit)
        self.speeds = speeds

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        recent = state.inflight.recent_prefill(candidates)
        speeds = self.speeds
        if speeds is None or len(speeds) != len(state.inflight.requests):
            least: float | np.ndarray = recent[recent.argmin()]
        else:
            kinds = speeds[candidates]
            least = np.empty(len(candidates))
            for speed in np.unique(kinds):
                same = kinds == speed
                least[same] = recent[same].min()
        return 1.0 / (1.0 + (recent - least) / self.unit)


class GpuUtilScorer(_SnapshotScorer):
    """Lower GPU utilisation scores higher: 1 - utilisation (from the GPU agent, DCGM or the emulator)."""

    name = "gpu-util"

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        util = snapshot.gpu_util[candidates]
        return np.where(np.isnan(util), NEUTRAL_SCORE, 1.0 - np.clip(util, 0.0, 1.0))


class GpuFreeMemoryScorer(_SnapshotScorer):
    """More free GPU memory scores higher: free / total."""

    name = "gpu-free-memory"

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            share = snapshot.gpu_free_bytes[candidates] / snapshot.gpu_total_bytes[candidates]
        return np.where(np.isfinite(share), np.clip(share, 0.0, 1.0), NEUTRAL_SCORE)


class LatencyScorer(_SnapshotScorer):
    """Lower recent latency (from server spans) scores higher: ``(1 + tolerance) * best / own``, at most 1, so
    every candidate within ``tolerance`` of the best scores 1 and a slower one less (5x the best: 0.24 with the
    default 0.2). Neutral until spans arrive; a candidate whose latency is unknown or not positive is neutral.

    ``signal`` is "ttft_s" or "e2e_s". ``tolerance`` (>= 0; 0: plain best / own) is there because the picker is
    max-score: without it the candidate with the lowest estimate by any margin wins every pick the load scorers
    tie on, so sampling noise herds traffic onto one endpoint, and an endpoint whose estimate is a hair above the
    others' (a decayed but never forgotten slow spell) gets almost none. Differences this small are within the
    noise of a time-decayed mean at a few requests per second; a server that is really slow still scores low.
    """

    name = "latency"

    def __init__(self, signal: str = "ttft_s", tolerance: float = 0.2) -> None:
        super().__init__()
        self.signal = signal
        self.tolerance = float(tolerance)

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        latency = getattr(snapshot, self.signal)[candidates]
        known = np.isfinite(latency) & (latency > 0)
        if not known.any():
            return np.full(len(candidates), NEUTRAL_SCORE)
        bar = latency[known].min() * (1.0 + self.tolerance)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(known, np.minimum(bar / latency, 1.0), NEUTRAL_SCORE)


class TtftPredictor:
    """Predicts, per candidate, how long the request would wait for its first token there, in seconds.

    Predicted work = the endpoint's prefill backlog (the work of the prompts this picker sent there that it has not
    had time to prefill, `InFlight.pending_prefill`; no scrape lag) + the work of this request's prompt tokens not
    expected to hit that endpoint's prefix cache, over the endpoint's prefill rate (the snapshot's
    ``prefill_tokens_per_s``, which `scorer.speeds.ServerSpeeds` learns; `DEFAULT_PREFILL_TOKENS_PER_S` where it is
    not known), plus the endpoint's decode step time where one is learned (``decode_step_s``: the step that makes
    the first token). The work of ``u`` tokens to prefill after ``c`` cached ones is ``u x (1 + (c + u / 2) /
    attention_tokens)`` tokens' worth (`ATTENTION_TOKENS`: their attention over the context before them; 0 counts
    the tokens alone), and the rates are learned in the same units. ``prefix_match`` (optional) gives, per endpoint
    of the pool, how many of the request's prefix blocks it likely holds, and ``block_tokens`` how many tokens a
    block is. The prefix-affinity scorer's imbalance guard applies here too: an endpoint with more than ``guard x
    (mean in-flight requests over the other candidates + 1)`` requests in flight (`scorer.inflight.overloaded`) gets
    no credit for its cache, or one popular prefix would pile every request onto it (a cached prompt is cheap to
    prefill, but the requests still have to be decoded somewhere).

    ``prefill`` tells the engine the work of the request's uncached tokens on the chosen endpoint, which the
    request's lease adds to that endpoint's backlog. Keeps a per-snapshot cache: one event loop.

    One predictor may serve several plugins of a profile (the ``ttft-gap`` filter and the ``predicted-ttft``
    scorer, `BuildContext.ttft_predictor`): a call with ``reuse`` then takes the prediction the
    previous call made for the same request and candidates in the same decision (same snapshot, no request counted
    since, within `REUSE_S`) instead of computing it again.
    """

    def __init__(
        self,
        prefix_match: object | None = None,
        block_tokens: int = 64,
        guard: float = 2.0,
        attention_tokens: float = ATTENTION_TOKENS,
    ) -> None:
        self.prefix_match = prefix_match
        self.attention_tokens = float(attention_tokens)
        self._per_attention = 1.0 / self.attention_tokens if self.attention_tokens > 0 else 0.0
        self._match = getattr(prefix_match, "match", None)
        # A PrefixIndex also says how deep the best match goes: 0 spares the work for a prompt nobody holds.
        self._match_depth = getattr(prefix_match, "match_depth", None)
        self.block_tokens = block_tokens
        self.guard = guard
        self._for: Snapshot | None = None
        self._tokens_per_s = np.zeros(0)
        self._step_s: np.ndarray | None = None  # decode seconds per step, where learned (None: nowhere)
        self._steps: np.ndarray | None = None  # those of the last candidates seen
        # The rates of the last candidates seen, and those candidates (reset with the snapshot).
        self._rates = np.zeros(0)
        self._drain = np.zeros(0)  # DRAIN_SHARE of those rates: what the backlog drains at
        self._rates_for: np.ndarray | None = None
        # Those rates, drain rates and steps as lists, for candidates few enough to compute on lists (`FEW_AS_LIST`).
        self._rates_few: list[float] = []
        self._drain_few: list[float] = []
        self._steps_few: list[float] | None = None
        # Whether a plugin sharing this predictor asks for `added_delay`: each prediction then counts the requests
        # waiting with the backlog it reads (`InFlight.prefill_queue`), kept for the next call, in _waiting.
        self.counts_waiting = False
        self._waiting: np.ndarray | list[float] | None = None
        # The last prediction, for prefill: the request, its state, candidates and the work of its uncached tokens per
        # candidate (one number where it is the same everywhere; a list where the candidates are few).
        self._last: tuple[RequestFeatures, State, np.ndarray, float | np.ndarray | list[float]] | None = None
        # The last prediction, for reuse (its request and candidates are in _last): snapshot, counters' version,
        # time and seconds.
        self._recent: tuple[Snapshot, int, float, np.ndarray | list[float]] | None = None

    def seconds(
        self, request: RequestFeatures, state: State, candidates: np.ndarray, *, reuse: bool = False
    ) -> np.ndarray:
        """Per candidate, the predicted seconds to the request's first token (a new array, or with ``reuse`` one the
        caller must not change)."""
        seconds = self._seconds(request, state, candidates, reuse=reuse)
        if not isinstance(seconds, list):
            return seconds
        array = np.array(seconds)
        recent = self._recent
        if recent is not None and recent[3] is seconds:  # reused as this array from now on
            self._recent = (recent[0], recent[1], recent[2], array)
        return array

    def _seconds(
        self, request: RequestFeatures, state: State, candidates: np.ndarray, *, reuse: bool = False
    ) -> np.ndarray | list[float]:
        """`seconds`, as a list where the candidates are few (`FEW_AS_LIST`): not to be changed by the caller."""
        snapshot = state.signals.snapshot
        if reuse and (reused := self._reused(request, state, candidates)) is not None:
            return reused
        if snapshot is not self._for:  # the rates change with the snapshot only
            rate, step = snapshot.prefill_tokens_per_s, snapshot.decode_step_s
            with np.errstate(invalid="ignore"):
                known = np.isfinite(rate) & (rate > 0)
                step_known = np.isfinite(step) & (step > 0)
            self._tokens_per_s = np.where(known, rate, DEFAULT_PREFILL_TOKENS_PER_S)
            self._step_s = np.where(step_known, step, 0.0) if step_known.any() else None
            self._for = snapshot
            self._rates_for = None
        # At least one token: a request whose prompt is unknown (a headers-only route) still ranks endpoints by
        # the work queued there, instead of scoring every one 0 when some endpoint is idle.
        tokens = request.prompt_tokens
        prompt = float(tokens if tokens > 1 else 1)  # max() without its call
        # The work of the request's tokens to prefill: one number, or per candidate where they differ (a list where
        # the candidates are few, `FEW_AS_LIST`).
        own: float | np.ndarray | list[float] = prompt
        hashes = request.prefix_hashes
        cached = None
        kv = state.signals.kv
        if kv is not None and request.cache_keys and kv.live.any():
            cached = self._cached_exact(request, candidates, kv)
        elif hashes:
            cached = self._guessed(hashes, candidates)
        few = len(candidates) <= FEW_AS_LIST
        # At least one token stays to prefill: the cached part is at most prompt_tokens - 1, and the prompt at least
        # prompt_tokens, so the difference is at least 1 (no floor needed).
        top = request.prompt_tokens - 1
        if cached is not None and few:  # on lists (`FEW_AS_LIST`): the same numbers
            held = cached.tolist()
            if any(held):
                over = state.inflight.overloaded(candidates, self.guard)
                if over is not None:
                    over_few = over.tolist()
                    held = [0 if over_few[i] else held[i] for i in range(len(held))]
                own = [prompt - (c if c < top else top) for c in held]
        elif cached is not None and np.count_nonzero(cached):  # count_nonzero: any() without its wrapper
            over = state.inflight.overloaded(candidates, self.guard)
            if over is not None:
                cached[over] = 0
            own = prompt - np.minimum(cached, top)
        if per := self._per_attention:  # own x (1 + (cached + own / 2) / L), cached = prompt - own
            whole, half = 1.0 + prompt * per, 0.5 * per
            own = [x * (whole - x * half) for x in own] if isinstance(own, list) else own * (whole - own * half)
        self._last = (request, state, candidates, own)
        if candidates is not self._rates_for:  # the candidates array is usually the pool's, the same every time
            self._rates = self._tokens_per_s[candidates]
            self._drain = self._rates * DRAIN_SHARE
            self._steps = None if self._step_s is None else self._step_s[candidates]
            self._rates_for = candidates
            self._rates_few, self._drain_few = self._rates.tolist(), self._drain.tolist()
            self._steps_few = None if self._steps is None else self._steps.tolist()
        inflight = state.inflight
        seconds: np.ndarray | list[float]
        if few:
            pending, self._waiting = inflight.prefill_queue_few(
                candidates, self._drain_few, waiting=self.counts_waiting
            )
            # Indices, not zip(..., strict=True): see `InFlight.prefill_queue_few`. The first token also waits for
            # the step that makes it, where one is learned: added after the division, as on arrays.
            rates, steps, span = self._rates_few, self._steps_few, range(len(pending))
            if isinstance(own, list):
                if steps is None:
                    seconds = [(pending[i] + own[i]) / rates[i] for i in span]
                else:
                    seconds = [(pending[i] + own[i]) / rates[i] + steps[i] for i in span]
            elif steps is None:
                seconds = [(pending[i] + own) / rates[i] for i in span]
            else:
                seconds = [(pending[i] + own) / rates[i] + steps[i] for i in span]
        else:
            pending_array, self._waiting = inflight.prefill_queue(candidates, self._drain, waiting=self.counts_waiting)
            seconds = (pending_array + own) / self._rates
            if self._steps is not None:
                seconds += self._steps
        self._recent = (snapshot, inflight.decisions, inflight.clock(), seconds)
        return seconds

    def added_delay(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray | None:
        """For the request `seconds` last predicted with these ``candidates``: per candidate, the seconds its prefill
        there would add to the first token of a request already waiting there for its own prefill (its prefill time
        there, times the requests estimated to wait, `InFlight.waiting_prefill`, counted at most once); None if
        `seconds` last predicted another request or other candidates. A server computes the prompts that wait
        together in one step (as many as its token budget holds): a prompt sent where a short one waits makes that
        one wait for both."""
        added = self._added_delay(request, state, candidates)
        return np.array(added) if isinstance(added, list) else added

    def _added_delay(
        self, request: RequestFeatures, state: State, candidates: np.ndarray
    ) -> np.ndarray | list[float] | None:
        """`added_delay`, as a list where the prediction was computed on lists (`FEW_AS_LIST`)."""
        last = self._last
        if last is None or last[0] is not request or last[2] is not candidates:
            return None
        waiting = self._waiting
        if isinstance(waiting, list):
            own = last[3]
            assert not isinstance(own, np.ndarray), "a prediction on lists keeps its work as a list or a number"
            few, span = self._rates_few, range(len(waiting))
            if isinstance(own, list):
                return [(1.0 if waiting[i] > 1.0 else waiting[i]) * own[i] / few[i] for i in span]
            return [(1.0 if waiting[i] > 1.0 else waiting[i]) * own / few[i] for i in span]
        rates = self._rates
        if waiting is None:  # no plugin said it would ask (`counts_waiting`)
            waiting = state.inflight.waiting_prefill(candidates, rates)
        return np.minimum(waiting, 1.0) * last[3] / rates

    def _reused(
        self, request: RequestFeatures, state: State, candidates: np.ndarray
    ) -> np.ndarray | list[float] | None:
        """The last prediction if it is of this request and candidates in this decision, its prefill estimate not yet
        taken; else None (a subset of the candidates is predicted anew: the imbalance guard weighs their mean load)."""
        last, recent = self._last, self._recent
        if (
            last is not None
            and recent is not None
            and last[0] is request
            and last[2] is candidates
            and recent[0] is state.signals.snapshot
            and recent[1] == state.inflight.decisions
            and 0.0 <= state.inflight.clock() - recent[2] <= REUSE_S
        ):
            return recent[3]
        return None

    def _guessed(self, hashes: tuple[int, ...], candidates: np.ndarray) -> np.ndarray | None:
        """Tokens of the prompt each candidate likely holds by ``prefix_match`` (a new array), None without a
        match."""
        if self._match_depth is not None:
            counts, deepest = self._match_depth(hashes)
            return counts[candidates] * self.block_tokens if deepest else None
        if self._match is not None:
            return self._match(hashes)[candidates] * self.block_tokens
        return None

    def _cached_exact(self, request: RequestFeatures, candidates: np.ndarray, kv: KVBlockIndex) -> np.ndarray:
        """Tokens of the request each candidate holds: what its server reports where it does (`KVBlockIndex.live`),
        the approximate match elsewhere."""
        exact, _ = kv.match_depth(request.cache_keys)
        cached = exact[candidates] * kv.block_size
        live = kv.live[candidates]
        if live.all():
            return cached
        hashes = request.prefix_hashes
        guess = self._guessed(hashes, candidates) if hashes else None
        return np.where(live, cached, 0 if guess is None else guess)

    def prefill(self, request: RequestFeatures, endpoint: int) -> tuple[float, float] | None:
        """For the decision just made: (``request``'s tokens still to prefill at ``endpoint``, that endpoint's
        prefill rate), what its lease adds to the prefill backlog; None when this predictor did not see the
        request (a filter that only predicts for classes with an objective)."""
        last = self._last
        if last is None or last[0] is not request:
            return None
        _, _, candidates, own = last
        self._last = None
        if not isinstance(own, float):
            # Candidates are ascending and distinct (filters keep the pool's order), so where every endpoint is a
            # candidate (the pool's own array, the usual case) the endpoint is its own position; else a binary
            # search, checked, finds it.
            position = endpoint
            if position >= len(candidates) or candidates[position] != endpoint:
                position = int(candidates.searchsorted(endpoint))
            if position >= len(candidates) or candidates[position] != endpoint:
                found = np.flatnonzero(candidates == endpoint)  # a filter of a plugin's own may reorder them
                if not len(found):
                    return None
                position = int(found[0])
            own = float(own[position])
        return own, self._tokens_per_s.item(endpoint)


class Predicting:
    """A plugin that predicts with a `TtftPredictor`: its own (from ``prefix_match``, ``block_tokens``, ``guard`` and
    ``attention_tokens``),
    or ``predictor``, the one its profile shares; and that passes the prediction's prefill estimate on (a
    `PrefillEstimator`)."""

    def __init__(
        self,
        prefix_match: object | None = None,
        block_tokens: int = 64,
        guard: float = 2.0,
        *,
        attention_tokens: float = ATTENTION_TOKENS,
        predictor: TtftPredictor | None = None,
    ) -> None:
        self.predictor = predictor or TtftPredictor(prefix_match, block_tokens, guard, attention_tokens)

    @property
    def block_tokens(self) -> int:
        return self.predictor.block_tokens

    def prefill(self, request: RequestFeatures, endpoint: int) -> tuple[float, float] | None:
        return self.predictor.prefill(request, endpoint)

    def estimate_prefill(self, request: RequestFeatures, state: State, endpoint: int) -> tuple[float, float] | None:
        """The prefill estimate of ``request`` on ``endpoint`` for a request this plugin did not help decide."""
        self.predictor.seconds(request, state, np.array([endpoint]))
        return self.predictor.prefill(request, endpoint)


class PredictedTTFTScorer(Predicting):
    """The time this request would wait for its first token on each candidate (`TtftPredictor`), plus
    ``delay_to_waiting`` times what its prefill there would add to the wait of a request already waiting for its own
    (`TtftPredictor.added_delay`): best / own.

    The second part is there because a server prefills the prompts that wait together in one step: where a short
    prompt waits, a long one sent after it makes it wait as long as both take, though the long one's own prediction
    is no worse there than elsewhere. In the simulator (16 H100s, Azure conversation trace, seed 0) the slowest 1% of
    requests were mostly such pairs, a 0.5-1k-token prompt and a 4-6k one sent within milliseconds to the same server
    (TTFT 160-210 ms where either alone took 40-150). Counted once however many wait: weighing each (the sum of their
    delays) did worse on the Azure code trace (bench/results/quality/fleets/README.md). 0 turns it off."""

    name = "predicted-ttft"
    bounded = True

    def __init__(
        self,
        prefix_match: object | None = None,
        block_tokens: int = 64,
        guard: float = 2.0,
        *,
        attention_tokens: float = ATTENTION_TOKENS,
        delay_to_waiting: float = DELAY_TO_WAITING,
        predictor: TtftPredictor | None = None,
    ) -> None:
        super().__init__(prefix_match, block_tokens, guard, attention_tokens=attention_tokens, predictor=predictor)
        self.delay_to_waiting = float(delay_to_waiting)
        if self.delay_to_waiting:
            self.predictor.counts_waiting = True

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        predictor = self.predictor
        cost = predictor._seconds(request, state, candidates, reuse=True)
        delay = self.delay_to_waiting
        added = predictor._added_delay(request, state, candidates) if delay else None
        if isinstance(cost, list) or len(cost) <= FEW_AS_LIST:
            # On lists (`FEW_AS_LIST`): the same numbers; indices, not zip (`InFlight.prefill_queue_few`).
            costs = cost if isinstance(cost, list) else cost.tolist()
            if added is not None:
                more = added if isinstance(added, list) else added.tolist()
                span = range(len(costs))
                if delay == 1.0:
                    costs = [costs[i] + more[i] for i in span]
                else:
                    costs = [costs[i] + delay * more[i] for i in span]
            least = min(costs)
            # The floor keeps a zero cost from dividing by zero; above it, it changes nothing and is skipped.
            return np.array([least / c for c in costs] if least >= 1e-12 else [least / max(c, 1e-12) for c in costs])
        if added is not None:
            # A new array: a reused prediction is not the scorer's. At weight 1 (the default) without the product.
            cost = cost + (added if delay == 1.0 else delay * np.asarray(added))
        least = cost[cost.argmin()]  # argmin: cheaper than min()
        return least / (cost if least >= 1e-12 else np.maximum(cost, 1e-12))


class LoraAffinityScorer:
    """Prefers endpoints that already have the request's LoRA adapter loaded (``vllm:lora_requests_info``):
    1 where a running or waiting request uses it, 0.5 where an adapter slot is free, 0 where all ``max_lora``
    slots hold other adapters. When no endpoint reports the model as an adapter (a base-model request, or no
    LoRA anywhere) every candidate is neutral. Computed once per (scrape, model, candidates)."""

    name = "lora-affinity"
    bounded = True

    def __init__(self) -> None:
        self._for: Snapshot | None = None
        self._cache: dict[str | None, tuple[np.ndarray, np.ndarray]] = {}

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        snapshot = state.signals.snapshot
        if snapshot is not self._for:
            self._for, self._cache = snapshot, {}
        cached = self._cache.get(request.model)
        if cached is not None and cached[0] is candidates:
            return cached[1]
        model = request.model
        infos = [snapshot.lora[i] if i < len(snapshot.lora) else None for i in candidates.tolist()]
        loaded = [info is not None and (model in info.running or model in info.waiting) for info in infos]
        if not any(loaded):
            scores = np.full(len(candidates), NEUTRAL_SCORE)
        else:
            values = []
            for info, here in zip(infos, loaded, strict=True):
                if here:
                    values.append(1.0)
                elif info is None:
                    values.append(NEUTRAL_SCORE)
                else:
                    in_use = len(set(info.running) | set(info.waiting))
                    values.append(0.5 if info.max_lora is None or in_use < info.max_lora else 0.0)
            scores = np.array(values)
        scores.setflags(write=False)
        self._cache[model] = (candidates, scores)
        return scores


class SeedFormulaScorer(_SnapshotScorer):
    """The seed formula: alpha (1 - GPU util) + beta (1 - queue / max queue) + gamma (best latency / own latency),
    over alpha + beta + gamma, floored at ``floor``. Unknown parts count neutral. ``max_queue`` bounds the queue
    term; the latency term is the inverse of average latency, scaled so the fastest candidate gets 1."""

    name = "seed-formula"

    def __init__(
        self, alpha: float = 1.0, beta: float = 1.0, gamma: float = 1.0, max_queue: float = 32.0, floor: float = 0.05
    ) -> None:
        super().__init__()
        if not alpha + beta + gamma > 0:  # each is >= 0 (the registry's parameter model)
            raise ValueError("alpha, beta and gamma must not all be 0 (they weigh the three terms)")
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.max_queue, self.floor = max_queue, floor
        self._latency = LatencyScorer("e2e_s", tolerance=0.0)  # the formula as written: best / own

    def _compute(self, snapshot: Snapshot, candidates: np.ndarray) -> np.ndarray:
        util = snapshot.gpu_util[candidates]
        gpu = np.where(np.isnan(util), NEUTRAL_SCORE, 1.0 - np.clip(util, 0.0, 1.0))
        waiting = snapshot.waiting[candidates]
        queue = np.where(np.isnan(waiting), NEUTRAL_SCORE, 1.0 - np.clip(waiting / self.max_queue, 0.0, 1.0))
        latency = self._latency._compute(snapshot, candidates)
        total = (self.alpha * gpu + self.beta * queue + self.gamma * latency) / (self.alpha + self.beta + self.gamma)
        return np.maximum(total, self.floor)
