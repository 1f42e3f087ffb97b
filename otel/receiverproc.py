"""The OTLP receiver's own process: ``python -m inferlb.otel.receiverproc --fd N``, started by the picker
(otel/spanfeed.py) with one end of a socket pair as fd N. Nothing here runs on the picker's event loop, so no
export, however large or malformed, can stall routing.

What is checked here, in this order, for each ``TraceService/Export`` call:

1. The sender (`SenderGate`), as soon as the call's headers are in: its IP inside the allowlist, else
   PERMISSION_DENIED (``untrusted_sender``); the bearer token when one is configured, else UNAUTHENTICATED
   (``unauthenticated``). Both before the message is read: an untrusted sender costs no reading and no parsing,
   and holds no slot.
2. A slot: at most ``max_concurrent_rpcs`` exports are read at once, the others are refused with
   RESOURCE_EXHAUSTED (``busy_requests``). A slot is held only while its one message is read, and the read has a
   deadline (`READ_TIMEOUT_S`): a sender whose message is not whole by then is cut off with DEADLINE_EXCEEDED
   (``slow_requests``), one that ends its call before a whole message with INVALID_ARGUMENT
   (``incomplete_requests``; gRPC itself refuses a message over ``max_message_bytes`` with RESOURCE_EXHAUSTED,
   which ends the call that way too). So buffered messages take at most ``max_concurrent_rpcs`` times
   ``max_message_bytes`` of memory, and no sender, listed or not, keeps a slot longer than the deadline.
3. If the records already written to the picker and not yet read exceed ``max_pending_bytes``, the picker is
   behind: the whole export is refused through OTLP ``partial_success`` (``dropped_requests``, ``dropped_spans``).
4. The message is parsed (INVALID_ARGUMENT and ``invalid_requests`` if it cannot be) and its spans checked
   (otel/spancheck.py: at most ``max_spans_per_request`` looked at, insane ones dropped).
5. The span budget: at most ``max_spans_per_s`` records a second go to the picker (token bucket, burst one
   second's worth or one full export); the rest are ``rate_limited``.

Spans not taken are reported to the sender as ``partial_success.rejected_spans`` with a message saying why (the
OTLP exporters do not retry those). The records go to the picker in RECORDS frames of at most `BATCH_RECORDS`;
the counters every ``stats_interval_s`` as STATS frames of increments. The picker may send new SETTINGS at any
time (a new allowlist after a pool change, a rotated token). The process exits when the picker's end of the
socket closes (the picker stopped or died), so it never outlives the picker; it ignores SIGINT (the picker owns
shutdown) and runs at a lower CPU priority than the picker, so a flood it parses cannot take routing's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from inferlb.otel.sendergate import Refusal, SenderGate
from inferlb.otel.spancheck import CheckCounts, check_export
from inferlb.otel.spanwire import (
    BATCH_RECORDS,
    Kind,
    ReceiverSettings,
    WireError,
    encode_frame,
    encode_json,
    encode_records,
    read_frame,
)
from inferlb.scorer.networks import Networks

__all__ = ["READ_TIMEOUT_S", "SERVICE", "ChildReceiver", "SpanBudget", "grpc_server", "main", "serve"]

logger = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
NICE = 10  # below the picker (0): under a flood the kernel gives routing the CPU first
# How long an export's one message may take to arrive once its headers are in. An OTLP exporter sends the whole
# message at once (at most max_message_bytes, 4 MiB by default: milliseconds inside a cluster), and its own
# deadline is 10 s; a sender still sending after this is stalled or holding the slot on purpose.
READ_TIMEOUT_S = 5.0


class SpanBudget:
    """A token bucket of spans: ``rate`` a second, at most ``burst`` saved up (starts full). Not thread-safe."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens = burst
        self._at = clock()

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` spans fit now (those are spent)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        granted = min(wanted, math.floor(self._tokens))
        self._tokens -= granted
        return max(granted, 0)


def _budget(settings: ReceiverSettings) -> SpanBudget:
    return SpanBudget(settings.max_spans_per_s, max(settings.max_spans_per_s, settings.max_spans_per_request))


class ChildReceiver:
    """The Export handler and its counters, writing records to the picker through ``writer``. Runs on the receiver
    process's event loop; `update` swaps the settings between two calls. ``read_timeout_s``: how long an export's
    message may take to arrive (`READ_TIMEOUT_S`)."""

    def __init__(
        self, settings: ReceiverSettings, writer: asyncio.StreamWriter, read_timeout_s: float = READ_TIMEOUT_S
    ) -> None:
        self.writer = writer
        self.counts: Counter[str] = Counter()
        self.settings = settings
        self.read_timeout_s = read_timeout_s
        self.gate = SenderGate(Networks.of(settings.allowed), settings.token)
        self.budget = _budget(settings)
        self._reading = 0

    @property
    def in_progress(self) -> int:
        """Exports holding a slot now (their message being read)."""
        return self._reading

    def update(self, settings: ReceiverSettings) -> None:
        old, self.settings = self.settings, settings
        self.gate = SenderGate(Networks.of(settings.allowed), settings.token)
        rates = ("max_spans_per_s", "max_spans_per_request")
        if any(getattr(old, name) != getattr(settings, name) for name in rates):
            self.budget = _budget(settings)  # else the bucket goes on as it was: a reload is no fresh burst
        logger.info("OTLP receiver: new settings; senders allowed: %s", ", ".join(settings.allowed) or "none")

    def handler(self) -> grpc.GenericRpcHandler:
        # Stream-unary, although Export is unary: gRPC calls a unary handler only once the whole message is in, so
        # a call whose sender stopped half way, on a connection it keeps open, would reach no check and no deadline
        # of ours. A streaming handler starts on the headers: the sender is checked before its message is read, and
        # the read has a deadline. The wire is the same, one message each way, so unary clients (every OTLP
        # exporter) see no difference.
        # No request deserializer: the handler gets the raw bytes and parses them only after the sender passed.
        export = grpc.stream_unary_rpc_method_handler(
            self.export, request_deserializer=None, response_serializer=ExportTraceServiceResponse.SerializeToString
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Export": export})

    async def export(self, requests: object, context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        """One Export call. ``requests`` (gRPC's request iterator) is not used: the one message is read from
        ``context`` with a deadline, once the sender passed and a slot is free."""
        counts = self.counts
        counts["requests"] += 1
        sender, refusal = self.gate.check(context.peer(), context.invocation_metadata())
        if refusal is not None or sender is None:
            refusal = refusal or Refusal.UNTRUSTED_SENDER
            counts[refusal.value] += 1
            await _abort(context, *_REFUSED[refusal])
        if self._reading >= self.settings.max_concurrent_rpcs:
            counts["busy_requests"] += 1
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many exports in progress; try again")
        self._reading += 1
        try:
            raw = await self._read(context)
        finally:
            self._reading -= 1
        return await self._take(raw, str(sender), context)

    async def _read(self, context: grpc.aio.ServicerContext) -> bytes:
        try:
            raw = await asyncio.wait_for(context.read(), self.read_timeout_s)
        except TimeoutError:
            self.counts["slow_requests"] += 1
            message = f"the message did not arrive within {self.read_timeout_s:g} s"
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, message)
        if not isinstance(raw, bytes):  # grpc.aio.EOF: the call ended first (cancelled, or over the size limit)
            self.counts["incomplete_requests"] += 1
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the call ended before its message")
        return raw

    async def _take(self, raw: bytes, ip: str, context: grpc.aio.ServicerContext) -> ExportTraceServiceResponse:
        counts = self.counts
        try:
            request = ExportTraceServiceRequest.FromString(raw)
        except DecodeError:
            counts["invalid_requests"] += 1
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "not an ExportTraceServiceRequest")
        settings = self.settings
        if self.writer.transport.get_write_buffer_size() > settings.max_pending_bytes:
            spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            counts["dropped_requests"] += 1
            counts["dropped_spans"] += spans
            return _rejected(spans, "the receiver is behind; spans dropped")
        checked = CheckCounts()
        records = check_export(request, settings.bounds, time.time_ns(), settings.max_spans_per_request, checked)
        granted = self.budget.take(len(records))
        limited = len(records) - granted
        counts.update({name: n for name, n in checked.items().items() if n})
        if limited:
            counts["rate_limited"] += limited
        for start in range(0, granted, BATCH_RECORDS):
            batch = records[start : min(start + BATCH_RECORDS, granted)]
            self.writer.write(encode_frame(Kind.RECORDS, encode_records(ip, batch)))
        rejected = {
            "over the per-export limit": checked.over_limit,
            "over the span rate budget": limited,
            "malformed": checked.malformed,
            "out of bounds": checked.out_of_bounds,
        }
        total = sum(rejected.values())
        if not total:
            return ExportTraceServiceResponse()
        return _rejected(total, "; ".join(f"{n} {why}" for why, n in rejected.items() if n))

    async def report_stats(self) -> None:
        """Send the counters' increments every ``stats_interval_s`` (forever; cancel to stop)."""
        while True:
            await asyncio.sleep(self.settings.stats_interval_s)
            self.flush_stats()

    def flush_stats(self) -> None:
        increments = {name: n for name, n in self.counts.items() if n}
        self.counts.clear()
        if increments:
            self.writer.write(encode_json(Kind.STATS, increments))


_REFUSED = {
    Refusal.UNTRUSTED_SENDER: (grpc.StatusCode.PERMISSION_DENIED, "this sender may not send spans here"),
    Refusal.UNAUTHENTICATED: (grpc.StatusCode.UNAUTHENTICATED, "a valid 'authorization: Bearer <token>' is needed"),
}


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("grpc's abort raises")  # unreachable: abort ends the call by raising


def _rejected(spans: int, message: str) -> ExportTraceServiceResponse:
    response = ExportTraceServiceResponse()
    response.partial_success.rejected_spans = spans
    response.partial_success.error_message = message
    return response


def grpc_server(receiver: ChildReceiver) -> grpc.aio.Server:
    """The gRPC server of ``receiver`` (its settings' message size limit), not yet bound or started; it needs a
    running event loop."""
    # No maximum_concurrent_rpcs: gRPC counts a call from its headers on and ends none that waits for its message,
    # so a few half-sent calls on connections kept open took its slots, from any sender, for as long as they liked.
    # ChildReceiver.export counts its own slots, for listed senders only, with a deadline on the read.
    return grpc.aio.server(
        handlers=(receiver.handler(),),
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", receiver.settings.max_message_bytes)],
    )


async def serve(sock: socket.socket) -> int:
    """Serve until the picker's end of ``sock`` closes; the exit status (0: a normal stop)."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        kind, payload = await read_frame(reader)
        if kind != Kind.SETTINGS:
            raise WireError(f"{kind.name} before SETTINGS")
        settings = ReceiverSettings.from_json(json.loads(payload))
    except (asyncio.IncompleteReadError, WireError, ValueError) as exc:
        logger.error("OTLP receiver: no settings from the picker (%s); exiting", exc)
        return 2
    receiver = ChildReceiver(settings, writer)
    server = grpc_server(receiver)
    try:
        port = server.add_insecure_port(settings.bind)
    except RuntimeError:  # grpc raises this where it cannot bind
        port = 0
    if not port:
        writer.write(encode_json(Kind.FAILED, {"error": f"the OTLP receiver cannot listen on {settings.bind}"}))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return 1
    await server.start()
    writer.write(encode_json(Kind.READY, {"port": port}))
    stats = asyncio.get_running_loop().create_task(receiver.report_stats())
    try:
        while True:
            kind, payload = await read_frame(reader)
            if kind == Kind.SETTINGS:
                receiver.update(ReceiverSettings.from_json(json.loads(payload)))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the picker closed its end: stop
    except (WireError, ValueError) as exc:
        logger.error("OTLP receiver: a broken frame from the picker (%s); exiting", exc)
        return 2
    finally:
        stats.cancel()
        await server.stop(0.2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferlb.otel.receiverproc", description=__doc__.split("\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the socket pair to the picker")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s otlp-receiver[{os.getpid()}] %(name)s: %(message)s",
    )
    # A Ctrl-C or a SIGTERM to the whole process group (systemd, a test's stop) is the picker's to handle: it
    # drains and then closes the socket pair, which ends this process. Dying first would only be restarted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    sock = socket.socket(fileno=args.fd)
    return asyncio.run(serve(sock))


if __name__ == "__main__":
    sys.exit(main())
