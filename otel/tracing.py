"""The tracer provider that exports spans over OTLP: the picker's ``inferlb.route`` spans and the emulator's
``llm_request`` spans go out through the same set-up.

`create_tracer_provider` builds an SDK `TracerProvider` with a bounded batch processor and an OTLP exporter (gRPC
or HTTP/protobuf). Nothing here reads or sets the global tracer or meter provider: the caller passes the provider
to whatever makes spans and shuts it down.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from urllib.parse import urlsplit

from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from inferlb.scorer.address import parse_address

__all__ = ["OTLP_PROTOS_HINT", "PROTOCOLS", "create_tracer_provider"]

OTLP_PROTOS_HINT = (
    "the OTLP exporter cannot load opentelemetry-proto's modules: xds-protos ships an older copy of them, and "
    "whichever package pip installed last owns those files; put the real ones back with "
    "'pip install --force-reinstall --no-deps opentelemetry-proto' (make does this after every install)"
)

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
    service_name: str,
    protocol: str = "grpc",
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
    and ``server.port`` naming the server the spans come from, so a receiver can tell servers apart without a
    trace id. Extra
    ``resource_attributes`` are added; they may not redefine those keys (use the parameters). Standard
    ``OTEL_RESOURCE_ATTRIBUTES`` entries are merged in underneath and never override these.

    Each export attempt, retries included, gives up after ``export_timeout_s``; spans that cannot be delivered are
    dropped by the SDK. The caller owns the provider and must `shutdown()` it.

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
        raise ValueError("service_name must be a non-empty string, e.g. 'inferlb'")
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
