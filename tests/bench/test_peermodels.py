"""bench/peermodels.py: each peer router's model decides as its source does on small hand-made situations, and every
registered peer-model contender runs in a tiny simulation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from inferlb.bench.desrun import DES_CONTENDERS, make_policy
from inferlb.bench.peermodels import (
    PEER_MODELS,
    SGLANG_CACHE_AWARE,
    ApproxTree,
    CacheAware,
    CacheAwareConfig,
    ConsistentHash,
    DynamoKv,
    GieDefault,
    HashRing,
    PowerOfTwo,
    peer_model,
)
from inferlb.sim.des import Arrival, FleetView, RequestRecord, ServerSnapshot, simulate
from inferlb.sim.engine import EngineModel, EngineOptions, SimRequest
from inferlb.sim.profiles import get_profile

PROFILE = get_profile("h100-llama3.1-8b")
BS = PROFILE.block_size


def _view(n: int, inflight: Sequence[int] | None = None, engines: Sequence[EngineModel] = ()) -> FleetView:
    return FleetView(
        now=1.0,
        servers=tuple(f"server-{i}" for i in range(n)),
        snapshots=[None] * n,
        inflight=list(inflight or [0] * n),
        inflight_tokens=[0] * n,
        engines=tuple(engines),
    )


def _arrival(rid: str, keys: Sequence[int], extra_tokens: int = 0, tag: object = None) -> Arrival:
    return Arrival(rid, 0.0, len(keys) * BS + extra_tokens, 8, tuple(keys), tag)


def test_the_tree_matches_the_longest_prefix_and_names_its_first_tenant_in_order() -> None:
    tree = ApproxTree(3, order=[2, 0, 1])
    tree.insert([1, 2, 3], [64, 64, 64], tenant=0, now=0.0)
    tree.insert([1, 2], [64, 64], tenant=2, now=0.0)
    assert tree.match([1, 2, 3, 4], now=1.0) == (3, 0)  # only tenant 0 holds the third symbol
    assert tree.match([1, 2, 9], now=1.0) == (2, 2)  # both hold [1, 2]: the first in order wins
    assert tree.match([7], now=1.0) == (0, None)
    assert tree.chars == [192, 0, 128]
    assert tree.smallest() == 1


def test_with_a_salt_each_node_orders_its_tenants_its_own_way() -> None:
    """As the routers' per-node maps do: two nodes that hold the same workers need not name the same one first, and
    the same salt draws the same orders."""

    def firsts(salt: int) -> list[int | None]:
        tree = ApproxTree(4, order=[0, 1, 2, 3], salt=salt)
        for node in range(1, 41):
            for tenant in range(4):
                tree.insert([node], [64], tenant=tenant, now=0.0)
        return [tree.match([node], now=1.0)[1] for node in range(1, 41)]

    assert firsts(7) == firsts(7)
    assert set(firsts(7)) == {0, 1, 2, 3}  # one global order would name the same worker for all 40
    assert firsts(7) != firsts(8)
    unsalted = ApproxTree(4, order=[2, 0, 1, 3])
    for node in (1, 2):
        for tenant in range(4):
            unsalted.insert([node], [64], tenant=tenant, now=0.0)
    assert [unsalted.match([n], now=1.0)[1] for n in (1, 2)] == [2, 2]


@pytest.mark.parametrize(
    ("alphabet", "expected"),
    [
        pytest.param(1, 1, id="next-character-matches-a-child-whose-tenant-wins"),
        pytest.param(1 << 40, 0, id="no-child-starts-alike-the-node-s-first-tenant-wins"),
    ],
)
def test_a_match_goes_on_into_a_child_that_starts_with_the_same_character(alphabet: int, expected: int) -> None:
    tree = ApproxTree(3, order=[0, 1, 2], alphabet=alphabet)
    tree.insert([1], [64], tenant=0, now=0.0)
    tree.insert([1, 5], [64, 64], tenant=2, now=0.0)
    tree.insert([1, 6], [64, 64], tenant=1, now=0.0)
    assert tree.match([1, 7], now=1.0) == (1, expected)


def test_eviction_drops_least_recently_used_leaves_of_a_tenant_over_budget() -> None:
    tree = ApproxTree(1, order=[0])
    tree.insert([1, 2], [10, 10], tenant=0, now=0.0)
    tree.insert([5, 6], [10, 10], tenant=0, now=5.0)
    tree.evict(max_chars=20)
    assert tree.chars == [20]
    assert tree.match([1, 2], now=6.0) == (0, None)  # the older branch went, leaf first, then its parent
    assert tree.match([5, 6], now=6.0) == (2, 0)


@pytest.mark.parametrize(
    ("prior", "expected"),
    [
        pytest.param([1, 2, 3, 4], 1, id="match-above-threshold-goes-to-the-holder"),
        pytest.param([1, 99, 98, 97], 0, id="match-below-threshold-goes-to-the-smallest-tree"),
    ],
)
def test_cache_aware_follows_its_threshold(prior: list[int], expected: int) -> None:
    policy = CacheAware(SGLANG_CACHE_AWARE, 2, BS, seed=0)
    policy.tree.insert(prior, [BS * 4] * 4, tenant=1, now=0.0)  # worker 1 holds the prompt's first block(s)
    # The new prompt shares 4 of 4 blocks with [1, 2, 3, 4], or 1 of 4 (0.25 <= 0.3) with [1, 99, 98, 97].
    assert policy(_arrival("r", [1, 2, 3, 4]), _view(2)) == expected


def test_cache_aware_sends_to_the_least_loaded_when_imbalanced() -> None:
    policy = CacheAware(SGLANG_CACHE_AWARE, 3, BS, seed=0)
    policy.tree.insert([1, 2], [BS * 4] * 2, tenant=0, now=0.0)
    assert policy(_arrival("a", [1, 2]), _view(3, [100, 30, 20])) == 2  # 100 - 20 > 64 and 100 > 1.5 * 20
    # 100 - 40 = 60: balanced, so the cache wins: a holder of the prompt (0, or 2 since "a"), not the least loaded 1.
    assert policy(_arrival("b", [1, 2]), _view(3, [100, 40, 60])) in {0, 2}
    assert policy.balanced == 1 and policy.cached == 1


def test_cache_aware_config_rejects_a_threshold_outside_zero_one() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareConfig(1.5, 64, 1.5, 60.0, 100)


def test_power_of_two_takes_the_less_loaded_of_two_distinct_workers() -> None:
    policy = PowerOfTwo(seed=3)
    view = _view(2, [5, 1])
    assert {policy(_arrival(f"r{k}", [k]), view) for k in range(20)} == {1}


def test_consistent_hashing_moves_only_the_keys_the_new_worker_takes() -> None:
    before = HashRing([f"server-{i}" for i in range(4)])
    after = HashRing([f"server-{i}" for i in range(5)])
    keys = [f"k{i}" for i in range(2000)]
    moved = [k for k in keys if before.lookup(k) != after.lookup(k)]
    assert all(after.lookup(k) == "server-4" for k in moved)
    assert 0.1 < len(moved) / len(keys) < 0.3  # about a fifth


def test_consistent_hashing_keys_by_session_else_by_the_request_text() -> None:
    policy = ConsistentHash()
    view = _view(8)
    same_session = {policy(_arrival(f"s{k}", [k, k + 1], tag="chat-7"), view) for k in range(10)}
    assert len(same_session) == 1
    assert policy(_arrival("x", [1, 2]), view) == policy(_arrival("y", [1, 2]), view)  # same text, same worker
    assert len({policy(_arrival(f"t{k}", [k]), view) for k in range(50)}) > 1


def test_each_seed_is_another_deployment_s_ring() -> None:
    """The real ring hashes the workers' URLs, so how the keys split depends on the deployment: a seed draws a
    ring, the same seed the same ring (seed 0 the ring the model always had)."""
    view = _view(4)
    arrivals = [_arrival(f"r{k}", [k, k + 7]) for k in range(400)]

    def owners(seed: int) -> list[int]:
        policy = ConsistentHash(seed=seed)
        return [policy(a, view) for a in arrivals]

    assert owners(1) == owners(1)
    assert owners(0) == [ConsistentHash()(a, view) for a in arrivals]
    moved = sum(a != b for a, b in zip(owners(0), owners(1), strict=True)) / len(arrivals)
    assert 0.5 < moved < 0.95  # another ring: about three keys in four change worker (four workers)


def _snapshot(waiting: int, usage: float) -> ServerSnapshot:
    return ServerSnapshot(1.0, True, 0, waiting, usage, 0, 0, 1000, BS)


def test_gie_weighs_prefix_three_against_queue_and_kv_two_each() -> None:
    policy = GieDefault(2, BS, seed=0)
    view = _view(2)
    view.snapshots = [_snapshot(0, 0.0), _snapshot(0, 0.0)]
    first = policy(_arrival("a", [1, 2, 3]), view)
    # The prompt's blocks are now in `first`'s index: a prefix score of 1 beats an equal load.
    assert policy(_arrival("b", [1, 2, 3]), view) == first
    # A longer queue there (queue score 0 against 1: -2) and a fuller cache (-2 * 0.9) outweigh the prefix (+3).
    view.snapshots[first] = _snapshot(10, 0.9)
    assert policy(_arrival("c", [1, 2, 3]), view) == 1 - first


def test_gie_prefix_score_counts_the_model_block_and_stops_at_the_first_miss() -> None:
    policy = GieDefault(2, BS, seed=0)
    policy._record(policy.hashes(_arrival("a", [1, 2, 3])), 0)
    assert policy.prefix_scores(policy.hashes(_arrival("b", [1, 2, 9])), 2) == [0.75, 0.0]
    assert policy.prefix_scores(policy.hashes(_arrival("c", [9])), 2) == [0.5, 0.0]


def _engine_holding(keys: Sequence[int]) -> EngineModel:
    engine = EngineModel(PROFILE, EngineOptions(seed=0, jitter=0.0))
    keys = list(keys) or [-5]
    request = SimRequest("warm", len(keys) * BS, 1, tuple(keys))
    engine.add(request)
    engine.advance(60.0)  # long enough to finish: its blocks stay cached
    return engine


def test_dynamo_picks_the_lowest_cost_worker() -> None:
    keys = list(range(1, 41))
    engines = [_engine_holding([]), _engine_holding(keys)]
    policy = DynamoKv(2, BS, seed=0)
    view = _view(2, engines=engines)
    logits = policy.logits(_arrival("a", keys), view)
    assert logits[1] < logits[0]  # 40 cached blocks less to prefill on worker 1
    assert logits[0] - logits[1] == pytest.approx(40.0)
    assert policy(_arrival("a", keys), view) == 1


def test_dynamo_counts_its_own_requests_until_they_finish() -> None:
    engines = [_engine_holding([]), _engine_holding([])]
    policy = DynamoKv(2, BS, seed=0)
    view = _view(2, engines=engines)
    first = policy(_arrival("a", list(range(100, 120))), view)
    probe = _arrival("c", [1])
    busy = policy.logits(probe, view)
    # 20 blocks still to prefill (weight 1) and 20 active blocks: 40 more on the worker that has "a".
    assert busy[first] - busy[1 - first] == pytest.approx(40.0)
    assert policy(_arrival("b", list(range(200, 220))), view) == 1 - first
    policy.finished(RequestRecord("a", first, 0.0, 20 * BS, 8, 0.0, 0.1, 0.2, 0, 0, None), 1.0)
    policy.finished(RequestRecord("b", 1 - first, 0.0, 20 * BS, 8, 0.0, 0.1, 0.2, 0, 0, None), 1.0)
    idle = policy.logits(probe, view)
    assert idle[0] == idle[1]


def test_peer_model_rejects_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown peer model"):
        peer_model("nginx", [PROFILE], 0)


@pytest.mark.parametrize("name", [c for c in DES_CONTENDERS if c.startswith("peer-model:")])
def test_every_registered_peer_model_runs_in_a_tiny_simulation(name: str) -> None:
    profiles = [PROFILE] * 3
    policy = make_policy(name, profiles, seed=0)
    shared = tuple(range(1, 9))
    arrivals = [Arrival(f"r{k}", k * 0.05, 200 + 10 * k, 4, (*shared, 1000 + k)) for k in range(12)]
    result = simulate(arrivals, policy, profiles, seed=0, on_finish=getattr(policy, "finished", None))
    assert result.policy_errors == 0
    assert all(r.error is None for r in result.records) and len(result.records) == 12


def test_every_peer_model_is_a_contender() -> None:
    assert [c.removeprefix("peer-model:") for c in DES_CONTENDERS if c.startswith("peer-model:")] == list(PEER_MODELS)
