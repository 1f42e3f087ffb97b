"""The picker gives each routed request a W3C traceparent and remembers where that trace went."""

from __future__ import annotations

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.otel.receiver import TraceJoin

from .test_server import MODEL, FakeEnvoy, body_message, destination, headers_message, make_engine, route_buffered

INCOMING = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def traced():
    join = TraceJoin()
    server = PickerServer(ExtProcService(make_engine(), max_body_bytes=4096, trace_join=join), "127.0.0.1:0")
    await server.start()
    yield server, join
    await server.stop(0)


def header(reply, key: str) -> str | None:
    common = getattr(reply, reply.WhichOneof("response")).response
    values = [h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == key]
    return values[0] if values else None


@pytest.mark.parametrize("incoming", [None, INCOMING, "00-zz-bad-01", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"])
async def test_routed_requests_carry_a_traceparent_that_the_join_knows(traced, incoming):
    server, join = traced
    reply = await route_buffered(server, {"model": MODEL, "prompt": "hi"}, {"traceparent": incoming})
    traceparent = header(reply, "traceparent")
    version, trace, span, flags = traceparent.split("-")
    assert (version, len(trace), len(span), flags) == ("00", 32, 16, "01")
    if incoming == INCOMING:
        assert trace == INCOMING.split("-")[1] and span != INCOMING.split("-")[2]  # the same trace, our own span
    else:
        assert trace != "0" * 32
    endpoint = server.service.engine.pool.endpoints[join.get(bytes.fromhex(trace))]
    assert endpoint.address == destination(reply)


async def test_without_a_join_no_traceparent_is_added():
    server = PickerServer(ExtProcService(make_engine(), max_body_bytes=4096), "127.0.0.1:0")
    await server.start()
    envoy = FakeEnvoy(server)
    try:
        await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED))
        reply = await envoy.send(body_message({"model": MODEL, "prompt": "hi"}))
    finally:
        await envoy.close()
        await server.stop(0)
    assert header(reply, "traceparent") is None
