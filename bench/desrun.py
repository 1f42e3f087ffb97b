"""The simulator half of the routing-quality benchmark: one trace, one fleet, one load, one contender per run.

Contenders are named as in results.json: ``envoy:ROUND_ROBIN``, ``envoy:LEAST_REQUEST``, ``envoy:RANDOM`` (Envoy's
balancers, as Envoy implements them), ``inferlb:<preset>`` (the real scoring engine) and ``oracle`` (exact server
state; the bound). Load is a fraction of the fleet's capacity, measured here by the simulator itself: one server
given a burst of the trace's own requests, all at once, completes them at its saturated rate; the fleet's capacity
is that times the number of servers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferlb.bench.metrics import Outcome, summarise
from inferlb.bench.peermodels import PEER_MODELS, peer_model
from inferlb.bench.policies import (
    LeastRequest,
    Oracle,
    PresetPolicy,
    RandomPolicy,
    Replicated,
    RoundRobin,
    WeightsTier,
)
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.sim.des import Arrival, FleetView, Hold, Policy, Refuse, RequestRecord, SimResult, simulate, trace_arrivals
from inferlb.sim.profiles import ServerProfile, fleet_of
from inferlb.sim.traces import load_trace

__all__ = [
    "DES_CONTENDERS",
    "DesJob",
    "capacity_rps",
    "fleet_capacity_rps",
    "load_arrivals",
    "make_policy",
    "replicated_name",
    "run_job",
    "scaled",
    "sim_figures",
]

DES_CONTENDERS: tuple[str, ...] = (
    "envoy:ROUND_ROBIN",
    "envoy:LEAST_REQUEST",
    "envoy:RANDOM",
    *(f"inferlb:{name}" for name in PRESET_NAMES),
    "inferlb-weights:default",  # the weights tier: Envoy's LEAST_REQUEST over the default preset's weights
    "inferlb-fixed-speed:default",  # the default predicting with one constant prefill rate, learning no speeds
    "inferlb-kv-events:default",  # the default with the servers' KV events: their exact prefix caches
    "inferlb-stream:default",  # the default timing the responses itself: each request's first token is known
    "inferlb-undeclared:default",  # the default with no relative speeds declared (pool.speeds) for its servers
    "oracle",
    *(f"peer-model:{name}" for name in PEER_MODELS),  # the peer routers' policies, modelled (bench/peermodels.py)
)
CAPACITY_SAMPLE = 400  # requests in the burst that measures one server's saturated rate


@dataclass(frozen=True, slots=True)
class DesJob:
    """One simulated run. ``rate_rps`` is the offered load it replays the trace at."""

    trace: str  # path
    requests: int
    servers: int
    profile: str  # one profile's name, or a fleet: PROFILE:COUNT,... (`sim.profiles.fleet_of`)
    policy: str
    load: float
    rate_rps: float
    seed: int
    scrape_interval_s: float = 0.1


def load_arrivals(path: str, requests: int, block_size: int, start: int = 0) -> list[Arrival]:
    """Requests ``start`` .. ``start + requests`` of the trace (its ticks spread evenly), as arrivals; times keep
    the trace's clock (`scaled` rebases them)."""
    trace = load_trace(path, limit=start + requests, spread_ticks=True)
    return trace_arrivals(trace, block_size)[start:]


def scaled(arrivals: Sequence[Arrival], rate_rps: float) -> list[Arrival]:
    """The same requests in the same order and rhythm, time-scaled so that their mean rate is ``rate_rps``."""
    if len(arrivals) < 2:
        return list(arrivals)
    first, last = arrivals[0].at, arrivals[-1].at
    native = (len(arrivals) - 1) / (last - first) if last > first else float("inf")
    factor = native / rate_rps if native != float("inf") else 0.0
    if factor == 0.0:  # every request at one instant: space them evenly instead
        return [replace(a, at=k / rate_rps) for k, a in enumerate(arrivals)]
    return [replace(a, at=(a.at - first) * factor) for a in arrivals]


def capacity_rps(arrivals: Sequence[Arrival], profile: ServerProfile, seed: int) -> float:
    """One server's saturated rate on this request mix: a burst of the first requests, all at time 0."""
    burst = [replace(a, at=0.0) for a in arrivals[:CAPACITY_SAMPLE]]
    result = simulate(burst, lambda _a, _v: 0, [profile], seed=seed)
    done = [r for r in result.records if r.error is None and r.e2e_s is not None]
    makespan = max((r.arrival_s + (r.e2e_s or 0.0) for r in done), default=0.0)
    if not done or makespan <= 0:
        raise RuntimeError("the capacity burst completed nothing; is the profile able to serve these prompts?")
    return len(done) / makespan


def fleet_capacity_rps(arrivals: Sequence[Arrival], fleet: Sequence[ServerProfile], seed: int) -> float:
    """A fleet's saturated rate on this request mix: each server's (`capacity_rps`, measured once per profile)
    summed."""
    each: dict[str, float] = {}
    for profile in fleet:
        if profile.name not in each:
            each[profile.name] = capacity_rps(arrivals, profile, seed)
    return sum(each[p.name] for p in fleet)


class _Timed:
    """Wraps a policy to count the CPU it spends per decision (the picker-CPU figure)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.cpu_s = 0.0
        self.calls = 0

    def __call__(self, arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        started = time.process_time()
        try:
            return self.policy(arrival, view)
        finally:
            self.cpu_s += time.process_time() - started
            self.calls += 1


def make_policy(name: str, profiles: Sequence[ServerProfile], seed: int) -> Policy:
    """The DES policy for a contender name (see the module docstring). ``ValueError`` for an unknown name."""
    if name == "envoy:ROUND_ROBIN":
        return RoundRobin()
    if name == "envoy:LEAST_REQUEST":
        return LeastRequest(seed)
    if name == "envoy:RANDOM":
        return RandomPolicy(seed)
    if name == "oracle":
        return Oracle(profiles)
    if name.startswith("peer-model:") and name.removeprefix("peer-model:") in PEER_MODELS:
        return peer_model(name.removeprefix("peer-model:"), profiles, seed)
    if name.startswith("inferlb-weights:") and name.removeprefix("inferlb-weights:") in PRESET_NAMES:
        return WeightsTier(name.removeprefix("inferlb-weights:"), profiles, seed=seed)
    if name.startswith("inferlb-fixed-speed:") and name.removeprefix("inferlb-fixed-speed:") in PRESET_NAMES:
        return PresetPolicy(name.removeprefix("inferlb-fixed-speed:"), profiles, seed=seed, learn_speeds=False)
    if name.startswith("inferlb-kv-events:") and name.removeprefix("inferlb-kv-events:") in PRESET_NAMES:
        return PresetPolicy(name.removeprefix("inferlb-kv-events:"), profiles, seed=seed, kv_events=True)
    if name.startswith("inferlb-stream:") and name.removeprefix("inferlb-stream:") in PRESET_NAMES:
        return PresetPolicy(name.removeprefix("inferlb-stream:"), profiles, seed=seed, first_tokens=True)
    if name.startswith("inferlb-undeclared:") and name.removeprefix("inferlb-undeclared:") in PRESET_NAMES:
        return PresetPolicy(name.removeprefix("inferlb-undeclared:"), profiles, seed=seed, declared_speeds=False)
    if name.startswith("inferlb:") and name.removeprefix("inferlb:") in PRESET_NAMES:
        return PresetPolicy(name.removeprefix("inferlb:"), profiles, seed=seed)
    replicated = _replicated(name)
    if replicated is not None:
        preset, count, delay, kv_events = replicated
        return Replicated(preset, profiles, seed=seed, replicas=count, sync_delay_s=delay, kv_events=kv_events)
    raise ValueError(f"unknown DES contender {name!r}; known: {', '.join(DES_CONTENDERS)}")


def replicated_name(preset: str, replicas: int, sync_delay_ms: float | None) -> str:
    """The DES contender of ``replicas`` pickers of ``preset`` syncing after ``sync_delay_ms`` (None: unsynced):
    ``inferlb:default@4/5ms``, ``inferlb:default@4/unsynced``."""
    return f"inferlb:{preset}@{replicas}/{'unsynced' if sync_delay_ms is None else f'{sync_delay_ms:g}ms'}"


def _replicated(name: str) -> tuple[str, int, float | None, bool] | None:
    """(preset, replicas, sync delay in seconds or None, whether they follow KV events) of a replicated name:
    ``inferlb:PRESET@N/SYNC`` or ``inferlb-kv-events:PRESET@N/SYNC``."""
    head, _, tail = name.partition("@")
    kv_events = head.startswith("inferlb-kv-events:")
    preset = head.removeprefix("inferlb-kv-events:" if kv_events else "inferlb:")
    count, _, sync = tail.partition("/")
    if head == preset or preset not in PRESET_NAMES or not count.isdigit() or int(count) < 1:
        return None
    if sync == "unsynced":
        return preset, int(count), None, kv_events
    try:
        delay_ms = float(sync.removesuffix("ms")) if sync.endswith("ms") else -1.0
    except ValueError:
        return None
    return (preset, int(count), delay_ms / 1000, kv_events) if 0 <= delay_ms < 60_000 else None


def run_job(job: DesJob, arrivals: Sequence[Arrival] | None = None) -> dict[str, Any]:
    """Simulate one job; its results.json row (plus the raw TTFTs under ``_ttft_s`` for the CDF plot)."""
    profiles = fleet_of(job.profile, job.servers)
    if arrivals is None:
        arrivals = load_arrivals(job.trace, job.requests, profiles[0].block_size)
    policy = make_policy(job.policy, profiles, job.seed)
    timed = _Timed(policy)
    finished: Callable[[RequestRecord, float], None] | None = getattr(policy, "finished", None)
    result = simulate(
        scaled(arrivals, job.rate_rps),
        timed,
        profiles,
        seed=job.seed,
        scrape_interval_s=job.scrape_interval_s,
        on_finish=finished,
    )
    row = _row(job, result)
    # A preset's figure is the routing unit's work per routed request (admission, the decision and the lease; its
    # adapter also rebuilds the snapshot, the collectors' job live), over decisions, not over the adapter's calls:
    # a request held for capacity is presented again at every tick of the wait queue.
    cpu_s = getattr(policy, "decide_cpu_s", timed.cpu_s)
    row["picker_cpu_us"] = round(cpu_s / max(getattr(policy, "decisions", timed.calls), 1) * 1e6, 1)
    if isinstance(
        policy, PresetPolicy | Replicated
    ):  # admission: requests held for capacity, and those that waited out
        row["held"], row["waited_out"] = policy.held, policy.waited_out
    row["wall_s"] = round(result.wall_s, 2)
    row["_ttft_s"] = [r.ttft_s for r in result.records if r.error is None and r.ttft_s is not None]
    return row


def sim_figures(result: SimResult) -> dict[str, Any]:
    """A simulated run's figures, as the live runs report theirs (`inferlb.bench.load.summarise`): latencies,
    throughput, the servers' prefix-cache hit rate, imbalance, errors and shed requests."""
    outcomes = [
        Outcome(
            server=str(r.server),
            arrival_s=r.arrival_s,
            ttft_s=r.ttft_s,
            e2e_s=r.e2e_s,
            output_tokens=r.output_tokens,
            error=None if r.error == "shed" else r.error,
            shed=r.error == "shed",  # admission control refused it (PresetPolicy's Refuse), as a 429 live
        )
        for r in result.records
    ]
    stats = result.servers
    return summarise(
        outcomes,
        [s.busy_s for s in stats],
        sum(s.prefix_cache_hits for s in stats),
        sum(s.prefix_cache_queries for s in stats),
    )


def _row(job: DesJob, result: SimResult) -> dict[str, Any]:
    figures = sim_figures(result)
    return {
        "trace": Path(job.trace).name,
        "mode": "des",
        "policy": job.policy,
        "load": job.load,
        "rate_rps": round(job.rate_rps, 3),
        **figures,
        "servers": job.servers,
        "profile": job.profile,
        "policy_errors": result.policy_errors,
    }
