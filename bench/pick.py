"""What a pick costs, and what the metrics scraper costs.

    python -m inferlb.bench.pick --out bench/results [--quick]

1. ``Engine.decide`` per preset at 8, 64 and 1,024 endpoints, on a fleet whose every signal is known and fresh
   (so every filter and scorer does its full work), with requests carrying a 4 KB prompt's prefix hashes and
   in-flight counts that move (each decision holds its lease for a while, as requests do). p50/p99 in µs.
2. The scraper: ``inferlb sim`` serving 256 emulated servers in one process, scraped by `MetricsCollector` every
   100 ms for 10 s in this process; the CPU this process spent per wall second (1.0 = one core), split into
   HTTP and parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from inferlb.bench.report import header, write
from inferlb.filter.request import apply_body
from inferlb.procs import ProcessError, free_port
from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import PRESET_NAMES, build_profile
from inferlb.scorer.signals import Signals
from inferlb.stack import start_sim

SIZES = (8, 64, 1024)


def _fleet(n: int, rng: np.random.Generator) -> tuple[Pool, Signals]:
    pool = Pool([EndpointConfig(f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000", None) for i in range(n)])
    signals = Signals(n, stale_after_s=3600)
    now = time.monotonic()
    signals.publish(
        signals.snapshot.with_values(
            running=rng.integers(0, 64, n),
            waiting=rng.integers(0, 8, n),
            kv_usage=rng.random(n) * 0.9,
            kv_tokens=np.full(n, 450_000),
            gpu_util=rng.random(n),
            gpu_free_bytes=rng.random(n) * 8e9,
            gpu_total_bytes=np.full(n, 80e9),
            ttft_s=0.05 + rng.random(n),
            e2e_s=1 + rng.random(n),
            scraped_at=np.full(n, now),
        )
    )
    return pool, signals


def _requests(count: int, rng: np.random.Generator) -> list[RequestFeatures]:
    systems = ["".join(rng.choice(list("abcdefgh "), 3000)) for _ in range(16)]
    out = []
    for i in range(count):
        body = orjson.dumps({"model": "m", "prompt": systems[i % 16] + f" q{i} " * 40, "max_tokens": 100})
        features = RequestFeatures(path="/v1/completions", method="POST", request_id=str(i))
        apply_body(features, body, complete=True, max_bytes=1 << 20)
        out.append(features)
    return out


def pick_latency(decisions: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    requests = _requests(512, rng)
    rows = []
    for n in SIZES:
        pool, signals = _fleet(n, rng)
        for preset in PRESET_NAMES:
            engine = Engine(pool, build_profile(preset, np.random.default_rng(2), size=n), signals=signals)
            held: deque[Any] = deque()
            times = np.empty(decisions)
            clock = time.perf_counter_ns
            for k in range(decisions):
                request = requests[k % len(requests)]
                start = clock()
                decision = engine.decide(request)
                times[k] = clock() - start
                held.append(engine.inflight.acquire(decision.endpoint.index, request.prompt_tokens))
                if len(held) > 4 * n:  # leases live for a while, then end
                    held.popleft().release()
            warm = times[decisions // 10 :] / 1000
            rows.append(
                {
                    "endpoints": n,
                    "preset": preset,
                    "p50_us": round(float(np.percentile(warm, 50)), 1),
                    "p99_us": round(float(np.percentile(warm, 99)), 1),
                }
            )
            print(f"pick {rows[-1]}", flush=True)
    return rows


def scrape_cost(servers: int, seconds: float, workdir: Path) -> dict[str, Any]:
    for attempt in range(3):  # a port found free may be taken by someone else before the servers bind it
        ports: set[int] = set()
        while len(ports) < servers:
            ports.add(free_port())
        addresses = [f"127.0.0.1:{port}" for port in sorted(ports)]
        try:
            process = start_sim(addresses, workdir / "sim.log", "--model", "m")
            break
        except ProcessError:
            if attempt == 2:
                raise
    try:
        pool = Pool([EndpointConfig(a, None) for a in addresses])
        signals = Signals(servers)

        async def run() -> MetricsCollector:
            collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.1, timeout_s=1.0))
            await collector.scrape_once()  # connect once before measuring
            cpu, wall = time.process_time(), time.monotonic()
            collector.stats.parse_s = 0.0
            rounds = collector.stats.rounds
            task = asyncio.create_task(collector.run())
            await asyncio.sleep(seconds)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            collector.stats.rounds -= rounds
            run.cpu, run.wall = time.process_time() - cpu, time.monotonic() - wall  # type: ignore[attr-defined]
            await collector.aclose()
            return collector

        collector = asyncio.run(run())
    finally:
        process.stop()
    cpu, wall = run.cpu, run.wall  # type: ignore[attr-defined]
    stats = collector.stats
    return {
        "endpoints": servers,
        "interval_s": 0.1,
        "wall_s": round(wall, 1),
        "rounds": stats.rounds,
        "rounds_per_s": round(stats.rounds / wall, 2),
        "scrapes_per_s": round(stats.rounds * servers / wall, 1),
        "errors": sum(stats.errors.values()),
        "cores": round(cpu / wall, 3),
        "parse_cores": round(stats.parse_s / wall, 3),
        "cpu_us_per_scrape": round(1e6 * cpu / max(stats.rounds * servers, 1), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    picks = pick_latency(2_000 if args.quick else 20_000)
    scrape = scrape_cost(64 if args.quick else 256, 3.0 if args.quick else 10.0, args.out)
    print(f"scrape {scrape}", flush=True)
    (args.out / "sim.log").unlink(missing_ok=True)
    report = {
        **header(f"python -m inferlb.bench.pick --out bench/results{' --quick' if args.quick else ''}"),
        "picks": picks,
        "scrape": scrape,
    }
    print(f"wrote {write(args.out, 'pick', report, _markdown)}")
    return 0


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Pick latency and scrape cost",
        "",
        f"{report['date']}; `{report['command']}`; {report['machine']}.",
        "",
        "## `Engine.decide`, µs (all signals fresh, 4 KB prompts with prefix hashes, moving in-flight counts)",
        "",
        "| preset | " + " | ".join(f"{n} endpoints p50 / p99" for n in SIZES) + " |",
        "|---|" + "---:|" * len(SIZES),
    ]
    for preset in PRESET_NAMES:
        cells = []
        for n in SIZES:
            row = next(r for r in report["picks"] if r["preset"] == preset and r["endpoints"] == n)
            cells.append(f"{row['p50_us']} / {row['p99_us']}")
        lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    s = report["scrape"]
    lines += [
        "",
        f"## Metrics scraper: {s['endpoints']} emulated servers every {s['interval_s']} s",
        "",
        "| rounds/s | scrapes/s | errors | collector cores | of which parsing | CPU µs per scrape |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {s['rounds_per_s']} | {s['scrapes_per_s']} | {s['errors']} | {s['cores']} | {s['parse_cores']} "
        f"| {s['cpu_us_per_scrape']} |",
        "",
        f"At 10 rounds/s over {s['endpoints']} endpoints that cost per scrape is "
        f"{s['cpu_us_per_scrape'] * s['endpoints'] * 10 / 1e6:.2f} of a core. Fewer than 10 rounds/s means the "
        "servers answered more slowly than the interval: here all of them are one emulator process on the same "
        "two cores as the collector.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
