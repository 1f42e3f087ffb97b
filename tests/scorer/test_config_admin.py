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
