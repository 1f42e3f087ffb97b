"""The vLLM emulator's per-request OpenTelemetry span, shaped like the one vLLM exports with ``--otlp-traces-endpoint``.

vLLM (V1 engine, ``OutputProcessor.do_tracing``) ends one span per finished request:

- name ``llm_request``, kind ``SERVER``, instrumentation scope ``vllm.llm_engine``;
- parent: the W3C ``traceparent``/``tracestate`` headers of the HTTP request (no headers: a new root trace);
- start: the request's arrival time; end: when the engine saw the last token;
- attributes (latencies in seconds as doubles, counts as ints):

  - ``gen_ai.latency.time_to_first_token`` (double): arrival to first token;
  - ``gen_ai.latency.e2e`` (double): arrival to finish;
  - ``gen_ai.latency.time_in_queue`` (double): waiting before the first schedule;
  - ``gen_ai.latency.time_in_model_prefill`` (double, if given): first schedule to first token;
  - ``gen_ai.latency.time_in_model_decode`` (double, if given): first token to last token;
  - ``gen_ai.latency.time_in_model_inference`` (double, if both given): prefill + decode;
  - ``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens`` (int);
  - ``gen_ai.request.id`` (string): the id the client sees (``cmpl-...``/``chatcmpl-...``);
  - ``gen_ai.response.model`` (string): the served model name;
  - ``gen_ai.request.max_tokens`` (int), ``gen_ai.request.temperature`` (double), ``gen_ai.request.top_p``
    (double), ``gen_ai.request.n`` (int): only when set and non-zero, as vLLM does (so greedy
    ``temperature=0`` is absent).

``gen_ai.response.model`` is what vLLM's V0 engine set; V1 dropped it, but a receiver that splits traffic by
model needs it, so it is kept. V0's ``gen_ai.usage.num_sequences`` and scheduler/forward timings are not emitted.

The latency attributes are whatever the emulator reports. The emulator may run on a virtual clock faster than real
time, so ``gen_ai.latency.e2e`` need not equal the span's ``end - start``: the span's times are wall-clock instants
(for ordering and joining with the caller's spans), the attributes are the emulated engine's own measurements.

The exporter is built by `create_tracer_provider`; nothing here reads or sets the global tracer or meter provider.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferlb.scorer.address import parse_address

__all__ = [
    "INSTRUMENTATION_SCOPE",
    "PROTOCOLS",
    "SPAN_NAME",
    "RequestSpans",
    "create_tracer_provider",
]

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
"""The span name vLLM gives its per-request span."""

OTLP_PROTOS_HINT = (
    "the OTLP exporter cannot load opentelemetry-proto's modules: xds-protos ships an older copy of them, and "
    "whichever package pip installed last owns those files; put the real ones back with "
    "'pip install --force-reinstall --no-deps opentelemetry-proto' (make does this after every install)"
)

INSTRUMENTATION_SCOPE = "vllm.llm_engine"
"""The tracer (instrumentation scope) name vLLM creates its request tracer under."""

PROTOCOLS = ("grpc", "http/protobuf")
"""The OTLP transports `create_tracer_provider` accepts (the values of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``)."""

_NO_ATTRIBUTES: Mapping[str, str] = MappingProxyType({})

# One batch holds the whole queue, so flushing at shutdown is at most two exports (one possibly in flight, one for
# the rest), each bounded by the exporter's timeout: a dead collector delays shutdown by seconds, not minutes.
# 2048 spans of ~15 attributes stay well under a collector's default 4 MiB gRPC message limit.
_MAX_QUEUE = 2048
_SCHEDULE_DELAY_MS = 500


def create_tracer_provider(
    endpoint: str,
    *,
    protocol: str = "grpc",
    service_name: str = "vllm",
    server_address: str | None = None,
    resource_attributes: Mapping[str, str] = _NO_ATTRIBUTES,
    export_timeout_s: float = 2.0,
) -> TracerProvider:
    """An SDK `TracerProvider` that batches spans to an OTLP collector at ``endpoint``.

    - ``protocol="grpc"``: ``endpoint`` is ``host:port``, ``http://host:port`` (both plaintext) or
      ``https://host:port`` (TLS with the system roots).
    - ``protocol="http/protobuf"``: ``endpoint`` is a URL (a bare ``host:port`` means ``http://``); when it has no
      path, ``/v1/traces`` is appended, otherwise it is used as given.

    The resource carries ``service.name`` and, when ``server_address`` (``"ip:port"``) is given, ``server.address``
    and ``server.port`` naming the emulated server, so a receiver can tell servers apart without a trace id. Extra
    ``resource_attributes`` are added; they may not redefine those keys (use the parameters). Standard
    ``OTEL_RESOURCE_ATTRIBUTES`` entries are merged in underneath and never override these.

    Each export attempt, retries included, gives up after ``export_timeout_s``; spans that cannot be delivered are
    dropped by the SDK. The caller owns the provider and must `shutdown()` it (`RequestSpans.shutdown` does).

    Raises ``ValueError`` for an unknown protocol, an empty or malformed endpoint, a bad ``server_address`` or a
    resource attribute that clashes with a parameter.
    """
    if protocol not in PROTOCOLS:
        allowed = ", ".join(repr(p) for p in PROTOCOLS)
        raise ValueError(f"protocol must be one of {allowed}; got {protocol!r}")
    if not export_timeout_s > 0:
        raise ValueError(f"export_timeout_s must be > 0; got {export_timeout_s!r}")
    attributes = _resource_attributes(service_name, server_address, resource_attributes)
    no_metrics = NoOpMeterProvider()
    exporter: SpanExporter
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    except ImportError as exc:
        raise ImportError(f"{OTLP_PROTOS_HINT} ({exc})") from exc
    if protocol == "grpc":
        target, insecure = _grpc_target(endpoint)
        exporter = GrpcExporter(endpoint=target, insecure=insecure, timeout=export_timeout_s, meter_provider=no_metrics)
    else:
        exporter = HttpExporter(endpoint=_http_url(endpoint), timeout=export_timeout_s, meter_provider=no_metrics)
    provider = TracerProvider(resource=Resource.create(attributes), meter_provider=no_metrics)
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=_MAX_QUEUE,
            max_export_batch_size=_MAX_QUEUE,
            schedule_delay_millis=_SCHEDULE_DELAY_MS,
            export_timeout_millis=export_timeout_s * 1000,
            meter_provider=no_metrics,
        )
    )
    return provider


def _resource_attributes(
    service_name: str, server_address: str | None, extra: Mapping[str, str]
) -> dict[str, str | int]:
    if not service_name:
        raise ValueError("service_name must be a non-empty string, e.g. 'vllm'")
    own: dict[str, str | int] = {"service.name": service_name}
    if server_address is not None:
        try:
            host, port = parse_address(server_address)
        except ValueError as exc:
            raise ValueError(f"server_address: {exc}") from None
        own["server.address"] = host
        own["server.port"] = port
    for key in ("service.name", "server.address", "server.port"):
        if key in extra:
            raise ValueError(
                f"resource_attributes[{key!r}] is set by a parameter: pass service_name= or server_address= instead"
            )
    return {**extra, **own}


def _grpc_target(endpoint: str) -> tuple[str, bool]:
    """``(host:port, insecure)`` for the gRPC exporter."""
    if "://" not in endpoint:
        _check_host_port(endpoint, endpoint)
        return endpoint, True
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"OTLP gRPC endpoint {endpoint!r}: scheme must be http:// or https:// (or none)")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"OTLP gRPC endpoint {endpoint!r} must not have a path: give 'host:port'")
    _check_host_port(parts.netloc, endpoint)
    return parts.netloc, parts.scheme == "http"


def _http_url(endpoint: str) -> str:
    """The full OTLP/HTTP traces URL."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"OTLP HTTP endpoint {endpoint!r}: scheme must be http:// or https://")
    _check_host_port(parts.netloc, endpoint)
    if parts.path in ("", "/"):
        return parts._replace(path="/v1/traces").geturl()
    return url


def _check_host_port(netloc: str, endpoint: str) -> None:
    host, sep, port = netloc.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"OTLP endpoint {endpoint!r} must name a host and port, e.g. '127.0.0.1:4317'")


class RequestSpans:
    """Emits one vLLM-style ``llm_request`` span per finished request to the given tracer provider.

    Contract:

    - `record` builds and ends the span synchronously and returns; with a batching provider (as built by
      `create_tracer_provider`) that is an append to the SDK's bounded queue, and the export happens on the SDK's
      worker thread. It never raises: any failure (bad input, SDK error) is logged once and counted in `errors`.
    - `record` may be called from any thread. ``errors`` is read without a lock; it only ever grows.
    - `shutdown` flushes pending spans and shuts the provider down (this object owns it). It is idempotent and
      thread-safe; `record` after `shutdown` emits nothing and counts an error.
    """

    def __init__(self, tracer_provider: trace_api.TracerProvider) -> None:
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._lock = threading.Lock()
        self._closed = False
        self.errors = 0
        """Requests whose span could not be emitted (failures and calls after `shutdown`)."""

    def record(
        self,
        *,
        traceparent: str | None,
        tracestate: str | None,
        request_id: str,
        model: str,
        start_ns: int,
        end_ns: int,
        ttft_s: float,
        e2e_s: float,
        queue_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        max_tokens: int | None,
        prefill_s: float | None = None,
        decode_s: float | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
    ) -> None:
        """Emit the span of one finished request.

        ``start_ns``/``end_ns`` are Unix-epoch nanoseconds (``time.time_ns()``), the request's arrival and finish;
        an ``end_ns`` before ``start_ns`` is raised to ``start_ns``. The ``*_s`` values are seconds and may be
        emulated (virtual) time; they are exported as given. ``traceparent``/``tracestate`` are the request's W3C
        headers; an absent or malformed ``traceparent`` starts a new trace. ``max_tokens``, ``temperature``,
        ``top_p`` and ``n`` are omitted when None or zero, as vLLM does. Never raises.
        """
        if self._closed:
            self._count_error(None)
            return
        try:
            carrier: dict[str, str] = {}
            if traceparent:
                carrier["traceparent"] = traceparent
                if tracestate:
                    carrier["tracestate"] = tracestate
            # An explicit empty base context: the span's parent is the request's header or nothing, never whatever
            # span happens to be current in the caller's task.
            parent = self._propagator.extract(carrier, context=Context())
            attributes: dict[str, Any] = {
                "gen_ai.response.model": str(model),
                "gen_ai.request.id": str(request_id),
                "gen_ai.latency.time_to_first_token": float(ttft_s),
                "gen_ai.latency.e2e": float(e2e_s),
                "gen_ai.latency.time_in_queue": float(queue_s),
                "gen_ai.usage.prompt_tokens": int(prompt_tokens),
                "gen_ai.usage.completion_tokens": int(completion_tokens),
            }
            if prefill_s is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = float(prefill_s)
            if decode_s is not None:
                attributes["gen_ai.latency.time_in_model_decode"] = float(decode_s)
            if prefill_s is not None and decode_s is not None:
                attributes["gen_ai.latency.time_in_model_inference"] = float(prefill_s) + float(decode_s)
            if max_tokens:
                attributes["gen_ai.request.max_tokens"] = int(max_tokens)
            if temperature:
                attributes["gen_ai.request.temperature"] = float(temperature)
            if top_p:
                attributes["gen_ai.request.top_p"] = float(top_p)
            if n:
                attributes["gen_ai.request.n"] = int(n)
            start = int(start_ns)
            span = self._tracer.start_span(
                SPAN_NAME,
                context=parent,
                kind=trace_api.SpanKind.SERVER,
                attributes=attributes,
                start_time=start,
            )
            span.end(end_time=max(start, int(end_ns)))
        except Exception as exc:
            self._count_error(exc)

    def _count_error(self, exc: Exception | None) -> None:
        with self._lock:
            self.errors += 1
            first = self.errors == 1
        if first:
            if exc is None:
                logger.warning("request span dropped: RequestSpans is shut down (further drops are only counted)")
            else:
                logger.warning("request span dropped: %r (further failures are only counted)", exc)

    def shutdown(self) -> None:
        """Flush pending spans and shut the provider down; later calls do nothing.

        Blocks until the provider's processors finish; with `create_tracer_provider`'s provider and a dead
        collector that is a few export timeouts at most.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:
            logger.exception("tracer provider shutdown failed")
