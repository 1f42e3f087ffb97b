"""The picker's configuration: one YAML file, validated once at start-up.

Every error names the exact place of the problem and what would fix it, e.g.
``pool.endpoints[2].address: '10.0.0.x:8000': '10.0.0.x' is not a literal IP address``. Nothing falls back
silently to a default: a key that is present must be valid, and unknown keys are refused (a typo would
otherwise be ignored).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferlb.scorer.address import format_address, parse_address, parse_authority
from inferlb.scorer.classes import ClassRule, RequestClass
from inferlb.scorer.credentials import TokenSource, parse_token_source
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.networks import DEFAULT_NETWORKS, Networks, destination_problem, parse_networks, unicast_problem
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.scorer.registry import MAX_WEIGHT, BuildContext, PluginSpec, ProfileSpec, default_registry

DEFAULT_LISTEN = "127.0.0.1:9002"
DEFAULT_ADMIN = "127.0.0.1:9003"
DEFAULT_POLICY = "default"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SCORERS = 32
DEFAULT_DRAIN_S = 5.0


@dataclass(frozen=True, slots=True)
class SignalsConfig:
    """How the picker collects server signals. ``scrape_metrics=False`` turns the vLLM scraper off."""

    scrape_metrics: bool = True
    scrape_interval_s: float = 0.1
    scrape_timeout_s: float = 0.5
    stale_after_s: float = 1.0
    gpu_interval_s: float = 0.5


LATENCY_SOURCES = ("spans", "stream")


@dataclass(frozen=True, slots=True)
class OtelConfig:
    """The span loop. ``receiver``: where the OTLP gRPC receiver listens for the servers' spans (None: off);
    ``inject_traceparent``: give each routed request a W3C traceparent so its server span joins the decision;
    latency statistics over ``window_s`` (quantiles) and with ``half_life_s`` (EWMA), published to the scorers
    every ``publish_interval_s``.

    ``latency_source`` says what feeds those statistics: ``spans`` (the servers' spans, at the receiver) or
    ``stream`` (the picker times each response as Envoy passes it through: TTFT to the first non-empty chunk of
    a streamed response, E2E to the body of any other; for servers that send no spans).

    Spans steer routing, so the receiver trusts only ``allowed_senders`` (CIDR strings; None: the pool's hosts
    and loopback, following the pool) and, with ``receiver_auth``, only exports that carry ``authorization:
    Bearer <token>``. It refuses messages over ``receiver_max_message_bytes``, takes at most
    ``receiver_max_spans_per_request`` spans of one export and ``receiver_max_spans_per_s`` latency spans a second
    (a burst of one second or one full export), and drops spans that end more than ``span_max_age_s`` before or
    ``span_max_ahead_s`` after now or whose duration or latencies exceed ``span_max_latency_s``. A decision waits
    ``join_max_age_s`` for its span (see otel/receiver.py for the join rule). ``join_by_name``: a span without a
    decision's trace id may still join the endpoint it names when it comes from that endpoint's own host (for
    servers that do not propagate trace context); off by default, because where several servers share a host
    (or a client runs on one) anything there could then speak for all of them."""

    receiver: str | None = None
    latency_source: str = "spans"
    inject_traceparent: bool = True
    exporter: str = "none"  # where the picker's own inferlb.route spans go: none | otlp-grpc | otlp-http
    export_endpoint: str | None = None
    window_s: float = 60.0
    half_life_s: float = 10.0
    publish_interval_s: float = 0.25
    heatmap_bucket_s: float = 10.0
    allowed_senders: tuple[str, ...] | None = None
    receiver_auth: TokenSource | None = None
    receiver_max_message_bytes: int = 4 << 20  # the OTel Collector's default batch limit
    receiver_max_spans_per_request: int = 16384
    receiver_max_spans_per_s: float = 10000.0  # ~3x what one picker process can route
    span_max_age_s: float = 600.0
    span_max_ahead_s: float = 60.0
    span_max_latency_s: float = 3600.0
    join_max_age_s: float = 300.0
    join_by_name: bool = False


REQUEST_ENDS = ("access-log", "stream")


@dataclass(frozen=True, slots=True)
class InflightConfig:
    """How the picker learns that a routed request ended (its in-flight count drops then).

    ``end``: ``access-log`` (the routing stream ends at the decision, and Envoy's gRPC access log reports the end;
    a picker restart cuts no routed request) or ``stream`` (the routing stream stays open for the whole request;
    for gateways that cannot send the access log). ``max_age_s``: a request whose end has not been reported after
    this long counts as ended (an access-log entry lost while the picker was unreachable)."""

    end: str = "access-log"
    max_age_s: float = 900.0


@dataclass(frozen=True, slots=True)
class AdminAuthConfig:
    """Who may use the admin API. ``token``: where the bearer token is (None: state-changing routes are off);
    ``allowed_hosts``: ``Host`` names accepted besides the admin's own address (e.g. a Service's DNS name)."""

    token: TokenSource | None = None
    allowed_hosts: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """When an endpoint counts as saturated for admission control."""

    max_waiting: float = 16
    max_kv_usage: float = 0.95


@dataclass(frozen=True, slots=True)
class GpuSource:
    """Where an endpoint's GPU state comes from: ``url`` of a GPU agent's (or the emulator's) ``/gpu`` (kind
    "agent") or of a DCGM exporter's ``/metrics`` (kind "dcgm"); ``indices`` are the GPUs of that node the endpoint
    uses (None: all of them). A parsed ``url`` is canonical ``http://ip:port/path``: a literal IP inside
    ``pool.allowed_networks``, no user, query or fragment."""

    url: str
    kind: str = "agent"
    indices: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One inference server. ``models`` is None when the endpoint accepts any model name."""

    address: str
    models: frozenset[str] | None
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu: GpuSource | None = None


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
    classes: tuple[ClassRule, ...] = ()
    default_class: RequestClass = field(default_factory=lambda: RequestClass("default"))
    admission: AdmissionConfig = field(default_factory=lambda: AdmissionConfig())
    otel: OtelConfig = field(default_factory=lambda: OtelConfig())
    inflight: InflightConfig = field(default_factory=InflightConfig)
    admin_auth: AdminAuthConfig = field(default_factory=AdminAuthConfig)
    drain_s: float = DEFAULT_DRAIN_S

    def profile_spec(self) -> ProfileSpec | str:
        """The spec of the chosen policy: a profile of this file, else the preset's name."""
        return self.profiles.get(self.policy, self.policy)


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file; raises ``ConfigError`` naming the file and the field."""
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
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_config(data: Any) -> Config:
    """Validate an already-parsed document (a mapping) into a ``Config``."""
    top = _mapping(
        data,
        "config",
        allowed={
            "listen",
            "admin",
            "policy",
            "max_body_bytes",
            "pool",
            "signals",
            "profiles",
            "session_header",
            "class_header",
            "classes",
            "default_class",
            "admission",
            "otel",
            "inflight",
            "admin_auth",
            "drain_s",
        },
    )
    listen = DEFAULT_LISTEN
    if "listen" in top:
        listen = _address(top["listen"], "listen")
    admin: str | None = DEFAULT_ADMIN
    if "admin" in top:
        admin = None if top["admin"] is None else _address(top["admin"], "admin")
        if admin is not None and admin == listen:
            raise ConfigError(f"admin must differ from listen; both are {admin!r}")
    profiles = _profiles(top["profiles"]) if "profiles" in top else {}
    policy = DEFAULT_POLICY
    if "policy" in top:
        policy = _string(top["policy"], "policy")
        if policy not in PRESET_NAMES and policy not in profiles:
            known = ", ".join([*PRESET_NAMES, *profiles])
            raise ConfigError(f"policy must be a preset or a profile of this file ({known}); got {policy!r}")
    signals = _signals(top["signals"]) if "signals" in top else SignalsConfig()
    session_header = _header_name(top["session_header"], "session_header") if "session_header" in top else None
    class_header = _header_name(top["class_header"], "class_header") if "class_header" in top else None
    admission = _admission(top["admission"]) if "admission" in top else AdmissionConfig()
    otel = _otel(top["otel"], listen, admin) if "otel" in top else OtelConfig()
    inflight = _inflight(top["inflight"]) if "inflight" in top else InflightConfig()
    admin_auth = _admin_auth(top["admin_auth"]) if "admin_auth" in top else AdminAuthConfig()
    if admin is not None and admin_auth.token is None and not _is_loopback(admin):
        raise ConfigError(
            f"admin: {admin!r} is reachable beyond this host, and the admin API can reroute all traffic: set "
            "admin_auth.token_file or admin_auth.token_env (a bearer token), or bind admin to 127.0.0.1"
        )
    drain_s = _number(top["drain_s"], "drain_s", 0, 3600) if "drain_s" in top else DEFAULT_DRAIN_S
    max_body = DEFAULT_MAX_BODY_BYTES
    if "max_body_bytes" in top:
        max_body = top["max_body_bytes"]
        if not isinstance(max_body, int) or isinstance(max_body, bool) or not 1024 <= max_body <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be an integer in 1024..{1 << 30}; got {max_body!r}")
    if "pool" not in top:
        raise ConfigError("pool is required: a mapping with a list 'endpoints'")
    pool = _mapping(top["pool"], "pool", allowed={"endpoints", "allowed_networks"})
    allowed_networks = DEFAULT_NETWORKS
    if "allowed_networks" in pool:
        allowed_networks = parse_networks(pool["allowed_networks"], "pool.allowed_networks")
    endpoints = _endpoints(pool.get("endpoints"), "pool.endpoints", allowed_networks)
    classes, default_class = _classes(top.get("classes", []), top.get("default_class"), endpoints)
    if class_header is None and any(rule.header_values is not None for rule in classes):
        raise ConfigError("classes match a header value, so class_header must name the header")
    # Build each profile once now, so that a bad plugin parameter fails at start-up, naming its place.
    registry = default_registry()
    for spec in profiles.values():
        registry.build(spec, BuildContext(size=len(endpoints)))
    return Config(
        endpoints=endpoints,
        allowed_networks=allowed_networks,
        listen=listen,
        policy=policy,
        max_body_bytes=max_body,
        signals=signals,
        profiles=profiles,
        session_header=session_header,
        admin=admin,
        class_header=class_header,
        classes=classes,
        default_class=default_class,
        admission=admission,
        otel=otel,
        inflight=inflight,
        admin_auth=admin_auth,
        drain_s=drain_s,
    )


def _is_loopback(address: str) -> bool:
    host, _ = parse_address(address)
    return ipaddress.ip_address(host).is_loopback


def _inflight(value: Any) -> InflightConfig:
    raw = _mapping(value, "inflight", allowed={"end", "max_age_s"})
    out: dict[str, Any] = {}
    if "end" in raw:
        if raw["end"] not in REQUEST_ENDS:
            raise ConfigError(f"inflight.end must be {' or '.join(REQUEST_ENDS)}; got {raw['end']!r}")
        out["end"] = raw["end"]
    if "max_age_s" in raw:
        out["max_age_s"] = _number(raw["max_age_s"], "inflight.max_age_s", 1, 86400)
    return InflightConfig(**out)


def _admin_auth(value: Any) -> AdminAuthConfig:
    raw = _mapping(value, "admin_auth", allowed={"token_file", "token_env", "allowed_hosts"})
    token = None
    if "token_file" in raw or "token_env" in raw:
        token = parse_token_source({k: v for k, v in raw.items() if k != "allowed_hosts"}, "admin_auth")
    hosts: set[str] = set()
    for i, host in enumerate(_list(raw.get("allowed_hosts", []), "admin_auth.allowed_hosts")):
        name = _string(host, f"admin_auth.allowed_hosts[{i}]").lower()
        if not all(c.isalnum() or c in "-._" for c in name):
            raise ConfigError(f"admin_auth.allowed_hosts[{i}] must be a host name without a port; got {host!r}")
        hosts.add(name)
    return AdminAuthConfig(token=token, allowed_hosts=frozenset(hosts))


def _otel(value: Any, listen: str, admin: str | None) -> OtelConfig:
    raw = _mapping(
        value,
        "otel",
        allowed={
            "receiver",
            "inject_traceparent",
            "window_s",
            "half_life_s",
            "publish_interval_s",
            "heatmap_bucket_s",
            "exporter",
            "export_endpoint",
            "latency_source",
            "allowed_senders",
            "receiver_auth",
            "receiver_max_message_bytes",
            "receiver_max_spans_per_request",
            "receiver_max_spans_per_s",
            "span_max_age_s",
            "span_max_ahead_s",
            "span_max_latency_s",
            "join_max_age_s",
            "join_by_name",
        },
    )
    out: dict[str, Any] = _otel_receiver(raw)
    if raw.get("receiver") is not None:
        receiver = _address(raw["receiver"], "otel.receiver")
        if receiver in (listen, admin):
            raise ConfigError(f"otel.receiver must differ from listen and admin; got {receiver!r}")
        out["receiver"] = receiver
    for name in ("inject_traceparent", "join_by_name"):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise ConfigError(f"otel.{name} must be true or false; got {raw[name]!r}")
            out[name] = raw[name]
    if "exporter" in raw:
        exporter = raw["exporter"]
        if exporter not in ("none", "otlp-grpc", "otlp-http"):
            raise ConfigError(f"otel.exporter must be none, otlp-grpc or otlp-http; got {exporter!r}")
        out["exporter"] = exporter
    if "latency_source" in raw:
        if raw["latency_source"] not in LATENCY_SOURCES:
            raise ConfigError(
                f"otel.latency_source must be {' or '.join(LATENCY_SOURCES)}; got {raw['latency_source']!r}"
            )
        out["latency_source"] = raw["latency_source"]
    if raw.get("export_endpoint") is not None:
        out["export_endpoint"] = _string(raw["export_endpoint"], "otel.export_endpoint")
    if out.get("exporter", "none") != "none" and "export_endpoint" not in out:
        raise ConfigError("otel.export_endpoint is required with an otlp exporter (host:port or a URL)")
    bounds = (
        ("window_s", 1, 86400),
        ("half_life_s", 0.01, 86400),
        ("publish_interval_s", 0.01, 60),
        ("heatmap_bucket_s", 0.1, 3600),
    )
    for name, low, high in bounds:
        if name in raw:
            out[name] = _number(raw[name], f"otel.{name}", low, high)
    if "receiver" not in out:
        for name in ("allowed_senders", "receiver_auth"):
            if raw.get(name) is not None:
                raise ConfigError(f"otel.{name} is set but otel.receiver is not: set otel.receiver or remove it")
    return OtelConfig(**out)


def _otel_receiver(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The receiver's trust and bounds keys of ``otel`` (see `OtelConfig`)."""
    out: dict[str, Any] = {}
    if raw.get("receiver_auth") is not None:
        out["receiver_auth"] = parse_token_source(raw["receiver_auth"], "otel.receiver_auth")
    if raw.get("allowed_senders") is not None:
        networks = parse_networks(raw["allowed_senders"], "otel.allowed_senders")
        for i, network in enumerate(networks.networks):
            where = f"otel.allowed_senders[{i}]"
            if network.prefixlen == 0:
                if "receiver_auth" not in out:
                    raise ConfigError(
                        f"{where}: {network} lets any host send spans, and spans steer routing: set "
                        "otel.receiver_auth (a bearer token) too, or list the servers' networks"
                    )
                continue
            problem = unicast_problem(network.network_address)
            if problem is not None:
                raise ConfigError(f"{where}: {network} {problem}; no span sender lives there")
        out["allowed_senders"] = networks.cidrs()
    integers = (("receiver_max_message_bytes", 64 << 10, 64 << 20), ("receiver_max_spans_per_request", 1, 1 << 20))
    for key, least, most in integers:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise ConfigError(f"otel.{key} must be an integer in {least}..{most}; got {value!r}")
            out[key] = value
    bounds = (
        ("receiver_max_spans_per_s", 1, 1e7),
        ("span_max_age_s", 1, 86400),
        ("span_max_ahead_s", 0, 3600),
        ("span_max_latency_s", 1, 86400),
        ("join_max_age_s", 1, 3600),
    )
    for name, low, high in bounds:
        if name in raw:
            out[name] = _number(raw[name], f"otel.{name}", low, high)
    return out


def _header_name(value: Any, where: str) -> str:
    name = _string(value, where).lower()
    if not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(f"{where} must be an HTTP header name; got {name!r}")
    return name


def _admission(value: Any) -> AdmissionConfig:
    raw = _mapping(value, "admission", allowed={"max_waiting", "max_kv_usage"})
    out: dict[str, float] = {}
    if "max_waiting" in raw:
        out["max_waiting"] = _number(raw["max_waiting"], "admission.max_waiting", 0, 1e6)
    if "max_kv_usage" in raw:
        out["max_kv_usage"] = _number(raw["max_kv_usage"], "admission.max_kv_usage", 0.01, 1)
    return AdmissionConfig(**out)


def _number(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(f"{where} must be a number in {low:g}..{high:g}; got {value!r}")
    return float(value)


_CLASS_KEYS = {"name", "match", "priority", "ttft_slo_s", "on_saturation", "max_wait_s", "retry_after_s", "labels"}
_MATCH_KEYS = {"min_prompt_tokens", "max_prompt_tokens", "stream", "models", "header"}


def _classes(
    value: Any, default_name: Any, endpoints: tuple[EndpointConfig, ...]
) -> tuple[tuple[ClassRule, ...], RequestClass]:
    rules = []
    by_name: dict[str, RequestClass] = {}
    for i, item in enumerate(_list(value, "classes")):
        here = f"classes[{i}]"
        entry = _mapping(item, here, allowed=_CLASS_KEYS)
        name = _string(entry.get("name"), f"{here}.name")
        if name in by_name:
            raise ConfigError(f"{here}.name {name!r} repeats an earlier class")
        on_saturation = entry.get("on_saturation", "wait")
        if on_saturation not in ("wait", "shed"):
            raise ConfigError(f"{here}.on_saturation must be 'wait' or 'shed'; got {on_saturation!r}")
        priority = entry.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError(f"{here}.priority must be an integer; got {priority!r}")
        slo = _number(entry["ttft_slo_s"], f"{here}.ttft_slo_s", 0.001, 3600) if "ttft_slo_s" in entry else None
        wait = _number(entry.get("max_wait_s", 0.5), f"{here}.max_wait_s", 0, 30)
        retry = entry.get("retry_after_s", 5)
        if isinstance(retry, bool) or not isinstance(retry, int) or not 1 <= retry <= 3600:
            raise ConfigError(f"{here}.retry_after_s must be an integer number of seconds in 1..3600; got {retry!r}")
        labels = {}
        if "labels" in entry:
            for key, val in _mapping(entry["labels"], f"{here}.labels").items():
                labels[_string(key, f"{here}.labels key")] = _string(val, f"{here}.labels.{key}")
            if not any(all(e.labels.get(k) == v for k, v in labels.items()) for e in endpoints):
                raise ConfigError(f"{here}.labels {labels!r}: no endpoint of the pool has them")
        request_class = RequestClass(name, priority, slo, on_saturation, wait, retry, labels)
        by_name[name] = request_class
        match = _mapping(entry.get("match", {}), f"{here}.match", allowed=_MATCH_KEYS)
        bounds = {}
        for key in ("min_prompt_tokens", "max_prompt_tokens"):
            if key in match:
                bound = match[key]
                if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
                    raise ConfigError(f"{here}.match.{key} must be an integer >= 0; got {bound!r}")
                bounds[key] = bound
        stream = match.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ConfigError(f"{here}.match.stream must be true or false; got {stream!r}")
        models = None
        if "models" in match:
            models = frozenset(
                _string(m, f"{here}.match.models[{j}]")
                for j, m in enumerate(_list(match["models"], f"{here}.match.models"))
            )
        headers = None
        if "header" in match:
            raw = match["header"]
            raw = [raw] if isinstance(raw, str) else _list(raw, f"{here}.match.header")
            headers = frozenset(_string(h, f"{here}.match.header") for h in raw)
        rules.append(ClassRule(request_class, stream=stream, models=models, header_values=headers, **bounds))
    if default_name is None:
        return tuple(rules), RequestClass("default")
    name = _string(default_name, "default_class")
    if name not in by_name:
        raise ConfigError(f"default_class {name!r} is not one of the classes ({', '.join(by_name) or 'none'})")
    return tuple(rules), by_name[name]


def _signals(value: Any) -> SignalsConfig:
    fields = {
        "scrape_metrics",
        "scrape_interval_s",
        "scrape_timeout_s",
        "stale_after_s",
        "gpu_interval_s",
    }
    raw = _mapping(value, "signals", allowed=fields)
    out: dict[str, Any] = {}
    for name in ("scrape_metrics",):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise ConfigError(f"signals.{name} must be true or false; got {raw[name]!r}")
            out[name] = raw[name]
    for name in ("scrape_interval_s", "scrape_timeout_s", "stale_after_s", "gpu_interval_s"):
        if name in raw:
            number = raw[name]
            if isinstance(number, bool) or not isinstance(number, int | float) or not 0.001 <= number <= 3600:
                raise ConfigError(f"signals.{name} must be a number of seconds in 0.001..3600; got {number!r}")
            out[name] = float(number)
    signals = SignalsConfig(**out)
    if signals.scrape_metrics and signals.stale_after_s <= signals.scrape_interval_s:
        raise ConfigError(
            f"signals.stale_after_s must be greater than signals.scrape_interval_s "
            f"({signals.stale_after_s:g} <= {signals.scrape_interval_s:g}): every endpoint would always be stale"
        )
    return signals


def _profiles(value: Any) -> dict[str, ProfileSpec]:
    raw = _mapping(value, "profiles")
    registry = default_registry()
    out = {}
    for name, body in raw.items():
        # A profile may take a preset's name: the file's own definition then replaces the preset.
        where = f"profiles.{_string(name, 'profiles key')}"
        entry = _mapping(body, where, allowed={"filters", "scorers", "picker"})
        filters = tuple(
            _plugin(item, f"{where}.filters[{i}]", registry.filters, weighted=False)
            for i, item in enumerate(_list(entry.get("filters", ["model"]), f"{where}.filters"))
        )
        if not filters or filters[0].type != "model":
            raise ConfigError(f"{where}.filters[0] must be 'model' (requests must go to endpoints serving their model)")
        scorers = tuple(
            _plugin(item, f"{where}.scorers[{i}]", registry.scorers, weighted=True)
            for i, item in enumerate(_list(entry.get("scorers", []), f"{where}.scorers"))
        )
        if len(scorers) > MAX_SCORERS:
            raise ConfigError(f"{where}.scorers: at most {MAX_SCORERS} scorers; got {len(scorers)}")
        picker = _plugin(entry.get("picker", "max-score"), f"{where}.picker", registry.pickers, weighted=False)
        out[name] = ProfileSpec(name, filters, scorers, picker, where=where)
    return out


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list; got {type(value).__name__}")
    return value


def _plugin(item: Any, where: str, known: Mapping[str, Any], *, weighted: bool) -> PluginSpec:
    """``"name"`` or ``{type: name, weight: w, <parameters>}``."""
    if isinstance(item, str):
        item = {"type": item}
    entry = _mapping(item, where)
    kind = _string(entry.get("type"), f"{where}.type")
    if kind not in known:
        raise ConfigError(f"{where}.type: unknown type {kind!r} (known: {', '.join(sorted(known))})")
    params = {str(k): v for k, v in entry.items() if k not in ("type", "weight")}
    weight = 1.0
    if "weight" in entry:
        if not weighted:
            raise ConfigError(f"{where}.weight: only scorers have weights")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
            raise ConfigError(f"{where}.weight must be > 0 and <= {MAX_WEIGHT:g}; got {weight!r}")
    return PluginSpec(kind, params, float(weight))


def _endpoints(value: Any, where: str, allowed: Networks) -> tuple[EndpointConfig, ...]:
    """The pool's endpoints; each address (and GPU source) a unicast address inside ``allowed``."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list of endpoints")
    seen: dict[str, int] = {}
    out = []
    for i, item in enumerate(value):
        here = f"{where}[{i}]"
        entry = _mapping(item, here, allowed={"address", "models", "labels", "gpu"})
        if "address" not in entry:
            raise ConfigError(f"{here}.address is required (a literal 'ip:port')")
        address = _address(entry["address"], f"{here}.address")
        # The picker sends traffic here: never to a metadata service or this host, only where the operator allows.
        problem = destination_problem(parse_address(address)[0], allowed, "pool.allowed_networks")
        if problem is not None:
            raise ConfigError(f"{here}.address: {entry['address']!r} {problem}")
        if address in seen:
            raise ConfigError(f"{here}.address {address!r} repeats {where}[{seen[address]}]")
        seen[address] = i
        models = None
        if "models" in entry:
            raw = entry["models"]
            if not isinstance(raw, list) or not raw:
                raise ConfigError(f"{here}.models must be a non-empty list of model names (omit it to accept any)")
            models = frozenset(_string(m, f"{here}.models[{j}]") for j, m in enumerate(raw))
        labels: dict[str, str] = {}
        if "labels" in entry:
            raw_labels = _mapping(entry["labels"], f"{here}.labels")
            for key, val in raw_labels.items():
                labels[_string(key, f"{here}.labels key")] = _string(val, f"{here}.labels.{key}")
        gpu = _gpu_source(entry["gpu"], f"{here}.gpu", allowed) if "gpu" in entry else None
        out.append(EndpointConfig(address=address, models=models, labels=labels, gpu=gpu))
    return tuple(out)


def _gpu_source(value: Any, where: str, allowed: Networks) -> GpuSource:
    """``{url: http://10.0.0.7:9400/gpu, kind: agent, indices: [0, 1]}``; ``kind`` defaults to agent.

    The picker fetches ``url`` every ``signals.gpu_interval_s``, so it is held to what a pool address is: plain
    ``http://`` (no TLS client is configured for it) to a literal IP (a hostname could resolve anywhere later)
    that is unicast and inside ``allowed``; no user, query or fragment. The path defaults to the kind's
    (``/gpu``, ``/metrics``); the stored URL is canonical, so two spellings of one source share a read."""
    entry = _mapping(value, where, allowed={"url", "kind", "indices"})
    kind = "agent"
    if "kind" in entry:
        kind = _string(entry["kind"], f"{where}.kind")
        if kind not in ("agent", "dcgm"):
            raise ConfigError(f"{where}.kind must be 'agent' or 'dcgm'; got {kind!r}")
    url = _string(entry.get("url"), f"{where}.url")
    if url[:8].lower() == "https://":
        raise ConfigError(
            f"{where}.url: {url!r}: https:// is not supported (the picker has no TLS client for GPU sources); "
            "use http:// to the node's agent or exporter"
        )
    if url[:7].lower() != "http://":
        raise ConfigError(f"{where}.url must be an http:// URL such as 'http://10.0.0.7:9400/gpu'; got {url!r}")
    rest = url[7:]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        raise ConfigError(f"{where}.url: {url!r}: a user name or password ('user@') is not allowed")
    if "?" in path:
        raise ConfigError(f"{where}.url: {url!r}: a query ('?...') is not allowed (agents and exporters take none)")
    if "#" in path:
        raise ConfigError(f"{where}.url: {url!r}: a fragment ('#...') is not allowed")
    try:
        host, port = parse_authority(authority, default_port=80)
    except ValueError as exc:
        raise ConfigError(f"{where}.url: {url!r}: {exc}") from None
    problem = destination_problem(host, allowed, "pool.allowed_networks")
    if problem is not None:
        shown = authority[: authority.find("]") + 1] if authority.startswith("[") else authority.split(":")[0]
        raise ConfigError(f"{where}.url: {url!r}: {shown} {problem}")
    if not path:
        path = "/gpu" if kind == "agent" else "/metrics"
    if not all(c.isascii() and (c.isalnum() or c in "-._~!$&'()*+,;=:@%/") for c in path):
        raise ConfigError(
            f"{where}.url: {url!r}: the path {path!r} may hold only letters, digits and -._~!$&'()*+,;=:@%/"
        )
    indices = None
    if "indices" in entry:
        raw = entry["indices"]
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw)
        ):
            raise ConfigError(f"{where}.indices must be a non-empty list of GPU indices (integers >= 0); got {raw!r}")
        indices = tuple(raw)
    return GpuSource(f"http://{format_address(host, port)}{path}", kind, indices)


def _mapping(value: Any, where: str, allowed: set[str] | None = None) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping; got {type(value).__name__}")
    if allowed is not None:
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string; got {value!r}")
    return value


def _address(value: Any, where: str) -> str:
    try:
        host, port = parse_address(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return format_address(host, port)
