"""Tests for otel/receiver.py: the join rule (one span per decision, a server speaks only for itself), the
TraceJoin's bounds, and that memory levels off however many spans join."""

from __future__ import annotations

import gc
import ipaddress
import os
import tracemalloc

import pytest

from inferlb.otel.heatmap import HeatmapAggregator
from inferlb.otel.latency import EndpointLatency
from inferlb.otel.receiver import CHILD_COUNTERS, ReceiverStats, SpanJoiner, TraceJoin
from inferlb.otel.spanwire import SpanRecord
from inferlb.scorer.networks import Networks

ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"]
HOSTS = [ipaddress.ip_address(a) for a in ("10.0.0.1", "10.0.0.2", "fd00::3")]  # where each endpoint's spans come from
TRACE = b"\x07" * 16


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(
    join: TraceJoin | None = None, *, by_name: bool = True, relays: tuple[str, ...] = ()
) -> tuple[SpanJoiner, list[tuple[int, float | None, float | None]]]:
    seen: list[tuple[int, float | None, float | None]] = []
    joiner = SpanJoiner(
        lambda e, t, x: seen.append((e, t, x)),
        ENDPOINTS,
        join if join is not None else TraceJoin(),
        ReceiverStats(),
        by_name=by_name,
        relays=Networks.of(relays),
    )
    return joiner, seen


def record(trace_id: bytes | None = None, server: str | None = None, ttft: float = 0.2) -> SpanRecord:
    return SpanRecord(trace_id, server, ttft, 1.5, 1_700_000_000.0)


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_a_trace_id_joins_one_span_from_its_endpoints_host_and_later_ones_are_duplicates() -> None:
    joiner, seen = make()
    joiner.join.record(TRACE, 1)
    for sender in ("192.0.2.9", "10.0.0.1", "127.0.0.1"):  # a forger who knows the trace id of a request it sent
        joiner.add(ip(sender), record(TRACE, ttft=600.0))
    assert seen == [] and joiner.stats.unverified == 3
    assert joiner.join.get(TRACE) == 1  # the decision waits for its server's span
    for _ in range(2000):
        joiner.add(ip("10.0.0.2"), record(TRACE))
    assert seen == [(1, 0.2, 1.5)]
    assert (joiner.stats.joined_by_trace, joiner.stats.duplicate) == (1, 1999)
    assert len(joiner.join) == 0


@pytest.mark.parametrize(
    ("sender", "joined"),
    [
        pytest.param("192.0.2.9", True, id="a-relay"),
        pytest.param("192.0.3.9", False, id="not-a-relay"),
        pytest.param(None, False, id="unknown-sender"),
    ],
)
def test_a_relay_may_pass_on_any_endpoints_span(sender: str | None, joined: bool) -> None:
    # An OpenTelemetry Collector sends the servers' spans from its own address (otel.relays).
    joiner, seen = make(relays=("192.0.2.0/24",))
    joiner.join.record(TRACE, 2)
    joiner.add(ip(sender) if sender else None, record(TRACE))
    assert seen == ([(2, 0.2, 1.5)] if joined else [])
    assert (joiner.stats.joined_by_trace, joiner.stats.unverified) == ((1, 0) if joined else (0, 1))


@pytest.mark.parametrize(
    ("sender", "outcome"),
    [
        pytest.param("10.0.0.1", "joined_by_resource", id="its-own-host"),
        pytest.param("10.0.0.2", "unverified", id="a-neighbour"),
        pytest.param("127.0.0.1", "unverified", id="loopback"),
        pytest.param(None, "unverified", id="unknown-sender"),
    ],
)
def test_a_span_naming_an_endpoint_counts_only_from_that_endpoints_host(sender: str | None, outcome: str) -> None:
    joiner, seen = make()
    joiner.add(ipaddress.ip_address(sender) if sender else None, record(os.urandom(16), "10.0.0.1:8000"))
    assert seen == ([(0, 0.2, 1.5)] if outcome == "joined_by_resource" else [])
    counts = {k: getattr(joiner.stats, k) for k in ("joined_by_resource", "unverified", "unjoined", "duplicate")}
    assert counts == {k: int(k == outcome) for k in counts}


def test_by_default_a_name_joins_nothing_even_from_the_endpoints_own_host() -> None:
    # Where servers share a host (or a client runs on one, as on loopback), the host proves nothing.
    joiner, seen = make(by_name=False)
    for _ in range(2000):
        joiner.add(ip("10.0.0.1"), record(os.urandom(16), "10.0.0.1:8000", ttft=20.0))
    assert seen == [] and joiner.stats.unverified == 2000 and joiner.stats.joined_by_resource == 0
    joiner.join.record(TRACE, 0)
    joiner.add(ip("10.0.0.1"), record(TRACE, "10.0.0.1:8000"))
    assert seen == [(0, 0.2, 1.5)]  # a decision's trace id still joins


def test_ipv6_endpoints_are_verified_by_their_host() -> None:
    joiner, seen = make()
    joiner.add(ip("fd00::3"), record(None, "[fd00::3]:8000"))
    assert seen == [(2, 0.2, 1.5)]


def test_the_trace_id_wins_over_the_name_and_a_span_naming_nothing_is_unjoined() -> None:
    joiner, seen = make()
    joiner.join.record(TRACE, 2)
    joiner.add(ip("fd00::3"), record(TRACE, "10.0.0.1:8000"))
    joiner.add(ip("10.0.0.1"), record(os.urandom(16), None))
    joiner.add(ip("10.0.0.1"), record(None, "10.9.9.9:1"))
    assert seen == [(2, 0.2, 1.5)]
    assert (joiner.stats.joined_by_trace, joiner.stats.unjoined) == (1, 2)


def test_the_heatmap_gets_joined_spans_at_their_end_time() -> None:
    heatmap = HeatmapAggregator(bucket_s=10)
    joiner = SpanJoiner(lambda e, t, x: None, ENDPOINTS, TraceJoin(), ReceiverStats(), heatmap=heatmap, by_name=True)
    joiner.add(ip("10.0.0.2"), record(None, "10.0.0.2:8000"))
    joiner.add(ip("10.0.0.1"), record(None, "10.0.0.2:8000"))  # unverified: not in the heatmap either
    grid = heatmap.grid()
    assert grid["endpoints"] == ["10.0.0.2:8000"] and grid["count"] == [[1]]
    assert grid["times"] == [1_700_000_000.0]


def test_an_envoy_trace_id_recorded_beside_ours_is_consumed_with_it() -> None:
    joiner, seen = make()
    envoy = b"\x08" * 16
    joiner.join.record(TRACE, 1, also=envoy)
    joiner.add(ip("10.0.0.2"), record(envoy))
    joiner.add(ip("10.0.0.2"), record(TRACE))
    assert seen == [(1, 0.2, 1.5)] and joiner.stats.unjoined == 1
    assert len(joiner.join) == 0


def test_recording_a_trace_id_again_makes_it_joinable_once_more() -> None:
    join = TraceJoin()
    join.record(TRACE, 0)
    assert join.consume(TRACE) == 0 and join.joined(TRACE)
    join.record(TRACE, 2)  # the client reused its traceparent for a new request
    assert not join.joined(TRACE) and join.consume(TRACE) == 2 and join.consume(TRACE) is None


def _spans_outcomes(joiner: SpanJoiner) -> list[tuple[str, float | None]]:
    outcomes: list[tuple[str, float | None]] = []
    joiner.outcome = lambda request_id, span: outcomes.append((request_id, span.ttft_s))
    return outcomes


def test_requests_of_one_trace_each_join_the_span_that_names_their_own_span_id() -> None:
    # A client's agent sends its calls in one trace (the same traceparent): each call is a decision of its own, and
    # its server's span (whose parent is the span id the picker put in that call's traceparent) joins it, whatever
    # order the spans come in. Before, the newer decision replaced the older: the first call's span was taken as
    # the second call's outcome, and the second's span was a duplicate.
    joiner, seen = make()
    outcomes = _spans_outcomes(joiner)
    first, second = b"\x01" * 8, b"\x02" * 8
    joiner.join.record(TRACE, 1, request_id="call-1", span_id=first)
    joiner.join.record(TRACE, 1, request_id="call-2", span_id=second)
    joiner.add(ip("10.0.0.2"), SpanRecord(TRACE, None, 5.0, 6.0, 1_700_000_000.0, parent_id=second))
    joiner.add(ip("10.0.0.2"), SpanRecord(TRACE, None, 0.1, 0.5, 1_700_000_000.0, parent_id=first))
    assert outcomes == [("call-2", 5.0), ("call-1", 0.1)]
    assert seen == [(1, 5.0, 6.0), (1, 0.1, 0.5)] and joiner.stats.joined_by_trace == 2
    joiner.add(ip("10.0.0.2"), SpanRecord(TRACE, None, 0.1, 0.5, 1_700_000_000.0, parent_id=first))
    assert joiner.stats.duplicate == 1 and len(seen) == 2


def test_a_span_of_an_unknown_parent_joins_the_oldest_decision_of_its_trace_it_may_speak_for() -> None:
    # With Envoy's tracer on, Envoy's span sits between the picker's and the server's: the server's span names a
    # parent the picker never saw. It joins the oldest of its trace's decisions that its sender may report on, and
    # a duplicate of it takes no other decision.
    joiner, _seen = make()
    outcomes = _spans_outcomes(joiner)
    joiner.join.record(TRACE, 0, request_id="to-0", span_id=b"\x01" * 8)
    joiner.join.record(TRACE, 1, request_id="to-1", span_id=b"\x02" * 8)
    joiner.join.record(TRACE, 1, request_id="to-1-again", span_id=b"\x03" * 8)
    envoys = b"\x0e" * 8
    joiner.add(ip("10.0.0.2"), SpanRecord(TRACE, None, 0.3, 1.0, 1_700_000_000.0, parent_id=envoys))
    joiner.add(ip("10.0.0.2"), SpanRecord(TRACE, None, 0.3, 1.0, 1_700_000_000.0, parent_id=envoys))
    joiner.add(ip("192.0.2.9"), SpanRecord(TRACE, None, 9.0, 9.0, 1_700_000_000.0, parent_id=b"\x0f" * 8))
    joiner.add(ip("10.0.0.1"), SpanRecord(TRACE, None, 0.2, 1.0, 1_700_000_000.0, parent_id=b"\x0d" * 8))
    assert outcomes == [("to-1", 0.3), ("to-0", 0.2)]
    assert (joiner.stats.duplicate, joiner.stats.unverified) == (1, 1)
    assert joiner.join.get(TRACE) == 1 and len(joiner.join) == 1


def test_a_span_of_an_unknown_parent_looks_at_one_decision_per_endpoint_whatever_the_trace_holds() -> None:
    # A client chooses its trace id: it could pile thousands of decisions into one trace on an endpoint whose host
    # sends no spans, and each span of the trace from another host walked past all of them (13 ms a span at 20,000,
    # on the routing loop).
    join = TraceJoin()
    for i in range(5000):
        join.record(TRACE, 0, span_id=i.to_bytes(8, "big"))
    join.record(TRACE, 1, request_id="the-one", span_id=b"\xff" * 8)
    asked: list[int] = []

    def speaks_for(endpoint: int) -> bool:
        asked.append(endpoint)
        return endpoint == 1

    key = join.find(TRACE, b"\xee" * 8, speaks_for)
    assert key is not None and join.endpoint_of(key) == 1 and sorted(asked) == [0, 1]
    assert join.take_key(key) == (1, "the-one")
    # Without one it may speak for, the oldest of the trace (which the caller counts as unverified).
    oldest = join.find(TRACE, b"\xee" * 8, lambda endpoint: False)
    assert oldest == TRACE + (0).to_bytes(8, "big")


def test_the_trace_join_is_bounded_by_size() -> None:
    join = TraceJoin(capacity=4)
    for i in range(1000):
        join.record(i.to_bytes(16, "big"), i % 3)
    assert len(join) == 4 and join.evicted == 996
    assert join.get((0).to_bytes(16, "big")) is None and join.get((999).to_bytes(16, "big")) == 999 % 3
    for i in range(1000):
        join.consume(i.to_bytes(16, "big"))
    assert len(join) == 0 and join.remembered == 1  # capacity // 4


def test_the_trace_join_forgets_decisions_whose_span_never_came() -> None:
    clock = Clock()
    join = TraceJoin(max_age_s=300, clock=clock)
    join.record(TRACE, 1)
    clock.now += 301
    assert join.consume(TRACE) is None and join.expired == 1
    join.record(b"\x01" * 16, 0)
    join.record(b"\x02" * 16, 0)
    clock.now += 200
    join.record(b"\x03" * 16, 0)
    clock.now += 200
    join.expire()
    assert len(join) == 1 and join.get(b"\x03" * 16) == 0 and join.expired == 3


def test_joined_trace_ids_are_remembered_for_as_long_as_decisions() -> None:
    clock = Clock()
    join = TraceJoin(capacity=32, max_age_s=60, clock=clock)
    for i in range(100):
        join.record(i.to_bytes(16, "big"), 0)
        join.consume(i.to_bytes(16, "big"))
    assert join.remembered == 8 and join.joined((99).to_bytes(16, "big")) and not join.joined((91).to_bytes(16, "big"))
    clock.now += 61
    join.expire()
    assert join.remembered == 0 and not join.joined((99).to_bytes(16, "big"))


def test_counters_from_the_receiver_process_cannot_set_the_pickers_own() -> None:
    stats = ReceiverStats()
    stats.add({"spans": 5, "joined_by_trace": 10**9, "malformed": True, "out_of_bounds": -3, "requests": "7"})
    assert stats.spans == 5 and stats.joined_by_trace == stats.malformed == stats.out_of_bounds == 0
    assert stats.requests == 0 and set(CHILD_COUNTERS) <= set(stats.as_dict())


def test_the_receivers_refusals_of_half_sent_calls_reach_the_picker() -> None:
    # The receiver process counts calls refused before their message (busy slots, too slow, cut off); the picker
    # took only the names it listed, so these were counted in the child and shown nowhere.
    stats = ReceiverStats()
    stats.add({"busy_requests": 2, "slow_requests": 8, "incomplete_requests": 1})
    assert (stats.busy_requests, stats.slow_requests, stats.incomplete_requests) == (2, 8, 1)


def test_memory_levels_off_when_spans_join() -> None:
    # 10 requests a second for 30 simulated minutes: each decision's span comes back 5 s later, except every
    # tenth, whose span never comes. What the join, the statistics and the heatmap hold must stop growing once
    # their windows are full (the join's 300 s; the heatmap's, shortened here to 5 min) instead of growing with
    # every span.
    clock = Clock(1_700_000_000.0)
    join = TraceJoin(capacity=65536, max_age_s=300, clock=clock)
    latency = EndpointLatency(len(ENDPOINTS), window_s=60, half_life_s=10, clock=clock)
    heatmap = HeatmapAggregator(bucket_s=10, max_buckets=30)
    joiner = SpanJoiner(latency.observe, ENDPOINTS, join, ReceiverStats(), heatmap=heatmap)
    rate, lag = 10, 50  # decisions per second; spans come back 5 s (50 decisions) later
    waiting: list[bytes | None] = []
    sizes: dict[int, int] = {}
    tracemalloc.start()
    try:
        for n in range(1, rate * 1800 + 1):
            clock.now += 1 / rate
            trace_id = n.to_bytes(16, "big")
            join.record(trace_id, n % 3)
            waiting.append(trace_id if n % 10 else None)
            if len(waiting) > lag:
                back = waiting.pop(0)
                if back is not None:
                    joiner.add(HOSTS[int.from_bytes(back, "big") % 3], SpanRecord(back, None, 0.2, 1.5, clock.now))
            if n % (rate * 120) == 0:
                gc.collect()
                sizes[n // (rate * 60)] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert joiner.stats.joined_by_trace == (rate * 1800 - lag) * 9 // 10
    # Decisions still waiting: the ones in flight, plus 300 s of those whose span never came.
    assert len(join) <= lag + rate * 300 // 10 + rate
    assert join.remembered <= min(rate * 300 + rate, join.capacity // 4)
    assert len(heatmap.grid()["times"]) <= heatmap.max_buckets
    settled = [size for minute, size in sizes.items() if minute > 10]
    assert max(settled) - min(settled) < 64 * 1024, sizes


def test_a_span_joined_by_trace_tells_its_requests_outcome_and_one_joined_by_name_does_not() -> None:
    join = TraceJoin()
    joiner, seen = make(join)
    told: list[tuple[str, float | None, float | None]] = []
    joiner.outcome = lambda rid, record: told.append((rid, record.ttft_s, record.e2e_s))
    join.record(TRACE, 1, request_id="req-1")
    join.record(b"\x08" * 16, 0)  # a decision without a request id
    joiner.add(HOSTS[1], record(TRACE, ttft=0.3))
    joiner.add(HOSTS[0], record(b"\x08" * 16))
    joiner.add(HOSTS[0], record(None, ENDPOINTS[0]))  # joined by name: no request to tell of
    assert told == [("req-1", 0.3, 1.5)]
    assert [e for e, _, _ in seen] == [1, 0, 0]
    joiner.add(HOSTS[1], record(TRACE))  # a duplicate tells nothing more
    assert len(told) == 1
