"""Rendering the Envoy bootstrap (envoy/bootstrap.yaml.j2) from the picker's config and a few options."""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from inferlb.scorer.address import parse_address

if TYPE_CHECKING:
    from inferlb.scorer.config import Config

TEMPLATE = "bootstrap.yaml.j2"
# What a waiting request's pick needs after its wait, within Envoy's message timeout (a pick takes well under 1 ms).
WAIT_MARGIN_MS = 100
# Routes whose JSON body the picker reads (its model, on a pool of several models, decides which servers may take
# the request); every other /v1/ route is decided from the headers alone (a transcription's multipart upload, say).
BODY_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v1/score",
)
FALLBACK_POLICIES = ("LEAST_REQUEST", "ROUND_ROBIN", "RANDOM")
CLUSTER_MODES = ("original-dst", "override-host")
TIERS = ("per-request", "weights")
BODY_MODES = ("buffered", "full-duplex")
# The request headers Envoy sends to the picker; it reads nothing else.
# traceparent: the picker continues the client's trace when it injects its own into the upstream request.
FORWARD_HEADERS = (":path", ":method", "x-request-id", "traceparent")
# Below the inference servers' keep-alive (vLLM's uvicorn: 5 s), so that Envoy, not the server, closes an idle
# upstream connection and never sends a request on one that is being closed.
UPSTREAM_IDLE_TIMEOUT_MS = 4000
# How often Envoy sends the picker the ends of the requests it routed (inflight.end: access-log): a request's
# in-flight count outlives the request by up to this long.
REQUEST_END_FLUSH_MS = 10
# A DNS name for the picker (``picker_address``): RFC 1123 labels, the last not all digits (so that a mistyped IP
# is not taken for a name).
_DNS_NAME = re.compile(r"(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)*[a-z]([-a-z0-9]{0,61}[a-z0-9])?", re.I)


class EnvoyConfigError(ValueError):
    """An option of the Envoy bootstrap is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    """What the bootstrap needs beyond the picker's config.

    ``picker=False`` renders Envoy alone (no ext_proc; every request to the fallback cluster), the baseline
    the benchmarks compare against. ``access_log_path`` None turns the access log off. ``picker_address``: where
    Envoy reaches the picker when that is not the config's ``listen`` address (Envoy in another pod or host):
    ``ip:port``, or ``name:port``, a DNS name that Envoy resolves every second (a STRICT_DNS cluster: a
    headless Kubernetes Service's name lists its ready pickers), health-checking each address it finds through
    the picker's gRPC ``readiness`` service, so that a draining picker gets no new streams.
    None: the config's ``listen`` address, loopback for a wildcard bind.
    """

    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:9901"
    fail_open: bool = True
    message_timeout_ms: int = 1000
    connect_timeout_ms: int = 2000
    fallback_lb_policy: str = "LEAST_REQUEST"
    max_requests: int = 65536
    access_log_path: str | None = "/dev/stdout"
    picker: bool = True
    forward_headers: tuple[str, ...] = FORWARD_HEADERS
    tracing: bool = False  # send Envoy's own spans to the picker's OTLP receiver (config otel.receiver)
    # How long a request may take to arrive (headers, then the whole request) and how long a stream may sit with
    # nothing moving either way; a streamed response is bounded only by the last.
    # xds: the server clusters' endpoints (and the fallback cluster's weights) come from the picker over ADS
    # (None: when the picker's config names a discovery source). cluster_mode: how the picked endpoint is reached,
    # "original-dst" (any ip:port the picker names) or "override-host" (only the pool's members, the picker's
    # list tried in order with up to ``retries`` retries). tier: "per-request" (the picker's pick) or "weights"
    # (Envoy's own balancer over the picker's weights, no per-request hop; needs xds).
    xds: bool | None = None
    cluster_mode: str = "original-dst"
    tier: str = "per-request"
    retries: int = 2
    # How long Envoy holds back an endpoint update to merge it with the next (its own default: 1000 ms, which is
    # a second before a pushed weight takes effect); 0 applies each at once.
    eds_merge_window_ms: int = 0
    request_headers_timeout_ms: int = 10_000
    request_timeout_ms: int = 30_000
    stream_idle_timeout_ms: int = 300_000
    picker_address: str | None = None
    # More picker replicas (ip:port each) that Envoy spreads its streams over with the first (config replicas:
    # they share their routing state through Redis).
    more_pickers: tuple[str, ...] = ()
    # How the body routes' JSON reaches the picker: "buffered" (Envoy buffers it whole and sends it in one
    # message) or "full-duplex" (FULL_DUPLEX_STREAMED: chunks as they arrive; the picker gives the body back).
    body_mode: str = "buffered"


def render_bootstrap(config: Config, options: EnvoyOptions) -> str:
    """The bootstrap YAML text. Raises ``EnvoyConfigError`` for an invalid option."""
    listen_host, listen_port = _address(options.listen, "listen")
    admin_host, admin_port = _address(options.admin, "admin")
    picker_host, picker_port, picker_dns = _picker_address(config, options.picker_address)
    if options.more_pickers and picker_dns:
        raise EnvoyConfigError("more_pickers lists ip:port addresses: it does not go with a picker_address DNS name")
    pickers = [(picker_host, picker_port)] + [_address(a, "more_pickers") for a in options.more_pickers]
    if options.fallback_lb_policy not in FALLBACK_POLICIES:
        raise EnvoyConfigError(
            f"fallback LB policy must be one of {', '.join(FALLBACK_POLICIES)}; got {options.fallback_lb_policy!r}"
        )
    for name in (
        "message_timeout_ms",
        "connect_timeout_ms",
        "max_requests",
        "request_headers_timeout_ms",
        "request_timeout_ms",
        "stream_idle_timeout_ms",
    ):
        if getattr(options, name) <= 0:
            raise EnvoyConfigError(f"{name} must be > 0; got {getattr(options, name)}")
    for name, bound in (("request", options.request_timeout_ms), ("stream idle", options.stream_idle_timeout_ms)):
        if bound <= options.message_timeout_ms:
            # Nothing moves on the stream, nor is the request sent upstream, while the picker decides: a shorter
            # bound would cut slow picks (a 504 instead of failing open or the picker's own answer).
            raise EnvoyConfigError(
                f"the {name} timeout ({bound} ms) must exceed the picker's message timeout "
                f"({options.message_timeout_ms} ms)"
            )
    for request_class in (*(rule.request_class for rule in config.classes), config.default_class):
        if request_class.on_saturation == "wait" and request_class.max_wait_s * 1000 + WAIT_MARGIN_MS > (
            options.message_timeout_ms
        ):
            # Envoy would cut the wait: a 504 with fail-closed, or the fallback cluster, past admission, with fail-open.
            raise EnvoyConfigError(
                f"class {request_class.name!r} waits up to {request_class.max_wait_s:g} s for capacity, but Envoy "
                f"gives the picker {options.message_timeout_ms} ms to answer: lower its max_wait_s to "
                f"{(options.message_timeout_ms - WAIT_MARGIN_MS) / 1000:g} s or less, or raise --message-timeout-ms "
                f"to {request_class.max_wait_s * 1000 + WAIT_MARGIN_MS:g} or more"
            )
    xds = options.xds if options.xds is not None else config.discovery is not None
    if options.cluster_mode not in CLUSTER_MODES:
        raise EnvoyConfigError(f"cluster_mode must be one of {', '.join(CLUSTER_MODES)}; got {options.cluster_mode!r}")
    if options.body_mode not in BODY_MODES:
        raise EnvoyConfigError(f"body_mode must be one of {', '.join(BODY_MODES)}; got {options.body_mode!r}")
    if options.tier not in TIERS:
        raise EnvoyConfigError(f"tier must be one of {', '.join(TIERS)}; got {options.tier!r}")
    if options.tier == "weights" and not (xds and options.picker):
        raise EnvoyConfigError("the weights tier needs the picker as Envoy's control plane (xds) to push weights")
    if options.tier == "weights" and config.quotas is not None:
        raise EnvoyConfigError(
            "the weights tier routes no request through the picker, so quotas would never be charged: render the "
            "per-request tier, or remove quotas"
        )
    if options.cluster_mode == "original-dst" and config.destinations > 1:
        raise EnvoyConfigError(
            f"the picker names {config.destinations} endpoints per request (destinations), which ORIGINAL_DST "
            "cannot take: use cluster_mode override-host, or destinations 1"
        )
    if not 0 <= options.eds_merge_window_ms <= 60_000:
        raise EnvoyConfigError(f"eds_merge_window_ms must be in 0..60000; got {options.eds_merge_window_ms}")
    if not 0 <= options.retries <= 5:
        raise EnvoyConfigError(f"retries must be in 0..5; got {options.retries}")
    if xds and not options.picker:
        raise EnvoyConfigError("xds needs the picker: it is the control plane")
    if not xds and config.discovery is not None:
        # Written into the file, the endpoints are the ones listed today: the discovered ones (all of them, where
        # none is listed) would be missing, and Envoy could not reach the endpoints the picker names.
        raise EnvoyConfigError(
            "the pool's endpoints come from discovery, which reaches Envoy only over xDS: render without --no-xds"
        )
    tracer_host, tracer_port = "", 0
    if options.tracing:
        if options.picker_address is not None:
            # The receiver's address comes from the config, which says where it binds, not where Envoy finds it.
            raise EnvoyConfigError("Envoy tracing needs the picker on Envoy's host: it cannot go with picker_address")
        if config.otel.receiver is None:
            raise EnvoyConfigError(
                "Envoy tracing sends spans to the picker's receiver: set otel.receiver in its config"
            )
        tracer_host, tracer_port = _address(config.otel.receiver, "otel.receiver")
        if tracer_host in ("0.0.0.0", "::"):
            tracer_host = "127.0.0.1" if tracer_host == "0.0.0.0" else "::1"
    # Imported here, not with this module: the CLI imports this module for its option names, and `inferlb sim`
    # (emulated servers) or `inferlb demo` need neither the template engine nor the filter's gRPC modules.
    import jinja2

    from inferlb.filter.observe import OBSERVED_HEADERS
    from inferlb.filter.request import OBJECTIVE_HEADERS

    template_text = importlib.resources.files("inferlb.envoy").joinpath(TEMPLATE).read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
    text = env.from_string(template_text).render(
        listen_host=listen_host,
        listen_port=listen_port,
        admin_host=admin_host,
        admin_port=admin_port,
        picker=options.picker,
        xds=xds,
        override_host=options.picker and options.cluster_mode == "override-host",
        # Past the endpoints the picker listed, Override Host falls back to its own balancer over every member:
        # one that may not serve the model, or that a class, a subset hint or a release arm keeps apart. A
        # request is retried on the listed endpoints only.
        retries=min(options.retries, config.destinations - 1),
        merge_window=_duration(options.eds_merge_window_ms),
        weights_tier=options.tier == "weights",
        tracer=options.tracing,
        tracer_host=tracer_host,
        tracer_port=tracer_port,
        pickers=pickers,
        picker_dns=picker_dns,
        endpoints=[parse_address(e.address) for e in config.endpoints],
        failure_mode_allow=options.fail_open,
        message_timeout=_duration(options.message_timeout_ms),
        connect_timeout=_duration(options.connect_timeout_ms),
        upstream_idle_timeout=_duration(UPSTREAM_IDLE_TIMEOUT_MS),
        request_headers_timeout=_duration(options.request_headers_timeout_ms),
        request_timeout=_duration(options.request_timeout_ms),
        stream_idle_timeout=_duration(options.stream_idle_timeout_ms),
        # The weights tier routes nothing through the picker: no request's end is the picker's to count.
        request_end_log=options.picker and config.inflight.end == "access-log" and options.tier != "weights",
        request_end_flush=_duration(REQUEST_END_FLUSH_MS),
        buffer_limit_bytes=config.max_body_bytes,
        fallback_lb_policy=options.fallback_lb_policy,
        max_requests=options.max_requests,
        access_log_path=options.access_log_path,
        body_routes=BODY_ROUTES,
        tenant_jwt=_tenant_jwt(config),
        picker_tls=None
        if config.tls is None
        else {"ca_file": config.tls.ca_file or config.tls.cert_file, "server_name": config.tls.server_name},
        full_duplex=options.body_mode == "full-duplex",
        debug_scores=config.debug_scores,
        observe=options.picker and config.otel.latency_source == "stream",
        observed_headers=OBSERVED_HEADERS,
        # The session header is the picker's input for session affinity: Envoy must send it.
        forward_headers=sorted(
            {
                *FORWARD_HEADERS,
                *(h.lower() for h in options.forward_headers),
                *filter(None, [config.session_header, config.class_header]),
                *config.named_headers,  # experiments assign by them; quotas name the tenant by one
                *(OBJECTIVE_HEADERS if config.inference_objectives else ()),
            }
        ),
    )
    yaml.safe_load(text)  # a template bug shows here, not as an Envoy start-up failure
    return text


def _tenant_jwt(config: Config) -> dict[str, Any] | None:
    """What the bootstrap's JWT filter needs when the quotas' tenant comes from a JWT claim (``quotas.source:
    jwt``), or None."""
    quotas = config.quotas
    if quotas is None or quotas.jwt is None:
        return None
    jwt = quotas.jwt
    return {
        "header": quotas.header,
        "issuer": jwt.issuer,
        "audiences": jwt.audiences,
        "jwks_file": jwt.jwks_file,
        "claim": jwt.claim,
        "forward": jwt.forward,
    }


def _picker_address(config: Config, address: str | None) -> tuple[str, int, bool]:
    """Where Envoy reaches the picker: host, port, and whether the host is a DNS name."""
    if address is None:
        host, port = _address(config.listen, "the picker's listen address")
        if host in ("0.0.0.0", "::"):
            # The picker listens on every interface; Envoy reaches it over loopback.
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        return host, port, False
    try:
        return (*parse_address(address), False)
    except ValueError:
        pass
    name, _, port_text = address.rpartition(":")
    if not _DNS_NAME.fullmatch(name) or not (
        port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536
    ):
        raise EnvoyConfigError(
            "picker_address must be 'ip:port' or 'dns-name:port' such as 'inferlb-picker.llm.svc.cluster.local:9002'"
            f"; got {address!r}"
        )
    return name.lower(), int(port_text), True


def _address(text: str, what: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise EnvoyConfigError(f"{what}: {exc}") from None


def _duration(ms: int) -> str:
    return f"{ms / 1000:.3f}s"
