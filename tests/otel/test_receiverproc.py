"""Tests for otel/receiverproc.py in process: what the receiver process checks, in which order, and what it sends
the picker (the process itself is exercised in test_loop.py)."""

from __future__ import annotations

import asyncio
import json
import struct

import grpc
import pytest

from inferlb.otel.receiverproc import ChildReceiver, SpanBudget
from inferlb.otel.spanwire import Kind, ReceiverSettings, decode_records

from .otlp import request, server, span

TOKEN = "s3cret-token-0123456789"
HERE = server("127.0.0.1:8001")


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, peer: str = "ipv4:127.0.0.1:5555", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer, self._metadata = peer, metadata
        self.code: grpc.StatusCode | None = None

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
        await receiver.export(b"\xff\xff\xff\xff not protobuf", context)  # refused before it is parsed
    assert context.code == code and receiver.counts == {"requests": 1, counter: 1} and not writer.data


async def test_an_accepted_export_goes_to_the_picker_as_records_and_counters() -> None:
    receiver, writer = make(token=TOKEN)
    context = FakeContext(metadata=(("authorization", f"Bearer {TOKEN}"),))
    reply = await receiver.export(
        request([span(), span(**{"gen_ai.latency.e2e": -1.0})], **HERE).SerializeToString(), context
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
    export = request([span() for _ in range(25)], **HERE).SerializeToString()
    first = await receiver.export(export, FakeContext())
    second = await receiver.export(export, FakeContext())
    assert first.partial_success.rejected_spans == 15 and second.partial_success.rejected_spans == 25
    assert "10 over the span rate budget" in second.partial_success.error_message
    assert len(records(writer)) == 10
    assert (receiver.counts["over_limit"], receiver.counts["rate_limited"]) == (30, 10)


async def test_when_the_picker_is_behind_whole_exports_are_refused() -> None:
    receiver, writer = make(max_pending_bytes=1000)
    writer.transport.buffered = 1001
    reply = await receiver.export(request([span(), span()], **HERE).SerializeToString(), FakeContext())
    assert reply.partial_success.rejected_spans == 2 and not writer.data
    assert (receiver.counts["dropped_requests"], receiver.counts["dropped_spans"]) == (1, 2)


async def test_new_settings_apply_to_the_next_export() -> None:
    receiver, _ = make()
    receiver.update(ReceiverSettings("127.0.0.1:0", ("10.0.0.0/8",)))
    context = FakeContext()
    with pytest.raises(Aborted):
        await receiver.export(request([span()], **HERE).SerializeToString(), context)
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
    await receiver.export(request([span() for _ in range(2500)], **HERE).SerializeToString(), FakeContext())
    sizes = [len(list(decode_records(p)[1])) for kind, p in writer.frames() if kind == Kind.RECORDS]
    assert sizes == [1024, 1024, 452]
    await asyncio.sleep(0)
