"""The picker's configuration: one YAML file, validated once at start-up.

Every error names the exact place of the problem and what would fix it, e.g.
``pool.endpoints[2].address: '10.0.0.x:8000': '10.0.0.x' is not a literal IP address``. Nothing falls back
silently to a default: a key that is present must be valid, and unknown keys are refused (a typo would
otherwise be ignored).

Example::

    listen: 127.0.0.1:9002          # where the ext_proc gRPC server listens
    policy: least-request           # round-robin | least-request
    max_body_bytes: 4194304         # larger request bodies get 413
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

DEFAULT_LISTEN = "127.0.0.1:9002"
DEFAULT_POLICY = "least-request"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One inference server. ``models`` is None when the endpoint accepts any model name."""

    address: str
    models: frozenset[str] | None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole picker configuration, validated."""

    endpoints: tuple[EndpointConfig, ...]
    listen: str = DEFAULT_LISTEN
    policy: str = DEFAULT_POLICY
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


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
    top = _mapping(data, "config", allowed={"listen", "policy", "max_body_bytes", "pool"})
    listen = DEFAULT_LISTEN
    if "listen" in top:
        listen = _address(top["listen"], "listen")
    policy = DEFAULT_POLICY
    if "policy" in top:
        policy = _string(top["policy"], "policy")
        if policy not in PRESET_NAMES:
            raise ConfigError(f"policy must be one of {', '.join(PRESET_NAMES)}; got {policy!r}")
    max_body = DEFAULT_MAX_BODY_BYTES
    if "max_body_bytes" in top:
        max_body = top["max_body_bytes"]
        if not isinstance(max_body, int) or isinstance(max_body, bool) or not 1024 <= max_body <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be an integer in 1024..{1 << 30}; got {max_body!r}")
    if "pool" not in top:
        raise ConfigError("pool is required: a mapping with a list 'endpoints'")
    pool = _mapping(top["pool"], "pool", allowed={"endpoints"})
    endpoints = _endpoints(pool.get("endpoints"), "pool.endpoints")
    return Config(endpoints=endpoints, listen=listen, policy=policy, max_body_bytes=max_body)


def _endpoints(value: Any, where: str) -> tuple[EndpointConfig, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list of endpoints")
    seen: dict[str, int] = {}
    out = []
    for i, item in enumerate(value):
        here = f"{where}[{i}]"
        entry = _mapping(item, here, allowed={"address", "models", "labels"})
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
        out.append(EndpointConfig(address=address, models=models, labels=labels))
    return tuple(out)


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
