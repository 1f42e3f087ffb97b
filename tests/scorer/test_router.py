"""Tests for scorer/router.py: the routing unit both the ext_proc service and the simulator call. Admission,
the decision and the in-flight lease with its prefill backlog, on a clock the test moves."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from inferlb.bench.policies import PresetPolicy
from inferlb.filter.server import ExtProcService
from inferlb.scorer.classes import Classifier, ClassRule, RequestClass
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import UnknownModelError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import DRAIN_SHARE
from inferlb.scorer.loadscorers import ATTENTION_TOKENS, DEFAULT_PREFILL_TOKENS_PER_S
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.router import Router
from inferlb.scorer.signals import Signals
from inferlb.scorer.speeds import ServerSpeeds
from inferlb.sim.profiles import get_profile

BATCH = RequestClass("batch", on_saturation="shed", retry_after_s=7)
PROMPT = RequestFeatures(model="m", prompt_tokens=1000, request_id="r1")


def router(clock, preset: str = "default", waiting: list[float] | None = None, rules=()) -> Router:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(3)])
    signals = Signals(3, stale_after_s=1.0, clock=clock)
    if waiting is not None:
        signals.publish(signals.snapshot.with_values(waiting=waiting, kv_usage=[0.1] * 3, scraped_at=[clock()] * 3))
    engine = Engine(pool, build_profile(preset, np.random.default_rng(0), size=3), signals=signals)
    return Router(engine, Classifier(rules), poll_s=3600)


def test_a_routed_request_is_counted_with_its_prefill_backlog_until_its_lease_ends(clock) -> None:
    r = router(clock)
    admit = r.admit(PROMPT)
    assert admit.verdict == "go" and admit.request.request_class == "default"
    routed = r.route(admit.request)
    index = routed.decision.endpoint.index
    inflight = r.engine.inflight
    assert (inflight.requests[index], inflight.tokens[index], inflight.sent[index]) == (1, 1000, 1)
    # The default preset's predicted-TTFT scorer estimated the prompt's prefill there (its 1,000 tokens' work, with
    # their attention over the 500 before each on average): the lease queued it.
    work = 1000 * (1 + 500 / ATTENTION_TOKENS)
    assert routed.decision.prefill == pytest.approx((work, DEFAULT_PREFILL_TOKENS_PER_S))
    rates = np.full(3, DEFAULT_PREFILL_TOKENS_PER_S)
    assert inflight.pending_prefill(np.arange(3), rates)[index] == pytest.approx(work)
    routed.lease.release()
    routed.lease.release()  # idempotent
    assert inflight.total() == 0 and inflight.tokens[index] == 0
    clock.advance(0.025 / DRAIN_SHARE)  # the backlog drains on the routing clock, not at the request's end
    assert inflight.pending_prefill(np.arange(3), rates)[index] == pytest.approx(work - 500)


def test_decisions_and_request_features_are_immutable(clock) -> None:
    r = router(clock)
    routed = r.route(r.admit(PROMPT).request)
    with pytest.raises(AttributeError):
        routed.decision.reason = "saturated"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        routed.lease = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROMPT.priority = 3  # type: ignore[misc]
    assert PROMPT.request_class is None  # admission returned a new object


def test_a_request_that_waited_out_is_routed_as_saturated(clock) -> None:
    r = router(clock, "least-request", waiting=[50, 50, 50])
    admit = r.admit(PROMPT)
    assert admit.verdict == "wait" and list(admit.candidates) == [0, 1, 2]
    routed = r.route(admit.request, saturated=True)
    assert routed.decision.reason == "saturated"
    assert r.route(admit.request).decision.reason == "best-score"


def test_a_shed_class_is_shed_only_when_every_endpoint_is_saturated(clock) -> None:
    rules = (ClassRule(BATCH, min_prompt_tokens=0),)
    r = router(clock, "least-request", waiting=[50, 50, 0], rules=rules)
    assert r.admit(PROMPT).verdict == "go"
    r.engine.signals.publish(r.engine.signals.snapshot.with_values(waiting=[50, 50, 50]))
    admit = r.admit(PROMPT)
    assert (admit.verdict, admit.request.request_class) == ("shed", "batch")
    clock.advance(5)  # every scrape is stale now: nothing is known, so nothing is saturated
    assert r.admit(PROMPT).verdict == "go"


def test_an_unknown_model_goes_ahead_to_be_refused_by_the_pick_with_the_reason(clock) -> None:
    r = router(clock, waiting=[50, 50, 50])
    admit = r.admit(dataclasses.replace(PROMPT, model="other"))
    assert admit.verdict == "go"
    with pytest.raises(UnknownModelError):
        r.route(admit.request)
    assert r.engine.inflight.total() == 0


def test_the_service_and_the_simulator_route_through_the_routing_unit() -> None:
    pool = Pool([EndpointConfig("10.0.0.1:8000", None)])
    service = ExtProcService(Engine(pool, build_profile("default", size=1)), max_body_bytes=1 << 20)
    policy = PresetPolicy("default", [get_profile("h100-llama3.1-8b")], seed=0)
    assert isinstance(service.router, Router) and isinstance(policy.router, Router)
    assert policy.signals.clock() == 0.0 and math.isfinite(policy.router.queue.poll_s)


def test_the_default_spreads_requests_whose_prompt_it_does_not_read(clock) -> None:
    # A headers-only route: no prompt, so the token scorers and the TTFT prediction tie once the one-token backlog
    # drains; the in-flight count (weight 0.25 in the default) is what keeps the requests level.
    r = router(clock, waiting=[0, 0, 0])
    headers_only = RequestFeatures(model="m", request_id="h")
    leases = []
    for _ in range(30):
        leases.append(r.route(r.admit(headers_only).request).lease)
        clock.advance(0.01)
        loads = r.engine.inflight.requests
        assert loads.max() - loads.min() <= 1, loads
    assert r.engine.inflight.requests.tolist() == [10, 10, 10]


def test_a_server_that_holds_the_shared_prefix_but_stops_finishing_loses_the_traffic(clock) -> None:
    # Every request shares one prompt; the server the first went to caches it and then stops finishing requests
    # (slowed), while the others finish each at once. Its cache credit must end once it holds more than 2x (the
    # other servers' mean in-flight requests + 1), that is at 3 here: against a mean that counted it, it took 7
    # with three servers, and in the demo a slowed server kept a quarter of the traffic that way.
    r = router(clock, waiting=[0, 0, 0])
    shared = tuple(range(100, 130))
    slow, held = None, []
    for i in range(40):
        request = RequestFeatures(model="m", prompt_tokens=2000, prefix_hashes=shared, request_id=f"q{i}")
        routed = r.route(r.admit(request).request)
        endpoint = routed.decision.endpoint.index
        slow = endpoint if slow is None else slow
        if endpoint == slow:
            held.append(routed.lease)
        else:
            routed.lease.release()
        clock.advance(0.05)
    assert len(held) == 3


def test_the_default_does_not_leave_a_slow_server_as_the_only_candidate_when_the_fast_ones_are_saturated(clock) -> None:
    # Two fast servers with queues over the saturation threshold (16), one four times slower under it but seconds
    # of prefill behind. Filtering saturation first left the slow one as the only candidate, and every request
    # until the next scrape went there; the ttft-gap filter comes first now and drops it.
    r = router(clock, waiting=[20, 20, 0])
    rates = [40_000.0, 40_000.0, 10_000.0]
    snapshot = r.engine.signals.snapshot.with_values(prefill_tokens_per_s=rates, peak_tokens_per_s=rates)
    r.engine.signals.publish(snapshot)
    r.engine.inflight.acquire(2, 0, (40_000, rates[2]))  # 4 s of prefill queued on the slow server
    admit = r.admit(PROMPT)
    assert admit.verdict == "go"  # one server is not saturated: admission lets the request go
    routed = r.route(admit.request)
    assert routed.decision.endpoint.index in (0, 1)
    assert routed.decision.reason == "best-score"


def test_room_that_comes_goes_to_the_waiters_before_newcomers_of_their_priority_or_lower(clock) -> None:
    # Once, newcomers that found room between two ticks of the queue took it at once, and a higher-priority request
    # that had waited for it waited out its max_wait_s.
    urgent_class = RequestClass("urgent", priority=10, max_wait_s=0.5)
    rule = ClassRule(urgent_class, header_values=frozenset({"urgent"}))
    r = router(clock, "default", waiting=[20, 20, 20], rules=(rule,))
    urgent = r.admit(RequestFeatures(model="m", request_id="u", class_hint="urgent"))
    assert urgent.verdict == "wait"
    waiter = r.queue.enter(urgent.candidates, urgent_class.priority, urgent_class.max_wait_s)
    signals = r.engine.signals  # a scrape: endpoint 0 has room for two more (max_waiting 16)
    signals.publish(signals.snapshot.with_values(waiting=[14, 20, 20], scraped_at=[clock()] * 3))
    newcomers = [r.admit(RequestFeatures(model="m", request_id=f"n{i}")) for i in range(3)]
    assert [a.verdict for a in newcomers] == ["wait"] * 3  # behind the urgent one
    clock.advance(0.02)
    r.queue.release()
    assert waiter.outcome is True  # the room was the urgent request's
    assert r.admit(RequestFeatures(model="m", request_id="later")).verdict == "go"  # no one waits any more


def test_a_newcomer_of_a_higher_priority_does_not_queue_behind_lower_ones(clock) -> None:
    urgent_class = RequestClass("urgent", priority=10, max_wait_s=0.5)
    rule = ClassRule(urgent_class, header_values=frozenset({"urgent"}))
    r = router(clock, "default", waiting=[20, 20, 20], rules=(rule,))
    low = r.admit(RequestFeatures(model="m", request_id="low"))
    r.queue.enter(low.candidates, 0, 0.5)
    signals = r.engine.signals
    signals.publish(signals.snapshot.with_values(waiting=[14, 20, 20], scraped_at=[clock()] * 3))
    assert r.admit(RequestFeatures(model="m", request_id="u", class_hint="urgent")).verdict == "go"


def test_a_request_retried_elsewhere_teaches_the_servers_speeds_nothing(clock) -> None:
    # Its timing holds the failed attempt on the first server and the work of the second: it was credited whole to
    # the first, as if that server had prefilled it.
    r = router(clock)
    r.speeds = ServerSpeeds(3, clock, prior_requests=0.0, min_requests=1)
    for rid, served_elsewhere in (("moved", True), ("stayed", False)):
        routed = r.route(r.admit(dataclasses.replace(PROMPT, request_id=rid)).request)
        index = routed.decision.endpoint.index
        address = r.pool.endpoints[(index + 1) % 3 if served_elsewhere else index].address
        outcome = r.served(routed.lease, address, request_id=rid)
        assert outcome == ("elsewhere" if served_elsewhere else "as-picked")
        clock.advance(0.2)
        assert r.speeds.observed(rid, 0.2, None) is (not served_elsewhere)
        routed.lease.release()
