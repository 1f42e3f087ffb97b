"""A bounded flood of forged OTLP span exports, for measuring routing under a span flood (bench/resilience.py).

    python -m inferlb.bench.spanflood --address 127.0.0.1:4317 --requests 100 --spans 80000 [--concurrency 4]
        [--token-env NAME | --token-file PATH] [--server 127.0.0.1:8000] [--ttft 20] [--duration-limit 120]

Each export is one ``ExportTraceServiceRequest`` of ``spans_per_request`` ``llm_request`` spans that claim
``server`` (resource ``server.address``/``server.port``) took ``ttft_s`` to the first token, with random trace ids
that join no decision, ending now. The message is built once and sent ``requests`` times from ``concurrency``
tasks over one gRPC channel; nothing is retried. A span is ~144 bytes on the wire, so the receiver's default
4 MiB message limit holds ~29,000: larger exports are refused whole by gRPC (RESOURCE_EXHAUSTED), which is
part of what a flood tests.

`flood` (async) and `flood_sync` (blocking, for a thread or a plain script) return what happened: exports sent,
answered OK, refused by gRPC status, spans sent, accepted and rejected (the receiver's ``partial_success``).
The flood is bounded: at most ``requests`` exports, and none started after ``duration_limit_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

__all__ = ["FloodResult", "flood", "flood_sync", "forged_export", "main"]

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass(slots=True)
class FloodResult:
    """What a flood did. ``refused``: exports that failed, by gRPC status name (``PERMISSION_DENIED``: not an
    allowed sender; ``UNAUTHENTICATED``: no or a wrong token; ``RESOURCE_EXHAUSTED``: over the message size or the
    concurrency limit; ``DEADLINE_EXCEEDED``: not answered within ``timeout_s``). ``spans_accepted`` counts the
    spans of OK answers less their ``partial_success.rejected_spans`` (``spans_rejected``); accepted is not
    joined: forged spans are accepted and then count as unjoined at a receiver that checks them."""

    requests: int = 0
    ok: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    spans_sent: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    message_bytes: int = 0
    elapsed_s: float = 0.0
    stopped_by_duration_limit: bool = False
    rejection_messages: list[str] = field(default_factory=list)  # the distinct partial_success messages, first 5


def forged_export(spans: int, *, server: str = "127.0.0.1:8000", ttft_s: float = 20.0) -> ExportTraceServiceRequest:
    """One export of ``spans`` forged ``llm_request`` spans naming ``server`` ("ip:port"), ending now."""
    host, _, port = server.rpartition(":")
    now = time.time_ns()
    e2e_s = ttft_s * 1.5
    attributes = [
        KeyValue(key="gen_ai.latency.time_to_first_token", value=AnyValue(double_value=ttft_s)),
        KeyValue(key="gen_ai.latency.e2e", value=AnyValue(double_value=e2e_s)),
    ]
    started = now - int(e2e_s * 1e9)
    forged = [
        Span(
            name="llm_request",
            trace_id=os.urandom(16),
            span_id=os.urandom(8),
            start_time_unix_nano=started,
            end_time_unix_nano=now,
            attributes=attributes,
        )
        for _ in range(spans)
    ]
    resource = Resource(
        attributes=[
            KeyValue(key="service.name", value=AnyValue(string_value="vllm")),
            KeyValue(key="server.address", value=AnyValue(string_value=host.strip("[]"))),
            KeyValue(key="server.port", value=AnyValue(int_value=int(port))),
        ]
    )
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=forged)])]
    )


async def flood(
    address: str,
    *,
    requests: int = 100,
    spans_per_request: int = 80_000,
    concurrency: int = 4,
    token: str | None = None,
    server: str = "127.0.0.1:8000",
    ttft_s: float = 20.0,
    duration_limit_s: float = 120.0,
    timeout_s: float = 30.0,
) -> FloodResult:
    """Send ``requests`` forged exports of ``spans_per_request`` spans to the OTLP receiver at ``address``
    ("host:port", plaintext gRPC), ``concurrency`` at a time, with ``authorization: Bearer <token>`` if given;
    stop starting new ones after ``duration_limit_s``. Never raises for what the receiver answers."""
    if requests < 0 or spans_per_request < 0 or concurrency < 1:
        raise ValueError("requests and spans_per_request must be >= 0 and concurrency >= 1")
    payload = forged_export(spans_per_request, server=server, ttft_s=ttft_s).SerializeToString()
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    result = FloodResult(message_bytes=len(payload))
    refused: Counter[str] = Counter()
    messages: list[str] = []
    began = time.monotonic()
    deadline = began + duration_limit_s
    remaining = requests

    async def worker(channel: grpc.aio.Channel) -> None:
        nonlocal remaining
        export = channel.unary_unary(
            EXPORT, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString
        )
        while remaining > 0:
            if time.monotonic() >= deadline:
                result.stopped_by_duration_limit = True
                return
            remaining -= 1
            result.requests += 1
            result.spans_sent += spans_per_request
            try:
                reply = await export(payload, metadata=metadata, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                refused[exc.code().name] += 1
                continue
            result.ok += 1
            rejected = reply.partial_success.rejected_spans
            result.spans_rejected += rejected
            result.spans_accepted += spans_per_request - rejected
            message = reply.partial_success.error_message
            if message and message not in messages and len(messages) < 5:
                messages.append(message)

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await asyncio.gather(*(worker(channel) for _ in range(concurrency)))
    result.refused = dict(refused)
    result.rejection_messages = messages
    result.elapsed_s = round(time.monotonic() - began, 3)
    return result


def flood_sync(address: str, **options: Any) -> dict[str, Any]:
    """`flood` on an event loop of its own (call it from a thread or a script); the result as a JSON-ready dict."""
    return asdict(asyncio.run(flood(address, **options)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferlb.bench.spanflood", description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="the OTLP receiver, host:port")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--spans", type=int, default=80_000, help="spans per export")
    parser.add_argument("--concurrency", type=int, default=4)
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token-env", help="an environment variable holding the receiver's bearer token")
    tokens.add_argument("--token-file", type=Path, help="a file holding the receiver's bearer token")
    parser.add_argument("--server", default="127.0.0.1:8000", help="the endpoint the forged spans name")
    parser.add_argument("--ttft", type=float, default=20.0, help="the TTFT the forged spans claim, seconds")
    parser.add_argument("--duration-limit", type=float, default=120.0, help="start no export after this, seconds")
    args = parser.parse_args(argv)
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            parser.error(f"--token-env {args.token_env}: the variable is empty or unset")
    elif args.token_file:
        token = args.token_file.read_text(encoding="utf-8").strip()
    result = flood_sync(
        args.address,
        requests=args.requests,
        spans_per_request=args.spans,
        concurrency=args.concurrency,
        token=token,
        server=args.server,
        ttft_s=args.ttft,
        duration_limit_s=args.duration_limit,
    )
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
