"""What a pick costs, and what the metrics scraper costs.

    inferlb bench pick --out bench/results [--quick]

1. ``Engine.decide`` per preset at 8, 64 and 1,024 endpoints, on a fleet whose every signal is known and fresh
   (so every filter and scorer does its full work), with requests carrying a 4 KB prompt's prefix hashes and
   in-flight counts that move (each decision holds its lease for a while, as requests do). p50/p99 in µs.
2. The scraper: 256 endpoints serving a real vLLM exposition from memory (`metricsfarm.py`), scraped by
   `MetricsCollector` every 100 ms for 10 s in this process; the CPU this process spent per wall second (1.0 = one
   core), split into HTTP and parsing; then how late the event loop runs, and what a pick costs, while it scrapes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from inferlb.bench import callgrind
from inferlb.bench.report import header, table, write
from inferlb.bench.stats import median, percentile, rounded
from inferlb.filter.request import apply_body
from inferlb.procs import ManagedProcess, free_port, http_ok
from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import PRESET_NAMES, build_profile
from inferlb.scorer.signals import Signals

__all__ = ["add_arguments", "pick_latency", "run", "scrape_cost"]

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
        out.append(apply_body(features, body, complete=True, max_bytes=1 << 20))
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
                    "p50_us": rounded(percentile(warm, 50), 1),
                    "p99_us": rounded(percentile(warm, 99), 1),
                }
            )
            print(f"pick {rows[-1]}", flush=True)
    return rows


FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm" / "vllm-0.32.0-cpu-metrics.txt"
PROBE_S = 0.002  # the loop-lag probe's period


def scrape_cost(endpoints: int, seconds: float, workdir: Path, body: Path = FIXTURE) -> dict[str, Any]:
    """Scrape ``endpoints`` static copies of ``body`` every 100 ms for ``seconds``: what the collector costs, and
    how late the event loop that also answers Envoy runs while it works (against the same probe with no scraping,
    in the same run)."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(endpoints)]
    argv = [sys.executable, "-m", "inferlb.bench.metricsfarm", "--body", str(body)]
    for address in addresses:
        argv += ["--listen", address]
    farm = ManagedProcess("metrics farm", argv, workdir / "metricsfarm.log").start()
    try:
        for address in (addresses[0], addresses[-1]):  # bound in order: the last up means all are
            farm.wait_ready(http_ok(f"http://{address}/metrics"), 30.0, f"serving on {address}")
        result = asyncio.run(_scrape_run(addresses, seconds))
    finally:
        farm.stop()
    return {"endpoints": endpoints, "interval_s": 0.1, "body_bytes": body.stat().st_size, **result}


async def _scrape_run(addresses: list[str], seconds: float) -> dict[str, Any]:
    n = len(addresses)
    pool = Pool([EndpointConfig(a, None) for a in addresses])
    signals = Signals(n, stale_after_s=1.0)
    engine = Engine(pool, build_profile("default", np.random.default_rng(3), size=n), signals=signals)
    request = _requests(1, np.random.default_rng(4))[0]
    idle = await _probe(engine, request, min(seconds, 3.0))  # the request path with no scraping
    collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.1, timeout_s=0.5))
    await collector.scrape_once()  # connect once before measuring
    before = dataclasses.replace(collector.stats, errors=collector.stats.errors.copy())
    usage, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    task = asyncio.create_task(collector.run())
    await asyncio.sleep(seconds)  # the collector alone: its CPU
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    cpu = user + system
    stats = collector.stats
    scrapes = stats.scrapes - before.scrapes
    body_bytes = stats.bytes - before.bytes  # now: the collector goes on scraping during the probe below
    parse_s = stats.parse_s - before.parse_s
    published = stats.published - before.published
    errors = sum(stats.errors.values()) - sum(before.errors.values())
    busy = await _probe(engine, request, min(seconds, 3.0))  # and the request path while it runs
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await collector.aclose()
    return {
        "bytes_per_scrape": round(body_bytes / max(scrapes, 1)),
        "wall_s": round(wall, 1),
        "scrapes_per_s": round(scrapes / wall, 1),
        "per_endpoint_hz": round(scrapes / wall / n, 2),
        "snapshots_per_s": round(published / wall, 1),
        "errors": errors,
        "cores": round(cpu / wall, 3),
        "system_cores": round(system / wall, 3),
        "parse_cores": round(parse_s / wall, 3),
        "cpu_us_per_scrape": round(1e6 * cpu / max(scrapes, 1), 1),
        "idle": idle,
        "scraping": busy,
    }


async def _probe(engine: Engine, request: RequestFeatures, seconds: float) -> dict[str, float | None]:
    """Every PROBE_S: how late the loop woke us (lag), one `Engine.decide`, and the oldest endpoint data it read."""
    loop = asyncio.get_running_loop()
    lags, picks, ages = [], [], []
    end = loop.time() + seconds
    while loop.time() < end:
        asked = loop.time()
        await asyncio.sleep(PROBE_S)
        lags.append(loop.time() - asked - PROBE_S)
        started = time.perf_counter()
        engine.decide(request)
        picks.append(time.perf_counter() - started)
        ages.append(float(np.max(engine.signals.snapshot.age())))

    def pct(values: list[float], q: float, scale: float) -> float | None:
        return rounded(percentile(values, q), 2, scale)

    return {
        "lag_p50_ms": pct(lags, 50, 1e3),
        "lag_p99_ms": pct(lags, 99, 1e3),
        "lag_max_ms": round(max(lags) * 1e3, 2),
        "pick_p50_us": pct(picks, 50, 1e6),
        "pick_p99_us": pct(picks, 99, 1e6),
        # None before the first scrape (every age is infinite).
        "oldest_data_p99_ms": pct(ages, 99, 1e3) if np.isfinite(ages).all() else None,
    }


# One A/B measurement, run in this interpreter and in another checkout's: the default preset's pick (decide and
# the in-flight lease, as pick_latency times it) at each size, printed as JSON {size: p50 µs}. It uses only names
# every revision of this module has had since the pick benchmark began.
_AB_CODE = """
import json, sys, time
from collections import deque
import numpy as np
from inferlb.bench.pick import SIZES, _fleet, _requests
from inferlb.scorer.engine import Engine
from inferlb.scorer.presets import build_profile
decisions = int(sys.argv[1])
rng = np.random.default_rng(1)
requests = _requests(512, rng)
out = {}
for n in SIZES:
    pool, signals = _fleet(n, rng)
    engine = Engine(pool, build_profile("default", np.random.default_rng(2), size=n), signals=signals)
    held, times = deque(), np.empty(decisions)
    for k in range(decisions):
        request = requests[k % len(requests)]
        start = time.perf_counter_ns()
        decision = engine.decide(request)
        held.append(engine.inflight.acquire(decision.endpoint.index, request.prompt_tokens))
        times[k] = time.perf_counter_ns() - start
        if len(held) > 4 * n:
            held.popleft().release()
    out[n] = float(np.percentile(times[decisions // 10 :] / 1000, 50))
print(json.dumps(out))
"""


# The same decisions counted in CPU instructions under valgrind's callgrind (``--instructions``): a count does not
# depend on what else the machine runs, so a change of a few percent shows where the timings' noise hides it. For
# that the decisions must be the same in every run: they run on a clock of their own (a decision every millisecond
# from a scrape at 0; on the real clock, valgrind's slowness and the machine's load would drain the prefill
# backlog by different amounts, and the counts differed by 5%), and the prompts' prefix hashes, from Python's
# salted hash, on a fixed salt (PYTHONHASHSEED).
_COUNT_CODE = """
import sys
from collections import deque
import numpy as np
from inferlb.bench.pick import _fleet, _requests
from inferlb.scorer.engine import Engine
from inferlb.scorer.presets import build_profile
decisions, n = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(1)
requests = _requests(512, rng)
pool, signals = _fleet(n, rng)
now = [0.0]
signals.clock = lambda: now[0]
signals.publish(signals.snapshot.with_values(scraped_at=np.zeros(n)))
engine = Engine(pool, build_profile("default", np.random.default_rng(2), size=n), signals=signals)
held = deque()
for k in range(decisions):
    now[0] += 0.001
    request = requests[k % len(requests)]
    decision = engine.decide(request)
    held.append(engine.inflight.acquire(decision.endpoint.index, request.prompt_tokens))
    if len(held) > 4 * n:
        held.popleft().release()
"""
COUNT_WARM = 300  # decisions before the counted ones (imports, first-call set-up), subtracted
COUNT_DECISIONS = 1000


def instructions(python: str, size: int, decisions: int) -> int:
    """The CPU instructions that interpreter ``python`` runs for the count workload (start-up included) with
    ``decisions`` decisions on ``size`` endpoints (`callgrind.count`)."""
    return callgrind.count(python, _COUNT_CODE, str(decisions), str(size))


def instructions_per_decision(python: str, size: int, counted: int = COUNT_DECISIONS) -> float:
    """Instructions per decision and lease: two runs, `COUNT_WARM` decisions and ``counted`` more, subtracted."""
    return callgrind.per_step(python, _COUNT_CODE, COUNT_WARM, counted, str(size))


def counted_against(python: str, counted: int = COUNT_DECISIONS) -> list[dict[str, Any]]:
    """Per size, the instructions per decision here and with ``python``, and their ratio."""
    rows = []
    for n in SIZES:
        this = instructions_per_decision(sys.executable, n, counted)
        other = instructions_per_decision(python, n, counted)
        rows.append({"endpoints": n, "this": round(this), "other": round(other), "ratio": round(this / other, 3)})
        print(f"instructions at {n}: this {this:.0f}, other {other:.0f}", flush=True)
    return rows


def against(python: str, rounds: int, decisions: int) -> dict[str, Any]:
    """The default preset's pick p50 here and with another checkout's interpreter ``python``, in alternation,
    ``rounds`` times each: the median of each side's rounds per size, and the ratio."""
    sides: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for _ in range(rounds):
        for side, exe in (("other", python), ("this", sys.executable)):
            done = subprocess.run(
                [exe, "-c", _AB_CODE, str(decisions)], capture_output=True, text=True, check=True, cwd="/"
            )
            sides[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{side} {sides[side][-1]}", flush=True)
    rows = []
    for n in SIZES:
        this = round(median([r[str(n)] for r in sides["this"]]) or 0.0, 1)
        other = round(median([r[str(n)] for r in sides["other"]]) or 0.0, 1)
        # The best round of each side too: on a machine whose speed comes and goes, the least disturbed run.
        this_best = round(min(r[str(n)] for r in sides["this"]), 1)
        other_best = round(min(r[str(n)] for r in sides["other"]), 1)
        rows.append(
            {
                "endpoints": n,
                "this_p50_us": this,
                "other_p50_us": other,
                "ratio": round(this / other, 3),
                "this_best_us": this_best,
                "other_best_us": other_best,
                "best_ratio": round(this_best / other_best, 3),
            }
        )
    return {"other_python": python, "rounds": rounds, "decisions": decisions, "rows": rows, "raw": sides}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="2,000 decisions per preset and size; 64 endpoints")
    parser.add_argument(
        "--against",
        metavar="PYTHON",
        help="instead: the default preset's pick here against another checkout's interpreter (its venv's python, "
        "with inferlb installed from that checkout), in alternation; writes pick-against.{json,md}",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs per side")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="with --against: also count each side's CPU instructions per decision under valgrind's callgrind "
        "(the same on a busy machine as on a quiet one; needs valgrind; a few minutes)",
    )


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    if args.against:
        result = {**header(args.command), **against(args.against, args.rounds, 2_000 if args.quick else 5_000)}
        if args.instructions:
            result["instructions"] = counted_against(args.against, 200 if args.quick else COUNT_DECISIONS)
        lines = [
            "# The default preset's pick against another revision",
            "",
            f"{result['date']}; `{result['command']}`; {result['machine']}. `Engine.decide` and the in-flight lease,"
            f" p50 µs, the median of {args.rounds} runs per side in alternation, and the best run of each side;"
            f" other: `{args.against}`.",
            "",
            *table(
                ["endpoints", "this p50 µs", "other p50 µs", "this / other", "best: this, other", "best: this / other"],
                (
                    [
                        r["endpoints"],
                        r["this_p50_us"],
                        r["other_p50_us"],
                        r["ratio"],
                        f"{r['this_best_us']}, {r['other_best_us']}",
                        r["best_ratio"],
                    ]
                    for r in result["rows"]
                ),
                "rrrrrr",
            ),
        ]
        if args.instructions:
            lines += [
                "",
                "CPU instructions per decision and lease (valgrind's callgrind; the same workload, counted once per"
                " side):",
                "",
                *table(
                    ["endpoints", "this", "other", "this / other"],
                    ([r["endpoints"], r["this"], r["other"], r["ratio"]] for r in result["instructions"]),
                    "rrrr",
                ),
            ]
        write(args.out, "pick-against", result, "\n".join(lines) + "\n")
        return 0
    picks = pick_latency(2_000 if args.quick else 20_000)
    scrape = scrape_cost(64 if args.quick else 256, 3.0 if args.quick else 10.0, args.out)
    print(f"scrape {scrape}", flush=True)
    (args.out / "metricsfarm.log").unlink(missing_ok=True)
    report = {**header(args.command), "picks": picks, "scrape": scrape}
    write(args.out, "pick", report, _markdown(report))
    return 0


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Pick latency and scrape cost",
        "",
        f"{report['date']}; `{report['command']}`; {report['machine']}.",
        "",
        "## `Engine.decide`, µs (all signals fresh, 4 KB prompts with prefix hashes, moving in-flight counts)",
        "",
    ]

    def cell(preset: str, n: int) -> str:
        row = next(r for r in report["picks"] if r["preset"] == preset and r["endpoints"] == n)
        return f"{row['p50_us']} / {row['p99_us']}"

    lines += table(
        ["preset", *(f"{n} endpoints p50 / p99" for n in SIZES)],
        ([preset, *(cell(preset, n) for n in SIZES)] for preset in PRESET_NAMES),
    )
    s = report["scrape"]
    idle, busy = s["idle"], s["scraping"]
    lines += [
        "",
        f"## Metrics scraper: {s['endpoints']} endpoints, each every {s['interval_s']} s",
        "",
        f"Every endpoint serves a real vLLM 0.32 exposition ({s['body_bytes'] // 1024} KB, tests/fixtures/vllm/) "
        "from one static server process (`bench/metricsfarm.py`); the collector runs in this process, so the CPU "
        "figures are its own.",
        "",
    ]
    keys = ["bytes_per_scrape", "scrapes_per_s", "per_endpoint_hz", "snapshots_per_s", "errors", "cores"]
    keys += ["system_cores", "parse_cores", "cpu_us_per_scrape"]
    head = ["bytes per scrape", "scrapes/s", "per endpoint, Hz", "snapshots/s", "errors", "collector cores"]
    head += ["of which in the kernel", "of which parsing", "CPU µs per scrape"]
    lines += table(head, [[s[k] for k in keys]], "r" * len(keys))
    lines += [
        "",
        f"The request path while it scrapes: a probe on the same event loop wakes every {PROBE_S * 1e3:g} ms, "
        "notes how late it woke (loop lag), makes one `default` pick and notes the oldest endpoint data the pick "
        "read; the same probe with no scraping is the baseline.",
        "",
    ]

    def probe(name: str, p: dict[str, Any], oldest: object) -> list[object]:
        lag = f"{p['lag_p50_ms']} / {p['lag_p99_ms']} / {p['lag_max_ms']}"
        return [name, lag, f"{p['pick_p50_us']} / {p['pick_p99_us']}", oldest]

    head = ["", "loop lag p50 / p99 / max, ms", "pick p50 / p99, µs", "oldest data p99, ms"]
    lines += table(head, [probe("no scraping", idle, "-"), probe("scraping", busy, busy["oldest_data_p99_ms"])])
    lines += [""]
    return "\n".join(lines)


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
