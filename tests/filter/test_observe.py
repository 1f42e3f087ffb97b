"""Timing responses from the stream Envoy mirrors in observability mode (otel.latency_source: stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from inferlb.filter.observe import ObserveStats, time_response
from inferlb.filter.requestend import OpenLeases
from inferlb.filter.server import ExtProcService, PickerServer

from .test_server import ENDPOINTS, FakeEnvoy, destination, headers_message, make_engine, until

POOL = {address: i for i, address in enumerate(ENDPOINTS)}


def _headers(pairs: dict[str, str], *, response: bool = False, observe: bool = True) -> ProcessingRequest:
    headers = HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    )
    message = ProcessingRequest(response_headers=headers) if response else ProcessingRequest(request_headers=headers)
    message.observability_mode = observe
    return message


def _chunk(data: bytes, eos: bool = False) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=eos), observability_mode=True)


def request(endpoint: str | None = ENDPOINTS[1]) -> ProcessingRequest:
    pairs = {":path": "/v1/completions"}
    if endpoint is not None:
        pairs["x-gateway-destination-endpoint"] = endpoint
    return _headers(pairs)


def response(status: str = "200", content_type: str = "text/event-stream") -> ProcessingRequest:
    return _headers({":status": status, "content-type": content_type}, response=True)


class Clock:
    """Advances by ``step`` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def _aiter(messages: list[ProcessingRequest], consumed: list[int]) -> AsyncIterator[ProcessingRequest]:
    for message in messages:
        consumed[0] += 1
        yield message


async def timed(
    messages: list[ProcessingRequest], clock: Clock | None = None
) -> tuple[list[tuple[str, float | None, float | None]], ObserveStats, int]:
    """Run ``time_response`` over ``messages``; return what it observed, its stats and how many it read."""
    seen: list[tuple[str, float | None, float | None]] = []
    stats = ObserveStats()
    consumed = [1]
    rest = _aiter(messages[1:], consumed)
    await time_response(messages[0], rest, POOL, lambda *m: seen.append(m), stats, clock or Clock(0.25))
    return seen, stats, consumed[0]


CASES = [
    # name, messages after the request headers, (ttft?, e2e?), the stat that counts it
    ("streamed: first non-empty chunk is TTFT", [response(), _chunk(b""), _chunk(b"data: {}\n\n")], "ttft"),
    ("unstreamed: first body chunk is E2E", [response(content_type="application/json"), _chunk(b"{}", True)], "e2e"),
    (
        "content type parameters and case",
        [response(content_type="Text/Event-Stream; charset=utf-8"), _chunk(b"x")],
        "ttft",
    ),
    ("an error status is not latency", [response(status="503"), _chunk(b"{}", True)], "not_ok"),
    ("no body ever came", [response()], "unfinished"),
    ("an empty body", [response(content_type="application/json"), _chunk(b"", True)], "unfinished"),
]


@pytest.mark.parametrize(("name", "rest", "outcome"), CASES, ids=[c[0] for c in CASES])
async def test_outcomes(name: str, rest: list[ProcessingRequest], outcome: str) -> None:
    seen, stats, _ = await timed([request(), *rest])
    assert getattr(stats, outcome) == 1
    assert sum(getattr(stats, f) for f in ("ttft", "e2e", "not_ok", "unknown_endpoint", "unfinished")) == 1
    if outcome in ("ttft", "e2e"):
        [(endpoint, ttft, e2e)] = seen
        assert endpoint == ENDPOINTS[1]
        assert (ttft is not None, e2e is not None) == (outcome == "ttft", outcome == "e2e")
        assert (ttft or e2e or 0) > 0
    else:
        assert seen == []


async def test_the_time_runs_from_the_request_headers_to_the_first_token() -> None:
    clock = Clock(0.0)
    consumed = [1]

    async def messages() -> AsyncIterator[ProcessingRequest]:
        for message, wait in ((response(), 0.2), (_chunk(b""), 0.3), (_chunk(b"data: t\n\n"), 0.5)):
            clock.now += wait  # time passes before each message reaches the picker
            consumed[0] += 1
            yield message

    seen: list[tuple[str, float | None, float | None]] = []
    await time_response(request(), messages(), POOL, lambda *m: seen.append(m), ObserveStats(), clock)
    assert seen == [(ENDPOINTS[1], pytest.approx(1.0), None)]


async def test_it_stops_reading_at_the_measurement() -> None:
    # Returning ends the stream, so Envoy mirrors nothing more of a long response.
    chunks = [_chunk(b"data: %d\n\n" % i) for i in range(100)]
    _, stats, consumed = await timed([request(), response(), *chunks])
    assert stats.ttft == 1 and consumed == 3


@pytest.mark.parametrize(
    "first",
    [request(endpoint=None), request(endpoint="10.9.9.9:80"), request(endpoint=""), response()],
    ids=["no destination", "outside the pool", "empty destination", "not request headers"],
)
async def test_nothing_to_attribute_it_to(first: ProcessingRequest) -> None:
    seen, stats, consumed = await timed([first, response(), _chunk(b"x")])
    assert seen == [] and stats.unknown_endpoint == 1 and consumed == 1


# ---- through the service, over real gRPC ----------------------------------------------------------------------


Observed = list[tuple[str, float | None, float | None]]


@pytest.fixture
async def served() -> AsyncIterator[tuple[PickerServer, Observed]]:
    seen: Observed = []
    service = ExtProcService(make_engine(), max_body_bytes=4096)
    service.response_timer = lambda *m: seen.append(m)
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    yield server, seen
    await server.stop(0)


async def _mirror(server: PickerServer, messages: list[ProcessingRequest]) -> list[object]:
    """Send ``messages`` as Envoy's observing filter does (never waiting for answers); return what came back."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = external_processor_pb2_grpc.ExternalProcessorStub(channel).Process()
        raced = False
        for message in messages:
            try:
                await call.write(message)
            except asyncio.InvalidStateError:
                break  # the picker has already closed the stream
            except grpc.aio.AioRpcError:
                # The picker closed the stream while this write was under way: grpc-core then fails the write
                # and the call with INTERNAL on this side (Envoy sees the same end of stream and moves on).
                raced = True
                break
        replies = [] if raced else [reply async for reply in call]
        assert await call.code() in ((grpc.StatusCode.OK, grpc.StatusCode.INTERNAL) if raced else (grpc.StatusCode.OK,))
        return replies


async def test_the_service_times_observing_streams_and_never_answers_them(
    served: tuple[PickerServer, Observed],
) -> None:
    server, seen = served
    replies = await _mirror(server, [request(ENDPOINTS[2]), response(), _chunk(b"data: a\n\n"), _chunk(b"b")])
    assert replies == []
    await until(lambda: len(seen) == 1)
    assert seen[0][0] == ENDPOINTS[2] and seen[0][1] is not None
    assert server.service.observe_stats.ttft == 1
    assert server.service.engine.inflight.total() == 0  # an observing stream is not a routed request


async def test_without_a_timer_observing_streams_are_closed_at_once() -> None:
    service = ExtProcService(make_engine(), max_body_bytes=4096)
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        assert await _mirror(server, [request(), response(), _chunk(b"x")]) == []
        assert service.observe_stats.ttft == 0 and service.stats.routed == 0
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    ("status", "content_type", "told"),
    [
        ("200", "text/event-stream", [("r-1", 0.25, None, False)]),  # streamed: its first token
        ("200", "application/json", [("r-1", None, 0.25, False)]),  # whole: its body
        ("503", "application/json", [("r-1", None, None, True)]),  # a 5xx is a failure
        ("429", "application/json", []),  # a refusal is neither latency nor a server failure
    ],
)
async def test_the_outcome_is_told_by_request_id(status: str, content_type: str, told: list[object]) -> None:
    first = _headers({"x-gateway-destination-endpoint": ENDPOINTS[1], "x-request-id": "r-1"})
    rest = _aiter([response(status, content_type), _chunk(b"data: x")], [0])
    outcomes: list[object] = []
    await time_response(
        first, rest, POOL, lambda *m: None, ObserveStats(), Clock(0.25), outcome=lambda *o: outcomes.append(o)
    )
    assert outcomes == told


# ---- the served endpoint the data plane reports ---------------------------------------------------------------


def served_response(address: str, status: str = "200") -> ProcessingRequest:
    message = response(status, "text/event-stream")
    fields = message.metadata_context.filter_metadata["envoy.lb"].fields
    fields["x-gateway-destination-endpoint-served"].string_value = address
    return message


async def test_a_response_served_by_the_next_endpoint_listed_is_timed_for_that_one() -> None:
    # Override Host lists the picker's choices; a retry served the second, and Envoy says so.
    first = _headers({"x-gateway-destination-endpoint": f"{ENDPOINTS[1]},{ENDPOINTS[2]}", "x-request-id": "r-7"})
    reports: list[tuple[str, str]] = []
    seen: Observed = []
    stats = ObserveStats()
    rest = _aiter([served_response(ENDPOINTS[2]), _chunk(b"data: x")], [0])
    await time_response(
        first, rest, POOL, lambda *m: seen.append(m), stats, Clock(0.25), served=lambda *r: reports.append(r)
    )
    assert reports == [("r-7", ENDPOINTS[2])]
    assert [s[0] for s in seen] == [ENDPOINTS[2]] and stats.served_elsewhere == 1


async def test_a_list_of_destinations_is_timed_for_the_first_when_nothing_is_reported() -> None:
    first = _headers({"x-gateway-destination-endpoint": f"{ENDPOINTS[0]},{ENDPOINTS[1]}"})
    seen, stats = [], ObserveStats()
    await time_response(
        first, _aiter([response(), _chunk(b"x")], [0]), POOL, lambda *m: seen.append(m), stats, Clock(0.1)
    )
    assert [s[0] for s in seen] == [ENDPOINTS[0]] and stats.served_elsewhere == 0


async def test_a_served_address_outside_the_pool_moves_nothing() -> None:
    first = _headers({"x-gateway-destination-endpoint": ENDPOINTS[0], "x-request-id": "r-8"})
    seen, stats = [], ObserveStats()
    rest = _aiter([served_response("10.9.9.9:80"), _chunk(b"x")], [0])
    await time_response(first, rest, POOL, lambda *m: seen.append(m), stats, Clock(0.1))
    assert [s[0] for s in seen] == [ENDPOINTS[0]] and stats.served_elsewhere == 0


async def test_a_served_report_moves_the_held_lease_to_the_endpoint_that_served() -> None:
    """With leases (routing streams end at the decision), the observing stream's report finds the request's lease
    by its id: its in-flight count moves to the endpoint that served, and its end releases it there."""
    service = ExtProcService(make_engine(), max_body_bytes=4096, leases=OpenLeases())
    service.response_timer = lambda *m: None
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        lease = service.engine.inflight.acquire(0, 40)
        service.leases.hold("r-9", lease)
        first = _headers({"x-gateway-destination-endpoint": f"{ENDPOINTS[0]},{ENDPOINTS[1]}", "x-request-id": "r-9"})
        await _mirror(server, [first, served_response(ENDPOINTS[1]), _chunk(b"data: x")])
        await until(lambda: service.stats.served["elsewhere"] == 1)
        inflight = service.engine.inflight
        assert inflight.requests.tolist() == [0, 1, 0] and inflight.tokens.tolist() == [0, 40, 0]
        service.leases.finish("r-9")
        assert inflight.requests.tolist() == [0, 0, 0] and inflight.tokens.tolist() == [0, 0, 0]
        # A report for a request the picker does not hold (ended, or routed before a restart) changes nothing.
        await _mirror(server, [first, served_response(ENDPOINTS[2]), _chunk(b"data: x")])
        await until(lambda: service.stats.served["unknown"] == 1)
        assert inflight.requests.tolist() == [0, 0, 0]
    finally:
        await server.stop(0)


async def test_without_leases_a_served_report_moves_the_count_of_the_open_routing_stream() -> None:
    # inflight.end: stream (the Kubernetes deployment's): the routing stream holds the count until the request ends.
    service = ExtProcService(make_engine(), max_body_bytes=4096)
    service.response_timer = lambda *m: None
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        envoy = FakeEnvoy(server)
        picked = destination(await envoy.send(headers_message(eos=True)))  # x-request-id rid-1
        other = next(a for a in ENDPOINTS if a != picked)
        first = _headers({"x-gateway-destination-endpoint": picked, "x-request-id": "rid-1"})
        await _mirror(server, [first, served_response(other), _chunk(b"data: x")])
        await until(lambda: service.stats.served["elsewhere"] == 1)
        inflight = service.engine.inflight
        assert inflight.requests[ENDPOINTS.index(other)] == 1 and inflight.total() == 1
        await envoy.close()
        await until(lambda: inflight.total() == 0)
        assert service._open == {}
    finally:
        await server.stop(0)


@pytest.mark.parametrize("held", [True, False], ids=["held-lease", "open-routing-stream"])
async def test_the_first_token_takes_the_prompt_out_of_the_exact_prefill_backlog(held: bool) -> None:
    """With first tokens reported (otel.latency_source: stream), the observing stream's first chunk tells the
    request's lease: its uncached tokens leave its endpoint's prefill backlog, and the request stays counted."""
    service = ExtProcService(make_engine(), max_body_bytes=4096, leases=OpenLeases() if held else None)
    service.response_timer = lambda *m: None
    inflight = service.engine.inflight
    inflight.first_tokens = True
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        lease = inflight.acquire(1, 1200, (1000, 5000.0), streamed=True)
        if held:
            service.leases.hold("r-7", lease)  # type: ignore[union-attr]
        else:
            service._open["r-7"] = lease
        rates = np.full(3, 5000.0)
        assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 1000, 0]
        # A report for another request changes nothing.
        other = _headers({"x-gateway-destination-endpoint": ENDPOINTS[1], "x-request-id": "r-8"})
        await _mirror(server, [other, response(), _chunk(b"data: x")])
        await until(lambda: service.observe_stats.ttft == 1)
        assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 1000, 0]
        first = _headers({"x-gateway-destination-endpoint": ENDPOINTS[1], "x-request-id": "r-7"})
        await _mirror(server, [first, response(), _chunk(b"data: x")])
        await until(lambda: service.observe_stats.ttft == 2)
        assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 0, 0]
        assert inflight.requests.tolist() == [0, 1, 0]  # still in flight until its end
    finally:
        await server.stop(0)
