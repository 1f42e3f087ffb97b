"""Tests for otel/receiverproc.py in process: what the receiver process checks, in which order, what it sends the
picker, and how its gRPC server bounds the calls in progress (the process itself is exercised in test_loop.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from inferlb.otel.receiverproc import ChildReceiver, SpanBudget, grpc_server
from inferlb.otel.spanwire import Kind, ReceiverSettings, decode_records

from ..conftest import until
from .h2calls import HalfSentExport
from .otlp import request, server, span

TOKEN = "s3cret-token-0123456789"
HERE = server("127.0.0.1:8001")


class Aborted(Exception):
    pass


class FakeContext:
    """A call whose one message (set by `export`) is there to read at once."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:5555", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer, self._metadata = peer, metadata
        self.code: grpc.StatusCode | None = None
        self.message: bytes | None = None
        self.reads = 0

    async def read(self) -> object:
        self.reads += 1
        return grpc.aio.EOF if self.message is None else self.message

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


class FakeTransport:
    def __init__(self) -> None:
        self.buffered = 0

    def get_write_buffer_size(self) -> int:
        return self.buffered


class FakeWriter:
    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def frames(self) -> list[tuple[Kind, bytes]]:
        out, offset = [], 0
        while offset < len(self.data):
            size, kind = struct.unpack_from("<IB", self.data, offset)
            out.append((Kind(kind), bytes(self.data[offset + 5 : offset + 5 + size])))
            offset += 5 + size
        return out


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**settings) -> tuple[ChildReceiver, FakeWriter]:
    writer = FakeWriter()
    base = {"bind": "127.0.0.1:0", "allowed": ("127.0.0.0/8",), **settings}
    return ChildReceiver(ReceiverSettings(**base), writer), writer  # type: ignore[arg-type]


async def export(receiver: ChildReceiver, raw: bytes, context: FakeContext | None = None):
    context = FakeContext() if context is None else context
    context.message = raw
    return await receiver.export(iter(()), context)


def records(writer: FakeWriter) -> list:
    return [r for kind, payload in writer.frames() if kind == Kind.RECORDS for r in decode_records(payload)[1]]


@pytest.mark.parametrize(
    ("settings", "context", "code", "counter"),
    [
        pytest.param(
            {"allowed": ("10.0.0.0/8",)}, FakeContext(), grpc.StatusCode.PERMISSION_DENIED, "untrusted_sender", id="ip"
        ),
        pytest.param({}, FakeContext("unix:/x"), grpc.StatusCode.PERMISSION_DENIED, "untrusted_sender", id="no-ip"),
        pytest.param(
            {"token": TOKEN}, FakeContext(), grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", id="no-token"
        ),
        pytest.param(
            {"token": TOKEN},
            FakeContext(metadata=(("authorization", "Bearer not-the-token-12345"),)),
            grpc.StatusCode.UNAUTHENTICATED,
            "unauthenticated",
            id="wrong-token",
        ),
        pytest.param({}, FakeContext(), grpc.StatusCode.INVALID_ARGUMENT, "invalid_requests", id="not-protobuf"),
    ],
)
async def test_a_refused_sender_costs_no_parsing(settings, context: FakeContext, code, counter: str) -> None:
    receiver, writer = make(**settings)
    with pytest.raises(Aborted):
        await export(receiver, b"\xff\xff\xff\xff not protobuf", context)  # refused before it is parsed
    assert context.code == code and receiver.counts == {"requests": 1, counter: 1} and not writer.data
    assert context.reads == (counter == "invalid_requests")  # an untrusted sender's message is not even read


async def test_an_accepted_export_goes_to_the_picker_as_records_and_counters() -> None:
    receiver, writer = make(token=TOKEN)
    context = FakeContext(metadata=(("authorization", f"Bearer {TOKEN}"),))
    reply = await export(
        receiver, request([span(), span(**{"gen_ai.latency.e2e": -1.0})], **HERE).SerializeToString(), context
    )
    assert reply.partial_success.rejected_spans == 1 and "1 out of bounds" in reply.partial_success.error_message
    assert [(r.server, r.ttft_s) for r in records(writer)] == [("127.0.0.1:8001", 0.2)]
    receiver.flush_stats()
    stats = [json.loads(p) for kind, p in writer.frames() if kind == Kind.STATS]
    assert stats == [{"requests": 1, "spans": 2, "llm_spans": 2, "out_of_bounds": 1}]
    receiver.flush_stats()  # nothing new: no frame
    assert len([k for k, _ in writer.frames() if k == Kind.STATS]) == 1


async def test_spans_past_the_limit_and_the_budget_are_rejected_to_the_sender() -> None:
    receiver, writer = make(max_spans_per_request=10, max_spans_per_s=1.0)
    clock = Clock()
    receiver.budget = SpanBudget(1.0, 10, clock=clock)
    body = request([span() for _ in range(25)], **HERE).SerializeToString()
    first = await export(receiver, body, FakeContext())
    second = await export(receiver, body, FakeContext())
    assert first.partial_success.rejected_spans == 15 and second.partial_success.rejected_spans == 25
    assert "10 over the span rate budget" in second.partial_success.error_message
    assert len(records(writer)) == 10
    assert (receiver.counts["over_limit"], receiver.counts["rate_limited"]) == (30, 10)


async def test_when_the_picker_is_behind_whole_exports_are_refused() -> None:
    receiver, writer = make(max_pending_bytes=1000)
    writer.transport.buffered = 1001
    reply = await export(receiver, request([span(), span()], **HERE).SerializeToString(), FakeContext())
    assert reply.partial_success.rejected_spans == 2 and not writer.data
    assert (receiver.counts["dropped_requests"], receiver.counts["dropped_spans"]) == (1, 2)


async def test_new_settings_apply_to_the_next_export() -> None:
    receiver, _ = make()
    receiver.update(ReceiverSettings("127.0.0.1:0", ("10.0.0.0/8",)))
    context = FakeContext()
    with pytest.raises(Aborted):
        await export(receiver, request([span()], **HERE).SerializeToString(), context)
    assert context.code == grpc.StatusCode.PERMISSION_DENIED


def test_the_budget_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    budget = SpanBudget(100.0, 500.0, clock=clock)
    assert budget.take(800) == 500 and budget.take(1) == 0
    clock.now += 0.5
    assert budget.take(100) == 50
    clock.now += 3600
    assert budget.take(10**6) == 500


async def test_records_go_in_bounded_frames() -> None:
    receiver, writer = make(max_spans_per_request=5000, max_spans_per_s=1e6)
    await export(receiver, request([span() for _ in range(2500)], **HERE).SerializeToString(), FakeContext())
    sizes = [len(list(decode_records(p)[1])) for kind, p in writer.frames() if kind == Kind.RECORDS]
    assert sizes == [1024, 1024, 452]
    await asyncio.sleep(0)


async def test_a_call_that_ends_before_its_message_is_refused_and_counted() -> None:
    receiver, writer = make()
    context = FakeContext()  # no message: read() says the call ended (cancelled, or over the size limit)
    with pytest.raises(Aborted):
        await receiver.export(iter(()), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and not writer.data
    assert receiver.counts == {"requests": 1, "incomplete_requests": 1} and receiver.in_progress == 0


# --- the gRPC server: slots and the read deadline, over real connections ----------------------------------------


@contextlib.asynccontextmanager
async def listening(receiver: ChildReceiver) -> AsyncIterator[int]:
    server = grpc_server(receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


async def send(port: int, export: trace_service_pb2.ExportTraceServiceRequest) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await trace_service_pb2_grpc.TraceServiceStub(channel).Export(export, timeout=10)


async def test_calls_whose_message_never_comes_are_cut_off_and_give_their_slots_back() -> None:
    # What a stalled or hostile sender does: headers, part of a message, then nothing, on a connection it keeps
    # open. gRPC never ends such a call itself; while gRPC counted the slots, max_concurrent_rpcs of them kept every
    # sender out for as long as the connections stayed open.
    receiver, writer = make(max_concurrent_rpcs=4)
    receiver.read_timeout_s = 0.2
    async with listening(receiver) as port:
        held = [await HalfSentExport.open(port) for _ in range(4)]
        await until(lambda: receiver.counts["slow_requests"] == 4, "every call cut off and counted")
        await until(lambda: receiver.in_progress == 0, "the slots given back")
        await send(port, request([span()], **HERE))
        for call in held:
            await call.close()
    assert len(records(writer)) == 1 and receiver.counts["busy_requests"] == 0


async def test_exports_past_the_slots_are_refused_and_counted() -> None:
    receiver, writer = make(max_concurrent_rpcs=2)
    receiver.read_timeout_s = 3600.0  # the two calls below keep their slots for the whole test
    async with listening(receiver) as port:
        held = [await HalfSentExport.open(port) for _ in range(2)]
        await until(lambda: receiver.in_progress == 2, "both slots taken")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await send(port, request([span()], **HERE))
        for call in held:
            await call.close()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not writer.data
    assert receiver.counts["busy_requests"] == 1


async def test_a_message_over_the_size_limit_is_refused_by_grpc_and_counted() -> None:
    receiver, writer = make(max_message_bytes=64 << 10)
    async with listening(receiver) as port:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await send(port, request([span() for _ in range(2000)], **HERE))
        await until(lambda: receiver.counts["incomplete_requests"] == 1, "the refusal counted")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not writer.data
