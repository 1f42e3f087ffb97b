"""Two picker replicas behind one real Envoy, sharing routing state through a real Redis: Envoy spreads its picker
streams over both, each replica counts the other's requests in flight, and a request's end that Envoy's access
log reports to the replica that did not route it still releases its count."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.bench.redisserver import REDIS, RedisServer, redis_server
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)"),
]

REQUESTS = 8


def _inflight(stack: LocalStack) -> list[int]:
    """Each replica's view: the requests in flight it counts over the pool (its own and its peers')."""
    views = []
    for url in stack.picker_admin_urls:
        rows = httpx.get(f"{url}/endpoints", headers=stack.admin_headers, timeout=5).json()["endpoints"]
        views.append(sum(r["inflight_requests"] for r in rows))
    return views


async def _streamed_while_all_count(stack: LocalStack) -> list[int]:
    """REQUESTS streamed completions through the gateway; while their answers stream, every picker (replica or
    worker) counts all of them, its own and the others'. Their statuses."""
    body = {"model": "m1", "prompt": "hold on " * 20, "max_tokens": 300, "stream": True}
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as client:

        async def one() -> int:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
                return response.status_code

        tasks = [asyncio.create_task(one()) for _ in range(REQUESTS)]
        everyone = [REQUESTS] * len(stack.picker_admin_urls)
        await asyncio.to_thread(poll, lambda: _inflight(stack) == everyone, "every picker sees all", 15.0)
        return await asyncio.gather(*tasks)


def test_two_replicas_behind_one_envoy_see_every_request_in_flight_and_every_end(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as redis:
        options = StackOptions(
            backends=2,
            models=("m1",),
            pickers=2,
            picker_env={"PYTHONHASHSEED": "977"},
            picker_config={"replicas": _shared(redis, tmp_path)},
        )
        with LocalStack(options, tmp_path / "stack") as stack:
            _all_ready(stack)
            assert asyncio.run(_streamed_while_all_count(stack)) == [200] * REQUESTS
            # Every end released its count, whichever replica Envoy's access log reached.
            poll(lambda: _inflight(stack) == [0, 0], "all ended everywhere", 30.0)
            routed = _routed(stack)
            assert sum(routed) == REQUESTS and all(n > 0 for n in routed), routed


def _shared(redis: RedisServer, folder: Path) -> dict[str, Any]:
    """The pickers' replicas section for ``redis``, its password in a file in ``folder``."""
    secret = folder / "redis-password"
    secret.write_text(redis.password)
    return {"url": redis.url, "password": {"token_file": str(secret)}}


def _all_ready(stack: LocalStack) -> None:
    def ready() -> bool:
        return all(httpx.get(f"{u}/readyz", timeout=5).status_code == 200 for u in stack.picker_admin_urls)

    poll(ready, "every picker ready", 30.0)


def _routed(stack: LocalStack) -> list[float]:
    """The decisions each picker (replica or worker) has made."""
    routed = []
    for url in stack.picker_admin_urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        lines = [line for line in text.splitlines() if line.startswith("inferlb_decisions_total{")]
        routed.append(sum(float(line.rsplit(" ", 1)[1]) for line in lines))
    return routed


def test_the_workers_of_one_picker_share_envoys_streams_and_their_counts(tmp_path: Path) -> None:
    """``inferlb serve --workers 2`` behind Envoy (``picker_workers``): Envoy's picker cluster lists both workers'
    ports, spreads the routing streams over them, and each worker counts the other's requests in flight."""
    with redis_server(tmp_path / "redis") as redis:
        options = StackOptions(
            backends=2,
            models=("m1",),
            picker_workers=2,
            picker_config={"replicas": _shared(redis, tmp_path)},
        )
        with LocalStack(options, tmp_path / "stack") as stack:
            assert len(stack.picker_admin_urls) == 2
            _all_ready(stack)
            assert asyncio.run(_streamed_while_all_count(stack)) == [200] * REQUESTS
            poll(lambda: _inflight(stack) == [0, 0], "all ended everywhere", 30.0)
            routed = _routed(stack)
            assert sum(routed) == REQUESTS and all(n > 0 for n in routed), routed


def test_a_tenant_over_its_quota_gets_429s_across_two_replicas_and_another_tenant_does_not(tmp_path: Path) -> None:
    """Two replicas behind one Envoy share tenant quotas through Redis: the quota header reaches the picker (the
    bootstrap forwards it), the tenant over its limit gets 429 with retry-after and a JSON reason whichever
    replica Envoy asks, and the other tenant is routed as before."""
    with redis_server(tmp_path / "redis") as redis:
        limits = {"small": {"requests_per_minute": 120, "burst_s": 2}, "big": {"requests_per_minute": 60000}}
        options = StackOptions(
            backends=2,
            models=("m1",),
            pickers=2,
            picker_config={
                "replicas": _shared(redis, tmp_path),
                "quotas": {"header": "x-tenant", "source": "gateway", "tenants": limits},
            },
        )
        with LocalStack(options, tmp_path / "stack") as stack:
            _all_ready(stack)
            body = {"model": "m1", "prompt": "hello", "max_tokens": 4}
            with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
                # Refused after their charge (no endpoint serves the model): the tenant gets its quota back.
                unknown = {**body, "model": "nope"}
                lost = [client.post("/v1/completions", json=unknown, headers={"x-tenant": "small"}) for _ in range(4)]
                assert [r.status_code for r in lost] == [404] * 4
                small = [client.post("/v1/completions", json=body, headers={"x-tenant": "small"}) for _ in range(12)]
                big = [client.post("/v1/completions", json=body, headers={"x-tenant": "big"}) for _ in range(12)]
            statuses = [r.status_code for r in small]
            # A burst of 4 (2 requests a second for 2 s), a little more while the 12 go: the rest refused.
            assert 4 <= statuses.count(200) <= 6 and statuses.count(429) == 12 - statuses.count(200), statuses
            refused = next(r for r in small if r.status_code == 429)
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["type"] == "quota_exceeded" and error["tenant"] == "small"
            assert error["limit"] == "requests_per_minute" and error["limit_value"] == 120
            assert [r.status_code for r in big] == [200] * 12
            # Both replicas took part: each refused or admitted some of them.
            counted = []
            for url in stack.picker_admin_urls:
                text = httpx.get(f"{url}/metrics", timeout=5).text
                lines = [line for line in text.splitlines() if line.startswith("inferlb_quota_requests_total{")]
                counted.append(sum(float(line.rsplit(" ", 1)[1]) for line in lines))
            assert sum(counted) == 32 and all(n > 0 for n in counted), counted  # 4 admitted then refunded
