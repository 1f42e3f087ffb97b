"""The live half of the routing-quality benchmark: client -> router -> emulated servers over loopback.

Contenders: ``envoy:ROUND_ROBIN``, ``envoy:LEAST_REQUEST``, ``envoy:RANDOM`` (Envoy alone), ``inferlb:<preset>``
(Envoy + the picker), ``inferlb-kv-events:default`` (the same, the servers publishing KV events and the picker
following them) and the peer routers of `inferlb.bench.peers` (the router alone in front of the servers, as
they are deployed). Every run starts fresh emulated servers, so no contender inherits another's warm caches; the
load generator (`inferlb.bench.loadgen`) is its own process. The servers run ``time_scale`` times real time (per
trace: as fast as the machine carries, below 1 for the high-rate traces) and the generator sends at that pace, so
times are reported in model seconds, comparable with the simulator's. Each run also records how many of the
machine's cores the processes used, the check that the machine itself was not the bottleneck.

A trace's window (``--start``, `inferlb.bench.window`) is chosen once per trace; with ``--repeats K`` every
(trace, contender, load) runs K times with seeds ``seed`` .. ``seed + K - 1``, in the order `plan_runs` gives:
round-robin over the contenders within each repetition, so that the machine's noise falls on every contender
alike.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from inferlb.bench.desrun import fleet_capacity_rps, load_arrivals
from inferlb.bench.load import cpu_seconds
from inferlb.bench.metrics import Outcome, summarise
from inferlb.bench.policies import PROFILE_LABEL, declared_hints
from inferlb.bench.quality import add_goodput, aggregate, settings
from inferlb.bench.window import choose_window
from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import ManagedProcess, free_port, free_ports, stop_all
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.scorer.promtext import read_vllm
from inferlb.sim.profiles import fleet_of
from inferlb.stack import LocalStack, StackOptions, start_sim

__all__ = ["LIVE_CONTENDERS", "LiveRun", "measure", "plan_runs", "run_live"]

MODEL = "bench-model"
ENVOY_CONTENDERS = ("envoy:ROUND_ROBIN", "envoy:LEAST_REQUEST", "envoy:RANDOM")
LIVE_LOADS = (0.5, 0.8)
LIVE_LOADS_QUICK = (0.6,)
# What this kind of machine (2 cores shared by the load generator, Envoy, the router and the emulated servers)
# carries without becoming the bottleneck itself: requests and streamed tokens per wall-clock second at the
# highest load. The servers' time scale is chosen per trace to stay under both (below 1: slower than real time).
MAX_WALL_RPS = 12.0
MAX_WALL_TOKENS_PER_S = 4000.0


def _peer_names() -> tuple[str, ...]:
    try:
        from inferlb.bench.peers import PEERS
    except ImportError:
        return ()
    return tuple(peer.name for peer in PEERS)


LIVE_CONTENDERS: tuple[str, ...] = (
    *ENVOY_CONTENDERS,
    *(f"inferlb:{p}" for p in PRESET_NAMES),
    "inferlb-kv-events:default",  # the servers publish KV events and the picker follows them
    *_peer_names(),
)
_OURS = ("envoy:", "inferlb:", "inferlb-kv-events:")


class LiveRun(NamedTuple):
    """One live run: a trace's path, a load, a contender, which repetition (from 0) and the seed it runs with."""

    trace: str
    load: float
    policy: str
    repeat: int
    seed: int


def plan_runs(
    traces: Sequence[str], loads: Sequence[float], policies: Sequence[str], repeats: int, seed: int
) -> list[LiveRun]:
    """Every run, in the order to run them: trace by trace; within a trace, repetition by repetition (repetition
    ``k`` with seed ``seed + k``); within a repetition, load by load, every contender once per load. ValueError for
    ``repeats`` below 1."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {repeats}")
    return [
        LiveRun(trace, load, policy, repeat, seed + repeat)
        for trace in traces
        for repeat in range(repeats)
        for load in loads
        for policy in policies
    ]


def run_live(args: argparse.Namespace, progress: Callable[[int], Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    profile, fleet, requests, loads, wanted = settings(
        args,
        "live",
        servers=4,
        requests=(60, 120),
        loads=(LIVE_LOADS_QUICK, LIVE_LOADS),
        contenders=LIVE_CONTENDERS,
    )
    notes: list[str] = []
    policies = []
    for name in wanted:
        reason = _unavailable(name)
        if reason is None:
            policies.append(name)
        else:
            notes.append(f"{name} not run: {reason}")
    summary: dict[str, Any] = {
        "fleet": {"servers": len(fleet), "profile": profile},
        "traces": {},
        "notes": notes,
        "slo_rule": "SLO: as given" if args.slo_ms else "SLO: twice the best TTFT p99 at the lowest load run.",
    }
    rows: list[dict[str, Any]] = []
    # Read with defaults: other suites build this namespace by hand (`inferlb.bench.peercheck`).
    start, repeats = getattr(args, "start", 0), getattr(args, "repeats", 1)
    runs = plan_runs(args.trace, loads, policies, repeats, args.seed)
    bar = progress(len(runs))
    workroot = Path(tempfile.mkdtemp(prefix="inferlb-bench-live-"))
    scales: dict[str, float] = {}
    starts: dict[str, int] = {}
    capacities: dict[str, float] = {}
    for path in args.trace:
        window = choose_window(path, requests, start)
        starts[path] = window.start
        arrivals = load_arrivals(path, requests, fleet[0].block_size, window.start)
        capacity = fleet_capacity_rps(arrivals, fleet, args.seed)
        peak = max(loads) * capacity
        mean_output = sum(a.output_tokens for a in arrivals) / len(arrivals)
        scale = min(MAX_WALL_RPS / peak, MAX_WALL_TOKENS_PER_S / (peak * mean_output))
        if args.time_scale is not None:
            scale = min(scale, args.time_scale)
        summary["traces"][Path(path).name] = {
            "requests": len(arrivals),
            "capacity_rps": round(capacity, 3),
            "slo_ttft_p99_ms": args.slo_ms,
            "time_scale": round(scale, 4),
            "start": window.start,
            "window": "auto: the most prefix reuse" if window.auto else "given",
            "reuse_share": None if window.reuse is None else round(window.reuse, 4),
            "repeats": repeats,
        }
        if window.reuse is None:
            notes.append(f"{Path(path).name} names no prompt blocks: no reuse to find, its window starts at the start.")
        scales[path], capacities[path] = scale, capacity
    for run in runs:
        path, load, policy = run.trace, run.load, run.policy
        name = f"{policy.replace(':', '-').replace(' ', '-')}-{load}-r{run.repeat}"
        workdir = workroot / Path(path).stem / name
        rate = load * capacities[path]
        row = _run_one(
            path, requests, policy, load, rate, len(fleet), profile, scales[path], run.seed, starts[path], workdir
        )
        row |= {"repeat": run.repeat, "seed": run.seed, "start": starts[path]}
        rows.append(row)
        bar.step(f"{Path(path).name} {policy} load {load} #{run.repeat}: TTFT p99 {row['ttft_p99_ms']} ms")
    bar.done()
    slo_missing = [t for t, info in summary["traces"].items() if info["slo_ttft_p99_ms"] is None]
    for trace in slo_missing:  # default SLO: twice the best TTFT p99 at the lowest load run
        lowest = min(loads)
        best = min(
            (r["ttft_p99_ms"] for r in rows if r["trace"] == trace and r["load"] == lowest and r["ttft_p99_ms"]),
            default=None,
        )
        summary["traces"][trace]["slo_ttft_p99_ms"] = None if best is None else round(2 * best, 1)
    summary["aggregate"] = aggregate(rows)
    if all(info["slo_ttft_p99_ms"] is not None for info in summary["traces"].values()):
        add_goodput(summary["aggregate"], summary)  # on the means over the repetitions
    summary["workdir"] = str(workroot)
    return rows, summary


def _unavailable(name: str) -> str | None:
    if name.startswith(_OURS):
        return None
    from inferlb.bench.peers import PEERS, available

    peer = next(p for p in PEERS if p.name == name)
    return available(peer)


def _run_one(
    trace: str,
    requests: int,
    policy: str,
    load: float,
    rate: float,
    servers: int,
    profile: str,
    scale: float,
    seed: int,
    start: int,
    workdir: Path,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    sim_args = ("--profile", profile, "--time-scale", str(scale), "--seed", str(seed))
    processes: list[ManagedProcess] = []
    stack: LocalStack | None = None
    try:
        if policy.startswith(_OURS):
            kind, name = policy.split(":", 1)
            envoy = (
                EnvoyOptions(access_log_path=None, picker=False, fallback_lb_policy=name)
                if kind == "envoy"
                else EnvoyOptions(access_log_path=None)
            )
            # On a mixed fleet the picker is told each server's profile and the profiles' relative speeds
            # (pool.speeds), as an operator would declare them.
            fleet = fleet_of(profile, servers)
            labels: tuple[dict[str, str], ...] = ()
            speeds: dict[str, Any] | None = None
            if kind != "envoy" and len({p.name for p in fleet}) > 1:
                hints = declared_hints(fleet)
                labels = tuple({PROFILE_LABEL: p.name} for p in fleet)
                speeds = {"label": hints.label, "relative": dict(hints.relative)}
            options = StackOptions(
                backends=servers,
                endpoint_labels=labels,
                speeds=speeds,
                models=(MODEL,),
                policy=name if kind != "envoy" else "least-request",
                profile=profile,
                time_scale=scale,
                sim_args=("--seed", str(seed)),
                envoy=envoy,
                envoy_concurrency=1,
                picker_log_level="warning",
                # The picker times the responses itself (the servers send no spans here): its latency scorer and
                # the servers' learned speeds have data, as in a deployment without a span pipeline.
                latency_source="stream",
                kv_events="map" if kind == "inferlb-kv-events" else None,
            )
            stack = LocalStack(options, workdir).start()
            endpoints, url = stack.endpoints, stack.gateway_url
            router = stack.picker
            watched = [p for p in (stack.envoy, stack.picker, stack.backends) if p is not None]
        else:
            from inferlb.bench.peers import PEERS, start_peer

            endpoints = [f"127.0.0.1:{free_port()}" for _ in range(servers)]
            peer = next(p for p in PEERS if p.name == policy)
            # Dynamo's KV router follows the servers' KV events, as it does vLLM's.
            events = free_ports(servers) if peer.kind == "dynamo" else 0
            event_args = ("--kv-events-port", str(events)) if events else ()
            # vllm-router's cache_aware mode asks every worker to render every request; real vLLM answers
            # that only with --enable-scale-out, so the peer is measured as it would be deployed.
            backends = start_sim(
                endpoints, workdir / "backends.log", *sim_args, *event_args, "--model", MODEL, "--enable-scale-out"
            )
            processes.append(backends)
            listen = f"127.0.0.1:{free_port()}"
            helpers: list[ManagedProcess] = []
            ports = [events + i for i in range(servers)] if events else []
            router = start_peer(
                peer, endpoints, listen, workdir, kv_events_ports=ports, profile=profile, helpers=helpers
            )
            processes += [router, *helpers]
            url = f"http://{listen}"
            watched = [router, *helpers, backends]
        return measure(trace, requests, policy, load, rate, url, endpoints, router, watched, scale, workdir, start)
    finally:
        if stack is not None:
            stack.stop()
        stop_all(processes)


def measure(
    trace: str,
    requests: int,
    policy: str,
    load: float,
    rate: float,
    url: str,
    endpoints: Sequence[str],
    router: ManagedProcess | None,
    watched: Sequence[ManagedProcess],
    scale: float,
    workdir: Path,
    start: int = 0,
) -> dict[str, Any]:
    """Replay requests ``start`` .. ``start + requests`` of ``trace`` through ``url`` at ``rate`` (model time) and
    return the run's results.json row; the servers at ``endpoints`` must be fresh (their counters are read)."""
    out = workdir / "records.jsonl"
    argv = [
        sys.executable, "-m", "inferlb.bench.loadgen",
        "--trace", trace, "--start", str(start), "--requests", str(requests), "--rate", str(rate),
        "--time-scale", str(scale), "--url", url, "--model", MODEL, "--out", str(out),
    ]  # fmt: skip
    cpu_before = {p.pid: cpu_seconds(p.pid) for p in watched if p.pid}
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(argv, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    loadgen_cpu = (children.ru_utime - children_before.ru_utime) + (children.ru_stime - children_before.ru_stime)
    cpu = {p.pid: cpu_seconds(p.pid) - cpu_before[p.pid] for p in watched if p.pid}
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    outcomes = [
        Outcome(
            server=r["server"],
            arrival_s=r["at"],
            ttft_s=r["ttft_s"],
            e2e_s=r["e2e_s"],
            output_tokens=r["tokens"],
            error=_error(r),
            shed=r["status"] == 429,
        )
        for r in records
    ]
    hits = queries = 0.0
    busy: list[float] = []
    served: list[int] = []  # each server's finished requests, by its own log
    for address in endpoints:
        reading = read_vllm(httpx.get(f"http://{address}/metrics", timeout=10).content, histograms=False)
        hits += reading.prefix_cache_hits or 0
        queries += reading.prefix_cache_queries or 0
        log = httpx.get(f"http://{address}/admin/requests", timeout=10).json()
        busy.append(float(log.get("busy_s", 0.0)))
        served.append(len(log.get("requests", ())))
    figures = summarise(outcomes, busy, hits, queries)
    router_cpu = cpu.get(router.pid) if router is not None and router.pid else None
    total_cpu = sum(cpu.values()) + loadgen_cpu
    return {
        "trace": Path(trace).name,
        "mode": "live",
        "policy": policy,
        "load": load,
        "rate_rps": round(rate, 3),
        **figures,
        "picker_cpu_us": None if router_cpu is None else round(router_cpu / max(len(records), 1) * 1e6, 1),
        "cores_used": round(total_cpu / wall, 2) if wall > 0 else None,
        "wall_s": round(wall, 1),
        "servers": len(endpoints),
        "server_requests": served,
        "_ttft_s": [o.ttft_s for o in outcomes if o.ttft_s is not None and o.error is None],
    }


def _error(record: dict[str, Any]) -> str | None:
    if record["status"] == 429:
        return None  # shed by admission control: a deliberate answer, counted as shed
    if record["status"] == 200 and record["error"] is None:
        return None
    return record["error"] or f"status {record['status']}"
