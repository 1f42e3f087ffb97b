"""Tests for scorer/config.py's admin_auth, inflight and drain_s sections, and the start-up refusal of an admin
API reachable beyond loopback without a token."""

from __future__ import annotations

from typing import Any

import pytest

from inferlb.scorer.config import parse_config
from inferlb.scorer.errors import ConfigError

POOL = {"endpoints": [{"address": "127.0.0.1:8000"}]}


def _config(**extra: Any) -> Any:
    return parse_config({"pool": POOL, **extra})


@pytest.mark.parametrize(
    "admin",
    [
        pytest.param("0.0.0.0:9003", id="every-ipv4-interface"),
        pytest.param("[::]:9003", id="every-ipv6-interface"),
        pytest.param("10.0.0.5:9003", id="pod-ip"),
    ],
)
def test_an_admin_api_beyond_loopback_needs_a_token(admin: str) -> None:
    with pytest.raises(ConfigError, match=r"reachable beyond this host.*admin_auth\.token_file"):
        _config(admin=admin)
    config = _config(admin=admin, admin_auth={"token_env": "INFERLB_ADMIN_TOKEN"})
    assert config.admin_auth.token is not None and config.admin_auth.token.env == "INFERLB_ADMIN_TOKEN"


def test_the_defaults_are_safe() -> None:
    config = _config()
    assert config.admin == "127.0.0.1:9003" and config.admin_auth.token is None  # writes off, loopback only
    assert config.inflight.end == "access-log" and config.inflight.max_age_s == 900
    assert config.drain_s == 5


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        pytest.param({"admin_auth": {"token": "abc"}}, "unknown key 'token'", id="inline-token"),
        pytest.param({"admin_auth": {"allowed_hosts": ["a:80"]}}, "without a port", id="host-with-port"),
        pytest.param({"admin_auth": {"allowed_hosts": "a"}}, "must be a list", id="hosts-not-list"),
        pytest.param({"inflight": {"end": "never"}}, "inflight.end must be access-log or stream", id="end"),
        pytest.param({"inflight": {"max_age_s": 0}}, "inflight.max_age_s", id="age"),
        pytest.param({"drain_s": -1}, "drain_s must be a number", id="drain"),
    ],
)
def test_bad_sections_are_refused(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _config(**extra)


def test_allowed_hosts_are_lower_case() -> None:
    config = _config(admin_auth={"token_file": "/run/token", "allowed_hosts": ["Admin.Inference.SVC"]})
    assert config.admin_auth.allowed_hosts == frozenset({"admin.inference.svc"})


EXACTLY_ONE = (
    "needs exactly one of token_file (a file holding the token) and token_env (an environment variable holding it)"
)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param({}, f"otel.receiver_auth {EXACTLY_ONE}", id="none"),
        pytest.param({"token_file": "a", "token_env": "B"}, f"otel.receiver_auth {EXACTLY_ONE}", id="both"),
        pytest.param(
            {"token_env": "BAD NAME"},
            "otel.receiver_auth.token_env must be an environment variable name; got 'BAD NAME'",
            id="env-name",
        ),
        pytest.param({"token_file": ""}, "otel.receiver_auth.token_file must be a non-empty string; got ''", id="path"),
        pytest.param("token", "otel.receiver_auth must be a mapping; got str", id="not-a-mapping"),
    ],
)
def test_a_bad_token_source_is_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(otel={"receiver": "127.0.0.1:4317", "receiver_auth": value})
    assert str(info.value) == message


def test_admin_auth_takes_one_token_source_at_most() -> None:
    with pytest.raises(ConfigError) as info:
        _config(admin_auth={"token_file": "/run/token", "token_env": "TOKEN"})
    assert str(info.value) == f"admin_auth {EXACTLY_ONE}"
    assert _config(admin_auth={"allowed_hosts": ["a"]}).admin_auth.token is None
