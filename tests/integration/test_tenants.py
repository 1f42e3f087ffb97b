"""Tenant quotas named by a JWT claim, through a real Envoy (``quotas.source: jwt``): Envoy checks each request's
token and puts its claim in the tenant header; no client can name its tenant, another's or a fresh one."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferlb.procs import SERVER_HEADER
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m1"
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
ISSUER = "https://auth.example.test"
KEY = b"a key of 32 bytes for the tests."
PER_MINUTE = 3  # each tenant's requests a minute, all of them at once (burst_s 60)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _token(claims: dict[str, Any], key: bytes = KEY) -> str:
    """A JWT signed with HS256 (the JWKS's one symmetric key)."""
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(signature)}"


def _bearer(tenant: str, key: bytes = KEY, **claims: Any) -> dict[str, str]:
    claims = {"iss": ISSUER, "aud": "inferlb", "exp": int(time.time()) + 600, "tenant": tenant, **claims}
    return {"authorization": f"Bearer {_token(claims, key)}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    folder = tmp_path_factory.mktemp("tenants")
    jwks = folder / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{"kty": "oct", "alg": "HS256", "k": _b64(KEY)}]}), encoding="utf-8")
    limits = {"requests_per_minute": PER_MINUTE, "burst_s": 60}
    quotas = {
        "header": "x-tenant",
        "source": "jwt",
        "jwt": {"issuer": ISSUER, "audiences": ["inferlb"], "jwks_file": str(jwks), "claim": "tenant"},
        "default": limits,
    }
    options = StackOptions(backends=2, models=(MODEL,), picker_config={"quotas": quotas})
    with LocalStack(options, folder) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10) as running:
        yield running


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-token"),
        pytest.param({"authorization": "Bearer not.a.token"}, id="garbage"),
        pytest.param(_bearer("x", b"another key of 32 bytes, not ours"), id="other-key"),
        pytest.param(_bearer("x", iss="https://elsewhere.test"), id="other-issuer"),
        pytest.param(_bearer("x", aud="someone-else"), id="other-audience"),
        pytest.param(_bearer("x", exp=int(time.time()) - 60), id="expired"),
        pytest.param({"x-tenant": "x"}, id="tenant-header-alone"),
    ],
)
def test_a_request_without_a_valid_token_is_refused_before_routing(
    client: httpx.Client, headers: dict[str, str]
) -> None:
    response = client.post("/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code in (401, 403)  # Envoy's: no or a bad token 401, a token for another audience 403
    assert SERVER_HEADER not in response.headers  # no server saw it
    assert response.json()["error"]["message"].startswith(("Jwt", "Audiences"))


def test_the_tenant_is_the_tokens_claim_whatever_header_the_client_sends(client: httpx.Client) -> None:
    # Tenant a spends its quota while claiming, by header, to be someone else each time: none of it counts.
    statuses = []
    for i in range(PER_MINUTE + 2):
        response = client.post("/v1/completions", json=COMPLETION, headers={**_bearer("a"), "x-tenant": f"fresh-{i}"})
        statuses.append(response.status_code)
    assert statuses == [200] * PER_MINUTE + [429, 429]
    assert "'a'" in response.json()["error"]["message"]
    # Another tenant's token has a quota of its own.
    assert client.post("/v1/completions", json=COMPLETION, headers=_bearer("b")).status_code == 200


@pytest.mark.parametrize(
    ("claims", "says"),
    [
        pytest.param({}, "names no tenant: its claim 'tenant' is missing or empty", id="no-claim"),
        pytest.param({"tenant": ""}, "names no tenant", id="empty"),
        pytest.param({"tenant": " v "}, "has control characters or spaces around it", id="spaces"),
    ],
)
def test_a_token_without_a_usable_tenant_is_refused_whatever_header_comes_with_it(
    client: httpx.Client, claims: dict[str, Any], says: str
) -> None:
    # The client's "x-tenant: v" was removed before the JWT filter ran: a token that names no tenant (or one that
    # is no usable name) borrows none, and shares no unnamed tenant with every other such token either.
    nameless = {"iss": ISSUER, "aud": "inferlb", "exp": int(time.time()) + 600, **claims}
    headers = {"authorization": f"Bearer {_token(nameless)}", "x-tenant": "v"}
    response = client.post("/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "tenant_refused" and says in error["message"]
    assert SERVER_HEADER not in response.headers
