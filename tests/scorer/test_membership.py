"""Membership changes in the routing core (scorer/membership.py): what stays keeps its state, what joins ramps in,
what leaves drains; the counters, signals and prefix index follow the endpoints across pools."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import NoEndpointError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.membership import Membership, Ramp, SlowStart
from inferlb.scorer.pool import Pool
from inferlb.scorer.prefix import PrefixIndex
from inferlb.scorer.presets import build_profile
from inferlb.scorer.signals import Signals


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ep(n: int, **extra) -> EndpointConfig:
    return EndpointConfig(address=f"10.0.0.{n}:8000", **extra)


def engine_over(configs, clock, policy="least-request", membership: Membership | None = None, plan=None) -> Engine:
    pool = Pool(configs) if plan is None else membership.pool(plan)
    signals = Signals(len(pool), clock=clock)
    return Engine(pool, build_profile(policy, np.random.default_rng(0), size=len(pool)), signals=signals)


def test_an_endpoint_that_stays_keeps_its_counters_and_a_lease_releases_into_the_new_pool() -> None:
    clock = Clock()
    old = Pool([ep(1), ep(2), ep(3)])
    inflight = InFlight(3, clock=clock)
    lease = inflight.acquire(2, 500)
    inflight.acquire(0, 100)
    membership = Membership()
    # 10.0.0.2 leaves idle, 10.0.0.4 joins; 10.0.0.3 (index 2) and 10.0.0.1 stay.
    plan = membership.plan(old, inflight.requests, [ep(3), ep(1), ep(4)], clock())
    assert [e.address for e in plan.endpoints] == ["10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000"]
    assert plan.mapping.tolist() == [0, 2, -1]
    assert plan.joined == ("10.0.0.4:8000",) and plan.removed == ("10.0.0.2:8000",) and not plan.draining
    new = inflight.moved(plan.mapping)
    assert inflight.successor is None  # nothing changes until the plan is in force
    inflight.hand_over(new, plan.mapping)
    assert new.requests.tolist() == [1, 1, 0] and new.tokens.tolist() == [100, 500, 0]
    lease.release()
    assert new.requests.tolist() == [1, 0, 0] and new.tokens.tolist() == [100, 0, 0]
    lease.release()  # idempotent across pools too
    assert new.requests.tolist() == [1, 0, 0]


def test_a_lease_follows_its_endpoint_through_two_changes() -> None:
    clock = Clock()
    first = InFlight(2, clock=clock)
    lease = first.acquire(1, 10)
    second = first.moved(np.array([1, 0]))
    first.hand_over(second, np.array([1, 0]))
    third = second.moved(np.array([-1, 0]))
    second.hand_over(third, np.array([-1, 0]))
    assert third.requests.tolist() == [0, 1]
    lease.release()
    assert third.requests.tolist() == [0, 0]


def test_an_endpoint_that_leaves_with_requests_in_flight_drains_and_goes_when_they_end() -> None:
    clock = Clock()
    membership = Membership()
    engine = engine_over([ep(1), ep(2)], clock)
    lease = engine.inflight.acquire(1, 10)
    plan = membership.plan(engine.pool, engine.inflight.requests, [ep(1)], clock())
    membership.commit(plan)
    assert plan.draining == {"10.0.0.2:8000"} and plan.left == ("10.0.0.2:8000",) and not plan.removed
    pool = membership.pool(plan)
    assert [e.draining for e in pool] == [False, True]
    drained = Engine(pool, build_profile("least-request", size=2), engine.inflight.moved(plan.mapping))
    engine.inflight.hand_over(drained.inflight, plan.mapping)
    # No new request goes to it, even though it is the least loaded... after its request ends.
    for _ in range(20):
        assert drained.decide(RequestFeatures()).endpoint.address == "10.0.0.1:8000"
    assert pool.model_indices(None).tolist() == [0]
    # Still draining while its request is in flight; gone once it ends.
    again = membership.plan(pool, drained.inflight.requests, [ep(1)], clock())
    assert again.draining == {"10.0.0.2:8000"} and again.empty
    lease.release()
    gone = membership.plan(pool, drained.inflight.requests, [ep(1)], clock())
    assert (
        gone.removed == ("10.0.0.2:8000",)
        and not gone.left
        and [e.address for e in gone.endpoints] == ["10.0.0.1:8000"]
    )
    membership.commit(gone)
    assert membership.changes == {"joined": 0, "left": 1, "removed": 1, "changed": 0}


def test_a_pool_whose_every_endpoint_drains_refuses_new_requests() -> None:
    pool = Pool([ep(1, models=frozenset({"m"}))], draining=frozenset({"10.0.0.1:8000"}))
    engine = Engine(pool, build_profile("least-request", size=1))
    with pytest.raises(NoEndpointError):
        engine.decide(RequestFeatures(model="m"))


def test_the_ramp_rises_from_its_floor_to_all_and_faster_when_idle() -> None:
    spec = SlowStart(ramp_s=10.0, min_fraction=0.1, idle_speedup=2.0)
    ramp = Ramp(spec, now=0.0)
    assert ramp.fraction(0.0) == pytest.approx(0.1)
    assert ramp.fraction(5.0) == pytest.approx(0.55)
    assert ramp.fraction(7.5, idle=True) == pytest.approx(1.0)  # 5 s + 2.5 s at twice the pace
    assert ramp.done
    slow = Ramp(spec, now=0.0)
    assert slow.fraction(7.5) == pytest.approx(0.775) and not slow.done
    off = Ramp(SlowStart(ramp_s=0.0), now=0.0)
    assert off.done and off.offer(0.0)


def test_thinning_keeps_a_ramping_endpoint_in_no_more_than_its_share_of_decisions() -> None:
    ramp = Ramp(SlowStart(ramp_s=1000.0, min_fraction=0.25), now=0.0)
    kept = [ramp.offer(0.0) for _ in range(400)]
    assert kept[0]  # the first decision it could serve, at once
    assert sum(kept) == pytest.approx(100, abs=1)


def test_a_joining_endpoint_takes_a_rising_share_instead_of_every_request() -> None:
    """Least-request would send a cold, empty server every request until it catches up; slow start caps its
    share at the ramp's fraction and lets it rise to a fair share."""
    clock = Clock()
    membership = Membership(SlowStart(ramp_s=20.0, min_fraction=0.1, idle_speedup=1.0))
    before = engine_over([ep(1), ep(2), ep(3)], clock)
    leases = [before.inflight.acquire(i % 3, 10) for i in range(30)]  # 10 requests in flight on each
    plan = membership.plan(before.pool, before.inflight.requests, [ep(1), ep(2), ep(3), ep(4)], clock())
    membership.commit(plan)
    pool = membership.pool(plan)
    inflight = before.inflight.moved(plan.mapping)
    before.inflight.hand_over(inflight, plan.mapping)
    engine = Engine(pool, build_profile("least-request", size=4), inflight, Signals(4, clock=clock))

    def share(decisions: int) -> float:
        chosen: Counter[str] = Counter()
        for _ in range(decisions):
            decision = engine.decide(RequestFeatures())
            chosen[decision.endpoint.address] += 1
            lease = inflight.acquire(decision.endpoint.index, 10)
            lease.release()  # each request ends at once: the load stays as it was
        return chosen["10.0.0.4:8000"] / decisions

    assert share(200) == pytest.approx(0.1, abs=0.02)  # without the ramp: 1.0 (it has nothing in flight)
    clock.now += 10.0
    assert share(200) == pytest.approx(0.55, abs=0.05)
    clock.now += 10.0
    assert share(200) == 1.0  # the ramp is over: least-request's own choice again
    assert not any(not ramp.done for _, ramp in pool.ramping)
    for lease in leases:
        lease.release()
    assert inflight.requests.tolist() == [0, 0, 0, 0]


def test_an_endpoint_back_before_it_drained_ramps_again_and_loses_its_prefix_credit() -> None:
    clock = Clock()
    membership = Membership()
    engine = engine_over([ep(1), ep(2)], clock, policy="prefix-aware")
    index = _index(engine)
    index.record(1, [11, 12, 13])
    lease = engine.inflight.acquire(1, 10)
    leaving = membership.plan(engine.pool, engine.inflight.requests, [ep(1)], clock())
    membership.commit(leaving)
    pool = membership.pool(leaving)
    back = membership.plan(pool, engine.inflight.requests, [ep(1), ep(2)], clock())
    assert back.joined == ("10.0.0.2:8000",) and back.restarted == (1,) and not back.draining
    assert "10.0.0.2:8000" in back.ramps
    rebuilt = Engine(membership.pool(back), build_profile("prefix-aware", size=2), engine.inflight)
    rebuilt.adopt(engine, back.mapping, back.restarted)
    assert _index(rebuilt).match([11, 12, 13]).tolist() == [0, 0]
    lease.release()


def test_a_model_or_label_change_keeps_the_endpoint_and_its_state() -> None:
    membership = Membership()
    a = frozenset({"a"})
    pool = Pool([ep(1, models=a), ep(2, models=a)])
    plan = membership.plan(
        pool, np.zeros(2), [ep(1, models=frozenset({"a", "b"})), ep(2, models=a, labels={"z": "x"})], 0
    )
    assert plan.changed == ("10.0.0.1:8000", "10.0.0.2:8000") and not plan.moves
    assert membership.pool(plan).model_indices("b").tolist() == [0]


def _index(engine: Engine) -> PrefixIndex:
    for ws in engine.profile.scorers:
        index = getattr(ws.scorer, "index", None)
        if isinstance(index, PrefixIndex):
            return index
    raise AssertionError("no prefix index")


def test_the_prefix_index_follows_endpoints_that_stay_and_forgets_those_that_went() -> None:
    old = PrefixIndex(3)
    old.record(0, [1, 2])
    old.record(1, [1, 5])
    old.record(2, [1, 2, 3])
    grown = PrefixIndex(4)
    grown.adopt(old, np.array([0, 1, 2, -1]))  # the pool grew at its end
    assert grown.match([1, 2, 3]).tolist() == [2, 1, 3, 0]
    grown.record(3, [1, 2, 3])
    assert grown.match([1, 2, 3]).tolist() == [2, 1, 3, 3]
    reordered = PrefixIndex(2)
    reordered.adopt(grown, np.array([2, 3]))  # endpoints 0 and 1 went
    assert reordered.match([1, 2, 3]).tolist() == [3, 3]
    assert len(reordered) == 3 and reordered.held(0) == 3
    reordered.forget(0)
    assert reordered.match([1, 2, 3]).tolist() == [0, 3] and reordered.held(0) == 0


def test_signals_follow_their_endpoints_and_a_joiner_is_unknown() -> None:
    clock = Clock()
    signals = Signals(2, clock=clock)
    snapshot = signals.snapshot.with_values(waiting=[3, 7], scraped_at=[clock(), clock()], up=[True, False])
    signals.publish(snapshot)
    moved = signals.moved(np.array([1, -1]))
    assert moved.snapshot.waiting[0] == 7 and np.isnan(moved.snapshot.waiting[1])
    assert moved.snapshot.up.tolist() == [False, True] and np.isnan(moved.snapshot.scraped_at[1])
    assert moved.clock is clock and len(moved.snapshot.lora) == 2
