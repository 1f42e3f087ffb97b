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
        filters: [model, staleness, {type: saturation, max_waiting: 8}]
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferlb.scorer.address import format_address, parse_address
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.scorer.registry import MAX_WEIGHT, BuildContext, PluginSpec, ProfileSpec, default_registry

DEFAULT_LISTEN = "127.0.0.1:9002"
DEFAULT_ADMIN = "127.0.0.1:9003"
DEFAULT_POLICY = "least-request"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SCORERS = 32


@dataclass(frozen=True, slots=True)
class SignalsConfig:
    """How the picker collects server signals. ``scrape_metrics=False`` turns the vLLM scraper off."""

    scrape_metrics: bool = True
    scrape_interval_s: float = 0.1
    scrape_timeout_s: float = 0.5
    stale_after_s: float = 1.0
    gpu_interval_s: float = 0.5


@dataclass(frozen=True, slots=True)
class GpuSource:
    """Where an endpoint's GPU state comes from: ``url`` of a GPU agent's (or the emulator's) ``/gpu`` (kind
    "agent") or of a DCGM exporter's ``/metrics`` (kind "dcgm"); ``indices`` are the GPUs of that node the endpoint
    uses (None: all of them)."""

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
    listen: str = DEFAULT_LISTEN
    policy: str = DEFAULT_POLICY
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    signals: SignalsConfig = field(default_factory=SignalsConfig)
    profiles: Mapping[str, ProfileSpec] = field(default_factory=dict)
    session_header: str | None = None
    admin: str | None = DEFAULT_ADMIN

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
        allowed={"listen", "admin", "policy", "max_body_bytes", "pool", "signals", "profiles", "session_header"},
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
    session_header = None
    if "session_header" in top:
        session_header = _string(top["session_header"], "session_header").lower()
        if not all(c.isalnum() or c in "-_" for c in session_header):
            raise ConfigError(f"session_header must be an HTTP header name; got {session_header!r}")
    max_body = DEFAULT_MAX_BODY_BYTES
    if "max_body_bytes" in top:
        max_body = top["max_body_bytes"]
        if not isinstance(max_body, int) or isinstance(max_body, bool) or not 1024 <= max_body <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be an integer in 1024..{1 << 30}; got {max_body!r}")
    if "pool" not in top:
        raise ConfigError("pool is required: a mapping with a list 'endpoints'")
    pool = _mapping(top["pool"], "pool", allowed={"endpoints"})
    endpoints = _endpoints(pool.get("endpoints"), "pool.endpoints")
    # Build each profile once now, so that a bad plugin parameter fails at start-up, naming its place.
    registry = default_registry()
    for spec in profiles.values():
        registry.build(spec, BuildContext(size=len(endpoints)))
    return Config(
        endpoints=endpoints,
        listen=listen,
        policy=policy,
        max_body_bytes=max_body,
        signals=signals,
        profiles=profiles,
        session_header=session_header,
        admin=admin,
    )


def _signals(value: Any) -> SignalsConfig:
    fields = {"scrape_metrics", "scrape_interval_s", "scrape_timeout_s", "stale_after_s", "gpu_interval_s"}
    raw = _mapping(value, "signals", allowed=fields)
    out: dict[str, Any] = {}
    if "scrape_metrics" in raw:
        if not isinstance(raw["scrape_metrics"], bool):
            raise ConfigError(f"signals.scrape_metrics must be true or false; got {raw['scrape_metrics']!r}")
        out["scrape_metrics"] = raw["scrape_metrics"]
    for name in ("scrape_interval_s", "scrape_timeout_s", "stale_after_s", "gpu_interval_s"):
        if name in raw:
            number = raw[name]
            if isinstance(number, bool) or not isinstance(number, int | float) or not 0.001 <= number <= 3600:
                raise ConfigError(f"signals.{name} must be a number of seconds in 0.001..3600; got {number!r}")
            out[name] = float(number)
    return SignalsConfig(**out)


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


def _endpoints(value: Any, where: str) -> tuple[EndpointConfig, ...]:
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
        gpu = _gpu_source(entry["gpu"], f"{here}.gpu") if "gpu" in entry else None
        out.append(EndpointConfig(address=address, models=models, labels=labels, gpu=gpu))
    return tuple(out)


def _gpu_source(value: Any, where: str) -> GpuSource:
    """``{url: http://10.0.0.7:9400/gpu, kind: agent, indices: [0, 1]}``; ``kind`` defaults to agent."""
    entry = _mapping(value, where, allowed={"url", "kind", "indices"})
    url = _string(entry.get("url"), f"{where}.url")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.url must be an http:// or https:// URL; got {url!r}")
    kind = "agent"
    if "kind" in entry:
        kind = _string(entry["kind"], f"{where}.kind")
        if kind not in ("agent", "dcgm"):
            raise ConfigError(f"{where}.kind must be 'agent' or 'dcgm'; got {kind!r}")
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
    return GpuSource(url, kind, indices)


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
