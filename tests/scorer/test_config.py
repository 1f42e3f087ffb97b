"""Tests for scorer/config.py: every error names the exact field, nothing falls back silently."""

from __future__ import annotations

import copy
import math
import operator
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.scorer.config import (
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_POLICY,
    Config,
    EndpointConfig,
    SignalsConfig,
    load_config,
    parse_config,
)
from inferlb.scorer.errors import ConfigError, ScorerError
from inferlb.scorer.networks import DEFAULT_NETWORKS, Networks
from inferlb.scorer.presets import PRESET_NAMES, build_profile
from inferlb.scorer.registry import ProfileSpec, default_registry
from inferlb.scorer.speeds import SpeedHints

GOOD_YAML = """\
listen: 127.0.0.1:9100
policy: round-robin
max_body_bytes: 2048
pool:
  endpoints:
    - address: 10.0.0.7:8000
      models: [meta-llama/Llama-3.1-8B-Instruct]
      labels: {zone: a}
    - address: "[fd00::1]:8000"
"""


def _doc(*endpoints: Any, **top: Any) -> dict[str, Any]:
    """A config document with the given endpoints (default: one valid endpoint) and top-level keys."""
    eps = list(endpoints) if endpoints else [{"address": "10.0.0.1:8000"}]
    return {**top, "pool": {"endpoints": eps}}


def test_parse_config_full_document() -> None:
    config = parse_config(yaml.safe_load(GOOD_YAML))
    assert config == Config(
        endpoints=(
            EndpointConfig(
                address="10.0.0.7:8000", models=frozenset({"meta-llama/Llama-3.1-8B-Instruct"}), labels={"zone": "a"}
            ),
            EndpointConfig(address="[fd00::1]:8000", models=None, labels={}),
        ),
        listen="127.0.0.1:9100",
        policy="round-robin",
        max_body_bytes=2048,
    )


def test_parse_config_defaults_when_keys_are_absent() -> None:
    config = parse_config(_doc())
    assert config.listen == DEFAULT_LISTEN == "127.0.0.1:9002"
    assert config.policy == DEFAULT_POLICY == "default"
    assert config.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024
    assert config.endpoints == (EndpointConfig(address="10.0.0.1:8000", models=None, labels={}),)


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        pytest.param("10.0.0.1:08000", "10.0.0.1:8000", id="leading-zero-port"),
        pytest.param("[FD00:0::1]:8000", "[fd00::1]:8000", id="ipv6-case-and-zeros"),
        pytest.param("[::1]:8000", "[::1]:8000", id="ipv6-already-canonical"),
    ],
)
def test_addresses_are_stored_canonical(raw: str, canonical: str) -> None:
    config = parse_config(_doc({"address": raw}, listen=raw))
    assert config.endpoints[0].address == canonical
    assert config.listen == canonical


@pytest.mark.parametrize("policy", [pytest.param(name, id=name) for name in PRESET_NAMES])
def test_every_preset_name_is_a_valid_policy(policy: str) -> None:
    assert parse_config(_doc(policy=policy)).policy == policy


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(1024, id="lowest"),
        pytest.param(1 << 30, id="highest"),
        pytest.param(65536, id="middle"),
    ],
)
def test_max_body_bytes_bounds_are_inclusive(value: int) -> None:
    assert parse_config(_doc(max_body_bytes=value)).max_body_bytes == value


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        pytest.param(["a"], frozenset({"a"}), id="one"),
        pytest.param(["a", "b/c"], frozenset({"a", "b/c"}), id="two"),
    ],
)
def test_models_become_a_frozenset(models: list[str], expected: frozenset[str]) -> None:
    assert parse_config(_doc({"address": "10.0.0.1:1", "models": models})).endpoints[0].models == expected


# (document, regex the ConfigError message must match). Each regex starts with the exact field it names.
ERRORS = [
    pytest.param(None, r"^config must be a mapping; got NoneType$", id="empty-document"),
    pytest.param([1, 2], r"^config must be a mapping; got list$", id="top-level-list"),
    pytest.param("pool", r"^config must be a mapping; got str$", id="top-level-string"),
    pytest.param(
        _doc(polcy="round-robin"),
        r"^config: unknown key 'polcy' \(allowed: admin, admin_auth, admission, class_header, classes, debug_scores, "
        r"default_class, destinations, drain_s, experiments, inference_objectives, inflight, kv_events, listen, "
        r"max_body_bytes, otel, policy, pool, profiles, quotas, replicas, session_header, signals, tls, "
        r"weights_interval_s\)$",
        id="unknown-top-key",
    ),
    pytest.param({"listen": "127.0.0.1:9002"}, r"^pool is required", id="missing-pool"),
    pytest.param({"pool": None}, r"^pool must be a mapping; got NoneType", id="pool-null"),
    pytest.param({"pool": ["10.0.0.1:80"]}, r"^pool must be a mapping; got list", id="pool-list"),
    pytest.param(
        {"pool": {"endpoint": []}},
        r"^pool: unknown key 'endpoint' \(allowed: allowed_networks, discovery, endpoints, slow_start, speeds\)",
        id="unknown-pool-key",
    ),
    pytest.param(
        {"pool": {}},
        r"^pool\.endpoints is required: a non-empty list of endpoints \(or set pool\.discovery\)$",
        id="endpoints-missing",
    ),
    pytest.param({"pool": {"endpoints": []}}, r"^pool\.endpoints must be a non-empty list", id="endpoints-empty"),
    pytest.param(
        {"pool": {"endpoints": {"address": "10.0.0.1:80"}}},
        r"^pool\.endpoints must be a non-empty list",
        id="endpoints-mapping",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, "10.0.0.2:80"),
        r"^pool\.endpoints\[1\] must be a mapping; got str",
        id="endpoint-string",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"models": ["m"]}),
        r"^pool\.endpoints\[1\]\.address is required",
        id="address-missing",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": "10.0.0.2:80", "weight": 2}),
        r"^pool\.endpoints\[1\]: unknown key 'weight' \(allowed: address, gpu, labels, models\)",
        id="unknown-endpoint-key",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": "vllm-0:8000"}),
        r"^pool\.endpoints\[1\]\.address: 'vllm-0:8000': 'vllm-0' is not a literal IP address",
        id="address-hostname",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": "10.0.0.2"}),
        r"^pool\.endpoints\[1\]\.address: '10\.0\.0\.2' must be a literal 'ip:port'",
        id="address-no-port",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": "10.0.0.2:0"}),
        r"^pool\.endpoints\[1\]\.address: '10\.0\.0\.2:0': port must be an integer in 1\.\.65535",
        id="address-port-zero",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": 8000}),
        r"^pool\.endpoints\[1\]\.address: must be a literal 'ip:port' string",
        id="address-int",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": None}),
        r"^pool\.endpoints\[1\]\.address: must be a literal 'ip:port' string",
        id="address-null",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80"}, {"address": "10.0.0.1:80"}),
        r"^pool\.endpoints\[1\]\.address '10\.0\.0\.1:80' repeats pool\.endpoints\[0\]$",
        id="duplicate",
    ),
    pytest.param(
        _doc({"address": "[::1]:80"}, {"address": "10.0.0.1:80"}, {"address": "[0:0::1]:080"}),
        r"^pool\.endpoints\[2\]\.address '\[::1\]:80' repeats pool\.endpoints\[0\]$",
        id="duplicate-after-canonicalising",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "models": []}),
        r"^pool\.endpoints\[0\]\.models must be a non-empty list of model names \(omit it to accept any\)",
        id="models-empty",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "models": "m"}),
        r"^pool\.endpoints\[0\]\.models must be a non-empty list",
        id="models-string",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "models": None}),
        r"^pool\.endpoints\[0\]\.models must be a non-empty list",
        id="models-null",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "models": ["a", 7]}),
        r"^pool\.endpoints\[0\]\.models\[1\] must be a non-empty string; got 7$",
        id="model-int",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "models": ["a", "b", ""]}),
        r"^pool\.endpoints\[0\]\.models\[2\] must be a non-empty string; got ''$",
        id="model-empty",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "labels": ["zone=a"]}),
        r"^pool\.endpoints\[0\]\.labels must be a mapping; got list",
        id="labels-list",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "labels": {"zone": 1}}),
        r"^pool\.endpoints\[0\]\.labels\.zone must be a string \(it may be empty\); got 1$",
        id="label-value-int",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "labels": {"zone": None}}),
        r"^pool\.endpoints\[0\]\.labels\.zone must be a string \(it may be empty\); got None$",
        id="label-value-null",
    ),
    pytest.param(
        _doc({"address": "10.0.0.1:80", "labels": {3: "a"}}),
        r"^pool\.endpoints\[0\]\.labels key must be a non-empty string; got 3$",
        id="label-key-int",
    ),
    pytest.param(
        _doc(listen="localhost:9002"),
        r"^listen: 'localhost:9002': 'localhost' is not a literal IP address",
        id="listen-hostname",
    ),
    pytest.param(_doc(listen=9002), r"^listen: must be a literal 'ip:port' string", id="listen-int"),
    pytest.param(
        _doc(policy="fastest"),
        r"^policy must be a preset or a profile of this file \(round-robin, least-request, kv-aware, prefix-aware, "
        r"seed-formula, default\); got 'fastest'$",
        id="policy-unknown",
    ),
    pytest.param(_doc(policy=""), r"^policy must be a non-empty string; got ''$", id="policy-empty"),
    pytest.param(
        _doc(policy=["round-robin"]), r"^policy must be a non-empty string; got \['round-robin'\]$", id="policy-list"
    ),
    pytest.param(
        _doc(max_body_bytes=1023),
        r"^max_body_bytes must be an integer in 1024\.\.1073741824; got 1023$",
        id="max-body-too-small",
    ),
    pytest.param(
        _doc(max_body_bytes=(1 << 30) + 1),
        r"^max_body_bytes must be an integer in 1024\.\.1073741824; got 1073741825$",
        id="max-body-too-big",
    ),
    pytest.param(_doc(max_body_bytes=0), r"^max_body_bytes must be an integer", id="max-body-zero"),
    pytest.param(_doc(max_body_bytes=-4096), r"^max_body_bytes must be an integer", id="max-body-negative"),
    pytest.param(
        _doc(max_body_bytes=True),
        r"^max_body_bytes must be an integer in 1024\.\.1073741824; got True$",
        id="max-body-bool",
    ),
    pytest.param(
        _doc(max_body_bytes=4096.0),
        r"^max_body_bytes must be an integer in 1024\.\.1073741824; got 4096\.0$",
        id="max-body-float",
    ),
    pytest.param(
        _doc(max_body_bytes="4096"),
        r"^max_body_bytes must be an integer in 1024\.\.1073741824; got '4096'$",
        id="max-body-string",
    ),
    pytest.param(_doc(max_body_bytes=None), r"^max_body_bytes must be an integer", id="max-body-null"),
]


@pytest.mark.parametrize(("document", "pattern"), ERRORS)
def test_parse_config_errors_name_the_exact_field(document: Any, pattern: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert isinstance(info.value, ScorerError)


def test_load_config_reads_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "inferlb.yaml"
    path.write_text(GOOD_YAML, encoding="utf-8")
    assert load_config(path) == parse_config(yaml.safe_load(GOOD_YAML))
    assert load_config(str(path)) == load_config(path)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        pytest.param("pool: [unclosed\n", r"not valid YAML", id="invalid-yaml"),
        pytest.param("listen: 127.0.0.1:9002\n\tpool: {}\n", r"not valid YAML", id="tab-indent"),
        pytest.param("", r"config must be a mapping; got NoneType", id="empty-file"),
        pytest.param(
            "pool:\n  endpoints:\n    - address: 10.0.0.1:80\n    - address: 10.0.0.1:80\n",
            r"pool\.endpoints\[1\]\.address '10\.0\.0\.1:80' repeats pool\.endpoints\[0\]",
            id="validation-error",
        ),
    ],
)
def test_load_config_errors_name_the_file(tmp_path: Path, content: str, pattern: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=r"^cannot read config file .*absent\.yaml: No such file or directory$"):
        load_config(path)


def test_load_config_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot read config file "):
        load_config(tmp_path)


def test_load_config_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"listen: 127.0.0.1:9002 # caf\xe9\npool: {endpoints: [{address: 10.0.0.1:80}]}\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml"):
        load_config(path)


def test_load_config_deeply_nested_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("pool: " + "[" * 1000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"deep\.yaml"):
        load_config(path)


# ---------------------------------------------------------------- profiles, signals, session header

POOL = {"endpoints": [{"address": "10.0.0.1:80"}, {"address": "10.0.0.2:80"}]}


def _profile_doc(**profile: Any) -> dict[str, Any]:
    return {"policy": "mine", "profiles": {"mine": profile}, "pool": POOL}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param(
            _profile_doc(scorers=["queue", "kv-cache", {"type": "in-flight", "weight": 0}]),
            r"^profiles\.mine\.scorers\[2\]\.weight must be a number in \(0, 100\]; got 0$",
            id="weight-zero",
        ),
        pytest.param(
            _profile_doc(scorers=[{"type": "queue", "weight": 1000}]),
            r"^profiles\.mine\.scorers\[0\]\.weight must be a number in \(0, 100\]; got 1000$",
            id="weight-too-big",
        ),
        pytest.param(
            _profile_doc(scorers=[{"type": "quue"}]),
            r"^profiles\.mine\.scorers\[0\]\.type: unknown type 'quue' \(known: .*queue.*\)$",
            id="unknown-scorer",
        ),
        pytest.param(
            _profile_doc(filters=["model", {"type": "memory-fit", "margin": 0.5}]),
            r"^profiles\.mine\.filters\[1\]\.margin must be a number >= 1; got 0.5$",
            id="bad-parameter-value",
        ),
        pytest.param(
            _profile_doc(filters=["model", {"type": "saturation", "max_waiting": 4}]),
            r"^profiles\.mine\.filters\[1\]: unknown parameter 'max_waiting' for 'saturation' \(accepted: none\); "
            r"one rule decides when an endpoint is saturated, .* set it in the config's admission section",
            id="saturation-thresholds-are-admissions",
        ),
        pytest.param(
            _profile_doc(scorers=[{"type": "prefix-affinity", "gard": 2}]),
            r"^profiles\.mine\.scorers\[0\]: unknown parameter 'gard' for 'prefix-affinity' "
            r"\(accepted: capacity_blocks, guard\)$",
            id="unknown-parameter",
        ),
        pytest.param(
            _profile_doc(filters=["staleness"]),
            r"^profiles\.mine\.filters\[0\] must be 'model'",
            id="model-filter-first",
        ),
        pytest.param(
            _profile_doc(filters=["model", {"type": "staleness", "weight": 2}]),
            r"^profiles\.mine\.filters\[1\]\.weight: only scorers have weights$",
            id="filter-weight",
        ),
        pytest.param(
            _profile_doc(picker="best"),
            r"^profiles\.mine\.picker\.type: unknown type 'best'",
            id="unknown-picker",
        ),
        pytest.param(
            _profile_doc(scorers="queue"), r"^profiles\.mine\.scorers must be a list; got str$", id="scorers-not-list"
        ),
        pytest.param(
            {"pool": POOL, "signals": {"scrape_interval_s": 0}},
            r"^signals\.scrape_interval_s must be a number of seconds in 0\.001\.\.3600; got 0$",
            id="scrape-interval",
        ),
        pytest.param(
            {"pool": POOL, "signals": {"scrape_metrics": "yes"}},
            r"^signals\.scrape_metrics must be true or false; got 'yes'$",
            id="scrape-flag",
        ),
        pytest.param(
            {"pool": POOL, "signals": {"stale_after": 1}},
            r"^signals: unknown key 'stale_after'",
            id="signals-typo",
        ),
        pytest.param(
            {"pool": POOL, "signals": {"scrape_interval_s": 2}},
            r"^signals\.stale_after_s must be greater than signals\.scrape_interval_s \(1 <= 2\): every endpoint",
            id="stale-before-the-next-scrape",
        ),
        pytest.param(
            {"pool": POOL, "session_header": "x session"},
            r"^session_header must be an HTTP header name; got 'x session'$",
            id="session-header",
        ),
    ],
)
def test_profile_and_signal_errors_name_the_exact_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(doc)


def test_a_profile_of_the_file_is_built_with_its_weights_and_parameters() -> None:
    config = parse_config(
        {
            "policy": "default",  # the file's own "default" replaces the preset
            "session_header": "X-Session-Id",
            "signals": {"scrape_interval_s": 0.25, "stale_after_s": 2, "scrape_metrics": False},
            "profiles": {
                "default": {
                    "filters": ["model", {"type": "memory-fit", "margin": 4}],
                    "scorers": [{"type": "queue", "weight": 2.5}, "session-affinity"],
                    "picker": {"type": "power-of-two"},
                }
            },
            "pool": POOL,
        }
    )
    assert config.session_header == "x-session-id"
    assert config.signals == SignalsConfig(
        scrape_metrics=False, scrape_interval_s=0.25, scrape_timeout_s=0.5, stale_after_s=2.0
    )
    # Without the scraper the interval is unused, so it need not be shorter than stale_after_s.
    assert parse_config({"pool": POOL, "signals": {"scrape_metrics": False, "scrape_interval_s": 5}})
    spec = config.profile_spec()
    assert isinstance(spec, ProfileSpec) and spec.name == "default"
    profile = build_profile(spec, size=2)
    assert [f.name for f in profile.filters] == ["model", "memory-fit"]
    assert profile.filters[1].margin == 4
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [("queue", 2.5), ("session-affinity", 1.0)]
    assert profile.picker.name == "power-of-two"


def test_presets_are_chosen_by_name() -> None:
    config = parse_config({"policy": "kv-aware", "pool": POOL})
    assert config.profile_spec() == "kv-aware"
    assert config.signals == SignalsConfig()


# ---------------------------------------------------------------- plugin parameters, from YAML text

PLACES = {
    "filters": "profiles.default.filters[1]",
    "scorers": "profiles.default.scorers[0]",
    "picker": "profiles.default.picker",
}


def _plugin_yaml(kind: str, entry: str) -> str:
    """A config whose profile "default" holds ``entry`` (a YAML flow mapping) at the place ``PLACES[kind]``."""
    filters = f"[model, {entry}]" if kind == "filters" else "[model]"
    scorers = f"[{entry}]" if kind == "scorers" else "[]"
    picker = entry if kind == "picker" else "max-score"
    return f"""\
policy: default
profiles:
  default:
    filters: {filters}
    scorers: {scorers}
    picker: {picker}
pool:
  endpoints: [{{address: 10.0.0.1:80}}, {{address: 10.0.0.2:80}}]
"""


# (kind, plugin type, parameter, what the message says it must be, {bad value as YAML: how the message shows it}).
# Every declared parameter of every built-in plugin is here (test_every_declared_parameter_is_tested checks).
MUST_BE = [
    ("filters", "memory-fit", "margin", "a number >= 1", {"x": "'x'", "0.9": "0.9", ".inf": "inf"}),
    ("filters", "memory-fit", "bytes_per_token", "a number > 0", {"0": "0", "'131072'": "'131072'", "[1]": "[1]"}),
    (
        "filters",
        "memory-fit",
        "default_output_tokens",
        "an integer >= 0",
        {"256.0": "256.0", "-1": "-1", "false": "False"},
    ),
    ("scorers", "in-flight-tokens", "unit", "a number > 0", {"0": "0", "-4096": "-4096", ".inf": "inf", "yes": "True"}),
    ("scorers", "recent-prefill", "unit", "a number > 0", {"0": "0", "-1": "-1", ".nan": "nan"}),
    ("scorers", "latency", "signal", "ttft_s or e2e_s", {"ttft": "'ttft'", "1": "1"}),
    (
        "scorers",
        "latency",
        "tolerance",
        "a number in 0..10",
        {"-0.1": "-0.1", "11": "11", "'x'": "'x'", ".inf": "inf", ".nan": "nan"},
    ),
    ("scorers", "predicted-ttft", "block_tokens", "an integer >= 1", {"0": "0", "64.0": "64.0", "'64'": "'64'"}),
    ("scorers", "predicted-ttft", "guard", "a number > 0 or .inf", {"0": "0", "-.inf": "-inf", "'2'": "'2'"}),
    ("filters", "ttft-slo", "guard", "a number > 0 or .inf", {"-1": "-1", ".nan": "nan"}),
    ("filters", "ttft-slo", "block_tokens", "an integer >= 1", {"-1": "-1", "2.5": "2.5", "no": "False"}),
    ("filters", "ttft-gap", "guard", "a number > 0 or .inf", {"0": "0"}),
    ("filters", "ttft-gap", "block_tokens", "an integer >= 1", {"0": "0"}),
    ("filters", "speed-class", "block_tokens", "an integer >= 1", {"0": "0"}),
    ("filters", "speed-class", "guard", "a number > 0 or .inf", {"0": "0"}),
    ("filters", "speed-class", "min_wait_s", "a number >= 0", {"-0.5": "-0.5", "'1'": "'1'", ".nan": "nan"}),
    (
        "scorers",
        "predicted-ttft",
        "attention_tokens",
        "a number >= 0",
        {"-1": "-1", "'26000'": "'26000'", ".nan": "nan"},
    ),
    ("scorers", "predicted-ttft", "delay_to_waiting", "a number >= 0", {"-1": "-1", "'1'": "'1'", ".inf": "inf"}),
    ("filters", "ttft-gap", "attention_tokens", "a number >= 0", {"-1": "-1"}),
    ("filters", "ttft-slo", "attention_tokens", "a number >= 0", {"-0.1": "-0.1", "'0'": "'0'"}),
    ("filters", "speed-class", "attention_tokens", "a number >= 0", {".inf": "inf"}),
    ("filters", "ttft-gap", "factor", "a number >= 1", {"0.5": "0.5", "'2'": "'2'", ".nan": "nan"}),
    ("filters", "ttft-gap", "seconds", "a number >= 0", {"-1": "-1", "'1'": "'1'"}),
    ("filters", "ttft-gap", "slower", "a number in (0, 1]", {"0": "0", "1.5": "1.5"}),
    ("scorers", "seed-formula", "alpha", "a number >= 0", {"-1": "-1", ".inf": "inf"}),
    ("scorers", "seed-formula", "beta", "a number >= 0", {"true": "True", "-0.5": "-0.5"}),
    ("scorers", "seed-formula", "gamma", "a number >= 0", {".nan": "nan", "'1'": "'1'"}),
    ("scorers", "seed-formula", "max_queue", "a number > 0", {"0": "0", "'32'": "'32'"}),
    ("scorers", "seed-formula", "floor", "a number in [0, 1)", {"1": "1", "-0.1": "-0.1"}),
    ("scorers", "prefix-affinity", "guard", "a number > 0 or .inf", {"0": "0", "-.inf": "-inf", "'2'": "'2'"}),
    ("scorers", "prefix-affinity", "capacity_blocks", "an integer >= 1", {"0": "0", "1.5": "1.5", "true": "True"}),
    ("scorers", "session-affinity", "c", "a number >= 1 or .inf", {"0.5": "0.5", "'1.25'": "'1.25'", ".nan": "nan"}),
    (
        "scorers",
        "session-affinity",
        "vnodes",
        "an integer in 1..1000",
        {"0": "0", "true": "True", "[160]": "[160]", "100000": "100000"},
    ),
]

BAD_VALUES = [
    pytest.param(
        kind,
        f"{{type: {plugin}, {param}: {value}}}",
        f"{PLACES[kind]}.{param} must be {must}; got {shown}",
        id=f"{plugin}.{param}={value}",
    )
    for kind, plugin, param, must, values in MUST_BE
    for value, shown in values.items()
]

# (kind, plugin type, an unknown parameter, what the message lists as accepted)
UNKNOWN = [
    ("filters", "memory-fit", "marg", "bytes_per_token, default_output_tokens, margin"),
    ("filters", "model", "models", "none"),
    ("filters", "staleness", "stale_after_s", "none"),
    ("scorers", "queue", "foo", "none"),
    ("scorers", "predicted-ttft", "prefix_match", "attention_tokens, block_tokens, delay_to_waiting, guard"),
    ("filters", "ttft-slo", "slo", "attention_tokens, block_tokens, guard"),
    ("filters", "ttft-gap", "margin", "attention_tokens, block_tokens, factor, guard, seconds, slower"),
    ("filters", "speed-class", "speeds", "attention_tokens, block_tokens, guard, min_wait_s"),
    ("scorers", "prefix-affinity", "index", "capacity_blocks, guard"),
    ("scorers", "session-affinity", "ring", "c, vnodes"),
    ("scorers", "seed-formula", "delta", "alpha, beta, floor, gamma, max_queue"),
    ("picker", "max-score", "rng", "none"),
    ("picker", "round-robin", "start", "none"),
    ("picker", "weighted-random", "seed", "none"),
    ("picker", "power-of-two", "seed", "none"),
]

BAD_VALUES += [
    pytest.param(
        kind,
        f"{{type: {plugin}, {name}: 1}}",
        f"{PLACES[kind]}: unknown parameter {name!r} for {plugin!r} (accepted: {accepted})",
        id=f"{plugin}-unknown-{name}",
    )
    for kind, plugin, name, accepted in UNKNOWN
]


@pytest.mark.parametrize(("kind", "entry", "message"), BAD_VALUES)
def test_bad_plugin_parameters_name_the_parameter_and_its_place(kind: str, entry: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_load(_plugin_yaml(kind, entry)))
    assert str(info.value) == message


def test_every_declared_parameter_is_tested() -> None:
    registry = default_registry()
    tables = {"filters": registry.filters, "scorers": registry.scorers, "picker": registry.pickers}
    declared = {
        (kind, name, param) for kind, table in tables.items() for name, p in table.items() for param in p.parameters()
    }
    assert declared == {(kind, plugin, param) for kind, plugin, param, _, _ in MUST_BE}
    assert set(registry.pickers) <= {plugin for kind, plugin, _, _ in UNKNOWN if kind == "picker"}


def test_seed_formula_weights_must_not_all_be_zero() -> None:
    text = _plugin_yaml("scorers", "{type: seed-formula, alpha: 0, beta: 0, gamma: 0}")
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_load(text))
    assert str(info.value) == (
        "profiles.default.scorers[0]: alpha, beta and gamma must not all be 0 (they weigh the three terms)"
    )


@pytest.mark.parametrize(
    ("kind", "entry", "attributes", "expected"),
    [
        pytest.param(
            "filters",
            "{type: memory-fit, margin: 1, bytes_per_token: 0.5, default_output_tokens: 0}",
            ("margin", "bytes_per_token", "default_output_tokens"),
            (1, 0.5, 0),
            id="memory-fit",
        ),
        pytest.param("scorers", "{type: in-flight-tokens, unit: 1}", ("unit",), (1.0,), id="in-flight-tokens"),
        pytest.param("scorers", "{type: recent-prefill, unit: 2}", ("unit",), (2.0,), id="recent-prefill"),
        pytest.param("scorers", "{type: latency, signal: e2e_s}", ("signal",), ("e2e_s",), id="latency"),
        pytest.param(
            "scorers", "{type: predicted-ttft, block_tokens: 1}", ("block_tokens",), (1,), id="predicted-ttft"
        ),
        pytest.param(
            "filters",
            "{type: ttft-slo, block_tokens: 1, attention_tokens: 0}",
            ("predictor.block_tokens", "predictor.attention_tokens"),
            (1, 0),
            id="ttft-slo",
        ),
        pytest.param(
            "scorers",
            "{type: predicted-ttft, attention_tokens: 58700}",
            ("predictor.attention_tokens",),
            (58_700,),
            id="predicted-ttft-attention",
        ),
        pytest.param(
            "scorers",
            "{type: predicted-ttft, delay_to_waiting: 0}",
            ("delay_to_waiting",),
            (0.0,),
            id="predicted-ttft-delay-off",
        ),
        pytest.param(
            "filters",
            "{type: ttft-gap, factor: 3, seconds: 0.5, slower: 0.5}",
            ("factor", "seconds", "slower"),
            (3, 0.5, 0.5),
            id="ttft-gap",
        ),
        pytest.param(
            "scorers",
            "{type: seed-formula, alpha: 0, beta: 0, gamma: 2, max_queue: 0.5, floor: 0}",
            ("alpha", "gamma", "max_queue", "floor"),
            (0, 2, 0.5, 0),
            id="seed-formula",
        ),
        pytest.param(
            "scorers",
            "{type: prefix-affinity, guard: .inf, capacity_blocks: 1}",
            ("guard", "index.capacity_blocks"),
            (math.inf, 1),
            id="prefix-affinity",
        ),
        pytest.param(
            "scorers", "{type: session-affinity, c: 1, vnodes: 1}", ("c", "ring.vnodes"), (1, 1), id="session-affinity"
        ),
    ],
)
def test_plugin_parameters_at_their_bounds_are_accepted(
    kind: str, entry: str, attributes: tuple[str, ...], expected: tuple[Any, ...]
) -> None:
    profile = build_profile(parse_config(yaml.safe_load(_plugin_yaml(kind, entry))).profile_spec(), size=2)
    plugin: Any = profile.filters[1] if kind == "filters" else profile.scorers[0].scorer
    assert tuple(operator.attrgetter(name)(plugin) for name in attributes) == expected


def test_the_prefix_index_takes_prefix_affinitys_size_whatever_the_order_of_scorers() -> None:
    doc = {
        "policy": "mine",
        "profiles": {
            "mine": {
                "filters": ["model", "ttft-slo"],
                "scorers": ["predicted-ttft", {"type": "prefix-affinity", "capacity_blocks": 7}],
            }
        },
        "pool": POOL,
    }
    profile = build_profile(parse_config(doc).profile_spec(), size=2)
    assert [w.scorer.name for w in profile.scorers] == ["predicted-ttft", "prefix-affinity"]  # the file's order
    assert profile.scorers[1].scorer.index.capacity_blocks == 7
    two = {"type": "prefix-affinity", "capacity_blocks": 8}
    doc["profiles"]["mine"]["scorers"].append(two)
    with pytest.raises(ConfigError, match=r"^profiles\.mine\.scorers\[2\]: capacity_blocks 8 differs from the 7"):
        parse_config(doc)


# ---- pool.allowed_networks: where endpoints and GPU sources may be ---------------------------------------------

DEFAULT_LIST = (
    r"127\.0\.0\.0/8, ::1/128, 10\.0\.0\.0/8, 172\.16\.0\.0/12, 192\.168\.0\.0/16, 100\.64\.0\.0/10, fc00::/7"
)
EVERYWHERE = ["0.0.0.0/0", "::/0"]


def _pool(*endpoints: Any, allowed: list[str] | None = None) -> dict[str, Any]:
    """A config document whose pool has ``endpoints`` and, unless None, ``allowed_networks``."""
    pool: dict[str, Any] = {"endpoints": list(endpoints)}
    if allowed is not None:
        pool["allowed_networks"] = allowed
    return {"pool": pool}


NOT_UNICAST = [
    pytest.param("169.254.169.254:80", "is link-local", id="cloud-metadata"),
    pytest.param("[fe80::1]:80", "is link-local", id="ipv6-link-local"),
    pytest.param("0.0.0.0:22", "is the unspecified address", id="unspecified"),
    pytest.param("[::]:80", "is the unspecified address", id="ipv6-unspecified"),
    pytest.param("224.0.0.1:80", "is a multicast address", id="multicast"),
    pytest.param("255.255.255.255:80", "is the broadcast address", id="broadcast"),
]


@pytest.mark.parametrize(
    "allowed", [pytest.param(None, id="default-allowlist"), pytest.param(EVERYWHERE, id="allow-everything")]
)
@pytest.mark.parametrize(("address", "words"), NOT_UNICAST)
def test_an_endpoint_must_be_a_unicast_address_whatever_the_allowlist(
    address: str, words: str, allowed: list[str] | None
) -> None:
    document = _pool({"address": "10.0.0.1:8000"}, {"address": address}, allowed=allowed)
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    assert str(info.value).startswith(f"pool.endpoints[1].address: {address!r} {words}"), str(info.value)


def test_a_public_endpoint_is_refused_until_its_network_is_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_pool({"address": "10.0.0.1:8000"}, {"address": "8.8.8.8:8000"}))
    assert re.fullmatch(
        rf"pool\.endpoints\[1\]\.address: '8\.8\.8\.8:8000' is outside pool\.allowed_networks \({DEFAULT_LIST}\): "
        r"add its network there if this server is yours",
        str(info.value),
    ), str(info.value)

    config = parse_config(_pool({"address": "8.8.8.8:8000"}, allowed=["8.8.8.0/24", "10.0.0.0/8"]))
    assert config.endpoints[0].address == "8.8.8.8:8000"
    assert config.allowed_networks == Networks.of(["8.8.8.0/24", "10.0.0.0/8"])
    assert parse_config(_doc()).allowed_networks == DEFAULT_NETWORKS


def test_allowed_networks_replace_the_default() -> None:
    with pytest.raises(ConfigError, match=r"^pool\.endpoints\[0\]\.address: '10\.0\.0\.1:8000' is outside pool\."):
        parse_config(_pool({"address": "10.0.0.1:8000"}, allowed=["192.168.7.0/24"]))


@pytest.mark.parametrize(
    ("allowed", "pattern"),
    [
        pytest.param([], r"^pool\.allowed_networks must be a non-empty list of networks", id="empty"),
        pytest.param("10.0.0.0/8", r"^pool\.allowed_networks must be a non-empty list of networks", id="string"),
        pytest.param(None, r"^pool\.allowed_networks must be a non-empty list of networks", id="null"),
        pytest.param(["10.0.0.0/8", 7], r"^pool\.allowed_networks\[1\] must be a network", id="int"),
        pytest.param(["10.0.0.1/8"], r"^pool\.allowed_networks\[0\]: '10\.0\.0\.1/8' is not a network", id="host-bits"),
        pytest.param(["10.0.0.0/33"], r"^pool\.allowed_networks\[0\]: '10\.0\.0\.0/33' is not a network", id="prefix"),
    ],
)
def test_allowed_networks_errors_name_the_entry(allowed: Any, pattern: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000"}], "allowed_networks": allowed}})
    assert re.search(pattern, str(info.value)), str(info.value)


def _gpu(url: str, kind: str | None = None, allowed: list[str] | None = None) -> dict[str, Any]:
    gpu = {"url": url} if kind is None else {"url": url, "kind": kind}
    return _pool({"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000", "gpu": gpu}, allowed=allowed)


@pytest.mark.parametrize(
    ("url", "kind", "expected"),
    [
        pytest.param("http://10.0.0.2:9400", None, "http://10.0.0.2:9400/gpu", id="agent-default-path"),
        pytest.param("http://10.0.0.2:9400", "dcgm", "http://10.0.0.2:9400/metrics", id="dcgm-default-path"),
        pytest.param("http://10.0.0.2/gpu", None, "http://10.0.0.2:80/gpu", id="default-port"),
        pytest.param("HTTP://[FD00::2]:9400/v1/gpu", None, "http://[fd00::2]:9400/v1/gpu", id="ipv6-canonical"),
    ],
)
def test_a_gpu_url_is_stored_canonical(url: str, kind: str | None, expected: str) -> None:
    gpu = parse_config(_gpu(url, kind)).endpoints[1].gpu
    assert gpu is not None and gpu.url == expected


@pytest.mark.parametrize(
    ("url", "allowed", "pattern"),
    [
        pytest.param(
            "https://10.0.0.2:9400/gpu",
            None,
            r"^pool\.endpoints\[1\]\.gpu\.url: 'https://10\.0\.0\.2:9400/gpu': https:// is not supported \(the picker "
            r"has no TLS client for GPU sources\); use http:// to the node's agent or exporter",
            id="https",
        ),
        pytest.param(
            "ftp://10.0.0.2/gpu",
            None,
            r"^pool\.endpoints\[1\]\.gpu\.url must be an http:// URL such as 'http://10\.0\.0\.7:9400/gpu'; "
            r"got 'ftp://10\.0\.0\.2/gpu'$",
            id="other-scheme",
        ),
        pytest.param(
            "http://gpu-node-2:9400/gpu",
            None,
            r"^pool\.endpoints\[1\]\.gpu\.url: 'http://gpu-node-2:9400/gpu': 'gpu-node-2:9400': 'gpu-node-2' is not a "
            r"literal IP address \(hostnames are not allowed: a name could resolve to any address later\)",
            id="hostname",
        ),
        pytest.param(
            "http://169.254.169.254/latest/meta-data/",
            EVERYWHERE,
            r"^pool\.endpoints\[1\]\.gpu\.url: 'http://169\.254\.169\.254/latest/meta-data/': 169\.254\.169\.254 "
            r"is link-local",
            id="link-local",
        ),
        pytest.param(
            "http://[::ffff:169.254.169.254]/gpu",
            EVERYWHERE,
            r"^pool\.endpoints\[1\]\.gpu\.url: .*an IPv4-mapped IPv6 address; write the IPv4 address",
            id="ipv4-mapped-metadata",
        ),
        pytest.param("http://0.0.0.0:9400/gpu", EVERYWHERE, r"is the unspecified address", id="unspecified"),
        pytest.param(
            "http://8.8.8.8:9400/gpu",
            None,
            rf"^pool\.endpoints\[1\]\.gpu\.url: 'http://8\.8\.8\.8:9400/gpu': 8\.8\.8\.8 is outside "
            rf"pool\.allowed_networks \({DEFAULT_LIST}\): add its network there if this server is yours$",
            id="outside-allowlist",
        ),
        pytest.param(
            "http://admin:secret@10.0.0.2:9400/gpu",
            None,
            r"^pool\.endpoints\[1\]\.gpu\.url: .*: a user name or password \('user@'\) is not allowed",
            id="userinfo",
        ),
        pytest.param(
            "http://10.0.0.2:9400/gpu?target=http://169.254.169.254/",
            None,
            r"^pool\.endpoints\[1\]\.gpu\.url: .*: a query \('\?\.\.\.'\) is not allowed",
            id="query",
        ),
        pytest.param("http://10.0.0.2:9400?x=1", None, r"a query \('\?\.\.\.'\) is not allowed", id="query-no-path"),
        pytest.param("http://10.0.0.2:9400/gpu#x", None, r"a fragment \('#\.\.\.'\) is not allowed", id="fragment"),
        pytest.param("http://10.0.0.2:9400/g pu", None, r"the path '/g pu' may hold only", id="path-space"),
        pytest.param("http://10.0.0.2:9400/g\\pu", None, r"the path '/g\\\\pu' may hold only", id="path-backslash"),
        pytest.param(
            "http:///gpu", None, r"^pool\.endpoints\[1\]\.gpu\.url: 'http:///gpu': names no host", id="no-host"
        ),
        pytest.param("http://fd00::2:9400/gpu", None, r"IPv6 addresses in brackets", id="ipv6-unbracketed"),
    ],
)
def test_a_gpu_url_must_be_http_to_an_allowed_literal_ip(url: str, allowed: list[str] | None, pattern: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_gpu(url, allowed=allowed))
    assert re.search(pattern, str(info.value)), str(info.value)


def test_a_public_gpu_source_is_accepted_once_its_network_is_allowed() -> None:
    gpu = parse_config(_gpu("http://8.8.8.8:9400/gpu", allowed=["10.0.0.0/8", "8.8.8.8/32"])).endpoints[1].gpu
    assert gpu is not None and gpu.url == "http://8.8.8.8:9400/gpu"


# --- otel: the span receiver's trust and bounds (otel/receiverproc.py checks them) -----------------------------

OTEL_POOL = {"endpoints": [{"address": "10.0.0.1:80"}]}


def _otel_config(**otel: Any) -> Config:
    return parse_config({"otel": {"receiver": "127.0.0.1:4317", **otel}, "pool": OTEL_POOL})


def test_the_receiver_trusts_the_pool_and_loopback_and_takes_sane_bounds_by_default() -> None:
    otel = _otel_config().otel
    assert otel.allowed_senders is None and otel.receiver_auth is None
    assert (otel.receiver_max_message_bytes, otel.receiver_max_spans_per_request) == (4 << 20, 16384)
    assert (otel.span_max_age_s, otel.span_max_ahead_s, otel.span_max_latency_s) == (600.0, 60.0, 3600.0)


def test_the_receivers_allowlist_token_and_limits_are_read() -> None:
    otel = _otel_config(
        allowed_senders=["10.0.0.0/8", "fd00::/8", "192.168.1.7"],
        receiver_auth={"token_file": "/run/secrets/otlp"},
        receiver_max_message_bytes=1 << 20,
        receiver_max_spans_per_request=4096,
        receiver_max_spans_per_s=5000,
        span_max_age_s=300,
        span_max_ahead_s=5,
        span_max_latency_s=600,
        join_max_age_s=120,
    ).otel
    assert otel.allowed_senders == ("10.0.0.0/8", "fd00::/8", "192.168.1.7/32")
    assert otel.receiver_auth is not None and otel.receiver_auth.file == "/run/secrets/otlp"
    assert (otel.receiver_max_message_bytes, otel.receiver_max_spans_per_request) == (1 << 20, 4096)
    assert (otel.receiver_max_spans_per_s, otel.span_max_age_s, otel.span_max_ahead_s) == (5000.0, 300.0, 5.0)
    assert (otel.span_max_latency_s, otel.join_max_age_s) == (600.0, 120.0)


def test_relays_are_read_and_may_be_everyone_only_with_a_token() -> None:
    assert _otel_config().otel.relays is None
    assert _otel_config(relays=["10.1.0.0/16"]).otel.relays == ("10.1.0.0/16",)
    with pytest.raises(ConfigError, match=r"^otel\.relays\[0\]: 0\.0\.0\.0/0 lets any host speak for every endpoint"):
        _otel_config(relays=["0.0.0.0/0"])
    with pytest.raises(ConfigError, match=r"^otel\.relays\[0\]: .* is a multicast address"):
        _otel_config(relays=["224.0.0.0/4"])
    with pytest.raises(ConfigError, match=r"^otel\.relays is set but otel\.receiver is not"):
        parse_config({"otel": {"relays": ["10.1.0.0/16"]}, "pool": OTEL_POOL})


def test_every_address_may_send_only_with_a_token() -> None:
    with pytest.raises(ConfigError, match=r"^otel\.allowed_senders\[0\]: 0\.0\.0\.0/0 lets any host send spans"):
        _otel_config(allowed_senders=["0.0.0.0/0"])
    otel = _otel_config(allowed_senders=["0.0.0.0/0", "::/0"], receiver_auth={"token_env": "OTLP_TOKEN"}).otel
    assert otel.allowed_senders == ("0.0.0.0/0", "::/0")


@pytest.mark.parametrize(
    ("otel", "pattern"),
    [
        pytest.param({"allowed_senders": []}, r"^otel\.allowed_senders must be a non-empty list", id="empty"),
        pytest.param({"allowed_senders": ["10.0.0.1/8"]}, r"^otel\.allowed_senders\[0\]: .*CIDR", id="host-bits"),
        pytest.param({"allowed_senders": ["lab"]}, r"^otel\.allowed_senders\[0\]: 'lab' is not a network", id="name"),
        pytest.param(
            {"allowed_senders": ["169.254.0.0/16"]}, r"^otel\.allowed_senders\[0\]: .* is link-local", id="link-local"
        ),
        pytest.param({"allowed_senders": ["224.0.0.0/4"]}, r"is a multicast address", id="multicast"),
        pytest.param(
            {"receiver_auth": {"token": "x"}},
            r"^otel\.receiver_auth: unknown key 'token' \(allowed: token_env, token_file\)$",
            id="inline-token",
        ),
        pytest.param({"receiver_auth": "secret"}, r"^otel\.receiver_auth must be a mapping", id="not-a-mapping"),
        pytest.param(
            {"receiver_max_message_bytes": 1 << 30}, r"^otel\.receiver_max_message_bytes must be an integer", id="big"
        ),
        pytest.param(
            {"receiver_max_spans_per_request": 0}, r"^otel\.receiver_max_spans_per_request must be", id="no-spans"
        ),
        pytest.param({"receiver_max_spans_per_s": 0}, r"^otel\.receiver_max_spans_per_s must be a number", id="rate"),
        pytest.param({"span_max_age_s": "10m"}, r"^otel\.span_max_age_s must be a number", id="age"),
        pytest.param({"span_max_ahead_s": -1}, r"^otel\.span_max_ahead_s must be a number", id="ahead"),
        pytest.param({"join_max_age_s": 0}, r"^otel\.join_max_age_s must be a number", id="join-age"),
    ],
)
def test_a_bad_receiver_setting_names_its_place(otel: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError) as info:
        _otel_config(**otel)
    assert re.search(pattern, str(info.value)), str(info.value)


@pytest.mark.parametrize(
    "key", [pytest.param("allowed_senders", id="allowlist"), pytest.param("receiver_auth", id="auth")]
)
def test_receiver_trust_settings_without_a_receiver_are_refused(key: str) -> None:
    value = ["10.0.0.0/8"] if key == "allowed_senders" else {"token_env": "OTLP_TOKEN"}
    with pytest.raises(ConfigError, match=rf"^otel\.{key} is set but otel\.receiver is not"):
        parse_config({"otel": {key: value}, "pool": OTEL_POOL})


# --- every mapping refuses unknown keys, and errors name their path ------------------------------------------

BASE: dict[str, Any] = {
    "otel": {"receiver": "127.0.0.1:4317", "receiver_auth": {"token_env": "OTLP_TOKEN"}},
    "admin_auth": {"token_env": "ADMIN_TOKEN"},
    "inflight": {},
    "admission": {},
    "signals": {},
    "class_header": "x-class",
    "classes": [{"name": "batch", "match": {"header": "batch"}}],
    "policy": "mine",
    "profiles": {"mine": {"filters": ["model", {"type": "saturation"}], "scorers": [{"type": "queue"}]}},
    "pool": {"endpoints": [{"address": "10.0.0.1:80", "gpu": {"url": "http://10.0.0.1:9400/gpu"}}]},
}


def _at(doc: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    for part in path:
        doc = doc[part]  # type: ignore[index]
    return doc


@pytest.mark.parametrize(
    ("path", "where", "allowed"),
    [
        pytest.param(
            (),
            "config",
            "admin, admin_auth, admission, class_header, classes, debug_scores, default_class, destinations, drain_s, "
            "experiments, inference_objectives, inflight, kv_events, listen, max_body_bytes, otel, policy, pool, "
            "profiles, quotas, replicas, session_header, signals, tls, weights_interval_s",
            id="top",
        ),
        pytest.param(("pool",), "pool", "allowed_networks, discovery, endpoints, slow_start, speeds", id="pool"),
        pytest.param(("pool", "endpoints", 0), "pool.endpoints[0]", "address, gpu, labels, models", id="endpoint"),
        pytest.param(("pool", "endpoints", 0, "gpu"), "pool.endpoints[0].gpu", "indices, kind, url", id="gpu"),
        pytest.param(
            ("signals",),
            "signals",
            "gpu_interval_s, scrape_interval_s, scrape_metrics, scrape_timeout_s, stale_after_s",
            id="signals",
        ),
        pytest.param(("otel",), "otel", None, id="otel"),
        pytest.param(("otel", "receiver_auth"), "otel.receiver_auth", "token_env, token_file", id="receiver-auth"),
        pytest.param(("admin_auth",), "admin_auth", "allowed_hosts, token_env, token_file", id="admin-auth"),
        pytest.param(("inflight",), "inflight", "end, max_age_s", id="inflight"),
        pytest.param(("admission",), "admission", "max_kv_usage, max_waiting", id="admission"),
        pytest.param(("classes", 0), "classes[0]", None, id="class"),
        pytest.param(
            ("classes", 0, "match"),
            "classes[0].match",
            "header, max_prompt_tokens, min_prompt_tokens, models, stream",
            id="class-match",
        ),
        pytest.param(("profiles", "mine"), "profiles.mine", "filters, picker, scorers", id="profile"),
    ],
)
def test_unknown_keys_are_refused_at_every_level(path: tuple[str | int, ...], where: str, allowed: str | None) -> None:
    doc = copy.deepcopy(BASE)
    parse_config(doc)  # valid as it stands
    _at(doc, path)["bogus"] = 1
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert re.fullmatch(rf"{re.escape(where)}: unknown key 'bogus' \(allowed: ([a-z_, ]+)\)", str(info.value))
    if allowed is not None:
        assert str(info.value).endswith(f"(allowed: {allowed})")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param(
            ("profiles", "mine", "filters", 1),
            "profiles.mine.filters[1]: unknown parameter 'bogus' for 'saturation' (accepted: none); one rule decides "
            "when an endpoint is saturated, for this filter and admission control alike: set it in the config's "
            "admission section, e.g. admission: {max_waiting: 8, max_kv_usage: 0.9}",
            id="filter-parameter",
        ),
        pytest.param(
            ("profiles", "mine", "scorers", 0),
            "profiles.mine.scorers[0]: unknown parameter 'bogus' for 'queue' (accepted: none)",
            id="scorer-parameter",
        ),
    ],
)
def test_unknown_plugin_parameters_are_refused(path: tuple[str | int, ...], message: str) -> None:
    doc = copy.deepcopy(BASE)
    _at(doc, path)["bogus"] = 1
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert str(info.value) == message


def test_every_error_is_reported_one_per_line_with_its_path_and_value() -> None:
    doc = copy.deepcopy(BASE)
    doc["listen"] = "localhost:9002"
    doc["signals"] = {"scrape_interval_s": "fast"}
    doc["pool"]["endpoints"].append({"address": "10.0.0.2:80", "labels": {"zone": 7}, "models": ["m", ""]})
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert str(info.value).splitlines() == [
        "listen: 'localhost:9002': 'localhost' is not a literal IP address (hostnames are not allowed: Envoy's "
        "ORIGINAL_DST cluster needs 'ip:port')",
        "signals.scrape_interval_s must be a number of seconds in 0.001..3600; got 'fast'",
        "pool.endpoints[1].models[1] must be a non-empty string; got ''",
        "pool.endpoints[1].labels.zone must be a string (it may be empty); got 7",
    ]


def test_an_error_shows_a_long_value_cut() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_doc(policy="p" * 5000))
    message = str(info.value)
    assert message.startswith("policy must be a preset or a profile of this file (") and len(message) < 500
    assert message.endswith("got " + "'" + "p" * 200 + "'… (5000 characters)")


def test_load_config_names_the_file_on_every_line(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("listen: x\npool: {endpoints: [{address: 10.0.0.1:80, weight: 2}]}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).splitlines() == [
        f"{path}: listen: 'x' must be a literal 'ip:port', e.g. '10.0.0.7:8000'",
        f"{path}: pool.endpoints[0]: unknown key 'weight' (allowed: address, gpu, labels, models)",
    ]


# ---------------------------------------------------------------- request classes and admission


@pytest.mark.parametrize(
    ("classes", "extra", "message"),
    [
        pytest.param([{"name": "a", "on_saturation": "drop"}], {}, r"classes\[0\]\.on_saturation", id="mode"),
        pytest.param([{"name": "a"}, {"name": "a"}], {}, r"classes\[1\]\.name 'a' repeats", id="repeat"),
        pytest.param([{"name": "a", "max_wait_s": -1}], {}, r"classes\[0\]\.max_wait_s must be", id="wait"),
        pytest.param([{"name": "a", "retry_after_s": 0}], {}, r"classes\[0\]\.retry_after_s", id="retry"),
        pytest.param([{"name": "a", "match": {"tokens": 3}}], {}, r"classes\[0\]\.match: unknown key", id="match"),
        pytest.param([{"name": "a", "labels": {"pool": "gpu9"}}], {}, r"no endpoint of the pool has them", id="labels"),
        pytest.param([{"name": "a", "match": {"header": "batch"}}], {}, r"class_header must name", id="no-header"),
        pytest.param([{"name": "a"}], {"default_class": "b"}, r"default_class 'b' is not one of", id="default"),
        pytest.param([], {"admission": {"max_kv_usage": 2}}, r"admission\.max_kv_usage must be", id="admission"),
    ],
)
def test_class_config_errors_name_the_field(classes: list, extra: dict, message: str) -> None:
    doc = {"pool": {"endpoints": [{"address": "10.0.0.1:80", "labels": {"pool": "a"}}]}, "classes": classes, **extra}
    with pytest.raises(ConfigError, match=message):
        parse_config(doc)


def test_class_config_parses() -> None:
    config = parse_config(
        {
            "class_header": "X-Class",
            "classes": [
                {"name": "batch", "match": {"header": ["batch", "offline"]}, "on_saturation": "shed"},
                {"name": "chat", "match": {"max_prompt_tokens": 4000, "stream": True}, "ttft_slo_s": 0.5},
            ],
            "default_class": "chat",
            "admission": {"max_waiting": 4},
            "pool": {"endpoints": [{"address": "10.0.0.1:80"}]},
        }
    )
    assert config.class_header == "x-class"
    assert [r.request_class.name for r in config.classes] == ["batch", "chat"]
    assert config.classes[0].header_values == frozenset({"batch", "offline"})
    assert config.default_class.name == "chat" and config.default_class.ttft_slo_s == 0.5
    assert config.admission.max_waiting == 4


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ({"url": "http://10.0.0.5:6379"}, r"replicas\.url must be redis:// or rediss://"),
        ({"url": "redis://user:secret@10.0.0.5:6379"}, r"replicas\.url must not carry a user or password"),
        ({"url": "redis://10.0.0.5:6379/db"}, r"replicas\.url's path must be a database number"),
        ({"url": "redis://10.0.0.5:6379", "ca_file": "/ca.pem"}, r"replicas\.ca_file is set but the URL is not rediss"),
        ({"url": "redis://10.0.0.5:6379", "username": "inferlb"}, r"replicas\.username needs a password"),
        ({"url": "redis://10.0.0.5:6379", "peer_ttl_s": 0.5}, r"replicas\.peer_ttl_s must be more than a second"),
        ({"url": "redis://10.0.0.5:6379", "key": "a key"}, r"replicas\.key must be a key name"),
        ({"url": "redis://10.0.0.5:6379", "passwd": "x"}, r"replicas: unknown key 'passwd'"),
        (
            {"url": "redis://redis.llm.svc:6379/0"},
            r"^replicas\.url: Redis at redis\.llm\.svc is reachable beyond this host, and whoever can write to its "
            r"stream steers this pool's traffic: set replicas\.password",
        ),
    ],
)
def test_a_bad_replicas_section_is_refused_naming_its_field(replicas: dict[str, Any], message: str) -> None:
    """The Redis the replicas share their state through: credentials come from a file or variable, never the URL."""
    with pytest.raises(ConfigError, match=message):
        parse_config(_doc(replicas=replicas))


@pytest.mark.parametrize(
    "replicas",
    [
        pytest.param({"url": "redis://127.0.0.1:6379"}, id="loopback"),
        pytest.param({"url": "redis://localhost:6379/0"}, id="localhost"),
        pytest.param({"url": "redis://[::1]:6379"}, id="ipv6-loopback"),
        pytest.param({"url": "rediss://10.0.0.5:6379", "password": {"token_env": "REDIS_PASSWORD"}}, id="with-auth"),
    ],
)
def test_redis_without_a_password_only_on_loopback(replicas: dict[str, Any]) -> None:
    assert parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "replicas": replicas}).replicas


def test_etcd_beyond_loopback_needs_its_auth() -> None:
    def etcd(**more: Any) -> dict[str, Any]:
        return {"pool": {"discovery": {"etcd": {"prefix": "/inferlb/", **more}}}}

    with pytest.raises(
        ConfigError, match=r"^pool\.discovery\.etcd\.urls\[1\]: etcd at 10\.0\.0\.5 is reachable beyond"
    ):
        parse_config(etcd(urls=["http://127.0.0.1:2379", "http://10.0.0.5:2379"]))
    assert parse_config(etcd(urls=["http://127.0.0.1:2379", "http://[::1]:2379"])).discovery is not None
    password = {"token_env": "ETCD_PASSWORD"}
    assert parse_config(etcd(urls=["https://10.0.0.5:2379"], username="u", password=password)).discovery


def test_etcd_credentials_cross_the_network_only_over_https() -> None:
    def etcd(*urls: str) -> dict[str, Any]:
        auth = {"username": "u", "password": {"token_env": "ETCD_PASSWORD"}}
        return {"pool": {"discovery": {"etcd": {"prefix": "/inferlb/", "urls": list(urls), **auth}}}}

    with pytest.raises(
        ConfigError, match=r"^pool\.discovery\.etcd\.urls\[1\]: etcd at 10\.0\.0\.6 is reached over plain http://"
    ) as refused:
        parse_config(etcd("https://10.0.0.5:2379", "http://10.0.0.6:2379"))
    assert "use https://" in str(refused.value)
    with pytest.raises(ConfigError, match=r"urls\[0\]: etcd at 10\.0\.0\.7 is reached over plain http://"):
        parse_config(etcd("HTTP://10.0.0.7:2379"))  # a scheme in any case
    # On loopback the password stays on this host.
    assert parse_config(etcd("http://127.0.0.1:2379", "http://[::1]:2379")).discovery


def test_a_replicas_section_with_its_password_from_a_file() -> None:
    config = parse_config(
        _doc(replicas={"url": "rediss://redis.llm.svc:6380/2", "password": {"token_file": "/run/secrets/redis"}})
    )
    assert config.replicas is not None and config.replicas.url == "rediss://redis.llm.svc:6380/2"
    assert config.replicas.password is not None and config.replicas.password.file == "/run/secrets/redis"
    assert parse_config(_doc()).replicas is None  # off unless configured


def test_pool_speeds_declares_a_relative_speed_per_kind_of_server() -> None:
    doc = _doc({"address": "10.0.0.1:8000", "labels": {"gpu": "h100"}}, {"address": "10.0.0.2:8000"})
    doc["pool"]["speeds"] = {"label": "gpu", "relative": {"h100": 3.3, "l4": 1}}
    config = parse_config(doc)
    assert config.speeds == SpeedHints("gpu", {"h100": 3.3, "l4": 1.0}, 1.0)
    assert list(config.speeds.of([e.labels for e in config.endpoints])) == [3.3, 1.0]
    assert parse_config(_doc()).speeds is None  # none declared: every server is priced from the fleet's figure


@pytest.mark.parametrize(
    ("speeds", "error"),
    [
        ({"relative": {"h100": 3}}, r"^pool\.speeds\.label is required"),
        ({"label": "gpu"}, r"^pool\.speeds\.relative is required"),
        ({"label": "gpu", "relative": {}}, r"^pool\.speeds\.relative must be a non-empty mapping"),
        ({"label": "gpu", "relative": {"h100": 0}}, r"^pool\.speeds\.relative\.h100 must be a relative speed in \(0"),
        ({"label": "gpu", "relative": {"h100": "fast"}}, r"^pool\.speeds\.relative\.h100 must be a relative speed"),
        ({"label": "gpu", "relative": {"h100": 3}, "default": -1}, r"^pool\.speeds\.default must be a relative speed"),
        ({"label": "gpu", "relative": {"h100": 3}, "rate": 1}, r"^pool\.speeds: unknown key 'rate'"),
    ],
    ids=["no-label", "no-relative", "empty", "zero", "not-a-number", "negative-default", "unknown-key"],
)
def test_pool_speeds_refuses_what_cannot_be_a_speed(speeds: dict[str, Any], error: str) -> None:
    doc = _doc()
    doc["pool"]["speeds"] = speeds
    with pytest.raises(ConfigError, match=error):
        parse_config(doc)


def test_the_kv_events_topic_may_be_empty_as_its_default_and_vllms_is() -> None:
    kv_events = {"port": 5557, "tokenizers": {"m": "pieces"}}
    pool = {"endpoints": [{"address": "10.0.0.1:80"}]}
    assert parse_config({"pool": pool, "kv_events": {**kv_events, "topic": ""}}).kv_events.topic == ""  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"kv_events\.topic must be a string; got 3"):
        parse_config({"pool": pool, "kv_events": {**kv_events, "topic": 3}})


def test_an_endpoints_label_may_be_empty_as_kubernetes_label_values_may() -> None:
    # A headless Service's EndpointSlices all carry `service.kubernetes.io/headless: ""`: the endpoint is kept.
    labels = {"service.kubernetes.io/headless": "", "app": "vllm"}
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000", "labels": labels}]}})
    assert config.endpoints[0].labels == labels
    with pytest.raises(ConfigError, match=r"pool\.endpoints\[0\]\.labels"):
        parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000", "labels": {"app": 7}}]}})


@pytest.mark.parametrize("namespace", ["", "LLM", "a.b_c", "-llm", "x" * 64])
def test_the_kubernetes_namespace_must_be_one_kubernetes_accepts(namespace: str) -> None:
    source = {"namespace": namespace, "selector": {"app": "vllm"}, "target_ports": [8000]}
    doc = {"pool": {"endpoints": [], "discovery": {"kubernetes": source}}}
    with pytest.raises(ConfigError, match="must be a Kubernetes namespace"):
        parse_config(doc)
    assert parse_config({"pool": {"endpoints": [], "discovery": {"kubernetes": {**source, "namespace": "llm-prod"}}}})
