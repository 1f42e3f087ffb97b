"""Tests for scorer/loadscorers.py: table-driven, on fleets with normal, missing, zero, equal and garbage signals.

Every scorer here is ``bounded``: it must return a float64 array shaped like its candidates, in [0, 1], without
NaN, and `NEUTRAL_SCORE` where it knows nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import NEUTRAL_SCORE, Engine, State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import DRAIN_SHARE, RECENT_HALF_LIFE_S, InFlight
from inferlb.scorer.loadscorers import (
    ATTENTION_TOKENS,
    DELAY_TO_WAITING,
    GpuFreeMemoryScorer,
    GpuUtilScorer,
    InFlightTokensScorer,
    KVCacheScorer,
    LatencyScorer,
    LoraAffinityScorer,
    PredictedTTFTScorer,
    QueueScorer,
    RecentPrefillScorer,
    RunningScorer,
    SeedFormulaScorer,
    TtftPredictor,
    fewer_is_better,
    min_max_low,
)
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.promtext import LoraInfo
from inferlb.scorer.signals import Signals

NAN = math.nan
INF = math.inf
N = NEUTRAL_SCORE
REQUEST = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=100)
ALL = [0, 1, 2, 3]
D = 20_000.0  # DEFAULT_PREFILL_TOKENS_PER_S
EXACT = LatencyScorer(tolerance=0)  # plain best / own


def state(n: int = 4, tokens: Sequence[int] = (), backlog: Sequence[float] = (), **values: Any) -> State:
    """A pool of ``n`` with these snapshot values, ``tokens[i]`` prompt tokens in flight to endpoint i and
    ``backlog[i]`` of them not yet prefilled there. Its clock stands still (at 0) until a test moves it."""
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(n)])
    signals = Signals(n)
    if values:
        signals.publish(signals.snapshot.with_values(**values))
    inflight = InFlight(n, clock=lambda: 0.0)
    for i, count in enumerate(tokens):
        if count:
            inflight.acquire(i, count)
    for i, count in enumerate(backlog):
        inflight.acquire(i, 0, (count, D)).release()  # a request gone, its prompt still to prefill
    return State(pool, inflight, signals)


def check_bounded(scores: np.ndarray, candidates: np.ndarray) -> None:
    """The ``bounded`` promise: a float64 ndarray aligned with the candidates, in [0, 1], no NaN."""
    assert type(scores) is np.ndarray and scores.dtype == np.float64
    assert scores.shape == candidates.shape
    assert ((scores >= 0) & (scores <= 1)).all(), scores


# ---------------------------------------------------------------- the two scalings


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([0, 1, 2, 3], [1, 2 / 3, 1 / 3, 0], id="spread"),
        pytest.param([5, 5, 5, 5], [1, 1, 1, 1], id="all-equal"),
        pytest.param([0, 0, 0, 0], [1, 1, 1, 1], id="zeros"),
        pytest.param([NAN, 0, 2, NAN], [N, 1, 0, N], id="missing"),
        pytest.param([NAN] * 4, [N] * 4, id="nothing-known"),
        pytest.param([7], [1], id="single"),
        pytest.param([-2, 2], [1, 0], id="negative"),
    ],
)
def test_min_max_low(values: list[float], expected: list[float]) -> None:
    assert min_max_low(np.array(values, dtype=float)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "unit", "expected"),
    [
        pytest.param([0, 1, 2, 0], 1, [1, 0.5, 1 / 3, 1], id="requests"),
        pytest.param([4096, 0, 8192, NAN], 4096, [0.5, 1, 1 / 3, N], id="tokens"),
        pytest.param([3, 3, 3], 1, [1, 1, 1], id="all-equal"),
        pytest.param([NAN] * 4, 1, [N] * 4, id="nothing-known"),
        pytest.param([9], 1, [1], id="single"),
    ],
)
def test_fewer_is_better(values: list[float], unit: float, expected: list[float]) -> None:
    assert fewer_is_better(np.array(values, dtype=float), unit) == pytest.approx(expected)


# ---------------------------------------------------------------- scorers that read one snapshot signal


@pytest.mark.parametrize(
    ("scorer", "values", "candidates", "expected"),
    [
        pytest.param(QueueScorer(), {"waiting": [0, 3, NAN, 1]}, ALL, [1, 0.25, N, 0.5], id="queue"),
        pytest.param(QueueScorer(), {"waiting": [4, 4, 4, 4]}, ALL, [1, 1, 1, 1], id="queue-all-equal"),
        pytest.param(QueueScorer(), {"waiting": [0, 3, 5, 1]}, [2], [1], id="queue-single"),
        pytest.param(RunningScorer(), {"running": [10, 0, 5, NAN]}, ALL, [0, 1, 0.5, N], id="running"),
        pytest.param(RunningScorer(), {"running": [10, 0, 5, 20]}, [0, 2], [0, 1], id="running-subset"),
        pytest.param(KVCacheScorer(), {"kv_usage": [0.0, 0.9, NAN, 7.0]}, ALL, [1, 0.1, N, 0], id="kv-garbage"),
        pytest.param(KVCacheScorer(), {"kv_usage": [-1, 1, 0.5, 0.5]}, ALL, [1, 0, 0.5, 0.5], id="kv-negative"),
        pytest.param(GpuUtilScorer(), {"gpu_util": [0.2, 1.0, NAN, -3]}, ALL, [0.8, 0, N, 1], id="gpu-util"),
        pytest.param(GpuUtilScorer(), {"gpu_util": [INF, 0, 0, 0]}, ALL, [0, 1, 1, 1], id="gpu-util-inf"),
        pytest.param(
            GpuFreeMemoryScorer(),
            {"gpu_free_bytes": [10, 0, NAN, 5], "gpu_total_bytes": [10, 10, 10, 0]},
            ALL,
            [1, 0, N, N],
            id="gpu-memory-zero-total",
        ),
        pytest.param(
            GpuFreeMemoryScorer(),
            {"gpu_free_bytes": [INF, -5, 20, 5], "gpu_total_bytes": [10, 10, 10, INF]},
            ALL,
            [N, 0, 1, 0],
            id="gpu-memory-garbage",
        ),
        pytest.param(EXACT, {"ttft_s": [0.1, 0.2, NAN, 0.0]}, ALL, [1, 0.5, N, N], id="latency"),
        pytest.param(EXACT, {"ttft_s": [INF, -1, 0.5, 1]}, ALL, [N, N, 1, 0.5], id="latency-garbage"),
        pytest.param(
            LatencyScorer("e2e_s", tolerance=0), {"e2e_s": [2, 4, 8, 1]}, [0, 1, 2], [1, 0.5, 0.25], id="e2e-subset"
        ),
        pytest.param(LatencyScorer(), {"ttft_s": [0.3] * 4}, ALL, [1] * 4, id="latency-all-equal"),
        pytest.param(LatencyScorer(), {}, ALL, [N] * 4, id="latency-no-spans-yet"),
        # The default tolerance, 0.2: within 20% of the best scores 1; beyond, 1.2 x best / own.
        pytest.param(LatencyScorer(), {"ttft_s": [0.1, 0.2, NAN, 0.5]}, ALL, [1, 0.6, N, 0.24], id="tolerance"),
        pytest.param(
            LatencyScorer(), {"ttft_s": [0.100, 0.105, 0.119, 0.121]}, ALL, [1, 1, 1, 1.2 / 1.21], id="noise-ties"
        ),
        pytest.param(LatencyScorer(tolerance=1), {"ttft_s": [1, 2, 4, 8]}, ALL, [1, 1, 0.5, 0.25], id="tolerance-1"),
    ],
)
def test_signal_scorers(
    scorer: Any, values: dict[str, list[float]], candidates: list[int], expected: list[float]
) -> None:
    given = np.array(candidates)
    got = scorer.score(REQUEST, state(**values), given)
    assert got == pytest.approx(expected)
    check_bounded(got, given)


def test_latency_tolerance_keeps_noise_from_deciding_max_score_picks() -> None:
    """Identical servers whose estimates differ by sampling noise tie, so the max-score picker spreads them at
    random instead of sending every tied pick to the one that happens to look fastest; a 5x slower one still loses."""
    s = state(ttft_s=[0.200, 0.203, 0.197, 1.0])
    exact = EXACT.score(REQUEST, s, np.arange(4))
    assert exact.argmax() == 2 and exact[:3].min() < 1  # without it, the one that looks fastest wins every tie
    scores = LatencyScorer().score(REQUEST, s, np.arange(4))
    assert scores[:3].tolist() == [1.0, 1.0, 1.0]
    assert scores[3] == pytest.approx(1.2 * 0.197 / 1.0)


# ---------------------------------------------------------------- in-flight tokens


@pytest.mark.parametrize(
    ("tokens", "unit", "candidates", "expected"),
    [
        pytest.param([0, 0, 0, 0], 4096, ALL, [1, 1, 1, 1], id="idle"),
        pytest.param([0, 8192, 2000, 0], 4096, ALL, [1, 1 / 3, 1 / (1 + 2000 / 4096), 1], id="spread"),
        pytest.param([4096] * 4, 4096, ALL, [1, 1, 1, 1], id="all-equal"),
        pytest.param([0, 1, 2, 3], 1, ALL, [1, 1 / 2, 1 / 3, 1 / 4], id="unit-1"),
        pytest.param([0, 8192, 2000, 0], 4096, [1, 2], [1 / (1 + 6192 / 4096), 1], id="least-among-candidates"),
        pytest.param([0, 8192, 2000, 0], 4096, [1], [1], id="single"),
        pytest.param([0, 10**12, 0, 0], 4096, ALL, [1, 0, 1, 1], id="huge"),
    ],
)
def test_in_flight_tokens_scorer(tokens: list[int], unit: float, candidates: list[int], expected: list[float]) -> None:
    given = np.array(candidates)
    got = InFlightTokensScorer(unit).score(REQUEST, state(tokens=tokens), given)
    assert got == pytest.approx(expected, abs=1e-6)
    check_bounded(got, given)


@pytest.mark.parametrize(
    ("sent", "speeds", "candidates", "expected"),
    [
        pytest.param([0, 0, 0, 0], None, ALL, [1, 1, 1, 1], id="idle"),
        pytest.param([0, 8192, 2000, 0], None, ALL, [1, 1 / 3, 1 / (1 + 2000 / 4096), 1], id="spread"),
        pytest.param([0, 8192, 2000, 0], None, [1, 2], [1 / (1 + 6192 / 4096), 1], id="least-among-candidates"),
        pytest.param([0, 10**12, 0, 0], None, ALL, [1, 0, 1, 1], id="huge"),
        # Two speeds: each is compared with its own kind; the fast ones were given more, and that is as it should be.
        pytest.param([8192, 12288, 0, 4096], [3, 3, 1, 1], ALL, [1, 0.5, 1, 0.5], id="within-each-speed"),
        pytest.param([8192, 12288, 0, 4096], [3, 3, 1, 1], [1, 3], [1, 1], id="one-of-each"),
        pytest.param(
            [0, 8192, 2000, 0], [1, 1], ALL, [1, 1 / 3, 1 / (1 + 2000 / 4096), 1], id="speeds-of-another-pool"
        ),
    ],
)
def test_recent_prefill_scorer(
    sent: list[int], speeds: list[float] | None, candidates: list[int], expected: list[float]
) -> None:
    given = np.array(candidates)
    declared = None if speeds is None else np.array(speeds, dtype=float)
    got = RecentPrefillScorer(4096, speeds=declared).score(REQUEST, state(tokens=sent), given)
    assert got == pytest.approx(expected, abs=1e-6)
    check_bounded(got, given)


def test_recent_prefill_scorer_forgets_a_burst_that_in_flight_tokens_still_count() -> None:
    now = [0.0]
    inflight = InFlight(2, clock=lambda: now[0])
    inflight.acquire(0, 8192)  # a long prompt, its request still running
    held = State(Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(2)]), inflight, Signals(2))
    scorer, tokens = RecentPrefillScorer(4096), InFlightTokensScorer(4096)
    everything = np.arange(2)
    assert scorer.score(REQUEST, held, everything) == pytest.approx([1 / 3, 1])
    now[0] = 10 * RECENT_HALF_LIFE_S
    assert scorer.score(REQUEST, held, everything) == pytest.approx([1, 1], abs=0.01)  # 8 tokens left
    assert tokens.score(REQUEST, held, everything) == pytest.approx([1 / 3, 1])


# ---------------------------------------------------------------- predicted TTFT
# These count a prompt's work as its tokens alone (attention_tokens=0) and a request's own wait alone
# (delay_to_waiting=0); the attention term and the delay to the requests waiting have tests of their own.


class Match:
    """A fake prefix index: per pool endpoint, how many of the request's leading blocks it holds."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = np.array(blocks)

    def match(self, hashes: Sequence[int]) -> np.ndarray:
        return self.blocks


PREFIXED = RequestFeatures(model="m", prompt_tokens=1000, prefix_hashes=tuple(range(15)))
NO_PROMPT = RequestFeatures(model="m")  # a headers-only route: the prompt is unknown


@pytest.mark.parametrize(
    ("request_", "backlog", "rates", "held", "candidates", "costs"),
    [
        pytest.param(REQUEST, [], None, None, ALL, [1000 / D] * 4, id="idle-default-rate"),
        pytest.param(REQUEST, [0, 8192, 2000, 0], None, None, ALL, [1000, 9192, 3000, 1000], id="backlog"),
        pytest.param(
            REQUEST, [], [NAN, 0, -5, 80_000], None, ALL, [1 / D, 1 / D, 1 / D, 1 / 80_000], id="learned-rate"
        ),
        pytest.param(REQUEST, [], [INF, 40_000, NAN, NAN], None, ALL, [1 / D, 1 / 40_000, 1 / D, 1 / D], id="inf-rate"),
        pytest.param(PREFIXED, [], None, [0, 10, 0, 0], ALL, [1000, 360, 1000, 1000], id="prefix-held"),
        pytest.param(PREFIXED, [], None, [0, 100, 0, 0], ALL, [1000, 1, 1000, 1000], id="prefix-longer-than-prompt"),
        pytest.param(REQUEST, [], None, [0, 10, 0, 0], ALL, [1] * 4, id="no-hashes-ignores-prefix"),
        pytest.param(PREFIXED, [0, 640, 0, 0], None, [0, 10, 0, 0], ALL, [1000, 1000, 1000, 1000], id="hit-vs-queue"),
        pytest.param(REQUEST, [0, 8192, 2000, 0], None, None, [1, 2], [9192, 3000], id="best-among-candidates"),
        pytest.param(REQUEST, [0, 8192, 2000, 0], None, None, [1], [1], id="single"),
        pytest.param(NO_PROMPT, [0, 8192, 2000, 0], None, None, ALL, [1, 8193, 2001, 1], id="no-prompt-known"),
    ],
)
def test_predicted_ttft_is_best_cost_over_own(
    request_: RequestFeatures,
    backlog: list[int],
    rates: list[float] | None,
    held: list[int] | None,
    candidates: list[int],
    costs: list[float],
) -> None:
    values = {"prefill_tokens_per_s": rates} if rates is not None else {}
    scorer = PredictedTTFTScorer(
        Match(held) if held is not None else None, block_tokens=64, attention_tokens=0, delay_to_waiting=0
    )
    given = np.array(candidates)
    got = scorer.score(request_, state(backlog=backlog, **values), given)
    expected = min(costs) / np.array(costs)
    assert got == pytest.approx(expected)
    check_bounded(got, given)


@pytest.mark.parametrize(
    ("candidates", "chosen"),
    [
        pytest.param([0, 1, 2, 3], 1, id="the-pool"),
        pytest.param([0, 2, 3], 2, id="a-subset-where-the-index-is-another-endpoint"),
        pytest.param([1, 3], 3, id="a-subset-past-its-length"),
        pytest.param([3, 0, 1], 1, id="reordered-by-a-plugins-filter"),
        pytest.param([3, 1, 2], 1, id="reordered-with-the-endpoint-at-its-own-index"),
    ],
)
def test_the_prefill_estimate_is_the_chosen_endpoints_whatever_the_candidates(
    candidates: list[int], chosen: int
) -> None:
    # Endpoint i holds 3 * i of the prompt's blocks: each has its own uncached part (1000 - 192 * i tokens).
    predictor = TtftPredictor(Match([0, 3, 6, 9]), block_tokens=64, attention_tokens=0)
    predictor.seconds(PREFIXED, state(), np.array(candidates))
    assert predictor.prefill(PREFIXED, chosen) == (1000 - 192 * chosen, D)


def test_a_picked_prompt_counts_until_it_is_prefilled_not_until_its_request_ends() -> None:
    now = [0.0]
    s = state()
    s.inflight.clock = lambda: now[0]
    scorer = PredictedTTFTScorer(Match([0, 10, 0, 0]), block_tokens=64, attention_tokens=0)
    first = RequestFeatures(model="m", prompt_tokens=10_000, prefix_hashes=tuple(range(15)))
    scorer.score(first, s, np.arange(4))
    prefill = scorer.prefill(first, 1)
    assert prefill == (9360, D)  # 640 of its tokens are predicted cached there: 9,360 to prefill
    s.inflight.acquire(1, 10_000, prefill)  # the request goes, and stays in flight throughout
    seconds = scorer.predictor.seconds(REQUEST, s, np.arange(4))
    assert seconds == pytest.approx(np.array([1000, 10_360, 1000, 1000]) / D)
    assert scorer.prefill(first, 2) is None  # one estimate per prediction
    now[0] = 0.25 / DRAIN_SHARE  # the time to prefill 5,000 tokens at DRAIN_SHARE of 20,000 tokens/s
    assert scorer.predictor.seconds(REQUEST, s, np.arange(4))[1] == pytest.approx((4360 + 1000) / D)
    now[0] = 10.0  # long prefilled, though the request is still in flight
    assert s.inflight.requests[1] == 1
    assert scorer.score(REQUEST, s, np.arange(4)) == pytest.approx([1, 1, 1, 1])


@pytest.mark.parametrize(
    ("requests", "guard", "costs"),
    [
        pytest.param([0, 0, 0, 0], 2.0, [1000, 360, 360, 1000], id="even-load-credits-both"),
        pytest.param([0, 3, 0, 0], 2.0, [1000, 1000, 360, 1000], id="a-hot-endpoint-gets-no-credit"),
        pytest.param([0, 2, 0, 0], 2.0, [1000, 360, 360, 1000], id="at-the-guard-still-credited"),
        pytest.param([0, 50, 0, 0], INF, [1000, 360, 360, 1000], id="guard-off"),
    ],
)
def test_the_imbalance_guard_stops_cache_credit_on_a_hot_endpoint(
    requests: list[int], guard: float, costs: list[float]
) -> None:
    # The guard: more than guard x (the other candidates' mean in-flight requests + 1): 3 > 2 x (0 + 1), 2 is not.
    # (Over all four candidates' mean, 3 would still be credited: 3 <= 2 x (0.75 + 1).)
    s = state()
    s.inflight.requests[:] = requests
    scorer = PredictedTTFTScorer(Match([0, 10, 10, 0]), block_tokens=64, guard=guard, attention_tokens=0)
    seconds = scorer.predictor.seconds(PREFIXED, s, np.arange(4))
    assert seconds == pytest.approx(np.array(costs) / D)


def test_a_backlog_drains_at_the_endpoints_learned_rate() -> None:
    now = [0.0]
    s = state(prefill_tokens_per_s=[D, 2 * D, D, D])
    s.inflight.clock = lambda: now[0]
    scorer = PredictedTTFTScorer(attention_tokens=0)
    for endpoint in (0, 1):
        request = RequestFeatures(model="m", prompt_tokens=20_000)
        scorer.score(request, s, np.arange(4))
        s.inflight.acquire(endpoint, 20_000, scorer.prefill(request, endpoint))
    now[0] = 0.5 / DRAIN_SHARE  # at DRAIN_SHARE of its rate, endpoint 0 has prefilled 10,000 tokens, 1 all 20,000
    seconds = scorer.predictor.seconds(REQUEST, s, np.arange(4))
    assert seconds == pytest.approx([(10_000 + 1000) / D, 1000 / (2 * D), 1000 / D, 1000 / D])


def test_a_pick_the_predictor_did_not_see_has_no_estimate() -> None:
    s = state()
    scorer = PredictedTTFTScorer(attention_tokens=0)
    scorer.score(REQUEST, s, np.arange(4))
    other = RequestFeatures(model="m", prompt_tokens=5000)
    assert scorer.prefill(other, 0) is None  # e.g. the request went on a route that did not score it
    assert scorer.prefill(REQUEST, 3) == (1000, D)


def test_a_long_prompt_counts_its_attention_over_the_context_before_each_token() -> None:
    # u tokens to prefill after c cached ones are u x (1 + (c + u / 2) / L) tokens' worth: at L tokens of prompt,
    # half as much again as its tokens; at 4 L, three times; the cached part adds its context to each new token.
    L = ATTENTION_TOKENS  # the default: Llama 3.1 8B's, rounded
    assert L == TtftPredictor().attention_tokens == 26_000
    long = RequestFeatures(model="m", prompt_tokens=int(4 * L), prefix_hashes=tuple(range(104)))  # 1,000-token blocks
    cached = 78  # endpoint 1 holds the first 3 L tokens: L are left, after a context of 3 L
    scorer = PredictedTTFTScorer(Match([0, cached, 0, 0]), block_tokens=1000, attention_tokens=L)
    seconds = scorer.predictor.seconds(long, state(), np.arange(4))
    assert seconds == pytest.approx(np.array([4 * L * 3, L * (1 + 3.5), 4 * L * 3, 4 * L * 3]) / D)
    assert scorer.prefill(long, 1) == pytest.approx((L * 4.5, D))  # the lease's backlog is that work too
    # A short prompt is nearly its tokens; 0 turns the term off.
    assert PredictedTTFTScorer(attention_tokens=L).predictor.seconds(REQUEST, state(), np.arange(1))[0] == (
        pytest.approx(1000 * (1 + 500 / L) / D)
    )
    linear = PredictedTTFTScorer(Match([0, cached, 0, 0]), block_tokens=1000, attention_tokens=0)
    assert linear.predictor.seconds(long, state(), np.arange(4)) == pytest.approx(np.array([4, 1, 4, 4]) * L / D)


def test_a_prompt_is_kept_from_a_server_where_another_waits_to_be_prefilled() -> None:
    # Endpoint 0 has 1,000 tokens of one request waiting; endpoint 1 is 1,000 tokens into a prefill step of 2,000
    # whose request is half done (the estimate drains with the tokens). A 4,000-token prompt waits about as long on
    # either by its own prediction, but on 0 the waiting request's first token would wait for both prompts.
    now = [0.0]
    s = state(2)
    s.inflight.clock = lambda: now[0]
    s.inflight.acquire(1, 0, (2000, D)).release()
    now[0] = 1000 / (D * DRAIN_SHARE)  # the time to prefill 1,000 tokens at DRAIN_SHARE of the rate
    s.inflight.acquire(0, 0, (1000, D)).release()
    long = RequestFeatures(model="m", prompt_tokens=4000)
    candidates = np.arange(2)
    alone = PredictedTTFTScorer(attention_tokens=0, delay_to_waiting=0)
    assert alone.predictor.seconds(long, s, candidates) == pytest.approx(np.array([5000, 5000]) / D)
    assert s.inflight.waiting_prefill(candidates, np.array([D, D])) == pytest.approx([1, 0.5])
    scorer = PredictedTTFTScorer(attention_tokens=0)
    assert scorer.delay_to_waiting == DELAY_TO_WAITING == 1
    added = np.array([1 * 4000, 0.5 * 4000]) / D  # its prefill time, times the requests waiting (at most one)
    cost = np.array([5000, 5000]) / D + added
    assert scorer.score(long, s, candidates) == pytest.approx(cost.min() / cost)
    assert scorer.score(long, s, candidates).argmax() == 1
    assert alone.score(long, s, candidates) == pytest.approx([1, 1])
    # However many wait, the delay counts once: it is what one waiting request would lose.
    for _ in range(3):
        s.inflight.acquire(0, 0, (10, D)).release()
    assert s.inflight.waiting_prefill(candidates[:1], np.array([D]))[0] == pytest.approx(4)
    scorer.predictor.seconds(long, s, candidates)
    assert scorer.predictor.added_delay(long, s, candidates) == pytest.approx(np.array([4000, 2000]) / D)
    assert scorer.predictor.added_delay(REQUEST, s, candidates) is None  # not the request predicted last
    assert scorer.predictor.added_delay(long, s, np.arange(2)) is None  # nor the candidates


def test_predicted_ttft_follows_a_new_snapshot() -> None:
    s = state(prefill_tokens_per_s=[D, D, D, D])
    scorer = PredictedTTFTScorer()
    assert scorer.score(REQUEST, s, np.arange(4)) == pytest.approx([1, 1, 1, 1])
    s.signals.publish(s.signals.snapshot.with_values(prefill_tokens_per_s=[D, 2 * D, D, D]))
    assert scorer.score(REQUEST, s, np.arange(4)) == pytest.approx([0.5, 1, 0.5, 0.5])


# ---------------------------------------------------------------- the seed formula

# (alpha (1 - util) + beta (1 - waiting / max_queue) + gamma (best e2e / own e2e)) / (alpha + beta + gamma),
# floored; each unknown term counts NEUTRAL_SCORE.
FLEET = {"gpu_util": [0.2, 0.5, NAN, 1.0], "waiting": [0, 16, NAN, 32], "e2e_s": [1, 2, NAN, 4]}


@pytest.mark.parametrize(
    ("params", "values", "candidates", "expected"),
    [
        pytest.param(
            {},
            FLEET,
            ALL,
            [(0.8 + 1 + 1) / 3, (0.5 + 0.5 + 0.5) / 3, (N + N + N) / 3, (0 + 0 + 0.25) / 3],
            id="defaults",
        ),
        pytest.param(
            {"alpha": 2, "beta": 1, "gamma": 0},
            FLEET,
            ALL,
            [(2 * 0.8 + 1) / 3, (2 * 0.5 + 0.5) / 3, (2 * N + N) / 3, 0.05],
            id="weights-and-floor",
        ),
        pytest.param({"alpha": 2, "beta": 1, "gamma": 0, "floor": 0}, FLEET, [3], [0], id="floor-zero"),
        pytest.param({"floor": 0.5}, FLEET, ALL, [(0.8 + 1 + 1) / 3, 0.5, 0.5, 0.5], id="high-floor"),
        pytest.param(
            {"max_queue": 8},
            {"gpu_util": [0] * 4, "waiting": [0, 4, 8, 100], "e2e_s": [1] * 4},
            ALL,
            [1, (1 + 0.5 + 1) / 3, 2 / 3, 2 / 3],
            id="max-queue",
        ),
        pytest.param(
            {},
            {"gpu_util": [0.5] * 4, "waiting": [8] * 4, "e2e_s": [2] * 4},
            ALL,
            [(0.5 + 0.75 + 1) / 3] * 4,
            id="all-equal",
        ),
        pytest.param({}, {}, ALL, [N] * 4, id="nothing-known"),
        pytest.param(
            {},
            {"gpu_util": [0] * 4, "waiting": [0] * 4, "e2e_s": [0] * 4},
            ALL,
            [(1 + 1 + N) / 3] * 4,
            id="zeros",
        ),
        pytest.param(
            {},
            {"gpu_util": [-3, 7, INF, NAN], "waiting": [-5, INF, 0, NAN], "e2e_s": [0, -1, INF, 2]},
            ALL,
            [(1 + 1 + N) / 3, (0 + 0 + N) / 3, (0 + 1 + N) / 3, (N + N + 1) / 3],
            id="garbage",
        ),
        pytest.param({}, FLEET, [1, 3], [(0.5 + 0.5 + 1) / 3, (0 + 0 + 0.5) / 3], id="best-latency-among-candidates"),
        pytest.param({}, FLEET, [3], [(0 + 0 + 1) / 3], id="single"),
    ],
)
def test_seed_formula(
    params: dict[str, float], values: dict[str, list[float]], candidates: list[int], expected: list[float]
) -> None:
    given = np.array(candidates)
    got = SeedFormulaScorer(**params).score(REQUEST, state(**values), given)
    assert got == pytest.approx(expected)
    check_bounded(got, given)


def test_seed_formula_refuses_all_zero_weights() -> None:
    # A constraint between parameters, so the constructor's; each parameter's own bounds are the registry's
    # (tests/scorer/test_config.py).
    with pytest.raises(ValueError, match=r"^alpha, beta and gamma must not all be 0"):
        SeedFormulaScorer(alpha=0, beta=0, gamma=0)


# ---------------------------------------------------------------- LoRA affinity

HAS_SQL = LoraInfo(running=("sql",), waiting=(), max_lora=2)
SLOT_FREE = LoraInfo(running=("chat",), waiting=(), max_lora=2)
FULL = LoraInfo(running=("chat", "math"), waiting=(), max_lora=2)


@pytest.mark.parametrize(
    ("lora", "model", "candidates", "expected"),
    [
        pytest.param([HAS_SQL, SLOT_FREE, FULL, None], "sql", ALL, [1, 0.5, 0, N], id="loaded-free-full-unreported"),
        pytest.param(
            [LoraInfo((), ("sql",), 1), SLOT_FREE, FULL, FULL], "sql", ALL, [1, 0.5, 0, 0], id="waiting-counts"
        ),
        pytest.param(
            [HAS_SQL, LoraInfo(("a", "b", "c"), (), None), None, None], "sql", ALL, [1, 0.5, N, N], id="no-max-lora"
        ),
        pytest.param([HAS_SQL, LoraInfo(("a",), ("b",), 2), FULL, FULL], "sql", ALL, [1, 0, 0, 0], id="slots-union"),
        pytest.param([HAS_SQL] * 4, "sql", ALL, [1, 1, 1, 1], id="all-equal"),
        pytest.param([HAS_SQL, SLOT_FREE, FULL, None], "base-model", ALL, [N] * 4, id="not-an-adapter"),
        pytest.param([HAS_SQL, SLOT_FREE, FULL, None], None, ALL, [N] * 4, id="no-model"),
        pytest.param([None] * 4, "sql", ALL, [N] * 4, id="nothing-reported"),
        pytest.param([HAS_SQL, SLOT_FREE, FULL, None], "sql", [1, 2], [N, N], id="loaded-only-off-candidates"),
        pytest.param([HAS_SQL, SLOT_FREE, FULL, None], "sql", [0], [1], id="single"),
    ],
)
def test_lora_affinity(
    lora: list[LoraInfo | None], model: str | None, candidates: list[int], expected: list[float]
) -> None:
    s = state()
    s.signals.publish(s.signals.snapshot.with_values(lora=lora))
    given = np.array(candidates)
    got = LoraAffinityScorer().score(RequestFeatures(model=model), s, given)
    assert got == pytest.approx(expected)
    check_bounded(got, given)


def test_lora_affinity_is_computed_once_per_scrape_and_model() -> None:
    s = state()
    s.signals.publish(s.signals.snapshot.with_values(lora=[HAS_SQL, SLOT_FREE, FULL, None]))
    scorer, sql, candidates = LoraAffinityScorer(), RequestFeatures(model="sql"), np.arange(4)
    first = scorer.score(sql, s, candidates)
    assert scorer.score(sql, s, candidates) is first
    s.signals.publish(s.signals.snapshot.with_values(lora=[None, HAS_SQL, FULL, None]))
    assert scorer.score(sql, s, candidates) == pytest.approx([N, 1, 0, N])


# ---------------------------------------------------------------- one prediction per decision


def _clocked_state(now: list[float]) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(4)])
    signals = Signals(4, clock=lambda: now[0])
    rates = [40_000.0, 40_000.0, 10_000.0, 10_000.0]  # unequal servers: the ttft-gap filter predicts
    signals.publish(signals.snapshot.with_values(prefill_tokens_per_s=rates, peak_tokens_per_s=rates))
    inflight = InFlight(4, clock=lambda: now[0])
    for i, tokens in enumerate((0, 4_000, 0, 2_000)):
        inflight.acquire(i, 0, (tokens, 40_000.0)).release()
    return State(pool, inflight, signals)


def test_a_prediction_is_reused_only_for_the_same_candidates() -> None:
    now = [0.0]
    st = _clocked_state(now)
    request = RequestFeatures(model="m", prompt_tokens=1000, prefix_hashes=(1, 2))
    shared = TtftPredictor(attention_tokens=0)
    candidates = np.arange(4)
    first = shared.seconds(request, st, candidates)
    assert shared.seconds(request, st, candidates, reuse=True) is first
    left = np.array([0, 2, 3])  # a filter dropped one: predicted anew (the imbalance guard weighs the candidates)
    alone = TtftPredictor(attention_tokens=0)
    np.testing.assert_array_equal(shared.seconds(request, st, left, reuse=True), alone.seconds(request, st, left))
    # What the engine asks after the pick is of the candidates the last plugin saw: all of the prompt, at
    # endpoint 2's rate.
    assert shared.prefill(request, 2) == alone.prefill(request, 2) == (1000.0, 10_000.0)


def test_a_prediction_is_not_reused_by_another_decision() -> None:
    now = [0.0]
    st = _clocked_state(now)
    request = RequestFeatures(model="m", prompt_tokens=1000)
    predictor = TtftPredictor()
    before = predictor.seconds(request, st, np.arange(4)).copy()
    st.inflight.acquire(0, 1000, (1000.0, 40_000.0))  # a decision was made since: endpoint 0 has more to prefill
    after = predictor.seconds(request, st, np.arange(4), reuse=True)
    assert after[0] > before[0]
    np.testing.assert_array_equal(after, TtftPredictor().seconds(request, st, np.arange(4)))
    now[0] = 0.5  # and later, with no decision in between: the backlog drained meanwhile
    later = predictor.seconds(request, st, np.arange(4), reuse=True)
    assert later[0] < after[0]
    other = RequestFeatures(model="m", prompt_tokens=5000)  # another request at the same instant
    assert predictor.seconds(other, st, np.arange(4), reuse=True)[0] > later[0]


def test_the_default_profile_predicts_once_per_decision_for_its_gap_filter_and_scorer() -> None:
    profile = build_profile("default", size=4)
    plugins = (*profile.filters, *(w.scorer for w in profile.scorers))
    predictors = {id(p.predictor) for p in plugins if hasattr(p, "predictor")}
    assert len(predictors) == 2  # ttft-gap and predicted-ttft share one; ttft-slo, for objectives only, has its own
    now = [0.0]
    st = _clocked_state(now)
    engine = Engine(st.pool, profile, st.inflight, st.signals)
    predictor = next(w.scorer for w in profile.scorers if w.scorer.name == "predicted-ttft").predictor
    calls = []
    # Four candidates: the backlog is read as lists (`FEW_AS_LIST`); both readings are watched.
    for reading in ("prefill_queue", "prefill_queue_few"):
        original = getattr(st.inflight, reading)
        spy = lambda c, r, original=original, **kw: calls.append(kw) or original(c, r, **kw)  # noqa: E731
        setattr(st.inflight, reading, spy)
    request = RequestFeatures(model="m", prompt_tokens=1000, request_id="r1")
    candidates, per_scorer, _ = engine.rank(request)
    assert calls == [{"waiting": True}]  # one reading of the backlog, with the requests waiting in it
    scores = dict(per_scorer)["predicted-ttft"]
    fresh = TtftPredictor()
    cost = fresh.seconds(request, st, candidates)
    added = fresh.added_delay(request, st, candidates)
    assert added is not None and added.any()  # the state has requests waiting to be prefilled
    cost = cost + DELAY_TO_WAITING * added
    np.testing.assert_allclose(scores, cost.min() / cost)
    assert predictor is not None
