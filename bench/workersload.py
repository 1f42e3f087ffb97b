"""Picker throughput at 1 and 2 workers (``inferlb serve --workers N``), for ``inferlb bench replicas``.

The same closed-loop load (wrk, buffered-body completions, ``CONCURRENCY`` connections) through the same kind of
gateway — real Envoy with two worker threads, backends that cost next to nothing (one Envoy answering every
request, as in the hop benchmark) — against three pickers: one worker alone, one worker in touch with Redis (the
exchange's cost with no peer), and two workers sharing state through Redis. Runs rotate between the three in
rounds, so that a noisy machine moves them alike. Per run: requests/s, latency, and CPU per request of the
picker (every worker's process; Envoy's apart).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferlb.bench.hop import BODY, MODEL, start_backends
from inferlb.bench.load import cpu_seconds, run_wrk
from inferlb.bench.redisserver import redis_server
from inferlb.envoyconf import EnvoyOptions
from inferlb.stack import LocalStack, StackOptions

__all__ = ["CONCURRENCY", "THROUGHPUT_RUNS", "picker_pids", "throughput_rows", "worker_ratios"]

CONCURRENCY = 32
BACKENDS = 4


@dataclass(frozen=True, slots=True)
class _Run:
    name: str
    workers: int
    redis: bool


THROUGHPUT_RUNS = (_Run("1 worker", 1, False), _Run("1 worker, Redis", 1, True), _Run("2 workers", 2, True))


def picker_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor's workers), from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except FileNotFoundError:
            continue
    return total


def throughput_rows(folder: Path, *, rounds: int, duration_s: float, policy: str) -> list[dict[str, Any]]:
    """The runs, ``rounds`` of each of THROUGHPUT_RUNS, ``duration_s`` seconds each; one row per run."""
    (folder / "backends").mkdir(parents=True, exist_ok=True)
    backends = start_backends(BACKENDS, folder / "backends")
    stacks: dict[str, LocalStack] = {}
    try:
        with redis_server(folder / "redis") as redis:
            secret = folder / "redis-password"
            secret.write_text(redis.password, encoding="utf-8")
            shared = {"replicas": {"url": redis.url, "password": {"token_file": str(secret)}}}
            common = StackOptions(
                servers=tuple(backends.addresses),
                models=(MODEL,),
                policy=policy,
                envoy=EnvoyOptions(access_log_path=None),
                envoy_concurrency=2,
                picker_log_level="warning",
                picker_env={"PYTHONHASHSEED": "1"},
            )
            for run in THROUGHPUT_RUNS:
                options = replace(common, picker_workers=run.workers, picker_config=shared if run.redis else {})
                stacks[run.name] = LocalStack(options, folder / run.name.replace(" ", "-").replace(",", ""))
                stacks[run.name].start()
            rows = []
            for number in range(1, rounds + 1):
                shift = (number - 1) % len(THROUGHPUT_RUNS)
                for run in THROUGHPUT_RUNS[shift:] + THROUGHPUT_RUNS[:shift]:
                    row = _measure(stacks[run.name], run, duration_s)
                    row["round"] = number
                    print(
                        f"  round {number}, {run.name}: {row['throughput_rps']:.0f} req/s, picker CPU "
                        f"{row['picker_cpu_us']:.0f} µs/req, p99 {row['p99_ms']} ms",
                        flush=True,
                    )
                    rows.append(row)
            return rows
    finally:
        for stack in stacks.values():
            stack.stop()
        backends.process.stop()


def _measure(stack: LocalStack, run: _Run, duration_s: float) -> dict[str, Any]:
    url = stack.gateway_url + "/v1/completions"
    run_wrk(url, connections=CONCURRENCY, duration_s=1.0, method="POST", body=BODY)  # warm-up
    assert stack.picker is not None and stack.envoy is not None
    pids = picker_pids(stack.picker.pid)
    picker_before, envoy_before = _cpu(pids), cpu_seconds(stack.envoy.pid)
    result = run_wrk(url, connections=CONCURRENCY, duration_s=duration_s, method="POST", body=BODY)
    picker_cpu, envoy_cpu = _cpu(pids) - picker_before, cpu_seconds(stack.envoy.pid) - envoy_before
    n = max(result.requests, 1)
    return {
        "mode": "throughput",
        "policy": run.name,
        "replicas": run.workers,
        "workers": run.workers,
        "shared": run.redis,
        "sync_delay_ms": None,
        "concurrency": CONCURRENCY,
        "requests": result.requests,
        "throughput_rps": round(result.rps, 1),
        "p50_ms": round(result.p50_us / 1000, 2),
        "p99_ms": round(result.p99_us / 1000, 2),
        "errors": result.errors,
        "picker_cpu_us": round(picker_cpu / n * 1e6, 1),
        "envoy_cpu_us": round(envoy_cpu / n * 1e6, 1),
        "picker_cores": round(picker_cpu / result.duration_s, 2),
        "prefix_hit_rate": None,
        "ttft_p99_ms": None,
    }


def worker_ratios(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Two workers over one (alone), per round, then the median: requests/s and picker CPU per request."""
    rps, cpu = [], []
    for number in sorted({r["round"] for r in rows}):
        one = next((r for r in rows if r["policy"] == "1 worker" and r["round"] == number), None)
        two = next((r for r in rows if r["policy"] == "2 workers" and r["round"] == number), None)
        if one and two and one["throughput_rps"] and one["picker_cpu_us"]:
            rps.append(two["throughput_rps"] / one["throughput_rps"])
            cpu.append(two["picker_cpu_us"] / one["picker_cpu_us"])
    if not rps:
        return None
    return {"throughput": round(statistics.median(rps), 3), "cpu_per_request": round(statistics.median(cpu), 3)}
