"""Tests for filter/requestend.py and the routing stream's end: with leases, the picker ends the stream at its
decision and the request stays counted until Envoy's access log reports its end (or the lease ages out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry, HTTPRequestProperties
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpHeaders, ProcessingRequest
from google.protobuf import text_format

from inferlb.filter.request import MAX_CLIENT_KEY_CHARS, client_key
from inferlb.filter.requestend import UNBROKEN_AGE_FACTOR, AccessLogReceiver, OpenLeases, _request_ids_message
from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.inflight import InFlight

from .test_server import ENDPOINTS, FakeEnvoy, destination, make_engine, until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_ends_when_its_request_id_is_reported() -> None:
    inflight = InFlight(2)
    leases = OpenLeases()
    leases.hold("a", inflight.acquire(0, 10))
    leases.hold("b", inflight.acquire(1, 20))
    assert inflight.requests.tolist() == [1, 1] and len(leases) == 2
    assert leases.finish("a") and inflight.requests.tolist() == [0, 1]
    assert not leases.finish("a")  # reported twice: the second changes nothing
    assert not leases.finish("never-routed")
    assert (leases.stats.ended, leases.stats.unknown_entries) == (1, 2)
    assert leases.finish("b") and inflight.tokens.tolist() == [0, 0] and len(leases) == 0


def test_the_access_log_parser_reads_the_request_ids_of_what_envoy_sends() -> None:
    """Envoy's entries carry far more than the request id (this one is shaped like Envoy 1.40's); the receiver's
    parser reads the ids, in order, and skips the rest, however it is laid out."""
    entry = HTTPAccessLogEntry()
    text_format.Parse(
        'common_properties { downstream_remote_address { socket_address { address: "127.0.0.1" port_value: 46052 } }'
        ' start_time { seconds: 1796170706 } duration { nanos: 6951367 } upstream_cluster: "inferlb_picked"'
        ' metadata { filter_metadata { key: "envoy.lb" value { fields { key: "x-gateway-destination-endpoint"'
        ' value { string_value: "127.0.0.1:26663" } } } } } route_name: "picked" stream_id: "s" }'
        ' protocol_version: HTTP11 request { request_method: POST path: "/v1/completions" user_agent: "u"'
        ' request_headers_bytes: 369 } response { response_code { value: 200 } response_code_details: "via_upstream" }',
        entry,
    )
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "inferlb.request_end"
    for request_id in ("r1", "r2", ""):
        added = message.http_logs.log_entry.add()
        added.CopyFrom(entry)
        added.request.request_id = request_id
    parsed = _request_ids_message().FromString(message.SerializeToString())
    assert [e.request.request_id for e in parsed.http_logs.log_entry] == ["r1", "r2", ""]


def test_a_repeated_request_id_ends_one_lease_per_report() -> None:
    inflight = InFlight(1)
    leases = OpenLeases()
    for _ in range(3):
        leases.hold("same", inflight.acquire(0, 1))
    assert leases.finish("same") and leases.finish("same")
    assert inflight.requests[0] == 1
    assert leases.finish("same") and inflight.requests[0] == 0


def test_an_unreported_lease_ages_out_and_is_counted() -> None:
    clock = Clock()
    inflight = InFlight(1)
    leases = OpenLeases(max_age_s=60, clock=clock)
    leases.hold("lost", inflight.acquire(0, 5))
    clock.now += 30
    leases.may_have_lost()  # Envoy's access-log stream broke: what it held went with it
    leases.hold("kept", inflight.acquire(0, 5))
    clock.now += 31
    assert leases.expire() == 1 and inflight.requests[0] == 1 and leases.stats.expired == 1
    assert not leases.finish("lost")  # its report comes too late to count twice
    assert leases.finish("kept") and inflight.requests[0] == 0


def test_a_long_request_holds_back_nothing_that_ended_after_it() -> None:
    # One request streaming for an hour must not keep the entries of the thousands that started and ended since.
    inflight = InFlight(1)
    leases = OpenLeases()
    leases.hold("streams-for-an-hour", inflight.acquire(0, 1))
    for i in range(10_000):
        leases.hold(f"r{i}", inflight.acquire(0, 1))
        assert leases.finish(f"r{i}")
    assert len(leases) == 1 and len(leases._held) == 1 and len(leases._by_id) == 1
    assert inflight.requests[0] == 1


def test_leases_are_bounded() -> None:
    inflight = InFlight(1)
    leases = OpenLeases(capacity=100)
    for i in range(250):
        leases.hold(f"r{i}", inflight.acquire(0, 1))
    assert len(leases) == 100 and inflight.requests[0] == 100 and leases.stats.evicted == 150
    assert not leases.finish("r0") and leases.finish("r249")
    leases.release_all()
    assert inflight.requests[0] == 0 and len(leases) == 0


@pytest.fixture
async def picker() -> AsyncIterator[PickerServer]:
    service = ExtProcService(make_engine(), max_body_bytes=4096, leases=OpenLeases())
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    yield server
    await server.stop(0)


def _headers(request_id: str | None) -> ProcessingRequest:
    pairs = [(":path", "/v1/embeddings"), (":method", "POST")]
    if request_id is not None:
        pairs.append(("x-request-id", request_id))
    return ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]), end_of_stream=True
        )
    )


async def _report_ends(server: PickerServer, *request_ids: str) -> None:
    """What Envoy's gRPC access logger sends: one stream, entries in a batch."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        message = als_pb2.StreamAccessLogsMessage()
        message.identifier.log_name = "inferlb.request_end"
        for request_id in request_ids:
            message.http_logs.log_entry.append(HTTPAccessLogEntry(request=HTTPRequestProperties(request_id=request_id)))

        async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
            yield message

        await stub.StreamAccessLogs(messages(), timeout=5)


async def test_the_routing_stream_ends_at_the_decision_and_the_access_log_ends_the_count(
    picker: PickerServer,
) -> None:
    envoy = FakeEnvoy(picker)
    address = destination(await envoy.send(_headers("req-1")))
    # The picker ends the stream itself: nothing ties this request to the picker's life any more.
    assert await asyncio.wait_for(envoy.call.read(), 5) is grpc.aio.EOF
    assert await asyncio.wait_for(envoy.call.code(), 5) == grpc.StatusCode.OK
    inflight = picker.service.engine.inflight
    index = ENDPOINTS.index(address)
    assert inflight.requests[index] == 1  # still in flight: Envoy has not reported the end
    await _report_ends(picker, "someone-else", "req-1")
    await until(lambda: inflight.total() == 0)
    assert picker.service.leases is not None and picker.service.leases.stats.unknown_entries == 1
    await envoy.channel.close()


async def test_a_long_request_id_is_kept_as_a_digest_and_its_reported_end_still_finds_it(picker: PickerServer) -> None:
    # Behind a gateway that passes a client's id on, the id may be tens of KB: the picker keeps a digest, and the
    # access log's copy of the id (whole) comes to the same key.
    long_id = "x" * 20_000
    envoy = FakeEnvoy(picker)
    destination(await envoy.send(_headers(long_id)))
    inflight = picker.service.engine.inflight
    leases = picker.service.leases
    assert leases is not None and inflight.total() == 1
    (kept,) = leases._by_id
    assert kept == client_key(long_id) and len(kept) <= MAX_CLIENT_KEY_CHARS
    await _report_ends(picker, "x" * 19_999 + "y", long_id)  # another id of the same length ends nothing of it
    await until(lambda: inflight.total() == 0)
    assert leases.stats.unknown_entries == 1
    await envoy.channel.close()


async def test_a_request_without_an_id_keeps_its_stream_and_ends_with_it(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    destination(await envoy.send(_headers(None)))
    inflight = picker.service.engine.inflight
    assert inflight.total() == 1
    await envoy.close()
    await until(lambda: inflight.total() == 0)


async def test_without_leases_the_stream_stays_open_until_envoy_closes_it() -> None:
    server = PickerServer(ExtProcService(make_engine(), max_body_bytes=4096), "127.0.0.1:0")
    await server.start()
    try:
        envoy = FakeEnvoy(server)
        destination(await envoy.send(_headers("req-2")))
        read = asyncio.ensure_future(envoy.call.read())
        done, _ = await asyncio.wait([read], timeout=0.2)
        assert not done  # open: the request's end is the stream's end
        await _report_ends(server, "req-2")  # an access log without leases ends nothing
        assert server.service.engine.inflight.total() == 1
        await envoy.call.done_writing()
        await asyncio.wait_for(read, 5)
        await until(lambda: server.service.engine.inflight.total() == 0)
        await envoy.channel.close()
    finally:
        await server.stop(0)


async def test_leases_carry_many_requests_without_holding_streams(picker: PickerServer) -> None:
    ids = [f"r{i}" for i in range(30)]
    for request_id in ids:
        envoy = FakeEnvoy(picker)
        destination(await envoy.send(_headers(request_id)))
        assert await asyncio.wait_for(envoy.call.read(), 5) is grpc.aio.EOF
        await envoy.channel.close()
    inflight = picker.service.engine.inflight
    assert inflight.total() == 30 and np.all(inflight.requests == 10)  # least-request spread them evenly
    await _report_ends(picker, *ids)
    await until(lambda: inflight.total() == 0)


async def test_stopping_ends_envoys_open_access_log_streams() -> None:
    service = ExtProcService(make_engine(), max_body_bytes=4096, leases=OpenLeases())
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = als_pb2_grpc.AccessLogServiceStub(channel)
    sent = asyncio.Event()

    async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        yield als_pb2.StreamAccessLogsMessage()
        sent.set()
        await asyncio.Event().wait()  # Envoy keeps its stream open for as long as it runs

    call = stub.StreamAccessLogs(messages())
    await sent.wait()
    await until(lambda: service.leases is not None and service.leases.stats.log_streams == 1)
    # A grace far longer than the test's own timeout: the stop must not wait for the open stream.
    await asyncio.wait_for(server.stop(grace=600), 30)
    await asyncio.wait_for(call, 30)
    await channel.close()


def test_the_parser_reads_response_codes_and_the_failure_flags() -> None:
    from inferlb.filter.requestend import failed

    message = als_pb2.StreamAccessLogsMessage()
    for text in (
        'request { request_id: "ok" } response { response_code { value: 200 } }',
        'request { request_id: "5xx" } response { response_code { value: 503 } }',
        'request { request_id: "reset" } response { response_code { value: 200 } }'
        " common_properties { response_flags { upstream_remote_reset: true } }",
        'request { request_id: "client-left" } common_properties { response_flags { downstream_remote_reset: true } }',
        'request { request_id: "429" } response { response_code { value: 429 } }',
    ):
        text_format.Parse(text, message.http_logs.log_entry.add())
    parsed = _request_ids_message().FromString(message.SerializeToString())
    assert [e.request.request_id for e in parsed.http_logs.log_entry if failed(e)] == ["5xx", "reset"]


async def test_failed_requests_in_the_access_log_are_their_experiment_arms_outcomes() -> None:
    from inferlb.scorer.experiments import ArmSpec, Experiments, ExperimentSpec
    from inferlb.scorer.features import RequestFeatures

    engine = make_engine()
    spec = ExperimentSpec("ab", (ArmSpec("a", engine.profile.name, 0.5), ArmSpec("b", "round-robin", 0.5)))
    experiments = Experiments.over(engine, [spec], lambda name: name, np.random.default_rng(0))
    service = ExtProcService(engine, max_body_bytes=4096, leases=OpenLeases(), experiments=experiments)
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        for rid in ("good", "bad"):
            routed = service.router.route(service.router.admit(RequestFeatures(model="m", request_id=rid)).request)
            service.leases.hold(rid, routed.lease)  # type: ignore[union-attr]
        message = als_pb2.StreamAccessLogsMessage()
        for text in (
            'request { request_id: "good" } response { response_code { value: 200 } }',
            'request { request_id: "bad" } response { response_code { value: 502 } }',
        ):
            text_format.Parse(text, message.http_logs.log_entry.add())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:

            async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
                yield message

            await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(messages(), timeout=5)
        arms = experiments.running["ab"].arms
        assert sum(a.outcomes.failed for a in arms) == 1 and sum(a.outcomes.finished for a in arms) == 1
        assert len(service.leases) == 0  # type: ignore[arg-type]
        # With the response stream timed, the stream tells outcomes; the access log still tells of a streamed
        # response that broke off after the first token the stream took for a success.
        service.response_timer = lambda endpoint, ttft, e2e: None
        assert service.failure_listener() == service._failed
    finally:
        await server.stop(0)


def test_a_long_generation_keeps_its_count_past_max_age_while_no_entry_can_have_been_lost() -> None:
    # A 32k-token answer streams for a quarter of an hour: expired at max_age_s, its server counted as idle.
    clock = Clock()
    inflight = InFlight(1)
    leases = OpenLeases(max_age_s=60, clock=clock)
    leases.hold("long", inflight.acquire(0, 5))
    clock.now += 61
    assert leases.expire() == 0 and inflight.requests[0] == 1
    clock.now += 60 * UNBROKEN_AGE_FACTOR - 61  # an entry Envoy dropped with its stream up: gone in the end too
    assert leases.expire() == 1 and inflight.requests[0] == 0 and leases.stats.expired == 1


async def test_an_access_log_stream_that_ends_marks_the_leases_held_as_maybe_lost() -> None:
    clock = Clock()
    leases = OpenLeases(max_age_s=60, clock=clock)
    receiver = AccessLogReceiver(lambda: leases)

    async def nothing() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        return
        yield

    clock.now = 500.0
    await receiver.StreamAccessLogs(nothing(), None)  # type: ignore[arg-type]
    assert leases.lost_at == 500.0
