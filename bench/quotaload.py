"""Tenant quotas across two replicas, live, for ``inferlb bench replicas``: one tenant over its token quota, one
well under it, through one real Envoy, two picker replicas sharing their buckets in a real Redis, and emulated
servers.

Three phases of ``PHASE_S`` seconds, open loop, each on a fresh gateway (fresh buckets, fresh servers): tenant
``b`` alone at ``B_RPS``; ``b`` with tenant ``a`` sending just under its token quota; ``b`` with ``a`` asking for
``A_OVER`` times its quota, its burst spent just before. What ``a`` gets admitted then is about its rate, and
loads the servers as in the phase before, so ``b``'s TTFT there against the phase before shows what refusing
``a``'s excess costs others. Per phase and tenant:
requests, admitted, refused (429), other errors, TTFT p50/p99 (streamed answers, the client's clock). The
limit's error: the tokens the replicas admitted for ``a`` (their own count, ``inferlb_quota_tokens_total``) over
what its bucket allows in the phase (the burst plus the rate times the phase's length).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench.metrics import picker_samples
from inferlb.bench.redisserver import redis_server
from inferlb.bench.stats import percentile
from inferlb.envoyconf import EnvoyOptions
from inferlb.stack import LocalStack, StackOptions

__all__ = ["PHASE_S", "quota_rows"]

MODEL = "bench-model"
PHASE_S = 20.0
B_RPS = 5.0
A_LIMIT_RPS = 3.0  # a's quota, in requests' worth of tokens a second
A_UNDER = 0.9  # a's rate, in quotas, while it stays within (its burst is full at the start)
A_OVER = 4.0  # and when it asks for too much
BURST_S = 5.0
PROMPT = "Tell me about the history of the printing press. " * 8
MAX_TOKENS = 16


async def _send(client: httpx.AsyncClient, tenant: str) -> tuple[int, float | None]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    started = time.monotonic()
    first = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-tenant": tenant}) as response:
            async for _ in response.aiter_bytes():
                if first is None:
                    first = time.monotonic() - started
            return response.status_code, first if response.status_code == 200 else None
    except httpx.HTTPError:
        return 0, None


async def _phase(url: str, rates: dict[str, float], seconds: float) -> dict[str, list[tuple[int, float | None]]]:
    """Open loop: each tenant's requests at its rate for ``seconds`` (a bounded count), all awaited."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=400)) as client:
        tasks: dict[str, list[asyncio.Task[tuple[int, float | None]]]] = {t: [] for t in rates}
        started = time.monotonic()
        plan = sorted((i / rate, tenant) for tenant, rate in rates.items() for i in range(int(rate * seconds)))
        for at, tenant in plan:
            delay = started + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule of an open-loop load, not a wait for readiness
            tasks[tenant].append(asyncio.create_task(_send(client, tenant)))
        return {t: list(await asyncio.gather(*ts)) for t, ts in tasks.items()}


async def _burst(url: str, tenant: str, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(_send(client, tenant) for _ in range(count)))


def _row(phase: str, tenant: str, results: list[tuple[int, float | None]]) -> dict[str, Any]:
    ttfts = sorted(t for _, t in results if t is not None)
    statuses = [s for s, _ in results]
    return {
        "mode": "quota",
        "policy": f"{phase}: tenant {tenant}",
        "phase": phase,
        "tenant": tenant,
        "replicas": 2,
        "shared": True,
        "sync_delay_ms": None,
        "requests": len(results),
        "admitted": statuses.count(200),
        "refused_429": statuses.count(429),
        "errors": sum(1 for s in statuses if s not in (200, 429)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "prefix_hit_rate": None,
        "throughput_rps": None,
    }


def _tokens(stack: LocalStack, tenant: str) -> float:
    return sum(picker_samples(url, "inferlb_quota_tokens_total").get(tenant, 0.0)
               for url in stack.picker_admin_urls)  # fmt: skip


def quota_rows(folder: Path, *, phase_s: float = PHASE_S) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The two phases' rows and the summary (the limit's error, b's TTFT with a over its quota and without)."""
    with redis_server(folder / "redis") as redis:
        secret = folder / "redis-password"
        secret.write_text(redis.password, encoding="utf-8")
        # A request's tokens as the picker counts them come from its own metrics: measured once, below.
        options = StackOptions(
            backends=2,
            models=(MODEL,),
            policy="default",
            envoy=EnvoyOptions(access_log_path=None),
            envoy_concurrency=1,
            picker_log_level="warning",
            pickers=2,
            picker_env={"PYTHONHASHSEED": "1"},
            picker_config={
                "replicas": {"url": redis.url, "password": {"token_file": str(secret)}},
                "quotas": {
                    "header": "x-tenant",
                    "source": "gateway",
                    "tenants": {"probe": {"requests_per_minute": 1e6}},
                },
            },
        )
        with LocalStack(options, folder / "probe") as stack:
            asyncio.run(_phase(stack.gateway_url, {"probe": 1.0}, 1.0))
            cost = _tokens(stack, "probe")
        limit = A_LIMIT_RPS * cost * 60  # tokens a minute
        quotas = {
            "header": "x-tenant",
            "source": "gateway",
            "tenants": {"a": {"tokens_per_minute": limit, "burst_s": BURST_S}, "b": {"tokens_per_minute": limit * 100}},
        }
        options = replace(options, picker_config={**options.picker_config, "quotas": quotas})
        phases: dict[str, tuple[dict[str, list[tuple[int, float | None]]], float, float]] = {}
        for phase, a_rps in (("b alone", 0.0), ("a within its quota", A_UNDER * A_LIMIT_RPS),
                             ("a over its quota", A_OVER * A_LIMIT_RPS)):  # fmt: skip
            with LocalStack(options, folder / phase.replace(" ", "-")) as stack:
                started = time.monotonic()
                if a_rps > A_LIMIT_RPS:
                    # Its burst spent first, so that what it gets admitted in the phase is its rate, as when it
                    # stays within its quota (the same load on the servers): a burst's worth and a few more at once.
                    asyncio.run(_burst(stack.gateway_url, "a", round(BURST_S * A_LIMIT_RPS) + 3))
                rates = {"b": B_RPS, **({"a": a_rps} if a_rps else {})}
                results = asyncio.run(_phase(stack.gateway_url, rates, phase_s))
                phases[phase] = (results, time.monotonic() - started, _tokens(stack, "a"))
    rows = [_row(phase, tenant, results) for phase, (by, _, _) in phases.items() for tenant, results in by.items()]
    over, elapsed, admitted_tokens = phases["a over its quota"]
    allowed = limit / 60 * (BURST_S + elapsed)  # from a full bucket, from the burst on
    b = {r["phase"]: r for r in rows if r["tenant"] == "b"}
    summary = {
        "request_tokens": cost,
        "a_tokens_per_minute": round(limit, 1),
        "a_asked_tokens": round(cost * len(over["a"]), 1),
        "a_admitted_tokens": round(admitted_tokens, 1),
        "a_allowed_tokens": round(allowed, 1),
        "limit_error": round(admitted_tokens / allowed - 1, 4),
        "b_refused": sum(r["refused_429"] for r in b.values()),
        # b's TTFT with a over its quota against a within it (the same admitted load): what the refusals cost
        "b_ttft_p50_ratio": _ratio(b["a over its quota"]["ttft_p50_ms"], b["a within its quota"]["ttft_p50_ms"]),
        "b_ttft_p99_ratio": _ratio(b["a over its quota"]["ttft_p99_ms"], b["a within its quota"]["ttft_p99_ms"]),
        "b_ttft_p99_ratio_to_alone": _ratio(b["a over its quota"]["ttft_p99_ms"], b["b alone"]["ttft_p99_ms"]),
    }
    return rows, summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None
