"""Tests for otel/receiver.py: joining spans to endpoints, and bad input that must never hurt the picker."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from inferlb.otel.receiver import SpanReceiver, TraceJoin

ENDPOINTS = {"127.0.0.1:8001": 0, "127.0.0.1:8002": 1, "[::1]:8003": 2}


def kv(key: str, value) -> common_pb2.KeyValue:
    if isinstance(value, bool):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(bool_value=value))
    if isinstance(value, int):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))
    if isinstance(value, float):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=value))
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def span(name="llm_request", trace_id=b"\x01" * 16, **attributes) -> trace_pb2.Span:
    attrs = {"gen_ai.latency.time_to_first_token": 0.2, "gen_ai.latency.e2e": 1.5, **attributes}
    return trace_pb2.Span(
        name=name,
        trace_id=trace_id,
        span_id=b"\x02" * 8,
        attributes=[kv(k, v) for k, v in attrs.items() if v is not None],
    )


def request(spans, **resource) -> trace_service_pb2.ExportTraceServiceRequest:
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[kv(k, v) for k, v in resource.items()]),
                scope_spans=[trace_pb2.ScopeSpans(spans=spans)],
            )
        ]
    )


def make() -> tuple[SpanReceiver, list, TraceJoin]:
    seen: list = []
    join = TraceJoin(capacity=4)
    return SpanReceiver(lambda e, t, x: seen.append((e, t, x)), ENDPOINTS, join), seen, join


def test_joins_by_trace_id_first_then_by_the_resource():
    receiver, seen, join = make()
    join.record(b"\x07" * 16, 1)
    receiver.process(request([span(trace_id=b"\x07" * 16)], **{"server.address": "127.0.0.1", "server.port": 8001}))
    receiver.process(request([span(trace_id=b"\x08" * 16)], **{"server.address": "127.0.0.1", "server.port": 8001}))
    receiver.process(request([span()], **{"server.address": "::1", "server.port": 8003}))
    receiver.process(request([span(**{"server.address": "127.0.0.1", "server.port": "8002"})]))
    assert seen == [(1, 0.2, 1.5), (0, 0.2, 1.5), (2, 0.2, 1.5), (1, 0.2, 1.5)]
    stats = receiver.stats
    assert (stats.joined_by_trace, stats.joined_by_resource, stats.unjoined) == (1, 3, 0)


@pytest.mark.parametrize(
    ("spans", "resource", "counter"),
    [
        pytest.param([span()], {}, "unjoined", id="no-endpoint"),
        pytest.param(
            [span(trace_id=b"\x09" * 16)],
            {"server.address": "10.9.9.9", "server.port": 1},
            "unjoined",
            id="unknown-server",
        ),
        pytest.param([span(trace_id=b"short")], {}, "unjoined", id="bad-trace-id"),
        pytest.param(
            [span(**{"gen_ai.latency.time_to_first_token": "fast", "gen_ai.latency.e2e": -1.0})],
            {"server.address": "127.0.0.1", "server.port": 8001},
            "malformed",
            id="garbage-latency",
        ),
        pytest.param([span()], {"service.name": "envoy-gateway"}, "envoy_spans", id="envoy-span"),
    ],
)
def test_bad_or_foreign_spans_are_counted_not_observed(spans, resource, counter):
    receiver, seen, _ = make()
    receiver.process(request(spans, **resource))
    assert seen == []
    assert getattr(receiver.stats, counter) == 1


def test_spans_that_are_not_requests_are_ignored():
    receiver, seen, _ = make()
    other = trace_pb2.Span(name="http.request", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    receiver.process(request([other], **{"server.address": "127.0.0.1", "server.port": 8001}))
    assert seen == [] and receiver.stats.spans == 1 and receiver.stats.llm_spans == 0


def test_the_trace_join_is_bounded():
    join = TraceJoin(capacity=4)
    for i in range(10):
        join.record(bytes([i]) * 16, i)
    assert len(join) == 4 and join.get(bytes([0]) * 16) is None and join.get(bytes([9]) * 16) == 9


@pytest.fixture
async def served():
    receiver, seen, _ = make()
    receiver._max_queue = 3
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield receiver, seen, channel
    await channel.close()
    await server.stop(0)


async def test_over_grpc_malformed_protobuf_is_refused_and_the_receiver_goes_on(served):
    receiver, seen, channel = served
    raw = channel.unary_unary(
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw(b"\xff\xff\xff\xff garbage")
    assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)
    stub = trace_service_pb2_grpc.TraceServiceStub(channel)
    await stub.Export(request([span()], **{"server.address": "127.0.0.1", "server.port": 8002}))
    task = asyncio.create_task(receiver.run())
    deadline = asyncio.get_running_loop().time() + 5
    while not seen:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    task.cancel()
    assert seen == [(1, 0.2, 1.5)]


async def test_a_flood_beyond_the_queue_is_dropped_and_counted(served):
    receiver, _, channel = served
    stub = trace_service_pb2_grpc.TraceServiceStub(channel)
    replies = [await stub.Export(request([span(), span()])) for _ in range(5)]  # nobody consumes: the queue fills
    assert [r.partial_success.rejected_spans for r in replies] == [0, 0, 0, 2, 2]
    assert receiver.stats.dropped_requests == 2 and len(receiver._queue) == 3
