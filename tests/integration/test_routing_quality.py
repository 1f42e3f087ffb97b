"""Routing quality through the real gateway: Envoy + picker + emulated vLLM servers, each policy in the same run.

Both tests replay one open-loop workload through a fresh gateway per policy (same seed, same servers' profile)
and compare what the servers and the client saw.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import httpx
import pytest

from inferlb.scorer.promtext import read_vllm
from inferlb.sim.replay import Shot, replay
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m"
SCALE = 2.0  # engine seconds per wall second


def run(policy: str, shots_for, tmp_path: Path, *, sim_args: tuple[str, ...] = (), backends: int = 4):
    options = StackOptions(
        backends=backends, models=(MODEL,), policy=policy, time_scale=SCALE, sim_args=("--seed", "3", *sim_args)
    )
    with LocalStack(options, tmp_path / policy) as stack:
        shots = shots_for(stack.gateway_url)
        records = asyncio.run(replay(shots, time_scale=SCALE, timeout_s=120))
        metrics = {a: read_vllm(httpx.get(f"http://{a}/metrics", timeout=10).content) for a in stack.endpoints}
        return stack.endpoints, records, metrics


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.slow  # 27 s on two cores; CI runs it (make test-slow)
def test_a_slowed_server_gets_less_traffic_and_the_tail_is_shorter(tmp_path: Path) -> None:
    rng = random.Random(7)
    workload = []
    t = 0.0
    for i in range(240):
        t += rng.expovariate(12.0)  # 12 requests per engine second over 4 servers
        workload.append((t, f"request {i} " + "x" * rng.randrange(2_000, 12_000), rng.randrange(20, 120)))

    def shots(url: str) -> list[Shot]:
        return [Shot(f"r{i}", at, url, MODEL, text, out) for i, (at, text, out) in enumerate(workload)]

    results = {}
    for policy in ("round-robin", "default"):
        endpoints, records, _ = run(policy, shots, tmp_path, sim_args=("--fault", "0:slowdown=5"))
        assert [r.error for r in records] == [None] * len(records), policy
        slow = endpoints[0]  # server 0 of `inferlb sim` is the first endpoint
        share = sum(r.server == slow for r in records) / len(records)
        # The tail is TTFT p95: p99 of 240 requests is the third-worst one, which a single scheduling stall of the
        # machine decides (seen on a loaded 2-core runner: one stall put three requests of one run over 1 s).
        results[policy] = (share, quantile([r.ttft_s for r in records if r.ttft_s is not None], 0.95) * SCALE)
    rr_share, rr_p95 = results["round-robin"]
    share, tail = results["default"]
    assert rr_share == pytest.approx(0.25, abs=0.02)
    # Measured: 10-12% alone, 12.5% once under the full suite's load, on an Intel 2-core host; 13-16% alone and 15%
    # under the suite on an AMD 2-core one since the prediction counts prompts' attention (13-14% before, 5 runs)
    # (round robin: 25%; a fair share of a server 5x slower than three others would be 6%). Under 17.5% is well
    # clear of round robin and of that noise.
    assert share < 0.7 * rr_share, results
    assert tail < rr_p95, results


def test_shared_prefixes_hit_the_cache_more_without_overloading_anyone(tmp_path: Path) -> None:
    # 24 shared prefixes of ~4k tokens: 96k tokens, more than one server's cache (64k tokens here), much less
    # than the fleet's. Round robin makes every server cache every prefix, and they evict each other.
    rng = random.Random(11)
    systems = [f"system prompt {k}: " + "".join(rng.choice("abcdefgh ") for _ in range(16_000)) for k in range(24)]
    workload = []
    t = 0.0
    for i in range(240):
        t += rng.expovariate(10.0)
        family = rng.randrange(len(systems))
        question = f" question {i}: " + "y" * rng.randrange(200, 2_000)
        workload.append((t, systems[family] + question, rng.randrange(10, 60)))

    def shots(url: str) -> list[Shot]:
        return [Shot(f"r{i}", at, url, MODEL, text, out) for i, (at, text, out) in enumerate(workload)]

    results = {}
    for policy in ("round-robin", "default"):
        endpoints, records, metrics = run(policy, shots, tmp_path, sim_args=("--kv-blocks", "4000"))
        assert [r.error for r in records] == [None] * len(records), policy
        hits = sum(m.prefix_cache_hits or 0 for m in metrics.values())
        queries = sum(m.prefix_cache_queries or 0 for m in metrics.values())
        load = Counter(r.server for r in records)
        results[policy] = (hits / queries, max(load.values()) / (len(records) / len(endpoints)), records)
    rr_rate, _, _ = results["round-robin"]
    rate, peak, _ = results["default"]
    assert rate > rr_rate + 0.1, (rate, rr_rate)
    assert peak <= 2.0, f"one server got {peak:.2f}x the mean load"
