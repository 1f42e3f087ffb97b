"""Tests for scorer/prefix.py: the per-endpoint prefix index and the prefix-affinity scorer."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import NEUTRAL_SCORE, Engine, Profile, Scorer, State, WeightedScorer
from inferlb.scorer.features import RequestFeatures, text_block_hashes
from inferlb.scorer.inflight import InFlight, Lease
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.loadscorers import PredictedTTFTScorer
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker
from inferlb.scorer.pool import Pool
from inferlb.scorer.prefix import PrefixAffinityScorer, PrefixIndex, overloaded
from inferlb.scorer.signals import Signals
from inferlb.scorer.tokenizer import cache_keys

# Stand-ins for chained block hashes: any distinct ints will do for the index.
A, B, C, D, E, X, Y = 11, 12, 13, 14, 15, 98, 99


def _index(records: Sequence[tuple[int, Sequence[int]]], size: int = 4, capacity: int = 64) -> PrefixIndex:
    index = PrefixIndex(size, capacity)
    for endpoint, hashes in records:
        index.record(endpoint, hashes)
    return index


# ---------------------------------------------------------------- the index


@pytest.mark.parametrize(
    ("records", "query", "expected"),
    [
        pytest.param([], [A, B], [0, 0, 0, 0], id="empty-index"),
        pytest.param([(0, [A, B, C])], [], [0, 0, 0, 0], id="empty-query"),
        pytest.param([(0, [A, B, C])], [A, B, C], [3, 0, 0, 0], id="full-match"),
        pytest.param([(0, [A, B, C])], [A, B, C, D, E], [3, 0, 0, 0], id="query-longer"),
        pytest.param([(0, [A, B, C])], [A], [1, 0, 0, 0], id="query-shorter"),
        pytest.param([(0, [A, B, C])], [A, B, X], [2, 0, 0, 0], id="diverges"),
        pytest.param([(0, [A, B, C])], [X, B, C], [0, 0, 0, 0], id="first-block-missing"),
        pytest.param([(0, [B, C])], [A, B, C], [0, 0, 0, 0], id="only-leading-runs-count"),
        pytest.param([(0, [A, C])], [A, B, C], [1, 0, 0, 0], id="gap-stops-the-run"),
        pytest.param(
            [(0, [A, B, C, D]), (1, [A, B]), (2, [A, X]), (3, [Y])],
            [A, B, C, D],
            [4, 2, 1, 0],
            id="per-endpoint-depths",
        ),
        pytest.param([(2, [A, B]), (2, [A, B, C])], [A, B, C], [0, 0, 3, 0], id="re-record-extends"),
    ],
)
def test_match_counts_leading_blocks(
    records: list[tuple[int, list[int]]], query: list[int], expected: list[int]
) -> None:
    counts = _index(records).match(query)
    assert counts.dtype == np.int64
    assert counts.tolist() == expected


@pytest.mark.parametrize(
    "size",
    [pytest.param(9, id="few-endpoints"), pytest.param(70, id="many-endpoints-drop-at-once")],
)
def test_match_agrees_with_a_brute_force_reference(size: int) -> None:
    rng = np.random.default_rng(size)
    capacity = 40
    index = PrefixIndex(size, capacity)
    held: list[list[int]] = [[] for _ in range(size)]  # LRU order, oldest first
    for _ in range(20 * size):
        endpoint = int(rng.integers(size))
        # Prompts from a small alphabet of chains so that they share heads and partly overlap.
        hashes = [int(rng.integers(3)) * 1000 + i for i in range(int(rng.integers(1, 12)))]
        index.record(endpoint, hashes)
        lru = held[endpoint]
        for block in reversed(hashes[:capacity]):
            if block in lru:
                lru.remove(block)
            lru.append(block)
        del lru[: max(0, len(lru) - capacity)]
        query = [int(rng.integers(3)) * 1000 + i for i in range(int(rng.integers(0, 14)))]
        expected = []
        for blocks in held:
            run = 0
            while run < len(query) and query[run] in blocks:
                run += 1
            expected.append(run)
        assert index.match(query).tolist() == expected
        assert [index.held(e) for e in range(size)] == [len(blocks) for blocks in held]
    assert len(index) == len({block for blocks in held for block in blocks})


@pytest.mark.parametrize(
    ("capacity", "records", "still_held", "forgotten"),
    [
        pytest.param(3, [(0, [A, B, C]), (0, [D, E])], [D, E, A], [B, C], id="oldest-go-first-tail-before-head"),
        pytest.param(3, [(0, [A, B, C]), (0, [A]), (0, [D, E])], [A, D, E], [B, C], id="re-sending-refreshes"),
        pytest.param(2, [(0, [A, B, C, D])], [A, B], [C, D], id="longer-than-capacity-keeps-the-head"),
        pytest.param(1, [(0, [A]), (0, [B]), (0, [C])], [C], [A, B], id="capacity-one"),
    ],
)
def test_lru_eviction(
    capacity: int, records: list[tuple[int, list[int]]], still_held: list[int], forgotten: list[int]
) -> None:
    index = _index(records, size=2, capacity=capacity)
    assert index.held(0) == capacity
    assert all(index.match([h])[0] == 1 for h in still_held)
    assert all(index.match([h])[0] == 0 for h in forgotten)


def test_memory_is_bounded_by_size_times_capacity() -> None:
    size, capacity = 5, 50
    index = PrefixIndex(size, capacity)
    for i in range(2000):
        index.record(i % size, [i * 100 + j for j in range(7)])
    assert [index.held(e) for e in range(size)] == [capacity] * size
    assert len(index) == size * capacity  # evicted blocks leave the shared map too


def test_eviction_on_one_endpoint_keeps_the_others() -> None:
    index = _index([(0, [A, B]), (1, [A, B]), (0, [C, D])], capacity=2)
    assert index.match([A, B]).tolist() == [0, 2, 0, 0]
    assert index.match([C, D]).tolist() == [2, 0, 0, 0]


def test_large_endpoint_indices() -> None:
    index = _index([(1023, [A, B]), (64, [A]), (0, [A, B])], size=1024)
    counts = index.match([A, B])
    assert np.flatnonzero(counts).tolist() == [0, 64, 1023]
    assert counts[[0, 64, 1023]].tolist() == [2, 1, 2]


@pytest.mark.parametrize(
    ("size", "capacity", "message"),
    [
        pytest.param(0, 10, "at least one endpoint", id="no-endpoints"),
        pytest.param(3, 0, "capacity_blocks", id="no-capacity"),
    ],
)
def test_index_validation(size: int, capacity: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixIndex(size, capacity)


@pytest.mark.parametrize("endpoint", [pytest.param(-1, id="negative"), pytest.param(4, id="too-large")])
def test_record_refuses_an_endpoint_outside_the_index(endpoint: int) -> None:
    with pytest.raises(ValueError, match="outside the index"):
        PrefixIndex(4).record(endpoint, [A])


# ---------------------------------------------------------------- the scorer


def _state(requests: Sequence[int]) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(len(requests))])
    inflight = InFlight(len(pool))
    inflight.requests[:] = requests
    return State(pool, inflight, Signals(len(pool)))


def _req(hashes: Sequence[int] = ()) -> RequestFeatures:
    return RequestFeatures(model="m", prefix_hashes=tuple(hashes))


@pytest.mark.parametrize(
    ("records", "hashes", "requests", "candidates", "guard", "expected"),
    [
        pytest.param([(0, [A, B])], [], [0, 0, 0, 0], [0, 1, 2, 3], 2.0, [NEUTRAL_SCORE] * 4, id="no-hashes-neutral"),
        pytest.param([(0, [A, B])], [X, Y], [0, 0, 0, 0], [0, 1, 2, 3], 2.0, [0, 0, 0, 0], id="no-match"),
        pytest.param(
            [(0, [A, B, C, D]), (1, [A, B]), (2, [A])],
            [A, B, C, D],
            [0, 0, 0, 0],
            [0, 1, 2, 3],
            2.0,
            [1.0, 0.5, 0.25, 0.0],
            id="matched-fraction",
        ),
        pytest.param(
            [(0, [A, B, C, D]), (1, [A, B])],
            [A, B, C, D],
            [0, 0, 0, 0],
            [1, 3],
            2.0,
            [0.5, 0.0],
            id="aligned-with-candidates",
        ),
        # the others' mean in-flight 1, bound 2 x (1 + 1) = 4: endpoint 0 with 9 is hot.
        pytest.param(
            [(0, [A, B]), (1, [A, B]), (2, [A])],
            [A, B],
            [9, 1, 1, 1],
            [0, 1, 2, 3],
            2.0,
            [0.0, 1.0, 0.5, 0.0],
            id="guard-zeroes-a-hot-endpoint",
        ),
        pytest.param(
            [(0, [A, B]), (1, [A, B])],
            [A, B],
            [6, 2, 2, 2],
            [0, 1, 2, 3],
            2.0,
            [1.0, 1.0, 0.0, 0.0],
            id="at-the-bound-is-not-hot",
        ),
        # Over the candidates the other's mean is 1 (bound 4: 5 is hot); over the pool it would be 6.3 (bound 14.7).
        pytest.param([(0, [A, B])], [A, B], [5, 1, 9, 9], [0, 1], 2.0, [0.0, 0.0], id="guard-uses-the-candidates-mean"),
        pytest.param([(0, [A, B])], [A, B], [9, 1, 1, 1], [0, 1, 2, 3], float("inf"), [1.0, 0, 0, 0], id="guard-off"),
        pytest.param([(0, [A, B])], [A, B], [3, 1, 1, 1], [0, 1, 2, 3], 1.0, [0.0, 0, 0, 0], id="tighter-guard"),
    ],
)
def test_prefix_affinity_scores(
    records: list[tuple[int, list[int]]],
    hashes: list[int],
    requests: list[int],
    candidates: list[int],
    guard: float,
    expected: list[float],
) -> None:
    scorer = PrefixAffinityScorer(_index(records), guard=guard)
    scores = scorer.score(_req(hashes), _state(requests), np.array(candidates, dtype=np.intp))
    assert scores.dtype == np.float64
    assert scores.tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("load", "over"),
    [
        # Three servers, two holding 3 requests: the third is over at 9 (> 2 x (3 + 1)). Against a mean that
        # counted it, it would need 19, and a slowed server that caches the popular prefixes fills up first.
        pytest.param([9, 3, 3], [True, False, False], id="small-pool-pile-up"),
        pytest.param([8, 3, 3], None, id="small-pool-at-the-bound"),
        pytest.param([0, 0, 0, 0], None, id="idle"),
        pytest.param([7, 7, 0, 0], [True, True, False, False], id="two-over"),
        pytest.param([50], None, id="one-candidate-has-no-others"),
    ],
)
def test_overloaded_compares_each_candidate_with_the_others(load: list[int], over: list[bool] | None) -> None:
    got = overloaded(np.array(load, dtype=np.float64), 2.0)
    assert (None if got is None else got.tolist()) == over


@pytest.mark.parametrize("seed", range(40))
def test_overloaded_finds_every_candidate_over_the_bound(seed: int) -> None:
    # The early exit checks the busiest candidate only; it must find what checking each one finds, on small pools
    # (read as a list) and large ones (numpy), with the in-flight counters' integers and with floats.
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 9)) if seed % 2 else int(rng.integers(9, 80))
    load = rng.integers(0, 12, size=size).astype(np.int64 if seed % 4 < 2 else np.float64)
    load[rng.integers(size)] += rng.integers(0, 4) * 10  # now and then one far over
    n = len(load)
    reference = [load[i] > 2.0 * ((load.sum() - load[i]) / (n - 1) + 1.0) for i in range(n)]
    got = overloaded(load, 2.0)
    assert (got.tolist() if got is not None else [False] * n) == reference


def test_prefix_affinity_index_must_fit_the_pool() -> None:
    scorer = PrefixAffinityScorer(_index([(0, [A])], size=3))
    with pytest.raises(ValueError, match="the prefix index has 3 endpoints, the pool 4"):
        scorer.score(_req([A]), _state([0, 0, 0, 0]), np.arange(4))


def test_prefix_affinity_satisfies_the_protocol() -> None:
    scorer: Scorer = PrefixAffinityScorer(PrefixIndex(2))
    assert scorer.name == "prefix-affinity"
    assert PrefixAffinityScorer.bounded is True


def test_on_pick_records_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    index = PrefixIndex(2)
    scorer = PrefixAffinityScorer(index)
    scorer.on_pick(_req([A, B]), 1)
    scorer.on_pick(_req(), 0)  # nothing to record
    assert index.match([A, B]).tolist() == [0, 2]
    assert index.held(0) == 0
    with caplog.at_level(logging.ERROR):
        scorer.on_pick(_req([A]), 5)  # an index smaller than the pool: counted and logged once, not raised
        scorer.on_pick(_req([A]), 5)
    assert scorer.record_errors == 2
    assert len(caplog.records) == 1


# ---------------------------------------------------------------- through a real engine


def _engine(size: int = 4, *, with_load: bool = False, guard: float = 2.0) -> tuple[Engine, PrefixIndex]:
    index = PrefixIndex(size)
    scorers = [WeightedScorer(PrefixAffinityScorer(index, guard=guard), 2.0)]
    if with_load:
        scorers.append(WeightedScorer(InFlightScorer(), 1.0))
    profile = Profile("prefix", (), scorers, MaxScorePicker(np.random.default_rng(11)))
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(size)])
    return Engine(pool, profile), index


def _prompt(topic: int) -> RequestFeatures:
    text = f"topic {topic}: " + "some shared document text " * 60
    return RequestFeatures(model="m", prefix_hashes=text_block_hashes(text, seed=hash("m")))


@pytest.mark.parametrize(
    "with_load", [pytest.param(False, id="affinity-only"), pytest.param(True, id="with-in-flight")]
)
def test_engine_repeated_prompts_stick_and_different_prompts_spread(with_load: bool) -> None:
    engine, index = _engine(with_load=with_load)
    homes: dict[int, set[int]] = {}
    for _ in range(5):
        for topic in range(40):
            homes.setdefault(topic, set()).add(engine.decide(_prompt(topic)).endpoint.index)
    assert all(len(endpoints) == 1 for endpoints in homes.values())
    spread = Counter(next(iter(endpoints)) for endpoints in homes.values())
    assert set(spread) == {0, 1, 2, 3}
    assert max(spread.values()) <= 20
    assert len(index) > 0


def test_engine_decision_reports_the_affinity_score() -> None:
    engine, _ = _engine()
    first = engine.decide(_prompt(1))
    again = engine.decide(_prompt(1))
    assert first.scores["prefix-affinity"] == 0.0
    assert again.scores["prefix-affinity"] == 1.0
    assert again.endpoint == first.endpoint


def test_engine_guard_moves_a_hot_prompt_elsewhere() -> None:
    engine, _ = _engine(with_load=True)
    leases: list[Lease] = []
    chosen = []
    for _ in range(12):
        decision = engine.decide(_prompt(7))
        chosen.append(decision.endpoint.index)
        leases.append(engine.inflight.acquire(decision.endpoint.index, 0))
    home = chosen[0]
    # Affinity (weight 2) outweighs the in-flight scorer at first; the guard then stops the pile-up.
    assert chosen[:2] == [home, home]
    assert len(set(chosen)) > 1
    assert engine.inflight.requests.max() <= 2.0 * (engine.inflight.requests.mean() + 1) + 1
    for lease in leases:
        lease.release()
    assert engine.decide(_prompt(7)).scores["prefix-affinity"] == 1.0


def test_the_index_holds_no_more_than_each_servers_kv_cache() -> None:
    # 64 blocks of 64 tokens fit a cache of 4096 tokens; a server of unknown size keeps capacity_blocks.
    index = PrefixIndex(3, capacity_blocks=1000)
    index.fit(np.array([4096.0, np.nan, 10**9]))
    assert [index.capacity(e) for e in range(3)] == [64, 1000, 1000]
    for start in range(0, 5000, 100):
        for endpoint in range(3):
            index.record(endpoint, list(range(start, start + 100)))
    assert [index.held(e) for e in range(3)] == [64, 1000, 1000]
    assert index.match(list(range(4900, 5000))).tolist() == [64, 100, 100]  # endpoint 0 keeps the heads
    index.fit(np.array([np.nan, np.nan, 6400.0]))  # a server reporting its cache later shrinks its share
    index.record(2, [10**6])
    assert index.held(2) == 100 and index.capacity(0) == 1000


def test_the_scorer_fits_the_index_to_the_servers_caches_from_the_snapshot() -> None:
    state = _state([0, 0])
    index = PrefixIndex(2)
    scorer = PrefixAffinityScorer(index)
    request = RequestFeatures(prefix_hashes=(1, 2, 3))
    scorer.score(request, state, np.arange(2))
    assert [index.capacity(e) for e in range(2)] == [65536, 65536]  # no cache sizes scraped yet
    snapshot = state.signals.snapshot
    state.signals.publish(snapshot.with_values(kv_tokens=np.array([448_304.0, np.nan])))
    scorer.score(request, state, np.arange(2))
    assert [index.capacity(e) for e in range(2)] == [7005, 65536]


# ---------------------------------------------------------------- the servers' own account (KV events)


def _exact_state(size: int = 3) -> tuple[State, KVBlockIndex]:
    pool = Pool([EndpointConfig(f"10.0.0.{i}:8000") for i in range(size)])
    signals = Signals(size)
    kv = KVBlockIndex(size, clock=signals.clock, block_size=4)
    signals.kv = kv
    return State(pool, InFlight(size), signals), kv


def test_where_servers_report_their_cache_the_score_follows_what_they_hold() -> None:
    """The approximate index believes endpoint 0 has the prompt (it was sent there); endpoint 0's server evicted
    it and endpoint 2's holds half of it: with the events, the score says so."""
    state, kv = _exact_state()
    tokens = list(range(40, 56))
    request = RequestFeatures(prefix_hashes=(A, B), cache_keys=cache_keys(tokens, 4), prompt_tokens=16)
    scorer = PrefixAffinityScorer(_index([(0, [A, B])], size=3))
    candidates = np.arange(3)
    assert scorer.score(request, state, candidates).tolist() == [1.0, 0.0, 0.0]  # nobody subscribed: the guess
    for e in range(3):
        kv.subscribed(e, True)
    kv.store(2, [7, 8], cache_keys(tokens, 4)[:2])
    assert scorer.score(request, state, candidates).tolist() == [0.0, 0.0, 0.5]
    kv.subscribed(0, False)  # its stream is down: the guess stands in for it, the others stay exact
    assert scorer.score(request, state, candidates).tolist() == [1.0, 0.0, 0.5]


def test_predicted_ttft_credits_the_reported_cache() -> None:
    state, kv = _exact_state()
    for e in range(3):
        kv.subscribed(e, True)
    tokens = list(range(4000))
    keys = cache_keys(tokens, 4)
    kv.store(1, list(range(500)), keys[:500])  # endpoint 1 holds half the prompt
    request = RequestFeatures(prompt_tokens=4000, cache_keys=keys)
    scores = PredictedTTFTScorer().score(request, state, np.arange(3))
    assert scores[1] == 1.0 and scores[0] == scores[2] < 0.6
