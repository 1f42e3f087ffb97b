"""OTLP protobuf builders and an async poll for the otel tests."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

TTFT = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"


def kv(key: str, value: Any) -> common_pb2.KeyValue:
    if isinstance(value, bool):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(bool_value=value))
    if isinstance(value, int):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))
    if isinstance(value, float):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=value))
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def span(
    name: str = "llm_request",
    trace_id: bytes = b"\x01" * 16,
    *,
    end_ns: int | None = None,
    duration_ns: int = 1_000_000_000,
    start_ns: int | None = None,
    **attributes: Any,
) -> trace_pb2.Span:
    """A span ending ``end_ns`` (default now) after ``duration_ns``, TTFT 0.2 s and E2E 1.5 s unless given (None
    leaves an attribute out)."""
    end = time.time_ns() if end_ns is None else end_ns
    start = end - duration_ns if start_ns is None else start_ns
    attrs = {TTFT: 0.2, E2E: 1.5, **attributes}
    return trace_pb2.Span(
        name=name,
        trace_id=trace_id,
        span_id=b"\x02" * 8,
        start_time_unix_nano=max(start, 0),
        end_time_unix_nano=end,
        attributes=[kv(k, v) for k, v in attrs.items() if v is not None],
    )


def request(spans: list[trace_pb2.Span], **resource: Any) -> trace_service_pb2.ExportTraceServiceRequest:
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[kv(k, v) for k, v in resource.items()]),
                scope_spans=[trace_pb2.ScopeSpans(spans=spans)],
            )
        ]
    )


def server(address: str) -> dict[str, Any]:
    """The resource attributes naming ``address`` ("ip:port"), as the emulator and vLLM set them."""
    host, _, port = address.rpartition(":")
    return {"server.address": host.strip("[]"), "server.port": int(port)}
