"""Tests for sim/spans.py: real OTLP export to in-process gRPC and HTTP receivers, and the span's exact shape."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind

from inferlb.otel.tracing import create_tracer_provider
from inferlb.procs import free_port
from inferlb.sim.spans import INSTRUMENTATION_SCOPE, SERVICE_NAME, SPAN_NAME, RequestSpans
from inferlb.stack import start_sim

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
START_NS = 1_700_000_000_000_000_000
END_NS = START_NS + 1_500_000_000
DEADLINE_S = 10.0


class Received:
    """Export requests a fake collector got, with a way to wait for spans (poll with a deadline, never sleep)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.paths: list[str] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, path: str = "") -> None:
        with self._cond:
            self.requests.append(request)
            self.paths.append(path)
            self._cond.notify_all()

    def spans(self) -> list[tuple[dict[str, Any], trace_pb2.Span]]:
        """(resource attributes, span) for every received span."""
        with self._cond:
            return [
                (_attrs(rs.resource.attributes), span)
                for req in self.requests
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def scopes(self) -> list[str]:
        with self._cond:
            return [ss.scope.name for req in self.requests for rs in req.resource_spans for ss in rs.scope_spans]

    def wait_for(self, count: int) -> list[tuple[dict[str, Any], trace_pb2.Span]]:
        deadline = time.monotonic() + DEADLINE_S
        with self._cond:
            while len(self._spans_locked()) < count:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"timed out waiting for {count} spans"
                self._cond.wait(remaining)
        return self.spans()

    def _spans_locked(self) -> list[trace_pb2.Span]:
        return [s for req in self.requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _kinds(kvs: Any) -> dict[str, str | None]:
    return {kv.key: kv.value.WhichOneof("value") for kv in kvs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self._received = received

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self._received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector() -> Iterator[tuple[str, Received]]:
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@pytest.fixture
def http_collector() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_response(415)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.add(request, self.path)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(DEADLINE_S)


def _record(spans: RequestSpans, **overrides: Any) -> None:
    kwargs: dict[str, Any] = {
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=abc",
        "request_id": "cmpl-42",
        "model": "model-a",
        "start_ns": START_NS,
        "end_ns": END_NS,
        "ttft_s": 0.25,
        "e2e_s": 1.5,
        "queue_s": 0.05,
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "max_tokens": 64,
        "prefill_s": 0.2,
        "decode_s": 1.25,
    }
    kwargs.update(overrides)
    spans.record(**kwargs)


EXPECTED_ATTRIBUTES = {
    "gen_ai.response.model": ("string_value", "model-a"),
    "gen_ai.request.id": ("string_value", "cmpl-42"),
    "gen_ai.latency.time_to_first_token": ("double_value", 0.25),
    "gen_ai.latency.e2e": ("double_value", 1.5),
    "gen_ai.latency.time_in_queue": ("double_value", 0.05),
    "gen_ai.latency.time_in_model_prefill": ("double_value", 0.2),
    "gen_ai.latency.time_in_model_decode": ("double_value", 1.25),
    "gen_ai.latency.time_in_model_inference": ("double_value", 1.45),
    "gen_ai.usage.prompt_tokens": ("int_value", 100),
    "gen_ai.usage.completion_tokens": ("int_value", 20),
    "gen_ai.request.max_tokens": ("int_value", 64),
}


def _assert_vllm_span(span: trace_pb2.Span) -> None:
    assert span.name == SPAN_NAME == "llm_request"
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert span.start_time_unix_nano == START_NS
    assert span.end_time_unix_nano == END_NS
    kinds = _kinds(span.attributes)
    values = _attrs(span.attributes)
    assert set(values) == set(EXPECTED_ATTRIBUTES)
    for key, (kind, value) in EXPECTED_ATTRIBUTES.items():
        assert kinds[key] == kind, key
        assert values[key] == pytest.approx(value), key


@pytest.mark.parametrize(
    ("protocol", "collector"),
    [
        pytest.param("grpc", "grpc_collector", id="grpc"),
        pytest.param("http/protobuf", "http_collector", id="http"),
    ],
)
def test_span_continues_the_callers_trace(protocol: str, collector: str, request: pytest.FixtureRequest) -> None:
    endpoint, received = request.getfixturevalue(collector)
    provider = create_tracer_provider(
        endpoint,
        service_name=SERVICE_NAME,
        protocol=protocol,
        server_address="10.0.0.7:8000",
        resource_attributes={"deployment.environment": "test"},
    )
    spans = RequestSpans(provider)
    try:
        _record(spans)
        assert provider.force_flush()
        [(resource, span)] = received.wait_for(1)
    finally:
        spans.shutdown()

    _assert_vllm_span(span)
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.span_id.hex() not in ("", PARENT_SPAN_ID)
    assert span.trace_state == "vendor=abc"
    assert resource["service.name"] == "vllm"
    assert resource["server.address"] == "10.0.0.7"
    assert resource["server.port"] == 8000
    assert resource["deployment.environment"] == "test"
    assert received.scopes() == [INSTRUMENTATION_SCOPE]
    if protocol == "http/protobuf":
        assert received.paths == ["/v1/traces"]
    assert spans.errors == 0


@pytest.mark.parametrize(
    "traceparent",
    [
        pytest.param(None, id="absent"),
        pytest.param("", id="empty"),
        pytest.param("not-a-traceparent", id="garbage"),
        pytest.param(f"00-{'0' * 32}-{PARENT_SPAN_ID}-01", id="zero-trace-id"),
        pytest.param(f"00-{TRACE_ID}-{PARENT_SPAN_ID}", id="missing-flags"),
    ],
)
def test_absent_or_malformed_traceparent_starts_a_new_trace(
    traceparent: str | None, grpc_collector: tuple[str, Received]
) -> None:
    endpoint, received = grpc_collector
    provider = create_tracer_provider(endpoint, service_name=SERVICE_NAME)
    spans = RequestSpans(provider)
    try:
        _record(spans, traceparent=traceparent, tracestate="vendor=abc")
        _record(spans, traceparent=traceparent, tracestate=None, request_id="cmpl-43")
        assert provider.force_flush()
        got = received.wait_for(2)
    finally:
        spans.shutdown()
    trace_ids = {span.trace_id.hex() for _, span in got}
    assert len(trace_ids) == 2, "each root request is its own trace"
    for resource, span in got:
        assert span.parent_span_id == b""
        assert span.trace_id.hex() not in (TRACE_ID, "0" * 32)
        assert span.trace_state == ""
        assert "server.address" not in resource
    assert spans.errors == 0


def test_unreachable_collector_neither_blocks_record_nor_stalls_shutdown() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port now: connections are refused.
    spans = RequestSpans(create_tracer_provider(f"127.0.0.1:{port}", service_name=SERVICE_NAME, export_timeout_s=1.0))
    started = time.monotonic()
    for i in range(200):
        _record(spans, request_id=f"cmpl-{i}")
    assert time.monotonic() - started < DEADLINE_S
    started = time.monotonic()
    spans.shutdown()
    spans.shutdown()
    assert time.monotonic() - started < DEADLINE_S
    assert spans.errors == 0


def _in_memory() -> tuple[RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestSpans(provider), exporter


def test_optional_attributes_follow_vllm() -> None:
    spans, exporter = _in_memory()
    _record(spans, prefill_s=None, decode_s=None, max_tokens=None)
    _record(spans, prefill_s=0.5, decode_s=None, max_tokens=0, temperature=0.0, top_p=0.0, n=0)
    _record(spans, temperature=0.7, top_p=0.9, n=2)
    bare, prefill_only, sampled = (dict(s.attributes or {}) for s in exporter.get_finished_spans())

    assert set(bare) == set(EXPECTED_ATTRIBUTES) - {
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
        "gen_ai.latency.time_in_model_inference",
        "gen_ai.request.max_tokens",
    }
    assert prefill_only["gen_ai.latency.time_in_model_prefill"] == 0.5
    assert "gen_ai.latency.time_in_model_inference" not in prefill_only
    assert not {"gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.n"} & set(prefill_only)
    assert sampled["gen_ai.request.temperature"] == 0.7
    assert sampled["gen_ai.request.top_p"] == 0.9
    assert sampled["gen_ai.request.n"] == 2
    assert spans.errors == 0


def test_virtual_latencies_are_exported_as_given_and_times_stay_ordered() -> None:
    spans, exporter = _in_memory()
    # An emulator on a fast virtual clock: 30 s of emulated latency in a 1 ms wall-clock span.
    _record(spans, end_ns=START_NS + 1_000_000, e2e_s=30.0, ttft_s=3)
    # An end before the start is clamped rather than exported as a negative duration.
    _record(spans, end_ns=START_NS - 5)
    fast, clamped = exporter.get_finished_spans()
    assert fast.attributes is not None
    assert fast.attributes["gen_ai.latency.e2e"] == 30.0
    assert isinstance(fast.attributes["gen_ai.latency.time_to_first_token"], float)
    assert fast.kind is SpanKind.SERVER
    assert (fast.start_time, fast.end_time) == (START_NS, START_NS + 1_000_000)
    assert (clamped.start_time, clamped.end_time) == (START_NS, START_NS)


def test_record_never_raises_and_counts_failures() -> None:
    spans, exporter = _in_memory()
    _record(spans, prompt_tokens="many")
    _record(spans, ttft_s=None)
    assert spans.errors == 2
    assert exporter.get_finished_spans() == ()
    spans.shutdown()
    spans.shutdown()
    _record(spans)
    assert spans.errors == 3
    assert exporter.get_finished_spans() == ()


def test_works_with_a_non_sdk_provider() -> None:
    spans = RequestSpans(NoOpTracerProvider())
    _record(spans)
    spans.shutdown()
    assert spans.errors == 0


def test_http_endpoint_with_a_path_is_used_as_given(http_collector: tuple[str, Received]) -> None:
    endpoint, received = http_collector
    provider = create_tracer_provider(
        endpoint.removeprefix("http://") + "/custom/traces", service_name=SERVICE_NAME, protocol="http/protobuf"
    )
    spans = RequestSpans(provider)
    try:
        _record(spans)
        assert provider.force_flush()
        received.wait_for(1)
    finally:
        spans.shutdown()
    assert received.paths == ["/custom/traces"]


def test_inferlb_sim_sends_one_span_per_request_naming_its_server(
    grpc_collector: tuple[str, Received], tmp_path: Path
) -> None:
    """The whole path: `inferlb sim --otlp-endpoint` as its own process, a real OTLP gRPC receiver."""
    endpoint, received = grpc_collector
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    args = ["--model", "m", "--time-scale", "10", "--otlp-endpoint", endpoint]
    process = start_sim(addresses, tmp_path / "sim.log", *args)
    trace_ids = ["4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c"]
    try:
        logged = {}
        for address, trace_id in zip(addresses, trace_ids, strict=True):
            response = httpx.post(
                f"http://{address}/v1/completions",
                json={"model": "m", "prompt": "p" * 2000, "max_tokens": 20},
                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                timeout=DEADLINE_S,
            )
            assert response.status_code == 200
            logged[address] = httpx.get(f"http://{address}/admin/requests", timeout=DEADLINE_S).json()["requests"][-1]
        spans = received.wait_for(2)
    finally:
        process.stop()
    assert len(spans) == 2
    by_server = {f"{resource['server.address']}:{resource['server.port']}": span for resource, span in spans}
    assert set(by_server) == set(addresses)
    for address, trace_id in zip(addresses, trace_ids, strict=True):
        span = by_server[address]
        assert span.name == "llm_request"
        assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == "00f067aa0ba902b7"
        attrs = _attrs(span.attributes)
        assert attrs["gen_ai.request.id"] == logged[address]["id"]
        assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(logged[address]["ttft_s"])
        assert attrs["gen_ai.usage.prompt_tokens"] == 500 and attrs["gen_ai.usage.completion_tokens"] == 20
