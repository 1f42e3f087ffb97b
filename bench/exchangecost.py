"""The replicas' exchange's own CPU, in process, for ``inferlb bench replicas``: one replica and a real Redis, fed
``RATE`` decisions a second (each with a ~1 KB prompt's blocks) for ``SECONDS`` seconds, against the same feed
with no exchange running; at publishing intervals of 5 and 20 ms, in rounds taken in turn. The figure is the
process's CPU per decision over the feed alone's: what the exchange adds to every routed request, without the
gRPC, Envoy and scoring that the throughput runs measure with it.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferlb.bench.redisserver import RedisServer, redis_server
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import text_block_hashes
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.replicas import Replicas

__all__ = ["INTERVALS_S", "RATE", "exchange_rows"]

RATE = 1300.0  # decisions a second: what one picker process routes here, near saturation
SECONDS = 4.0
INTERVALS_S = (0.005, 0.02)
ENDPOINTS = [f"127.0.0.1:{9100 + i}" for i in range(4)]
PROMPT = "Summarise the following text. " * 33


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _feed(server: RedisServer, secret: Path, interval_s: float | None, key: str, seconds: float) -> float:
    """CPU seconds per decision of the feed, with the exchange at ``interval_s`` (None: none running) on a stream
    ``key`` of its own (no peer: what one replica spends to tell)."""
    document = {"pool": {"endpoints": [{"address": a, "models": ["m"]} for a in ENDPOINTS]}}
    engine = Engine(Pool(parse_config(document).endpoints), build_profile("least-request", np.random.default_rng(0)))
    replicas = None
    task = None
    if interval_s is not None:
        shared = {
            "url": server.url,
            "password": {"token_file": str(secret)},
            "publish_interval_s": interval_s,
            "key": key,
        }
        config = parse_config({**document, "replicas": shared}).replicas
        assert config is not None
        replicas = Replicas(config, lambda: engine)
        replicas.share_prefixes = True  # published whatever this process's hash seed: what costs is the same
        task = asyncio.create_task(replicas.run())
        while not replicas.ready():
            await asyncio.sleep(0.01)  # catching up: the replay of the stream
    hashes = text_block_hashes(PROMPT, seed=1)
    leases = []
    decisions = int(RATE * seconds)
    cpu, started = _cpu_s(), time.monotonic()
    for i in range(decisions):
        leases.append(engine.inflight.acquire(i % len(ENDPOINTS), 100))
        if replicas is not None:
            replicas.routed(ENDPOINTS[i % len(ENDPOINTS)], hashes)
        if len(leases) > 32:
            leases.pop(0).release()
        if i % 13 == 12:  # the feed's schedule (bounded: `decisions`), 13 decisions a step
            delay = started + (i + 1) / RATE - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    spent = _cpu_s() - cpu
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert replicas is not None
        await replicas.close()
    return spent / decisions


def exchange_rows(
    folder: Path, *, rounds: int = 3, seconds: float = SECONDS
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One row per interval and round (the exchange's µs per decision over the feed alone's, in that round), and
    the median per interval."""
    rows: list[dict[str, Any]] = []
    logging.getLogger("inferlb.scorer.replicas").setLevel(logging.WARNING)  # each feed connects and leaves
    with redis_server(folder / "redis") as server:
        secret = folder / "redis-password"
        secret.write_text(server.password, encoding="utf-8")
        for number in range(1, rounds + 1):
            alone = asyncio.run(_feed(server, secret, None, f"inferlb:exchange-{number}", seconds))
            for interval in INTERVALS_S:
                with_exchange = asyncio.run(
                    _feed(server, secret, interval, f"inferlb:exchange-{number}-{interval}", seconds)
                )
                cost_us = (with_exchange - alone) * 1e6
                print(f"  round {number}, publishing every {interval * 1000:g} ms: {cost_us:.0f} µs per decision")
                rows.append({
                    "mode": "exchange",
                    "policy": f"exchange every {interval * 1000:g} ms",
                    "round": number,
                    "replicas": 1,
                    "shared": True,
                    "sync_delay_ms": interval * 1000,
                    "decisions_per_s": RATE,
                    "feed_cpu_us": round(alone * 1e6, 1),
                    "exchange_cpu_us": round(cost_us, 1),
                    "prefix_hit_rate": None,
                    "ttft_p99_ms": None,
                    "throughput_rps": None,
                    "errors": 0,
                })  # fmt: skip
    medians: dict[str, float] = {}
    for interval in INTERVALS_S:
        values = sorted(r["exchange_cpu_us"] for r in rows if r["sync_delay_ms"] == interval * 1000)
        medians[f"{interval * 1000:g}ms"] = values[len(values) // 2]
    return rows, medians
