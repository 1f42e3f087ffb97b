"""Tests for scorer/session.py: consistent hashing with bounded loads and the session-affinity scorer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import NEUTRAL_SCORE, Engine, Profile, Scorer, State, WeightedScorer
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight, Lease
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker
from inferlb.scorer.pool import Pool
from inferlb.scorer.session import ConsistentHashRing, SessionAffinityScorer
from inferlb.scorer.signals import Signals

KEYS = [f"user-{i}" for i in range(2000)]


def _mask(size: int, allowed: Sequence[int]) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    mask[list(allowed)] = True
    return mask


# ---------------------------------------------------------------- the ring


def test_ring_is_the_same_in_every_process() -> None:
    # Pinned: BLAKE2b points, not Python's salted hash, so other picker processes and restarts agree (every
    # test run is a process with a fresh hash salt).
    keys = ["alice", "bob", "carol", "dave", "session-1", "session-2"]
    assert [ConsistentHashRing(8).lookup(k) for k in keys] == [5, 2, 7, 1, 4, 6]


@pytest.mark.parametrize(
    ("size", "vnodes"),
    [pytest.param(8, 160, id="8x160"), pytest.param(3, 160, id="3x160"), pytest.param(16, 40, id="16x40")],
)
def test_ring_spreads_keys_evenly(size: int, vnodes: int) -> None:
    ring = ConsistentHashRing(size, vnodes)
    counts = Counter(ring.lookup(k) for k in KEYS)
    assert set(counts) == set(range(size))
    mean = len(KEYS) / size
    assert all(0.6 * mean < n < 1.4 * mean for n in counts.values()), counts


@pytest.mark.parametrize(
    ("size", "removed"),
    [
        pytest.param(8, [3], id="one-of-8"),
        pytest.param(8, [0, 5], id="two-of-8"),
        pytest.param(8, [0, 1, 2, 3, 4, 5, 6], id="all-but-one"),
        pytest.param(2, [1], id="one-of-2"),
    ],
)
def test_removing_endpoints_moves_only_their_keys(size: int, removed: list[int]) -> None:
    ring = ConsistentHashRing(size)
    allowed = _mask(size, [e for e in range(size) if e not in removed])
    moved = 0
    for key in KEYS:
        before = ring.lookup(key)
        after = ring.lookup(key, allowed)
        assert after is not None and allowed[after]
        if before not in removed:
            assert after == before
        else:
            moved += 1
    # The removed endpoints' keys go to many endpoints, not one neighbour.
    if size - len(removed) > 2:
        targets = {ring.lookup(k, allowed) for k in KEYS if ring.lookup(k) in removed}
        assert len(targets) > 2
    assert moved > 0


def test_a_ring_built_again_without_an_endpoint_moves_only_that_endpoints_keys() -> None:
    # A membership change builds the profile anew over the next pool, whose endpoints' indices shift when one
    # leaves: with points by index, 92% of the keys of endpoints that stayed moved (their KV cache lost). Points
    # come from the addresses now.
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 5)]
    before, after = ConsistentHashRing(4, names=addresses), ConsistentHashRing(3, names=addresses[1:])
    stayed = moved = 0
    for key in KEYS:
        owner = addresses[before.lookup(key)]  # type: ignore[index]
        if owner == addresses[0]:
            continue
        stayed += 1
        moved += addresses[1:][after.lookup(key)] != owner  # type: ignore[index]
    assert stayed > 0 and moved == 0


def test_lookup_with_nothing_allowed_is_none() -> None:
    ring = ConsistentHashRing(4)
    none = np.zeros(4, dtype=bool)
    assert ring.lookup("k", none) is None
    assert ring.lookup("k", none, np.zeros(4, dtype=np.int64)) is None


def test_long_walks_fall_back_to_the_vectorised_pass() -> None:
    ring = ConsistentHashRing(64, vnodes=4)
    for only in (0, 17, 63):
        allowed = _mask(64, [only])
        assert {ring.lookup(k, allowed) for k in KEYS[:200]} == {only}


def test_bounded_loads_spill_to_the_next_endpoint_on_the_ring() -> None:
    size = 8
    ring = ConsistentHashRing(size)
    everyone = np.ones(size, dtype=bool)
    spilled_to = set()
    for key in KEYS[:300]:
        home = ring.lookup(key)
        assert home is not None
        next_home = ring.lookup(key, everyone & ~_mask(size, [home]))
        loads = np.zeros(size, dtype=np.int64)
        # Mean 10/8: bound 1.25 x 2.25 = 2.81; the home endpoint with 10 is over it.
        loads[home] = 10
        assert ring.lookup(key, everyone, loads) == next_home
        spilled_to.add(next_home)
        # At the bound the key stays home: loads of 3 with mean 2.375 -> bound 4.22.
        loads[:] = 2
        loads[home] = 3
        assert ring.lookup(key, everyone, loads) == home
    assert len(spilled_to) == size  # an overloaded endpoint's keys spread over the others


@pytest.mark.parametrize(
    ("loads", "allowed", "c", "expected"),
    [
        # Keys on the lightly loaded endpoint stay; the bound ignores disallowed endpoints' loads.
        pytest.param([0, 0, 0, 0], [0, 1, 2, 3], 1.25, "home", id="idle"),
        pytest.param([100, 100, 100, 100], [0, 1, 2, 3], 1.25, "home", id="evenly-busy"),
        pytest.param([50, 50, 50, 50], None, 1.0, "home", id="c-one-even"),
    ],
)
def test_bounded_loads_keep_keys_home_when_balanced(
    loads: list[int], allowed: list[int] | None, c: float, expected: str
) -> None:
    ring = ConsistentHashRing(4)
    mask = None if allowed is None else _mask(4, allowed)
    for key in KEYS[:100]:
        assert ring.lookup(key, mask, np.array(loads, dtype=np.int64), c) == ring.lookup(key)


def test_bounded_loads_always_find_an_endpoint() -> None:
    ring = ConsistentHashRing(6)
    rng = np.random.default_rng(5)
    for key in KEYS[:300]:
        loads = rng.integers(0, 50, 6)
        allowed = rng.random(6) < 0.5
        allowed[int(rng.integers(6))] = True
        chosen = ring.lookup(key, allowed, loads, 1.0)
        assert chosen is not None and allowed[chosen]
        assert loads[chosen] <= 1.0 * (loads[allowed].mean() + 1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda: ConsistentHashRing(0), "at least one endpoint", id="no-endpoints"),
        pytest.param(lambda: ConsistentHashRing(3, vnodes=0), "vnodes", id="no-vnodes"),
        pytest.param(lambda: ConsistentHashRing(3).lookup("k", c=0.9), "c must be >= 1", id="c-below-one"),
        pytest.param(lambda: ConsistentHashRing(3).lookup("k", np.ones(2, dtype=bool)), "allowed", id="short-mask"),
        pytest.param(lambda: ConsistentHashRing(3).lookup("k", loads=np.zeros(4)), "loads", id="long-loads"),
    ],
)
def test_validation(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- the scorer


def _state(requests: Sequence[int]) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(len(requests))])
    inflight = InFlight(len(pool))
    inflight.requests[:] = requests
    return State(pool, inflight, Signals(len(pool)))


def _req(session: str | None) -> RequestFeatures:
    return RequestFeatures(model="m", session_key=session)


def test_scorer_ring_must_fit_the_pool() -> None:
    scorer = SessionAffinityScorer(ConsistentHashRing(2))
    with pytest.raises(ValueError, match="the hash ring has 2 endpoints, the pool 4"):
        scorer.score(_req("k"), _state([0, 0, 0, 0]), np.arange(2))


def test_scorer_without_a_session_key_is_neutral() -> None:
    scorer: Scorer = SessionAffinityScorer(ConsistentHashRing(4))
    scores = scorer.score(_req(None), _state([0, 0, 0, 0]), np.arange(4))
    assert scores.tolist() == [NEUTRAL_SCORE] * 4
    assert scorer.name == "session-affinity"
    assert SessionAffinityScorer.bounded is True


@pytest.mark.parametrize(
    ("candidates", "requests"),
    [
        pytest.param([0, 1, 2, 3], [0, 0, 0, 0], id="all"),
        pytest.param([1, 3], [0, 0, 0, 0], id="subset"),
        pytest.param([2], [0, 0, 0, 0], id="one"),
        pytest.param([0, 1, 2, 3], [9, 9, 0, 0], id="loaded"),
    ],
)
def test_scorer_picks_the_ring_choice_among_candidates(candidates: list[int], requests: list[int]) -> None:
    ring = ConsistentHashRing(4)
    scorer = SessionAffinityScorer(ring)
    cands = np.array(candidates, dtype=np.intp)
    for key in KEYS[:50]:
        scores = scorer.score(_req(key), _state(requests), cands)
        assert scores.dtype == np.float64
        assert sorted(scores.tolist()) == [0.0] * (len(candidates) - 1) + [1.0]
        expected = ring.lookup(key, _mask(4, candidates), np.array(requests), 1.25)
        assert int(cands[scores.argmax()]) == expected


# ---------------------------------------------------------------- through a real engine


def _engine(size: int = 4) -> Engine:
    profile = Profile(
        "session",
        (),
        [WeightedScorer(SessionAffinityScorer(ConsistentHashRing(size)), 2.0), WeightedScorer(InFlightScorer(), 1.0)],
        MaxScorePicker(np.random.default_rng(13)),
    )
    return Engine(Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(size)]), profile)


def test_engine_sessions_stick_and_spread() -> None:
    engine = _engine()
    homes: dict[str, set[int]] = {}
    for _ in range(3):
        for key in KEYS[:60]:
            homes.setdefault(key, set()).add(engine.decide(_req(key)).endpoint.index)
    assert all(len(endpoints) == 1 for endpoints in homes.values())
    assert {next(iter(e)) for e in homes.values()} == {0, 1, 2, 3}


def test_engine_a_busy_session_spills_with_bounded_loads() -> None:
    engine = _engine()
    leases: list[Lease] = []
    chosen = []
    for _ in range(12):
        decision = engine.decide(_req("heavy-user"))
        chosen.append(decision.endpoint.index)
        leases.append(engine.inflight.acquire(decision.endpoint.index, 0))
    home = chosen[0]
    assert chosen.count(home) < len(chosen)
    assert len(set(chosen)) > 1
    for lease in leases:
        lease.release()
    assert engine.decide(_req("heavy-user")).endpoint.index == home
