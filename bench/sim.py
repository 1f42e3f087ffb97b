"""What the emulator costs and how fast the simulator runs.

    inferlb bench sim --out bench/results [--quick] [--traces DIR]

1. The discrete-event simulator replays the Mooncake conversation trace (12,031 requests, one hour) on 16
   emulated H100 + Llama-3.1-8B servers, once per policy (round robin, fewest in flight), on one core, and
   reports the wall time with the simulated results.
2. The live emulator: ``inferlb sim`` with 8 servers (its own process) takes 50 requests/s of streamed
   completions for 20 s (the Azure conversation trace's first requests, rate-scaled to 50/s; round robin over the
   servers; the client in this process). Reported: the emulator's CPU seconds over the whole run (the arrivals,
   then the drain of the requests still streaming after the last one), divided two ways: per offered second (by
   the arrival window's length: what each second of this load costs) and per wall second (by the run's wall
   time, drain included: the mean share of a core, 1.0 = one core); client errors; and the engine-time TTFT/E2E
   the servers logged.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench.load import cpu_seconds
from inferlb.bench.report import header, table, write
from inferlb.bench.stats import median, percentile, rounded
from inferlb.procs import free_port
from inferlb.sim.des import FleetView, simulate, trace_arrivals
from inferlb.sim.profiles import get_profile
from inferlb.sim.replay import Shot, replay
from inferlb.sim.traces import load_trace, prompt_text
from inferlb.stack import start_sim

__all__ = ["add_arguments", "des_speed", "live_cost", "run", "traces_dir"]

PROFILE = "h100-llama3.1-8b"
MODEL = "bench-model"


def traces_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    env = os.environ.get("INFERLB_TRACES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def des_speed(traces: Path, servers: int, limit: int | None) -> list[dict[str, Any]]:
    profile = get_profile(PROFILE)
    trace = load_trace(traces / "mooncake_conversation_trace.jsonl", limit=limit)
    arrivals = trace_arrivals(trace, profile.block_size)

    def round_robin() -> Any:
        counter = itertools.count()
        return lambda arrival, view: next(counter) % len(view.servers)

    def fewest_in_flight(arrival: Any, view: FleetView) -> int:
        return min(range(len(view.servers)), key=view.inflight.__getitem__)

    rows = []
    for name, policy in (("round-robin", round_robin()), ("fewest-in-flight", fewest_in_flight)):
        started = time.process_time()
        result = simulate(arrivals, policy, [profile] * servers, seed=1)
        cpu = time.process_time() - started
        ttft = [r.ttft_s for r in result.records if r.ttft_s is not None]
        queries = sum(s.prefix_cache_queries for s in result.servers)
        rows.append(
            {
                "policy": name,
                "requests": len(result.records),
                "servers": servers,
                "simulated_s": round(result.simulated_s, 1),
                "wall_s": round(result.wall_s, 2),
                "cpu_s": round(cpu, 2),
                "events": result.events,
                "errors": sum(r.error is not None for r in result.records),
                "ttft_p50_ms": rounded(percentile(ttft, 50, method="higher"), 1, 1000),
                "ttft_p99_ms": rounded(percentile(ttft, 99, method="higher"), 1, 1000),
                "prefix_hit_rate": round(sum(s.prefix_cache_hits for s in result.servers) / max(queries, 1), 3),
            }
        )
        print(f"des {name}: {rows[-1]}", flush=True)
    return rows


def live_cost(traces: Path, servers: int, rate: float, duration_s: float, workdir: Path) -> dict[str, Any]:
    # The first rate x duration requests, squeezed (or stretched) to arrive over `duration_s`.
    count = int(rate * duration_s)
    path = traces / "AzureLLMInferenceTrace_conv.csv"
    span = load_trace(path, limit=count + 1).requests[-1].arrival_s
    trace = load_trace(path, limit=count, rate_scale=span / duration_s)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(servers)]
    process = start_sim(addresses, workdir / "sim.log", "--profile", PROFILE, "--model", MODEL)
    try:
        shots = [
            Shot(
                f"r{r.index}",
                r.arrival_s,
                f"http://{addresses[i % servers]}",
                MODEL,
                prompt_text(r, trace.name),
                r.output_tokens,
            )
            for i, r in enumerate(trace.requests)
        ]
        cpu_before, wall_before = cpu_seconds(process.pid), time.monotonic()
        client = asyncio.run(replay(shots, timeout_s=120))
        cpu, wall = cpu_seconds(process.pid) - cpu_before, time.monotonic() - wall_before
        logged = []
        for address in addresses:
            logged += httpx.get(f"http://{address}/admin/requests", timeout=10).json()["requests"]
    finally:
        process.stop()
    ttft = [e["ttft_s"] for e in logged if e["ttft_s"] is not None]
    e2e = [e["e2e_s"] for e in logged if e["e2e_s"] is not None]
    window = trace.duration_s  # the first arrival is at 0, the last at the end of the load window
    row = {
        "servers": servers,
        "requests": len(shots),
        "offered_rps": round(len(shots) / window, 1),
        "load_window_s": round(window, 1),
        "wall_s": round(wall, 1),
        "sim_cpu_s": round(cpu, 2),
        "sim_cpu_per_offered_s": round(cpu / window, 3),
        "sim_cpu_per_wall_s": round(cpu / wall, 3),
        "sim_cpu_ms_per_request": round(1000 * cpu / len(shots), 2),
        "output_tokens": sum(c.tokens for c in client),
        "client_errors": sum(c.error is not None for c in client),
        "server_ttft_p50_ms": rounded(median(ttft), 1, 1000),
        "server_e2e_p50_ms": rounded(median(e2e), 1, 1000),
    }
    print(f"live: {row}", flush=True)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--traces", type=Path, help="folder with the traces (default: ../shared/traces)")
    parser.add_argument("--quick", action="store_true", help="2,000 requests in the DES, 5 s of live load")


def run(args: argparse.Namespace) -> int:
    traces = traces_dir(args.traces)
    if not (traces / "mooncake_conversation_trace.jsonl").exists():
        print(
            f"inferlb bench sim: error: no traces in {traces}; give --traces DIR or set INFERLB_TRACES_DIR",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    des = des_speed(traces, 16, 2000 if args.quick else None)
    live = live_cost(traces, 8, 50.0, 5.0 if args.quick else 20.0, args.out)
    (args.out / "sim.log").unlink(missing_ok=True)
    report = {**header(args.command), "des": des, "live": live}
    write(args.out, "sim", report, _markdown(report))
    return 0


_DES_COLUMNS = {
    "policy": "policy",
    "requests": "requests",
    "simulated_s": "simulated s",
    "wall_s": "wall s",
    "cpu_s": "CPU s",
    "events": "events",
    "errors": "errors",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "prefix_hit_rate": "prefix hit rate",
}
_LIVE_COLUMNS = {
    "requests": "requests",
    "offered_rps": "offered req/s",
    "load_window_s": "load window s",
    "wall_s": "wall s",
    "sim_cpu_s": "emulator CPU s",
    "sim_cpu_per_offered_s": "CPU s per offered s",
    "sim_cpu_per_wall_s": "CPU s per wall s",
    "sim_cpu_ms_per_request": "CPU ms / request",
    "output_tokens": "output tokens",
    "client_errors": "client errors",
    "server_ttft_p50_ms": "server TTFT p50 ms",
    "server_e2e_p50_ms": "server E2E p50 ms",
}


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Emulator cost and simulator speed",
        "",
        f"{report['date']}; `{report['command']}`; {report['machine']}.",
        "",
        "## Discrete-event simulator: Mooncake conversation trace, 16 x h100-llama3.1-8b",
        "",
    ]
    lines += table(list(_DES_COLUMNS.values()), [[r[k] for k in _DES_COLUMNS] for r in report["des"]])
    live = report["live"]
    lines += [
        "",
        f"## Live emulator: {live['servers']} servers in one `inferlb sim` process, streamed completions",
        "",
        "Emulator CPU s is the whole run's: the load window (arrivals), then the drain (requests still streaming "
        "after the last arrival). Per offered second divides it by the load window, per wall second by the wall "
        "time, drain included (the mean share of one core).",
        "",
    ]
    lines += table(list(_LIVE_COLUMNS.values()), [[live[k] for k in _LIVE_COLUMNS]], "r" * len(_LIVE_COLUMNS))
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
