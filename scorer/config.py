"""The picker's configuration: one YAML file, validated once at start-up by pydantic.

Every error names the exact place of the problem and what would fix it, e.g.
``pool.endpoints[2].address: '10.0.0.x:8000': '10.0.0.x' is not a literal IP address``. Nothing falls back
silently to a default: a key that is present must be valid, and unknown keys are refused (a typo would
otherwise be ignored). `ConfigFile` is the file's shape (``inferlb config schema`` prints its JSON Schema);
`parse_config` turns it into the `Config` the picker runs with. The sections whose shape is the file's
(`SignalsConfig`, `OtelConfig`, `EndpointConfig`, ...) are frozen dataclasses that pydantic validates from the
file; built in code, they are not validated. The field rules and the error wording are in scorer/validation.py.

Example::

    listen: 127.0.0.1:9002          # where the ext_proc gRPC server listens
    admin: 127.0.0.1:9003           # the admin API (/endpoints, /decisions, /config, /metrics); null: off
    policy: default                 # a preset (see scorer/presets.py) or a profile defined below
    max_body_bytes: 4194304         # larger request bodies get 413
    session_header: x-session-id    # the header session affinity hashes (Envoy must forward it)
    signals:
      scrape_interval_s: 0.1        # every endpoint's vLLM /metrics, this often
      scrape_timeout_s: 0.5
      stale_after_s: 1.0            # older metrics count as stale: the endpoint is treated as saturated
    profiles:
      my-profile:
        filters: [model, staleness, saturation]
        scorers:
          - {type: queue, weight: 2}
          - {type: prefix-affinity, weight: 1, guard: 2.0}
        picker: power-of-two
    pool:
      endpoints:
        - address: 10.0.0.7:8000
          models: [meta-llama/Llama-3.1-8B-Instruct]
          labels: {zone: a}
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

import yaml
from pydantic import ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from inferlb.scorer.address import format_address, parse_address, parse_authority
from inferlb.scorer.classes import ClassRule, RequestClass
from inferlb.scorer.credentials import TokenSource
from inferlb.scorer.errors import ConfigError, shown
from inferlb.scorer.experiments import ArmSpec, ExperimentSpec, GuardSpec, SpecError, arm_masks, endpoint_masks
from inferlb.scorer.membership import SlowStart
from inferlb.scorer.networks import (
    DEFAULT_ALLOWED_NETWORKS,
    DEFAULT_NETWORKS,
    Networks,
    destination_problem,
    unicast_problem,
)
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.scorer.registry import (
    BuildContext,
    PluginSpec,
    ProfileSpec,
    checked_weight,
    default_registry,
    unknown_type,
)
from inferlb.scorer.speeds import SpeedHints
from inferlb.scorer.validation import (
    FLAG,
    TEXT,
    Model,
    Parsed,
    Section,
    config_error,
    integer,
    invalid,
    must,
    non_empty_list,
    number,
    one_of,
    optional,
)

DEFAULT_LISTEN = "127.0.0.1:9002"
DEFAULT_ADMIN = "127.0.0.1:9003"
DEFAULT_POLICY = "default"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SCORERS = 32
MAX_TENANT_CHARS = 128
DEFAULT_DRAIN_S = 5.0
LATENCY_SOURCES = ("spans", "stream")
REQUEST_ENDS = ("access-log", "stream")
TENANT_SOURCES = ("jwt", "gateway")
# Headers that cannot name a tenant: credentials, and those Envoy's bootstrap sets or removes itself.
_NOT_TENANT_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "host", "x-request-id", "x-gateway-destination-endpoint"}
)


def _address(value: Any) -> str:
    return format_address(*parse_address(value))


def _destination(value: Any) -> str:
    """An address the picker sends traffic to: unicast (never a metadata service or this host); whether it is
    inside ``pool.allowed_networks`` is `PoolFile`'s check."""
    address = _address(value)
    problem = destination_problem(parse_address(address)[0], None)
    if problem is not None:
        raise ValueError(f"{shown(value)} {problem}")
    return address


def _network(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f" must be a network such as '10.0.0.0/8'; got {shown(value)}")
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError as exc:
        raise ValueError(f"{shown(value)} is not a network in CIDR form ({exc})") from None


def _header_name(value: Any) -> str:
    if not isinstance(value, str) or not value or not all(c.isalnum() or c in "-_" for c in value):
        raise invalid(f" must be an HTTP header name; got {shown(value)}")
    return value.lower()


def _one_or_more(value: Any) -> Any:
    """A list of strings as given, or one string as a list of it."""
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list):
        raise invalid(f" must be a string or a list of strings; got {shown(value)}")
    return value


Address = Annotated[str, Parsed(_address)]
OptionalAddress = Annotated[str | None, optional(Parsed(_address))]
Text = Annotated[str, TEXT]
LabelValue = Annotated[str, must("a string (it may be empty)", lambda value: isinstance(value, str))]
HeaderName = Annotated[str | None, Parsed(_header_name)]  # optional, but a null given is refused
Seconds = Annotated[float, number(ge=0.001, le=3600, noun="a number of seconds")]
_NETWORK_LIST = non_empty_list("a non-empty list of networks such as '10.0.0.0/8'")
Network = Annotated[str, Parsed(_network)]


@dataclass(frozen=True, slots=True)
class SignalsConfig(Section):
    """How the picker collects server signals. ``scrape_metrics=False`` turns the vLLM scraper off."""

    scrape_metrics: Annotated[bool, FLAG] = True
    scrape_interval_s: Seconds = 0.1
    scrape_timeout_s: Seconds = 0.5
    stale_after_s: Seconds = 1.0
    gpu_interval_s: Seconds = 0.5

    @model_validator(mode="after")
    def _not_always_stale(self) -> SignalsConfig:
        if self.scrape_metrics and self.stale_after_s <= self.scrape_interval_s:
            raise invalid(
                f" must be greater than signals.scrape_interval_s ({self.stale_after_s:g} <= "
                f"{self.scrape_interval_s:g}): every endpoint would always be stale",
                "stale_after_s",
            )
        return self


class TokenFile(Model):
    """Where a bearer token is: ``token_file`` (a path) or ``token_env`` (an environment variable's name), never the
    token itself. ``required``: one of them must be given."""

    required: ClassVar[bool] = True
    token_file: Annotated[str | None, TEXT] = None
    token_env: Annotated[
        str | None,
        must(
            "an environment variable name",
            lambda v: isinstance(v, str) and bool(v) and all(c.isalnum() or c == "_" for c in v),
        ),
    ] = None

    @model_validator(mode="after")
    def _one_source(self) -> TokenFile:
        given = (self.token_file is not None) + (self.token_env is not None)
        if given > 1 or (self.required and not given):
            raise invalid(
                " needs exactly one of token_file (a file holding the token) and token_env (an environment "
                "variable holding it)"
            )
        return self

    def source(self) -> TokenSource | None:
        if self.token_file is not None:
            return TokenSource(file=self.token_file)
        return None if self.token_env is None else TokenSource(env=self.token_env)


def _token(value: Any) -> TokenSource | None:
    return None if value is None else TokenFile.model_validate(value).source()


@dataclass(frozen=True, slots=True)
class OtelConfig(Section):
    """The span loop. ``receiver``: where the OTLP gRPC receiver listens for the servers' spans (None: off);
    ``inject_traceparent``: give each routed request a W3C traceparent so its server span joins the decision;
    latency statistics over ``window_s`` (quantiles) and with ``half_life_s`` (EWMA), published to the scorers
    every ``publish_interval_s``.

    ``latency_source`` says what feeds those statistics: ``spans`` (the servers' spans, at the receiver) or
    ``stream`` (the picker times each response as Envoy passes it through: TTFT to the first non-empty chunk of
    a streamed response, E2E to the body of any other; for servers that send no spans). With ``stream`` the picker
    also sees each request's first token, so the prefill backlog is counted exactly (`InFlight.first_tokens`).

    Spans steer routing, so the receiver trusts only ``allowed_senders`` (CIDR strings; None: the pool's hosts
    and loopback, following the pool) and, with ``receiver_auth``, only exports that carry ``authorization:
    Bearer <token>``. It refuses messages over ``receiver_max_message_bytes``, takes at most
    ``receiver_max_spans_per_request`` spans of one export and ``receiver_max_spans_per_s`` latency spans a second
    (a burst of one second or one full export), and drops spans that end more than ``span_max_age_s`` before or
    ``span_max_ahead_s`` after now or whose duration or latencies exceed ``span_max_latency_s``. A decision waits
    ``join_max_age_s`` for its span (see otel/receiver.py for the join rule), and a span joins a decision only
    when it comes from the host of the endpoint that decision chose, or from one of ``relays`` (CIDR strings: the
    networks of senders that pass on other hosts' spans, such as an OpenTelemetry Collector; also allowed to
    send). A client chooses its own trace id, so without that rule anything allowed to send spans could give any
    endpoint the latency of its choice for the requests it sent. ``join_by_name``: a span without a decision's
    trace id may still join the endpoint it names when it comes from that endpoint's own host (for servers that
    do not propagate trace context); off by default, because where several servers share a host (or a client
    runs on one) anything there could then speak for all of them."""

    receiver: OptionalAddress = None
    latency_source: Annotated[str, one_of(*LATENCY_SOURCES)] = "spans"
    inject_traceparent: Annotated[bool, FLAG] = True
    # where the picker's own inferlb.route spans go
    exporter: Annotated[str, one_of("none", "otlp-grpc", "otlp-http")] = "none"
    export_endpoint: Annotated[str | None, optional(TEXT)] = None
    window_s: Annotated[float, number(ge=1, le=86400)] = 60.0
    half_life_s: Annotated[float, number(ge=0.01, le=86400)] = 10.0
    publish_interval_s: Annotated[float, number(ge=0.01, le=60)] = 0.25
    heatmap_bucket_s: Annotated[float, number(ge=0.1, le=3600)] = 10.0
    allowed_senders: Annotated[tuple[Network, ...] | None, optional(_NETWORK_LIST)] = None
    receiver_auth: Annotated[TokenSource | None, Parsed(_token, input=TokenFile | None)] = None
    # the OTel Collector's default batch limit
    receiver_max_message_bytes: Annotated[int, integer(ge=64 << 10, le=64 << 20)] = 4 << 20
    receiver_max_spans_per_request: Annotated[int, integer(ge=1, le=1 << 20)] = 16384
    receiver_max_spans_per_s: Annotated[float, number(ge=1, le=1e7)] = 10000.0  # ~3x what one picker process routes
    span_max_age_s: Annotated[float, number(ge=1, le=86400)] = 600.0
    span_max_ahead_s: Annotated[float, number(ge=0, le=3600)] = 60.0
    span_max_latency_s: Annotated[float, number(ge=1, le=86400)] = 3600.0
    join_max_age_s: Annotated[float, number(ge=1, le=3600)] = 300.0
    join_by_name: Annotated[bool, FLAG] = False
    relays: Annotated[tuple[Network, ...] | None, optional(_NETWORK_LIST)] = None

    @model_validator(mode="after")
    def _receiver_settings(self) -> OtelConfig:
        for name, what in (("allowed_senders", "send spans"), ("relays", "speak for every endpoint")):
            for i, cidr in enumerate(getattr(self, name) or ()):
                network = ipaddress.ip_network(cidr)
                if network.prefixlen == 0:
                    if self.receiver_auth is None:
                        raise invalid(
                            f": {network} lets any host {what}, and spans steer routing: set otel.receiver_auth (a "
                            "bearer token) too, or list the servers' networks",
                            name,
                            i,
                        )
                elif (problem := unicast_problem(network.network_address)) is not None:
                    raise invalid(f": {network} {problem}; no span sender lives there", name, i)
        if self.exporter != "none" and self.export_endpoint is None:
            raise invalid(" is required with an otlp exporter (host:port or a URL)", "export_endpoint")
        if self.receiver is None:
            for name in ("allowed_senders", "receiver_auth", "relays"):
                if getattr(self, name) is not None:
                    raise invalid(" is set but otel.receiver is not: set otel.receiver or remove it", name)
        return self


@dataclass(frozen=True, slots=True)
class InflightConfig(Section):
    """How the picker learns that a routed request ended (its in-flight count drops then).

    ``end``: ``access-log`` (the routing stream ends at the decision, and Envoy's gRPC access log reports the end;
    a picker restart cuts no routed request) or ``stream`` (the routing stream stays open for the whole request;
    for gateways that cannot send the access log). ``max_age_s``: a request whose end has not been reported after
    this long counts as ended if its entry may have been lost (an access-log stream from Envoy ended, or with
    replicas Redis was out of reach, while it ran); any other after four times this (filter/requestend.py)."""

    end: Annotated[str, one_of(*REQUEST_ENDS)] = "access-log"
    max_age_s: Annotated[float, number(ge=1, le=86400)] = 900.0


@dataclass(frozen=True, slots=True)
class AdminAuthConfig:
    """Who may use the admin API. ``token``: where the bearer token is (None: state-changing routes are off);
    ``allowed_hosts``: ``Host`` names accepted besides the admin's own address (e.g. a Service's DNS name)."""

    token: TokenSource | None = None
    allowed_hosts: frozenset[str] = frozenset()


def _host_name(value: Any) -> str:
    if not isinstance(value, str) or not value or not all(c.isalnum() or c in "-._" for c in value):
        raise invalid(f" must be a host name without a port; got {shown(value)}")
    return value.lower()


class AdminAuthFile(TokenFile):
    """``admin_auth``: the token (optional: without one, state-changing routes are off) and ``allowed_hosts``."""

    required: ClassVar[bool] = False
    allowed_hosts: tuple[Annotated[str, Parsed(_host_name)], ...] = ()

    def config(self) -> AdminAuthConfig:
        return AdminAuthConfig(self.source(), frozenset(self.allowed_hosts))


@dataclass(frozen=True, slots=True)
class AdmissionConfig(Section):
    """When an endpoint counts as saturated for admission control."""

    max_waiting: Annotated[float, number(ge=0, le=1e6)] = 16
    max_kv_usage: Annotated[float, number(ge=0.01, le=1)] = 0.95


@dataclass(frozen=True, slots=True)
class GpuSource(Section):
    """Where an endpoint's GPU state comes from: ``url`` of a GPU agent's (or the emulator's) ``/gpu`` (kind
    "agent") or of a DCGM exporter's ``/metrics`` (kind "dcgm"); ``indices`` are the GPUs of that node the endpoint
    uses (None: all of them). A parsed ``url`` is canonical ``http://ip:port/path``: a literal unicast IP (inside
    ``pool.allowed_networks``: `PoolFile` checks), no user, query or fragment.

    The picker fetches ``url`` every ``signals.gpu_interval_s``, so it is held to what a pool address is: plain
    ``http://`` (no TLS client is configured for it) to a literal IP (a hostname could resolve anywhere later).
    The path defaults to the kind's (``/gpu``, ``/metrics``); the stored URL is canonical, so two spellings of one
    source share a read."""

    url: Text = field(metadata={"description": "e.g. 'http://10.0.0.7:9400/gpu'"})
    kind: Annotated[str, one_of("agent", "dcgm")] = "agent"
    indices: Annotated[
        tuple[Annotated[int, integer(ge=0)], ...] | None,
        non_empty_list("a non-empty list of GPU indices (integers >= 0)"),
    ] = None

    @model_validator(mode="after")
    def _canonical(self) -> GpuSource:
        return replace(self, url=_gpu_url(self.url, self.kind))


def _gpu_url(url: str, kind: str) -> str:
    """``url`` in canonical form, its host a unicast address; `invalid` naming ``url`` otherwise."""

    def refuse(problem: str) -> ValueError:
        return invalid(f": {shown(url)}: {problem}", "url")

    if url[:8].lower() == "https://":
        raise refuse(
            "https:// is not supported (the picker has no TLS client for GPU sources); use http:// to the "
            "node's agent or exporter"
        )
    if url[:7].lower() != "http://":
        raise invalid(f" must be an http:// URL such as 'http://10.0.0.7:9400/gpu'; got {shown(url)}", "url")
    rest = url[7:]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        raise refuse("a user name or password ('user@') is not allowed")
    if "?" in path:
        raise refuse("a query ('?...') is not allowed (agents and exporters take none)")
    if "#" in path:
        raise refuse("a fragment ('#...') is not allowed")
    try:
        host, port = parse_authority(authority, default_port=80)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    problem = destination_problem(host, None)
    if problem is not None:
        raise refuse(f"{host} {problem}")
    path = path or ("/gpu" if kind == "agent" else "/metrics")
    if not all(c.isascii() and (c.isalnum() or c in "-._~!$&'()*+,;=:@%/") for c in path):
        raise refuse(f"the path {path!r} may hold only letters, digits and -._~!$&'()*+,;=:@%/")
    return f"http://{format_address(host, port)}{path}"


@dataclass(frozen=True, slots=True)
class EndpointConfig(Section):
    """One inference server. ``models`` is None when the endpoint accepts any model name."""

    address: Annotated[str, Parsed(_destination)] = field(metadata={"description": "a literal 'ip:port'"})
    models: Annotated[
        frozenset[Text] | None, non_empty_list("a non-empty list of model names (omit it to accept any)")
    ] = None
    # Label values may be empty, as Kubernetes's may (a headless Service's slices carry
    # `service.kubernetes.io/headless: ""`).
    labels: Mapping[Text, LabelValue] = field(default_factory=dict)
    gpu: Annotated[GpuSource | None, must("a mapping", lambda v: isinstance(v, dict))] = None


@dataclass(frozen=True, slots=True)
class SlowStartConfig(Section):
    """``pool.slow_start``: an endpoint that joins while the picker runs is offered a share of the decisions it
    could serve that rises from ``min_fraction`` to all of them over ``ramp_s`` seconds (0: no ramp),
    ``idle_speedup`` times faster while its metrics show nothing waiting (see scorer/membership.py)."""

    ramp_s: Annotated[float, number(ge=0, le=3600)] = 30.0
    min_fraction: Annotated[float, number(gt=0, le=1)] = 0.1
    idle_speedup: Annotated[float, number(ge=1, le=100)] = 2.0

    def spec(self) -> SlowStart:
        return SlowStart(self.ramp_s, self.min_fraction, self.idle_speedup)


@dataclass(frozen=True, slots=True)
class SpeedsConfig(Section):
    """``pool.speeds``: how fast each kind of server prefills, relative to the others (only the ratios matter), by
    the value of the endpoint label ``label``; ``default`` for an endpoint without it or with a value not listed.
    On a fleet of unequal servers the learned speeds start each endpoint from this instead of the fleet's pooled
    figure, and the ``ttft-gap`` filter judges which servers are slower by it (scorer/speeds.py)."""

    label: Text = field(metadata={"description": "the endpoint label that names its kind of server, e.g. 'gpu'"})
    relative: Annotated[
        dict[Text, Annotated[float, number(gt=0, le=1e6, noun="a relative speed")]],
        must("a non-empty mapping of label values to relative speeds", lambda v: isinstance(v, dict) and bool(v)),
    ] = field(metadata={"description": "label value -> relative prefill speed, e.g. {h100: 3.3, l4: 1}"})
    default: Annotated[float, number(gt=0, le=1e6, noun="a relative speed")] = 1.0

    def spec(self) -> SpeedHints:
        return SpeedHints(self.label, dict(self.relative), self.default)


def _etcd_url(value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(f" must be an etcd client URL such as 'https://10.0.0.5:2379'; got {shown(value)}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or parts.username or parts.password or parts.query or parts.fragment:
        raise invalid(f" must be http:// or https:// with a host and port, nothing else; got {shown(value)}")
    if parts.path not in ("", "/"):
        raise invalid(f" must not have a path (the v3 API's paths are fixed); got {shown(value)}")
    try:
        host, port = parse_authority(parts.netloc, default_port=2379)
    except ValueError as exc:
        raise invalid(f": {exc}") from None
    return f"{parts.scheme}://{format_address(host, port)}"


@dataclass(frozen=True, slots=True)
class EtcdConfig(Section):
    """``pool.discovery.etcd``: the endpoints are the values under ``prefix`` in etcd (v3, through its JSON
    gateway), watched. Each value is a JSON object ``{"address": "10.0.0.7:8000", "models": [...], "labels":
    {...}, "ready": true}``; the address may name a host (``gpu-7.internal:8000``), which the picker resolves
    (every address it has), never Envoy. ``username`` and ``password`` (``{token_file: ...}`` or ``{token_env:
    ...}``) when etcd has auth enabled, which it needs beyond loopback (and https: the password must not cross the
    network in clear text); ``ca_file`` for an https URL signed by a private CA."""

    urls: Annotated[tuple[Annotated[str, Parsed(_etcd_url)], ...], non_empty_list("a non-empty list of URLs")] = field(
        metadata={"description": "a non-empty list of etcd client URLs, e.g. ['https://10.0.0.5:2379']"}
    )
    prefix: Annotated[
        str,
        must(
            "a key prefix such as '/inferlb/endpoints/'",
            lambda v: isinstance(v, str) and len(v) >= 2 and v.startswith("/"),
        ),
    ] = field(metadata={"description": "a key prefix such as '/inferlb/endpoints/'"})
    timeout_s: Annotated[float, number(ge=0.1, le=60)] = 2.0
    username: Annotated[str | None, optional(TEXT)] = None
    password: Annotated[TokenSource | None, Parsed(_token, input=TokenFile | None)] = None
    ca_file: Annotated[str | None, optional(TEXT)] = None
    max_endpoints: Annotated[int, integer(ge=1, le=65536)] = 4096

    @model_validator(mode="after")
    def _credentials_together(self) -> EtcdConfig:
        if (self.username is None) != (self.password is None):
            raise invalid(" and password go together: give both or neither", "username")
        if self.ca_file is not None and not any(u.startswith("https://") for u in self.urls):
            raise invalid(" is set but no URL is https://", "ca_file")
        for i, url in enumerate(self.urls):
            parts = urlsplit(url)
            host = parts.hostname or ""
            if _loopback_host(host):
                continue
            if self.password is None:
                # Whoever can write under the prefix decides the pool (within pool.allowed_networks).
                raise invalid(
                    f": etcd at {host} is reachable beyond this host, and whoever can write under the prefix "
                    "decides where this pool's traffic goes: turn on etcd's auth and give username and password "
                    "(from a file or variable), or reach etcd on loopback",
                    "urls",
                    i,
                )
            if parts.scheme != "https":
                # The password goes to etcd with each authentication, the token with each request.
                raise invalid(
                    f": etcd at {host} is reached over plain http:// beyond this host, and its password (and the "
                    "auth token it gives) would cross the network in clear text: use https:// (with ca_file for a "
                    "private CA), or reach etcd on loopback",
                    "urls",
                    i,
                )
        return self


def _label_value(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 63 or not all(c.isalnum() or c in "-_." for c in value):
        raise invalid(f" must be a Kubernetes label value (letters, digits, '-', '_', '.'); got {shown(value)}")
    return value


def _namespace(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= 63
        or not all(c in "abcdefghijklmnopqrstuvwxyz0123456789-" for c in value)
        or value[0] == "-"
        or value[-1] == "-"
    ):
        raise invalid(
            f" must be a Kubernetes namespace (lower-case letters, digits and '-', at most 63); got {shown(value)}"
        )
    return value


def _label_key(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 317
        or not all(c.isalnum() or c in "-_./" for c in value)
    ):
        raise invalid(f" must be a Kubernetes label key such as 'app' or 'example.com/role'; got {shown(value)}")
    return value


def _api_url(value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(f" must be the API server's URL such as 'https://10.96.0.1:443'; got {shown(value)}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise invalid(f" must be http(s)://host:port with no path; got {shown(value)}")
    return value.rstrip("/")


def _service_name(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= 63
        or not all(c.isdigit() or c == "-" or "a" <= c <= "z" for c in value)
        or not value[0].isalpha()
        or value.endswith("-")
    ):
        raise invalid(f" must be a Service name (lower-case letters, digits and '-'); got {shown(value)}")
    return value


@dataclass(frozen=True, slots=True)
class KubernetesConfig(Section):
    """``pool.discovery.kubernetes``: the endpoints are, in ``namespace``, either the ready Pods with every label
    of ``selector``, one per ``target_ports`` entry at the Pod's IP (the InferencePool shape), or the ready
    endpoints of the EndpointSlices of the Service ``service``, at the ports the slices list (only
    ``target_ports`` among them when it is set). ``models``: the models of every endpoint found (the Pod
    annotation ``inferlb.io/models`` overrides it; None: any model). ``api_url``: the API server (default: the
    cluster's own, from the Pod's environment; plain http:// with a token only on loopback); ``token_file`` and
    ``ca_file``: the Pod's service account by default (None for an API server that needs neither, such as the
    tests')."""

    namespace: Annotated[str, Parsed(_namespace)] = field(metadata={"description": "the Pods' namespace"})
    selector: Annotated[
        dict[Annotated[str, Parsed(_label_key)], Annotated[str, Parsed(_label_value)]] | None,
        optional(must("a non-empty mapping of labels", lambda v: isinstance(v, dict) and bool(v))),
    ] = field(default=None, metadata={"description": "a non-empty mapping of labels, e.g. {app: vllm}"})
    service: Annotated[str | None, optional(Parsed(_service_name))] = field(
        default=None, metadata={"description": "a Service whose EndpointSlices are the pool, e.g. vllm"}
    )
    target_ports: Annotated[
        tuple[Annotated[int, integer(ge=1, le=65535)], ...] | None,
        optional(must("a non-empty list of ports", lambda v: isinstance(v, list) and bool(v), minItems=1)),
    ] = field(default=None, metadata={"description": "a non-empty list of ports, e.g. [8000]"})
    models: Annotated[
        frozenset[Text] | None, non_empty_list("a non-empty list of model names (omit it to accept any)")
    ] = None
    api_url: Annotated[str | None, Parsed(_api_url)] = None
    token_file: Annotated[str | None, optional(TEXT)] = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: Annotated[str | None, optional(TEXT)] = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    timeout_s: Annotated[float, number(ge=0.1, le=60)] = 5.0
    max_endpoints: Annotated[int, integer(ge=1, le=65536)] = 4096

    @model_validator(mode="after")
    def _one_shape(self) -> KubernetesConfig:
        if (self.selector is None) == (self.service is None):
            raise invalid(" needs exactly one of selector (Pods) and service (its EndpointSlices)")
        if self.selector is not None and self.target_ports is None:
            raise invalid(" is needed with a selector: the ports of each Pod to send to", "target_ports")
        if self.api_url is not None and self.token_file is not None:
            parts = urlsplit(self.api_url)
            host = parts.hostname or ""
            if parts.scheme == "http" and not _loopback_host(host):
                # The token is the picker's service account: whoever reads it lists and watches as the picker.
                raise invalid(
                    f": the API server at {host} is reached over plain http:// beyond this host, and the "
                    "service-account token (token_file) would cross the network in clear text: use https:// (with "
                    "ca_file), set token_file to null for an API server that takes no token, or reach it on "
                    "loopback (kubectl proxy)",
                    "api_url",
                )
        return self


def _loopback_host(host: str) -> bool:
    """Whether ``host`` (a URL's host: a name or an IP literal) is this host's own loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _redis_url(value: Any) -> str:
    if not isinstance(value, str):
        raise invalid(f" must be a Redis URL such as 'redis://10.0.0.5:6379/0'; got {shown(value)}")
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or parts.query or parts.fragment:
        raise invalid(
            f" must be redis:// or rediss:// with a host (and a port, a database), nothing else; got {shown(value)}"
        )
    if parts.username or parts.password:
        raise invalid(" must not carry a user or password: give username and password (a file or variable)")
    if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
        raise invalid(f"'s path must be a database number such as /0; got {shown(value)}")
    try:
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise invalid(f" has a bad port; got {shown(value)}") from None
    return value


@dataclass(frozen=True, slots=True)
class ReplicasConfig(Section):
    """``replicas``: several pickers share routing state through Redis (``url``), off the hot path: each publishes
    its own in-flight requests and tokens per endpoint every ``publish_interval_s`` (a full snapshot every
    second) and adds the others' to its own view; experiments' control state (an operator's action, a guard's
    roll-back) is shared and remembered there too. ``username`` and ``password`` (``{token_file: ...}`` or
    ``{token_env: ...}``) for Redis AUTH; a ``rediss://`` URL uses TLS (``ca_file`` for a private CA). Pickers
    share state only under the same ``key``. A peer not heard from for ``peer_ttl_s`` counts no more."""

    url: Annotated[str, Parsed(_redis_url)] = field(
        metadata={"description": "a Redis URL such as 'redis://10.0.0.5:6379/0'"}
    )
    key: Annotated[
        str,
        must(
            "a key name of letters, digits and ':-_.' such as 'inferlb:pool-a'",
            lambda v: isinstance(v, str) and 0 < len(v) <= 200 and all(c.isalnum() or c in ":-_." for c in v),
        ),
    ] = "inferlb"
    username: Annotated[str | None, optional(TEXT)] = None
    password: Annotated[TokenSource | None, Parsed(_token, input=TokenFile | None)] = None
    ca_file: Annotated[str | None, optional(TEXT)] = None
    publish_interval_s: Annotated[float, number(ge=0.001, le=1)] = 0.005
    peer_ttl_s: Annotated[float, number(ge=0.1, le=600)] = 3.0
    timeout_s: Annotated[float, number(ge=0.01, le=60)] = 1.0

    @model_validator(mode="after")
    def _consistent(self) -> ReplicasConfig:
        if self.username is not None and self.password is None:
            raise invalid(" needs a password", "username")
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise invalid(" is set but the URL is not rediss://", "ca_file")
        if self.peer_ttl_s <= 1.0:
            raise invalid(
                " must be more than a second: every replica sends a full snapshot once a second", "peer_ttl_s"
            )
        host = urlsplit(self.url).hostname or ""
        if self.password is None and not _loopback_host(host):
            # The replicas take each other's counts from the stream as they come: a writer can send every endpoint
            # but one to the count limit and so route the whole pool to that one.
            raise invalid(
                f": Redis at {host} is reachable beyond this host, and whoever can write to its stream steers this "
                "pool's traffic: set replicas.password (Redis AUTH, from a file or variable), or reach Redis on "
                "loopback",
                "url",
            )
        return self


@dataclass(frozen=True, slots=True)
class TenantLimits(Section):
    """One tenant's quota: ``requests_per_minute`` and ``tokens_per_minute`` (either may be left out: no limit of
    that kind), and ``burst_s``: how many seconds of its rate a tenant that was idle may spend at once (its
    bucket's size). A request's tokens are its prompt's (as the picker counts them) plus its ``max_tokens``, or
    the quotas' ``assumed_output_tokens`` where it names none."""

    requests_per_minute: Annotated[float | None, optional(number(gt=0, le=1e9))] = None
    tokens_per_minute: Annotated[float | None, optional(number(gt=0, le=1e12))] = None
    burst_s: Annotated[float, number(ge=1, le=3600)] = 60.0

    @model_validator(mode="after")
    def _some_limit(self) -> TenantLimits:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise invalid(" needs requests_per_minute or tokens_per_minute (or both)")
        return self


def _tenant_name(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TENANT_CHARS or not value.isprintable():
        raise invalid(f" must be a tenant name of 1 to {MAX_TENANT_CHARS} printable characters; got {shown(value)}")
    return value


TenantName = Annotated[str, Parsed(_tenant_name)]


@dataclass(frozen=True, slots=True)
class TlsConfig(Section):
    """``tls``: the picker's gRPC listener (``listen``: ext_proc, the request ends, ADS, gRPC health) serves TLS
    with ``cert_file`` and ``key_file`` (PEM, read again for new connections when they change), as gateways that
    speak TLS to an endpoint picker expect. ``ca_file``: what Envoy's bootstrap (`inferlb envoy-config`) trusts for
    it, a path where Envoy runs (default: ``cert_file`` itself, for a self-signed certificate); ``server_name``: a
    DNS name the certificate must hold, which that Envoy checks and sends (SNI), so that no other certificate of
    the same CA passes for the picker (default: any the CA signed). ``health_listen``: a plaintext listener of
    gRPC health alone, for probes that cannot speak TLS (a kubelet's)."""

    cert_file: Annotated[str, TEXT] = field(metadata={"description": "the certificate chain (PEM)"})
    key_file: Annotated[str, TEXT] = field(metadata={"description": "its private key (PEM)"})
    ca_file: Annotated[str | None, optional(TEXT)] = None
    server_name: Annotated[str | None, optional(Parsed(_host_name))] = None
    health_listen: Annotated[str | None, optional(Parsed(_address))] = None


@dataclass(frozen=True, slots=True)
class TenantJwtConfig(Section):
    """``quotas.jwt``: Envoy checks every request's JWT (``Authorization: Bearer <token>``; none, or one that fails
    the checks: 401) against ``issuer``, ``audiences`` (one of them must be the token's; empty: not checked) and
    the public keys of ``jwks_file`` (a JWKS file where Envoy runs; HMAC keys work too), and names the tenant by
    the token's claim ``claim`` (``a.b`` for a nested one). Whatever header of that name the client sent is
    removed first. The token reaches the servers only with ``forward``."""

    issuer: Annotated[str, TEXT] = field(metadata={"description": "the tokens' iss, e.g. https://auth.example.com"})
    jwks_file: Annotated[str, TEXT] = field(metadata={"description": "the JWKS file, on Envoy's machine"})
    claim: Annotated[str, TEXT] = field(metadata={"description": "the claim that names the tenant, e.g. tenant"})
    audiences: tuple[Annotated[str, TEXT], ...] = ()
    forward: Annotated[bool, FLAG] = False


@dataclass(frozen=True, slots=True)
class QuotasConfig(Section):
    """``quotas``: per-tenant limits. The tenant is the value of the request header ``header``, which a client
    must not be able to set, since it could spend another tenant's quota, or escape its own under a new name each
    time. ``source`` says who sets it: ``jwt`` (Envoy, from a claim of the request's JWT, as ``jwt`` says; the
    bootstrap `inferlb envoy-config` renders checks the token and removes any copy the client sent) or ``gateway``
    (a gateway in front that authenticates clients and sets it, the only way clients reach Envoy: the operator
    vouches for that). ``tenants`` names the limits of each tenant; ``default`` those of any other tenant (and of
    a request without the header, the tenant ``""``); without ``default`` they are not limited. A request over
    its tenant's quota gets 429 with ``retry-after`` and a JSON reason. With ``replicas`` the limits hold across
    all the replicas (scorer/quotas.py says how closely)."""

    header: Annotated[str | None, Parsed(_header_name)] = field(
        default=None, metadata={"description": "the request header that names the tenant, e.g. x-tenant-id"}
    )
    source: Annotated[str | None, one_of(*TENANT_SOURCES)] = field(
        default=None, metadata={"description": "who sets the header: jwt (Envoy, from a JWT claim) or gateway"}
    )
    jwt: TenantJwtConfig | None = None
    tenants: dict[TenantName, TenantLimits] = field(default_factory=dict)
    default: TenantLimits | None = None
    assumed_output_tokens: Annotated[int, integer(ge=0, le=1 << 24)] = 256
    sync_interval_s: Annotated[float, number(ge=0.002, le=5)] = 0.02
    max_tenants: Annotated[int, integer(ge=1, le=1_000_000)] = 10_000

    @model_validator(mode="after")
    def _consistent(self) -> QuotasConfig:
        if self.header is None:
            raise invalid(" is needed: the request header that names the tenant", "header")
        if self.header in _NOT_TENANT_HEADERS:
            raise invalid(
                f" cannot be {self.header!r}: Envoy uses it for something else (or it holds credentials, which would"
                " become metric labels); name the tenant in a header of its own, e.g. x-tenant-id",
                "header",
            )
        if self.source is None:
            raise invalid(
                " is needed: who sets the tenant header, so that no client can: 'jwt' (Envoy, from a claim of each"
                " request's JWT; give quotas.jwt) or 'gateway' (a gateway in front that authenticates clients)",
                "source",
            )
        if (self.source == "jwt") != (self.jwt is not None):
            raise invalid(
                " is needed with source 'jwt' (issuer, jwks_file, claim)"
                if self.jwt is None
                else " is for source 'jwt' only: with 'gateway' the gateway in front checks clients",
                "jwt",
            )
        if not self.tenants and self.default is None:
            raise invalid(" limits nothing: give tenants, default, or both")
        return self


# Prompts a slow tokenizer may hold (running or waiting for a thread, late ones included): a request that finds this
# many routes at once without exact cache keys, so one client's huge prompts cannot hold up everyone's.
KEYING_QUEUE = 8
# How long a request waits for its exact cache keys before it routes without them, on the approximate prefix index
# (the tokenizer's late result is dropped). A few KB take milliseconds (bench/results/kvevents.md); the keyed head of
# a prompt of 128k tokens or more, most of a second.
KEYING_DEADLINE_S = 0.05


# The `otel` settings a picker reads once, at start-up (the rest follow a reload): a reload that changes one is refused.
OTEL_FIXED_AT_START = (
    "window_s",
    "half_life_s",
    "heatmap_bucket_s",
    "join_max_age_s",
    "exporter",
    "export_endpoint",
    "inject_traceparent",
)


@dataclass(frozen=True, slots=True)
class KVEventsConfig(Section):
    """``kv_events``: the servers publish their KV-cache events (vLLM's ``--kv-events-config``, publisher zmq), and
    the prefix scorers match requests against what each server reports it holds instead of guessing from what was
    sent there. Every endpoint publishes on ``port`` (and answers replays on ``replay_port``) at its own IP.
    ``tokenizers`` names, per model, the folder of its tokenizer (``tokenizer.json`` and ``tokenizer_config.json``)
    or ``pieces`` (the emulator's); requests for other models, and endpoints whose events stop, keep the
    approximate index. ``ports`` and ``replay_ports`` give, by endpoint address, the ports of servers that publish
    elsewhere (several servers on one IP); the host is always the endpoint's own. ``block_size`` must be the
    servers' KV block size (vLLM's ``--block-size``, 16 by default). ``max_bytes_per_s``: what one endpoint may
    publish a second on average (a batch at the 1 MiB limit as its burst; replays included); a batch beyond it is
    dropped and the endpoint is unsure for ``resync_s``, since decoding costs the picker's CPU (scorer/kvsubscriber.py).
    A server that prefills 10,000 tokens a second publishes tens of KB a second. ``keying_deadline_s``: how long a
    request waits for its prompt's exact keys (the tokenizer runs in a thread) before it routes on the approximate
    index; ``keying_queue``: prompts the tokenizer may hold at once (a request that finds that many routes at once
    without exact keys)."""

    port: Annotated[int, integer(ge=1, le=65535, noun="a port number")] = field(
        metadata={
            "description": "the port each endpoint publishes KV events on (vLLM: the endpoint of --kv-events-config)"
        }
    )
    replay_port: Annotated[int | None, integer(ge=1, le=65535, noun="a port number")] = None
    # Per endpoint address, ports other than the common ones (servers that share an IP, as on one test machine).
    ports: dict[Address, Annotated[int, integer(ge=1, le=65535, noun="a port number")]] = field(default_factory=dict)
    replay_ports: dict[Address, Annotated[int, integer(ge=1, le=65535, noun="a port number")]] = field(
        default_factory=dict
    )
    # The ZMQ topic prefix to subscribe to: "" (vLLM's default) takes every topic.
    topic: Annotated[str, must("a string", lambda value: isinstance(value, str))] = ""
    tokenizers: dict[Text, Text] = field(default_factory=dict)
    block_size: Annotated[int, integer(ge=1, le=4096)] = 16
    pending_s: Annotated[float, number(ge=0, le=60)] = 2.0
    stale_s: Annotated[float, number(ge=0.1, le=3600)] = 5.0
    resync_s: Annotated[float, number(ge=0, le=3600)] = 30.0
    replay_timeout_s: Annotated[float, number(ge=0.01, le=60)] = 2.0
    max_bytes_per_s: Annotated[int, integer(ge=64 << 10, le=1 << 30)] = 1 << 20
    keying_deadline_s: Annotated[float, number(ge=0.001, le=10)] = KEYING_DEADLINE_S
    keying_queue: Annotated[int, integer(ge=1, le=1024)] = KEYING_QUEUE

    @model_validator(mode="after")
    def _consistent(self) -> KVEventsConfig:
        if not self.tokenizers:
            raise invalid(
                " is needed: name each model's tokenizer folder (or 'pieces' for the emulator), or the servers' "
                "events cannot be matched to requests",
                "tokenizers",
            )
        if self.replay_port == self.port:
            raise invalid(f" must differ from port ({self.port})", "replay_port")
        return self


@dataclass(frozen=True, slots=True)
class DiscoveryConfig(Section):
    """``pool.discovery``: where the endpoints come from besides ``pool.endpoints`` (which then may be empty):
    exactly one of ``etcd`` and ``kubernetes``."""

    etcd: EtcdConfig | None = None
    kubernetes: KubernetesConfig | None = None

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryConfig:
        if (self.etcd is None) == (self.kubernetes is None):
            raise invalid(" needs exactly one source: etcd or kubernetes")
        return self


class PoolFile(Model):
    """``pool``: the endpoints, and the networks they and their GPU sources must be inside. With ``discovery``
    the endpoints come (also) from a discovery source; ``slow_start`` ramps in the endpoints that join; ``speeds``
    declares how fast each kind of server is."""

    allowed_networks: Annotated[tuple[Network, ...], _NETWORK_LIST] = DEFAULT_ALLOWED_NETWORKS
    endpoints: Annotated[
        tuple[EndpointConfig, ...],
        must("a non-empty list of endpoints (empty only with pool.discovery)", lambda v: isinstance(v, list)),
    ] = ()
    discovery: DiscoveryConfig | None = None
    slow_start: SlowStartConfig = Field(default_factory=SlowStartConfig)
    speeds: SpeedsConfig | None = None

    @model_validator(mode="after")
    def _inside_allowed_networks(self) -> PoolFile:
        if not self.endpoints and self.discovery is None:
            if "endpoints" in self.model_fields_set:
                raise invalid(" must be a non-empty list of endpoints (or set pool.discovery); got []", "endpoints")
            raise invalid(" is required: a non-empty list of endpoints (or set pool.discovery)", "endpoints")
        allowed, where = Networks.of(self.allowed_networks), "pool.allowed_networks"
        seen: dict[str, int] = {}
        for i, endpoint in enumerate(self.endpoints):
            problem = destination_problem(parse_address(endpoint.address)[0], allowed, where)
            if problem is not None:
                raise invalid(f": {shown(endpoint.address)} {problem}", "endpoints", i, "address")
            if endpoint.address in seen:
                raise invalid(
                    f" {endpoint.address!r} repeats pool.endpoints[{seen[endpoint.address]}]", "endpoints", i, "address"
                )
            seen[endpoint.address] = i
            url = None if endpoint.gpu is None else endpoint.gpu.url
            host = None if url is None else urlsplit(url).hostname  # the url is canonical: its host an IP
            if host is not None and (problem := destination_problem(host, allowed, where)) is not None:
                raise invalid(f": {shown(url)}: {host} {problem}", "endpoints", i, "gpu", "url")
        return self


_CLASS = RequestClass("")  # the defaults of a class


class MatchFile(Model):
    """What a request must be for its class's rule to match (all given conditions; none: every request)."""

    min_prompt_tokens: Annotated[int | None, integer(ge=0)] = None
    max_prompt_tokens: Annotated[int | None, integer(ge=0)] = None
    stream: Annotated[bool | None, optional(FLAG)] = None
    models: Annotated[frozenset[Text] | None, must("a list", lambda v: isinstance(v, list))] = None
    header: Annotated[frozenset[Text] | None, Parsed(_one_or_more)] = None


class ClassFile(Model):
    """One entry of ``classes``: its rule (``match``) and what its requests get (see `RequestClass`)."""

    name: Text = Field(description="the class's name")
    match: MatchFile = Field(default_factory=MatchFile)
    priority: Annotated[int, integer()] = _CLASS.priority
    ttft_slo_s: Annotated[float | None, number(ge=0.001, le=3600)] = None
    # Unset: "shed" for a negative priority (sheddable, as the Endpoint Picker protocol's objectives say), else
    # "wait".
    on_saturation: Annotated[str | None, optional(one_of("wait", "shed"))] = None
    max_wait_s: Annotated[float, number(ge=0, le=30)] = _CLASS.max_wait_s
    retry_after_s: Annotated[int, integer(ge=1, le=3600, noun="an integer number of seconds")] = _CLASS.retry_after_s
    labels: dict[Text, Text] = Field(default_factory=dict)

    def rule(self) -> ClassRule:
        fields = self.model_dump(exclude={"match"})
        if fields["on_saturation"] is None:
            fields["on_saturation"] = "shed" if self.priority < 0 else _CLASS.on_saturation
        match = self.match
        return ClassRule(
            RequestClass(**fields),
            min_prompt_tokens=match.min_prompt_tokens,
            max_prompt_tokens=match.max_prompt_tokens,
            stream=match.stream,
            models=match.models,
            header_values=match.header,
        )


class PluginEntry:
    """``Annotated`` metadata of a profile's plugin entry: a type name, or a mapping with ``type``, its parameters
    and (scorers only) ``weight``. Validated into a `PluginSpec`; the registry checks the type and parameters
    when `parse_config` builds the profile. ``kind``: "filters", "scorers" or "pickers"."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self._spec)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return default_registry().entry_schema(self.kind)

    def _spec(self, item: Any) -> PluginSpec:
        if isinstance(item, str):
            item = {"type": item}
        if not isinstance(item, dict):
            raise invalid(f" must be a type name or a mapping with a type; got {type(item).__name__}")
        kind = item.get("type")
        if not isinstance(kind, str) or not kind:
            raise invalid(f" must be a non-empty string; got {shown(kind)}", "type")
        table = getattr(default_registry(), self.kind)
        if kind not in table:
            raise invalid(f": {unknown_type(table, kind)}", "type")
        if "weight" in item and self.kind != "scorers":
            raise invalid(": only scorers have weights", "weight")
        params = {str(k): v for k, v in item.items() if k not in ("type", "weight")}
        return PluginSpec(kind, params, checked_weight(item.get("weight", 1.0)))


class ProfileFile(Model):
    """A scheduling profile: filters (the first must be ``model``), weighted scorers, one picker."""

    filters: tuple[Annotated[PluginSpec, PluginEntry("filters")], ...] = Field(("model",), validate_default=True)
    scorers: tuple[Annotated[PluginSpec, PluginEntry("scorers")], ...] = ()
    picker: Annotated[PluginSpec, PluginEntry("pickers")] = Field("max-score", validate_default=True)

    @model_validator(mode="after")
    def _model_first(self) -> ProfileFile:
        if not self.filters or self.filters[0].type != "model":
            raise invalid(" must be 'model' (requests must go to endpoints serving their model)", "filters", 0)
        if len(self.scorers) > MAX_SCORERS:
            raise invalid(f": at most {MAX_SCORERS} scorers; got {len(self.scorers)}", "scorers")
        return self


class ArmFile(Model):
    """One arm of an experiment: a name, the profile it routes with (a preset or a profile of this file), and its
    share of the experiment's traffic (a step of 0.001; ignored when the experiment assigns by header)."""

    name: Text = Field(description="the arm's name")
    profile: Text = Field(description="a preset or a profile of this file")
    weight: Annotated[float, number(ge=0, le=1)] = 0.0
    endpoints: dict[Text, Text] = Field(
        default_factory=dict, description="a release arm's endpoints: the pool's endpoints with all these labels"
    )
    model: Text | None = Field(
        default=None,
        description="a release arm's model: its requests' body is rewritten to name it, and they route to its servers",
    )


_GUARD = GuardSpec()


class GuardFile(Model):
    """An experiment's guard rail (see `scorer.experiments.GuardSpec`): a treatment arm that breaches a bound has its
    weight cut, and is rolled back at the ``max_breaches``-th breach."""

    max_error_rate: Annotated[float, number(ge=0, le=1)] = _GUARD.max_error_rate
    max_ttft_p99_ratio: Annotated[float | None, optional(number(ge=1, le=1000))] = _GUARD.max_ttft_p99_ratio
    min_requests: Annotated[int, integer(ge=1, le=1_000_000)] = _GUARD.min_requests
    cut: Annotated[float, number(ge=0, le=0.99)] = _GUARD.cut
    max_breaches: Annotated[int, integer(ge=1, le=100)] = _GUARD.max_breaches
    check_s: Annotated[float, number(ge=0.1, le=3600)] = _GUARD.check_s

    def spec(self) -> GuardSpec:
        return GuardSpec(
            self.max_error_rate, self.max_ttft_p99_ratio, self.min_requests, self.cut, self.max_breaches, self.check_s
        )


class ScopeFile(Model):
    """Which requests an experiment covers (all given conditions; none: every request)."""

    models: tuple[Text, ...] = ()
    classes: tuple[Text, ...] = ()
    paths: tuple[Text, ...] = ()


_EXPERIMENT = ExperimentSpec("", (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5)))  # the defaults


class ExperimentFile(Model):
    """One entry of ``experiments`` (see scorer/experiments.py): arms (the first is the control), how requests are
    assigned (``weight``, ``hash`` of ``header``, or ``header`` whose ``values`` name arms), its ``scope``, and the
    sequential test's settings."""

    name: Text = Field(description="the experiment's name")
    arms: tuple[ArmFile, ...] = Field(description="two or more arms; the first is the control")
    assign: Annotated[str, one_of("weight", "hash", "header")] = _EXPERIMENT.assign
    header: HeaderName = None
    values: dict[Text, Text] = Field(default_factory=dict)
    scope: ScopeFile = Field(default_factory=ScopeFile)
    alpha: Annotated[float, number(ge=0.001, le=0.5)] = _EXPERIMENT.alpha
    min_samples: Annotated[int, integer(ge=2, le=10_000_000)] = _EXPERIMENT.min_samples
    latency_tau: Annotated[float, number(ge=0.001, le=10)] = _EXPERIMENT.latency_tau
    error_tau: Annotated[float, number(ge=0.0001, le=1)] = _EXPERIMENT.error_tau
    window_s: Annotated[float, number(ge=1, le=86400)] = _EXPERIMENT.window_s
    guard: GuardFile | None = None
    ramp: tuple[Annotated[float, number(ge=0.001, le=1)], ...] = ()
    ramp_step_s: Annotated[float, number(ge=1, le=86400)] = _EXPERIMENT.ramp_step_s

    @model_validator(mode="after")
    def _valid(self) -> ExperimentFile:
        try:
            self.spec()
        except SpecError as exc:
            raise invalid(f": {exc}", *exc.field) from None
        return self

    def spec(self) -> ExperimentSpec:
        return ExperimentSpec(
            self.name,
            tuple(ArmSpec(a.name, a.profile, a.weight, dict(a.endpoints), a.model) for a in self.arms),
            assign=self.assign,
            header=self.header,
            values=dict(self.values),
            models=frozenset(self.scope.models),
            classes=frozenset(self.scope.classes),
            paths=self.scope.paths,
            alpha=self.alpha,
            min_samples=self.min_samples,
            latency_tau=self.latency_tau,
            error_tau=self.error_tau,
            window_s=self.window_s,
            guard=None if self.guard is None else self.guard.spec(),
            ramp=self.ramp,
            ramp_step_s=self.ramp_step_s,
        )


class ConfigFile(Model):
    """The picker's configuration file (see the README's Configuration section)."""

    model_config = ConfigDict(title="inferlb picker configuration")

    listen: Address = DEFAULT_LISTEN
    admin: OptionalAddress = DEFAULT_ADMIN
    admin_auth: AdminAuthFile = Field(default_factory=AdminAuthFile)
    drain_s: Annotated[float, number(ge=0, le=3600)] = DEFAULT_DRAIN_S
    inflight: InflightConfig = Field(default_factory=InflightConfig)
    policy: Text = DEFAULT_POLICY
    max_body_bytes: Annotated[int, integer(ge=1024, le=1 << 30)] = DEFAULT_MAX_BODY_BYTES
    session_header: HeaderName = None
    signals: SignalsConfig = Field(default_factory=SignalsConfig)
    profiles: dict[Text, ProfileFile] = Field(default_factory=dict)
    class_header: HeaderName = None
    # The Endpoint Picker protocol's inference objective header names the request's class (off: whoever sends
    # requests could pick any class by name; turn it on behind a gateway that sets or strips the header).
    inference_objectives: Annotated[bool, FLAG] = False
    # For debugging: each routed response names the candidates' scores (header x-inferlb-scores). Off: it shows
    # clients the pool's addresses.
    debug_scores: Annotated[bool, FLAG] = False
    classes: tuple[ClassFile, ...] = ()
    default_class: Text | None = None
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    otel: OtelConfig = Field(default_factory=OtelConfig)
    experiments: tuple[ExperimentFile, ...] = ()
    destinations: Annotated[int, integer(ge=1, le=8)] = 1
    weights_interval_s: Annotated[float, number(ge=0.05, le=60)] = 1.0
    replicas: ReplicasConfig | None = None
    quotas: QuotasConfig | None = None
    kv_events: KVEventsConfig | None = None
    tls: TlsConfig | None = None
    pool: PoolFile = Field(description="a mapping with a list 'endpoints'")

    @model_validator(mode="after")
    def _consistent(self) -> ConfigFile:
        if self.admin is not None and self.admin == self.listen:
            raise invalid(f" must differ from listen; both are {self.admin!r}", "admin")
        if self.otel.receiver is not None and self.otel.receiver in (self.listen, self.admin):
            raise invalid(f" must differ from listen and admin; got {self.otel.receiver!r}", "otel", "receiver")
        health = None if self.tls is None else self.tls.health_listen
        if health is not None and health in (self.listen, self.admin, self.otel.receiver):
            raise invalid(f" must differ from listen, admin and otel.receiver; got {health!r}", "tls", "health_listen")
        if self.policy not in PRESET_NAMES and self.policy not in self.profiles:
            known = ", ".join([*PRESET_NAMES, *self.profiles])
            raise invalid(f" must be a preset or a profile of this file ({known}); got {shown(self.policy)}", "policy")
        if self.admin is not None and self.admin_auth.source() is None and not _is_loopback(self.admin):
            raise invalid(
                f": {self.admin!r} is reachable beyond this host, and the admin API can reroute all traffic: set "
                "admin_auth.token_file or admin_auth.token_env (a bearer token), or bind admin to 127.0.0.1",
                "admin",
            )
        # With a discovery source the endpoints are not known yet: the checks against them run on each membership.
        listed_only = self.pool.discovery is None
        names: dict[str, int] = {}
        for i, entry in enumerate(self.classes):
            if entry.name in names:
                raise invalid(f" {entry.name!r} repeats an earlier class", "classes", i, "name")
            names[entry.name] = i
            labels = entry.labels.items()
            if (
                listed_only
                and labels
                and not any(all(e.labels.get(k) == v for k, v in labels) for e in self.pool.endpoints)
            ):
                raise invalid(f" {entry.labels!r}: no endpoint of the pool has them", "classes", i, "labels")
            if entry.match.header is not None and self.class_header is None:
                raise invalid(f" must name the header that classes[{i}].match.header reads", "class_header")
        if self.default_class is not None and self.default_class not in names:
            listed = ", ".join(names) or "none"
            raise invalid(f" {self.default_class!r} is not one of the classes ({listed})", "default_class")
        seen: set[str] = set()
        for i, experiment in enumerate(self.experiments):
            if experiment.name in seen:
                raise invalid(f" {experiment.name!r} repeats an earlier experiment", "experiments", i, "name")
            seen.add(experiment.name)
            for j, arm in enumerate(experiment.arms):
                if arm.profile not in PRESET_NAMES and arm.profile not in self.profiles:
                    known = ", ".join([*PRESET_NAMES, *self.profiles])
                    raise invalid(
                        f" must be a preset or a profile of this file ({known}); got {shown(arm.profile)}",
                        "experiments",
                        i,
                        "arms",
                        j,
                        "profile",
                    )
                if (
                    listed_only
                    and arm.model is not None
                    and not any(e.models is None or arm.model in e.models for e in self.pool.endpoints)
                ):
                    raise invalid(
                        f" {shown(arm.model)}: no endpoint of the pool serves it", "experiments", i, "arms", j, "model"
                    )
            for k, name in enumerate(experiment.scope.classes):
                if name not in names and name != "default":
                    raise invalid(f" {name!r} is not a request class", "experiments", i, "scope", "classes", k)
            for k, model in enumerate(experiment.scope.models):
                if listed_only and not any(e.models is None or model in e.models for e in self.pool.endpoints):
                    served = sorted({m for e in self.pool.endpoints for m in e.models or ()})
                    raise invalid(
                        f" {shown(model)}: no endpoint of the pool serves it, so the experiment covers no request"
                        f" (served: {', '.join(served)})",
                        "experiments",
                        i,
                        "scope",
                        "models",
                        k,
                    )
            try:
                if listed_only:
                    endpoint_masks(experiment.spec().arms, [e.labels for e in self.pool.endpoints])
            except ValueError as exc:
                raise invalid(f": {exc}", "experiments", i) from None
        if listed_only and len(self.experiments) > 1:
            try:  # one experiment's release endpoints serve none of the others' requests
                arm_masks([e.spec() for e in self.experiments], [e.labels for e in self.pool.endpoints])
            except ValueError as exc:
                raise invalid(f": {exc}", "experiments") from None
        return self


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(parse_address(address)[0]).is_loopback


@dataclass(frozen=True, slots=True)
class Config:
    """The whole picker configuration, validated."""

    endpoints: tuple[EndpointConfig, ...]
    allowed_networks: Networks = DEFAULT_NETWORKS  # where endpoints and GPU sources may be (pool.allowed_networks)
    listen: str = DEFAULT_LISTEN
    policy: str = DEFAULT_POLICY
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    profiles: Mapping[str, ProfileSpec] = field(default_factory=dict)
    session_header: str | None = None
    admin: str | None = DEFAULT_ADMIN
    class_header: str | None = None
    inference_objectives: bool = False
    debug_scores: bool = False
    classes: tuple[ClassRule, ...] = ()
    default_class: RequestClass = field(default_factory=lambda: RequestClass("default"))
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig())
    otel: OtelConfig = field(default_factory=lambda: OtelConfig())
    inflight: InflightConfig = field(default_factory=InflightConfig)
    admin_auth: AdminAuthConfig = field(default_factory=AdminAuthConfig)
    drain_s: float = DEFAULT_DRAIN_S
    experiments: tuple[ExperimentSpec, ...] = ()
    discovery: DiscoveryConfig | None = None
    slow_start: SlowStart = field(default_factory=SlowStart)
    speeds: SpeedHints | None = None  # the operator's relative speeds per kind of server (pool.speeds)
    # How many endpoints the picker names per request, best first (more than 1: Envoy's Override Host cluster
    # retries a request that never reached a server on the next); how often it pushes Envoy endpoint weights.
    destinations: int = 1
    weights_interval_s: float = 1.0
    replicas: ReplicasConfig | None = None  # several pickers share routing state through Redis
    quotas: QuotasConfig | None = None  # per-tenant limits (across the replicas, with replicas)
    kv_events: KVEventsConfig | None = None  # the servers' own account of their prefix caches
    tls: TlsConfig | None = None  # TLS on the gRPC listener

    def profile_spec(self, name: str | None = None) -> ProfileSpec | str:
        """The spec of the chosen policy (or of the profile ``name``): a profile of this file, else the preset's
        name."""
        name = self.policy if name is None else name
        return self.profiles.get(name, name)

    @property
    def experiment_headers(self) -> tuple[str, ...]:
        """The headers the experiments assign by, which Envoy must forward to the picker."""
        return tuple(sorted({e.header for e in self.experiments if e.header}))

    @property
    def named_headers(self) -> tuple[str, ...]:
        """The headers read into each request's features by name: the experiments' and the quotas' tenant header
        (Envoy must forward them all)."""
        tenant = () if self.quotas is None or self.quotas.header is None else (self.quotas.header,)
        return tuple(sorted({*self.experiment_headers, *tenant}))


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file; raises ``ConfigError`` naming the file and the field (one line per
    error, each starting with the file's name)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # a value PyYAML cannot build, such as the date 2024-13-01
        raise ConfigError(f"{path}: not valid YAML: a value that cannot be read ({exc})") from None
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError("\n".join(f"{path}: {line}" for line in str(exc).splitlines())) from None


def parse_config(data: Any) -> Config:
    """Validate an already-parsed document (a mapping) into a ``Config``."""
    try:
        doc = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc) from None
    profiles = {
        name: ProfileSpec(name, p.filters, p.scorers, p.picker, where=f"profiles.{name}")
        for name, p in doc.profiles.items()
    }
    # Build each profile once now, so that a bad plugin type or parameter fails at start-up, naming its place.
    registry = default_registry()
    for spec in profiles.values():
        registry.build(spec, BuildContext(size=max(len(doc.pool.endpoints), 1)))
    rules = tuple(entry.rule() for entry in doc.classes)
    by_name = {rule.request_class.name: rule.request_class for rule in rules}
    return Config(
        endpoints=doc.pool.endpoints,
        allowed_networks=Networks.of(doc.pool.allowed_networks),
        listen=doc.listen,
        policy=doc.policy,
        max_body_bytes=doc.max_body_bytes,
        signals=doc.signals,
        profiles=profiles,
        session_header=doc.session_header,
        admin=doc.admin,
        class_header=doc.class_header,
        inference_objectives=doc.inference_objectives,
        debug_scores=doc.debug_scores,
        classes=rules,
        default_class=RequestClass("default") if doc.default_class is None else by_name[doc.default_class],
        admission=doc.admission,
        otel=doc.otel,
        inflight=doc.inflight,
        admin_auth=doc.admin_auth.config(),
        drain_s=doc.drain_s,
        experiments=tuple(e.spec() for e in doc.experiments),
        discovery=doc.pool.discovery,
        slow_start=doc.pool.slow_start.spec(),
        speeds=None if doc.pool.speeds is None else doc.pool.speeds.spec(),
        destinations=doc.destinations,
        weights_interval_s=doc.weights_interval_s,
        replicas=doc.replicas,
        quotas=doc.quotas,
        kv_events=doc.kv_events,
        tls=doc.tls,
    )
