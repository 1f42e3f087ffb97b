"""Tests for inferlb/adminguard.py: the admin API refuses other hosts, cross-site requests, writes without the
token (or any write when no token is configured), form and text posts, and protected reads without the token."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from inferlb.adminguard import AdminGuard
from inferlb.scorer.credentials import Credential

TOKEN = "0123456789abcdef0123"
BEARER = {"authorization": f"Bearer {TOKEN}"}
YAML = {**BEARER, "content-type": "application/yaml"}


def _app(admin: str, token: str | None, hosts: frozenset[str] = frozenset()) -> tuple[FastAPI, list[bytes]]:
    app = FastAPI()
    posted: list[bytes] = []

    @app.get("/config")
    async def config() -> dict[str, str]:
        return {"pool": "secret"}

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/config")
    async def post_config(request: Request) -> dict[str, str]:
        posted.append(await request.body())
        return {"status": "applied"}

    credential = Credential(token.encode()) if token is not None else None
    app.add_middleware(AdminGuard, admin=admin, auth=lambda: (credential, hosts))
    return app, posted


async def _send(app: FastAPI, method: str, path: str, host: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
        return await client.request(method, path, **kwargs)


@pytest.mark.parametrize(
    ("host", "headers", "content", "status"),
    [
        pytest.param("attacker.example", {"content-type": "text/plain"}, b"pool: {}", 421, id="rebinding-text-plain"),
        pytest.param("attacker.example:9003", YAML, b"pool: {}", 421, id="rebinding-with-token"),
        pytest.param("127.0.0.1:9003", {"content-type": "text/plain"}, b"pool: {}", 401, id="no-token"),
        pytest.param("127.0.0.1:9003", {**BEARER, "content-type": "text/plain"}, b"x", 415, id="text-plain"),
        pytest.param(
            "127.0.0.1:9003",
            {**BEARER, "content-type": "application/x-www-form-urlencoded"},
            b"a=b",
            415,
            id="form",
        ),
        pytest.param("127.0.0.1:9003", {**BEARER, "content-type": "multipart/form-data; b=x"}, b"x", 415, id="multi"),
        pytest.param("127.0.0.1:9003", {**BEARER}, b"pool: {}", 415, id="no-content-type"),
        pytest.param("127.0.0.1:9003", {"authorization": "Bearer wrong-token-000000"}, b"", 401, id="wrong-token"),
        pytest.param("127.0.0.1:9003", {"authorization": TOKEN}, b"", 401, id="no-bearer-scheme"),
        pytest.param("127.0.0.1:9003", {**YAML, "origin": "http://evil.example"}, b"pool: {}", 403, id="cross-origin"),
        pytest.param(
            "127.0.0.1:9003", {**YAML, "origin": "http://127.0.0.1:8080"}, b"pool: {}", 403, id="other-port-origin"
        ),
        pytest.param("127.0.0.1:9003", {**YAML, "sec-fetch-site": "cross-site"}, b"pool: {}", 403, id="fetch-site"),
        pytest.param("127.0.0.1:9003", YAML, b"pool: {}", 200, id="token-and-yaml"),
        pytest.param("localhost:9003", {**BEARER, "content-type": "application/json"}, b"{}", 200, id="json"),
        pytest.param("127.0.0.1:9003", {**YAML, "origin": "http://127.0.0.1:9003"}, b"pool: {}", 200, id="same-origin"),
    ],
)
async def test_a_write_needs_the_admins_host_the_token_and_a_json_or_yaml_body(
    host: str, headers: dict[str, str], content: bytes, status: int
) -> None:
    app, posted = _app("127.0.0.1:9003", TOKEN)
    response = await _send(app, "POST", "/config", host, headers=headers, content=content)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert posted == ([content] if status == 200 else [])  # a refused write never reaches the route
    if status != 200:
        assert response.json()["error"]["code"] == status


async def test_with_no_token_configured_writes_are_off_and_reads_stay_on_loopback() -> None:
    app, posted = _app("127.0.0.1:9003", None)
    response = await _send(app, "POST", "/config", "127.0.0.1:9003", headers=YAML, content=b"pool: {}")
    assert response.status_code == 403 and "no admin token is configured" in response.json()["error"]["message"]
    assert posted == []
    assert (await _send(app, "GET", "/config", "127.0.0.1:9003")).status_code == 200
    assert (await _send(app, "GET", "/config", "rebind.attacker.example")).status_code == 421


async def test_with_a_token_the_config_is_read_only_with_it_and_metrics_stay_open() -> None:
    app, _ = _app("127.0.0.1:9003", TOKEN)
    refused = await _send(app, "GET", "/config", "127.0.0.1:9003")
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert (await _send(app, "GET", "/config", "127.0.0.1:9003", headers=BEARER)).json() == {"pool": "secret"}
    assert (await _send(app, "GET", "/metrics", "127.0.0.1:9003")).status_code == 200


async def test_no_cors_a_preflight_gets_no_allow_origin() -> None:
    app, _ = _app("127.0.0.1:9003", TOKEN)
    preflight = await _send(
        app,
        "OPTIONS",
        "/config",
        "127.0.0.1:9003",
        headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
    )
    assert preflight.status_code == 405
    for response in (preflight, await _send(app, "GET", "/metrics", "127.0.0.1:9003", headers={"origin": "x"})):
        assert not [name for name in response.headers if name.startswith("access-control-")]


@pytest.mark.parametrize(
    ("admin", "host", "allowed"),
    [
        pytest.param("127.0.0.1:9003", "127.0.0.1:9003", True, id="own-address"),
        pytest.param("127.0.0.1:9003", "localhost:19003", True, id="localhost-port-forward"),
        pytest.param("127.0.0.1:9003", "[::1]:9003", True, id="loopback-v6"),
        pytest.param("127.0.0.1:9003", "10.0.0.5:9003", False, id="other-ip-on-loopback-bind"),
        pytest.param("10.0.0.5:9003", "10.0.0.5:9003", True, id="pod-ip"),
        pytest.param("10.0.0.5:9003", "localhost:9003", False, id="localhost-on-pod-ip-bind"),
        pytest.param("0.0.0.0:9003", "10.1.2.3:9003", True, id="wildcard-any-ip"),
        pytest.param("0.0.0.0:9003", "[fd00::9]:9003", True, id="wildcard-any-ipv6"),
        pytest.param("0.0.0.0:9003", "localhost:19003", True, id="wildcard-port-forward"),
        pytest.param("0.0.0.0:9003", "inferlb-admin.inference.svc:9003", True, id="allowed-name"),
        pytest.param("0.0.0.0:9003", "evil.example:9003", False, id="wildcard-name"),
        pytest.param("0.0.0.0:9003", "", False, id="no-host"),
        pytest.param("0.0.0.0:9003", "10.0.0.1:80@evil.example", False, id="garbage"),
    ],
)
async def test_the_host_must_be_the_admins_own_address(admin: str, host: str, allowed: bool) -> None:
    app, _ = _app(admin, TOKEN, frozenset({"inferlb-admin.inference.svc"}))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get("/metrics", headers={"host": host})
    assert (response.status_code == 200) is allowed, response.text


async def test_a_repeated_authorization_header_is_refused() -> None:
    app, posted = _app("127.0.0.1:9003", TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9003") as client:
        headers = [("authorization", "Bearer x"), ("authorization", f"Bearer {TOKEN}")]
        request = client.build_request("POST", "/config", headers=[*headers, ("content-type", "application/json")])
        response = await client.send(request)
    assert response.status_code == 400 and posted == []
