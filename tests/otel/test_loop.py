"""Tests for otel/loop.py and otel/spanfeed.py with the real receiver process: who may send, what moves latency,
that decoding happens in the child while the picker's event loop runs, and that a dead child comes back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferlb.bench.spanflood import flood
from inferlb.otel import receiverproc, spancheck, spanfeed
from inferlb.otel.loop import SpanLoop, receiver_settings
from inferlb.scorer.config import EndpointConfig, OtelConfig
from inferlb.scorer.credentials import TokenSource
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals
from inferlb.scorer.speeds import SpeedHints

from ..conftest import until
from .h2calls import HalfSentExport
from .otlp import E2E, TTFT, request, server, span

LOCAL = ("127.0.0.1:8001", "127.0.0.1:8002")
TOKEN = "s3cret-token-0123456789abcdef"
S = 1_000_000_000


def pool(*addresses: str) -> Pool:
    return Pool([EndpointConfig(a, None) for a in addresses])


@contextlib.asynccontextmanager
async def running(config: OtelConfig, endpoints: Pool) -> AsyncIterator[SpanLoop]:
    """A started SpanLoop; on the way out it is stopped and its receiver process is gone (and reaped)."""
    loop = SpanLoop(config, endpoints, Signals(len(endpoints)))
    await loop.start()
    assert loop.receiver is not None
    try:
        yield loop
    finally:
        pid = loop.receiver.pid
        await loop.stop()
    assert pid is not None and loop.receiver.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def counts(loop: SpanLoop) -> list[float]:
    return [float(c) for c in np.nan_to_num(loop.view()["count"])]


async def export(loop: SpanLoop, spans, metadata=None, **resource):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{loop.port}") as channel:
        return await trace_service_pb2_grpc.TraceServiceStub(channel).Export(
            request(spans, **resource), metadata=metadata, timeout=10
        )


@pytest.mark.parametrize(
    ("allowed", "endpoints", "counter", "refused"),
    [
        pytest.param(("10.0.0.0/8",), LOCAL, "untrusted_sender", {"PERMISSION_DENIED": 2}, id="outside-allowlist"),
        pytest.param(None, ("10.0.0.1:8000", "10.0.0.2:8000"), "unverified", {}, id="not-the-endpoints-host"),
    ],
)
async def test_forged_spans_change_nothing_and_are_counted(allowed, endpoints, counter: str, refused) -> None:
    config = OtelConfig(receiver="127.0.0.1:0", join_by_name=True, allowed_senders=allowed)
    async with running(config, pool(*endpoints)) as loop:
        result = await flood(
            f"127.0.0.1:{loop.port}", requests=2, spans_per_request=1000, concurrency=1, server=endpoints[0]
        )
        assert result.refused == refused and result.requests == 2
        stats = loop.receiver.stats  # type: ignore[union-attr]
        await until(lambda: getattr(stats, counter) == (2 if refused else 2000), f"{counter} counted")
        assert counts(loop) == [0.0, 0.0]
        assert stats.joined_by_trace == stats.joined_by_resource == 0
        assert loop.heatmap.grid()["endpoints"] == []


@pytest.mark.parametrize("relayed", [pytest.param(False, id="forged"), pytest.param(True, id="from-a-relay")])
async def test_a_span_for_a_decision_joins_only_from_its_endpoints_host_or_a_relay(relayed: bool) -> None:
    # Loopback may send (the default allowlist), and a client chooses its request's trace id: without the sender's
    # check, a process here could have given the endpoints at 10.0.0.x a latency of 600 s for every request it sent.
    endpoints = ("10.0.0.1:8000", "10.0.0.2:8000")
    config = OtelConfig(receiver="127.0.0.1:0", relays=("127.0.0.0/8",) if relayed else None)
    async with running(config, pool(*endpoints)) as loop:
        trace = b"\x07" * 16
        loop.join.record(trace, 0)
        await export(loop, [span(trace_id=trace, **{TTFT: 600.0, E2E: 700.0})])
        stats = loop.receiver.stats  # type: ignore[union-attr]
        if relayed:
            await until(lambda: stats.joined_by_trace == 1, "the relayed span joined")
            assert counts(loop) == [1.0, 0.0]
        else:
            await until(lambda: stats.unverified == 1, "the forged span counted")
            assert counts(loop) == [0.0, 0.0] and stats.joined_by_trace == 0
            assert loop.join.get(trace) == 0  # still waiting for its server's span


@pytest.mark.parametrize(
    ("metadata", "accepted"),
    [
        pytest.param(None, False, id="missing"),
        pytest.param((("authorization", "Bearer not-the-token-0123456789"),), False, id="wrong"),
        pytest.param((("authorization", f"Bearer {TOKEN}"),), True, id="right"),
    ],
)
async def test_a_configured_token_is_required(monkeypatch: pytest.MonkeyPatch, metadata, accepted: bool) -> None:
    monkeypatch.setenv("INFERLB_TEST_OTLP_TOKEN", TOKEN)
    config = OtelConfig(
        receiver="127.0.0.1:0", join_by_name=True, receiver_auth=TokenSource(env="INFERLB_TEST_OTLP_TOKEN")
    )
    async with running(config, pool(*LOCAL)) as loop:
        stats = loop.receiver.stats  # type: ignore[union-attr]
        if accepted:
            await export(loop, [span()], metadata, **server(LOCAL[0]))
            await until(lambda: stats.joined_by_resource == 1, "the span joined")
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await export(loop, [span()], metadata, **server(LOCAL[0]))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await until(lambda: stats.unauthenticated == 1, "the refusal counted")
            assert counts(loop) == [0.0, 0.0]


async def test_calls_left_half_sent_by_a_sender_not_allowed_cost_the_others_nothing() -> None:
    # Each call sends its headers and part of its message, then nothing, on a connection kept open. Were the sender
    # checked only once a whole message was in, max_concurrent_rpcs (8) of them would keep every sender out.
    config = OtelConfig(receiver="127.0.0.1:0", join_by_name=True, allowed_senders=("127.0.0.1/32",))
    async with running(config, pool(*LOCAL)) as loop:
        assert loop.receiver is not None and loop.port is not None
        stats = loop.receiver.stats
        held = [await HalfSentExport.open(loop.port, source="127.0.0.2") for _ in range(3 * 8)]
        await until(lambda: stats.untrusted_sender == 3 * 8, "every call refused on its headers and counted")
        await export(loop, [span()], **server(LOCAL[0]))  # a listed sender, the calls above still open
        for call in held:
            await call.close()
        # The SDK's own OTLP/gRPC exporter (a unary call) is served as before.
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{loop.port}", insecure=True, timeout=10)
        try:
            assert await asyncio.to_thread(exporter.export, [sdk_span()]) == SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        await until(lambda: stats.joined_by_resource == 2, "both listed exports joined")


def sdk_span() -> ReadableSpan:
    """One finished llm_request span of the OpenTelemetry SDK, from the endpoint ``LOCAL[0]``."""
    memory = InMemorySpanExporter()
    host, port = LOCAL[0].split(":")
    provider = TracerProvider(resource=Resource({"server.address": host, "server.port": int(port)}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("test").start_as_current_span("llm_request", attributes={TTFT: 0.2, E2E: 1.5}):
        pass
    provider.shutdown()
    [finished] = memory.get_finished_spans()
    return finished


async def test_insane_and_repeated_spans_are_dropped_and_the_heatmap_window_stays() -> None:
    async with running(OtelConfig(receiver="127.0.0.1:0", join_by_name=True), pool(*LOCAL)) as loop:
        trace = b"\x07" * 16
        loop.join.record(trace, 1)
        now = time.time_ns()
        insane = [
            span(end_ns=2**63 - 1, start_ns=now),
            span(**{TTFT: 3.0, E2E: 1.0}),
            span(**{TTFT: float("nan")}),
            span(end_ns=now, start_ns=now + S),
        ]
        reply = await export(loop, insane, **server(LOCAL[0]))
        assert reply.partial_success.rejected_spans == 4
        await export(loop, [span(trace_id=trace), span(trace_id=trace), span(trace_id=trace)])
        await export(loop, [span(trace_id=b"\x09" * 16)], **server(LOCAL[0]))
        stats = loop.receiver.stats  # type: ignore[union-attr]
        outcomes = (4, 1, 2, 1)
        await until(
            lambda: (stats.out_of_bounds, stats.joined_by_trace, stats.duplicate, stats.joined_by_resource) == outcomes,
            "every span's outcome counted",
        )
        assert counts(loop) == [1.0, 1.0]
        grid = loop.heatmap.grid()
        assert grid["late"] == 0 and sum(map(sum, grid["count"])) == 2
        assert max(grid["times"]) <= now / S  # the window is where the real spans are, not in 2262


def listening_pids(port: int, pids: list[int]) -> set[int]:
    """Which of ``pids`` hold the socket listening on TCP ``port`` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    holders = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    holders.add(pid)
    return holders


async def test_a_large_export_is_decoded_in_the_child_while_the_loop_keeps_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing in this process may decode or check spans: only the child does.
    def not_here(*args, **kwargs):
        raise AssertionError("the picker's process handled an OTLP export")

    monkeypatch.setattr(spancheck, "check_export", not_here)
    monkeypatch.setattr(receiverproc.ChildReceiver, "export", not_here)
    spans = 30_000
    config = OtelConfig(
        receiver="127.0.0.1:0",
        join_by_name=True,
        receiver_max_message_bytes=16 << 20,
        receiver_max_spans_per_request=50_000,
        receiver_max_spans_per_s=1e6,
    )
    async with running(config, pool(*LOCAL)) as loop:
        feed = loop.receiver
        assert feed is not None and feed.pid is not None and loop.port is not None
        assert listening_pids(loop.port, [os.getpid(), feed.pid]) == {feed.pid}
        # A task that runs whenever the loop is free; it notes each count of joined spans it sees. Joining 30,000
        # spans in one go would show it one or two; slices of at most slice_records show it one per slice.
        seen: set[int] = set()
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen.add(feed.stats.joined_by_resource)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            result = await flood(f"127.0.0.1:{loop.port}", requests=1, spans_per_request=spans, server=LOCAL[0])
            assert result.ok == 1 and result.spans_rejected == 0
            await until(lambda: feed.stats.joined_by_resource == spans, "all spans joined", timeout=60)
        finally:
            stop.set()
            await watcher
        assert 0 < feed.max_slice <= feed.slice_records
        assert len(seen) >= spans // feed.slice_records
        assert counts(loop) == [float(spans), 0.0]


async def test_a_killed_receiver_process_is_started_again_on_the_same_port() -> None:
    async with running(OtelConfig(receiver="127.0.0.1:0", join_by_name=True), pool(*LOCAL)) as loop:
        feed = loop.receiver
        assert feed is not None
        first, port = feed.pid, loop.port
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await until(lambda: feed.stats.restarts == 1 and feed.pid not in (None, first), "a new receiver process")
        assert feed.port == port
        await export(loop, [span()], **server(LOCAL[1]))
        await until(lambda: feed.stats.joined_by_resource == 1, "a span through the new process")


async def test_a_reload_hands_the_running_receiver_its_new_settings() -> None:
    config = OtelConfig(receiver="127.0.0.1:0", join_by_name=True)
    async with running(config, pool(*LOCAL)) as loop:
        feed = loop.receiver
        assert feed is not None
        first = feed.pid
        # The same process takes a new allowlist: loopback is no longer in it.
        loop.rebind(pool(*LOCAL), Signals(2), keep=True, config=replace(config, allowed_senders=("10.0.0.0/8",)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await until_refused(loop)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and feed.pid == first
        # A new gRPC message limit needs a new process, on the same port; that is no restart after a failure.
        loop.rebind(pool(*LOCAL), Signals(2), keep=True, config=replace(config, receiver_max_message_bytes=1 << 20))
        await until(lambda: feed.pid not in (None, first), "a new receiver process")
        await export(loop, [span()], **server(LOCAL[0]))
        await until(lambda: feed.stats.joined_by_resource == 1, "a span through the new process")
        assert feed.stats.restarts == 0


async def test_a_message_limit_changed_while_the_receiver_restarts_reaches_the_next_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once, a second reload that came while the process the first one asked for was starting was recorded as in
    # force and sent as SETTINGS, which cannot change a gRPC server's limit: the receiver kept the first limit.
    config = OtelConfig(receiver="127.0.0.1:0", join_by_name=True, receiver_max_message_bytes=1 << 20)
    async with running(config, pool(*LOCAL)) as loop:
        feed = loop.receiver
        assert feed is not None
        first = feed.pid
        real_read_frame = spanfeed.read_frame
        second = replace(config, receiver_max_message_bytes=4 << 20)

        async def read_frame(reader):
            if feed._child is None:  # the next process has its settings and is starting: reload again now
                monkeypatch.setattr(spanfeed, "read_frame", real_read_frame)
                loop.rebind(pool(*LOCAL), Signals(2), keep=True, config=second)
            return await real_read_frame(reader)

        monkeypatch.setattr(spanfeed, "read_frame", read_frame)
        loop.rebind(pool(*LOCAL), Signals(2), keep=True, config=replace(config, receiver_max_message_bytes=512 << 10))
        big = [span(**{"pad": "p" * 1_500_000})]
        await until(lambda: feed.pid not in (None, first), "a new receiver process")
        for _ in range(100):  # the process the second reload wants may follow the one the first wanted
            try:
                await export(loop, big, **server(LOCAL[0]))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE), exc
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("a 1.5 MB export was never accepted under a 4 MiB limit")


async def until_refused(loop: SpanLoop) -> None:
    """Export until the receiver refuses (the new settings travel to it asynchronously)."""
    for _ in range(200):
        await export(loop, [span()], **server(LOCAL[0]))
        await asyncio.sleep(0.02)


def test_the_default_allowlist_follows_the_pool() -> None:
    config = OtelConfig(receiver="127.0.0.1:4317")
    first = receiver_settings(config, pool("10.0.0.1:8000", "10.0.0.2:8000"))
    second = receiver_settings(config, pool("10.1.0.1:8000", "[fd00::5]:8000"))
    assert first.allowed == ("10.0.0.1/32", "10.0.0.2/32", "127.0.0.0/8", "::1/128")
    assert second.allowed == ("10.1.0.1/32", "fd00::5/128", "127.0.0.0/8", "::1/128")
    assert receiver_settings(replace(config, allowed_senders=("10.0.0.0/8",)), pool(*LOCAL)).allowed == ("10.0.0.0/8",)
    relayed = receiver_settings(replace(config, relays=("10.9.0.0/16",)), pool("10.0.0.1:8000"))
    assert relayed.allowed == ("10.0.0.1/32", "127.0.0.0/8", "::1/128", "10.9.0.0/16")  # a relay may send


async def test_a_pool_change_moves_the_default_allowlist_of_the_running_receiver() -> None:
    config = OtelConfig(receiver="127.0.0.1:0", join_by_name=True)
    async with running(config, pool(*LOCAL)) as loop:
        loop.rebind(pool("10.0.0.1:8000"), Signals(1), keep=False)
        assert loop.receiver is not None and loop.receiver.settings.allowed == ("10.0.0.1/32", "127.0.0.0/8", "::1/128")
        assert loop.receiver.settings.bind == f"127.0.0.1:{loop.port}"
        await export(loop, [span()], **server("10.0.0.1:8000"))  # loopback still sends, but is not 10.0.0.1
        await until(lambda: loop.receiver.stats.unverified == 1, "the span counted")  # type: ignore[union-attr]
        assert counts(loop) == [0.0]


async def test_a_receiver_that_cannot_listen_fails_the_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        loop = SpanLoop(OtelConfig(receiver=f"127.0.0.1:{port}", join_by_name=True), pool(*LOCAL), Signals(2))
        with pytest.raises(OSError, match="cannot listen"):
            await loop.start()
        assert loop.receiver is not None and loop.receiver.pid is None


def test_a_membership_change_keeps_each_staying_endpoints_latency_under_its_new_index() -> None:
    a, b, c, d = (f"127.0.0.1:{port}" for port in (8001, 8002, 8003, 8004))
    loop = SpanLoop(OtelConfig(latency_source="stream"), pool(a, b, c), Signals(3))
    for _ in range(5):
        loop.observe_response(a, 0.1, None)
        loop.observe_response(c, 0.9, None)
    loop.join.record(b"t" * 16, 2)  # a decision for c, its span still to come
    loop.join.record(b"u" * 16, 1)  # one for b, which leaves

    # b leaves (idle), d joins: c moves from index 2 to 1.
    loop.rebind(pool(a, c, d), Signals(3), keep=False, mapping=np.array([0, 2, -1]))
    assert counts(loop) == [5.0, 5.0, 0.0]
    assert loop.view()["ttft_p50"][1] == pytest.approx(0.9, rel=0.03)
    assert [h.count for h in loop.histograms.ttft] == [5, 5, 0]  # c's /metrics series carries on
    assert loop.join.consume(b"t" * 16) == 1  # c's span still joins, to c
    assert loop.join.consume(b"u" * 16) is None and loop.join.expired == 1
    loop.observe_response(b, 0.5, None)  # a response of a request routed to b before it left: counted nowhere
    loop.observe_response(d, 0.2, None)
    assert counts(loop) == [5.0, 5.0, 1.0]

    # c restarted (it left and came back before its last request ended): its latency starts over, cold.
    loop.rebind(pool(a, c, d), Signals(3), keep=False, mapping=np.array([0, 1, 2]), restarted=(1,))
    assert counts(loop) == [5.0, 0.0, 1.0]
    assert [h.count for h in loop.histograms.ttft] == [5, 5, 1]


def test_declared_speeds_follow_the_pools_labels_through_membership_changes_and_reloads() -> None:
    a, b, c = (
        EndpointConfig(f"127.0.0.1:{port}", None, {"gpu": gpu})
        for port, gpu in ((8001, "h100"), (8002, "l4"), (8003, "h100"))
    )
    hints = SpeedHints("gpu", {"h100": 3.0, "l4": 1.0})
    loop = SpanLoop(OtelConfig(latency_source="stream"), Pool([a, b]), Signals(2), hints)
    assert loop.speeds.relative is not None and list(loop.speeds.relative) == [3.0, 1.0]
    # b leaves, c joins: both left are H100s, nothing to tell apart.
    loop.rebind(Pool([a, c]), Signals(2), keep=False, mapping=np.array([0, -1]))
    assert loop.speeds.relative is None
    # A reload declares only the L4s' speed: the H100s get the default.
    loop.hints = SpeedHints("gpu", {"l4": 2.0}, default=0.5)
    loop.rebind(Pool([a, c, b]), Signals(3), keep=False, mapping=np.array([0, 1, -1]))
    assert list(loop.speeds.relative) == [0.5, 0.5, 2.0]
    loop.hints = None  # the declaration removed, same pool
    loop.rebind(Pool([a, c, b]), Signals(3), keep=True)
    assert loop.speeds.relative is None
