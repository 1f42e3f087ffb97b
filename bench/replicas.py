"""Picker replicas, live: one picker beside two that share their routing state through Redis and two that share
nothing, on the same workload through the same real Envoy and emulated servers, and two sharing ones whose Redis
is killed and restarted mid-run.

    inferlb bench replicas [--trace FILE] [--requests N] [--load F] [--servers N] [--out DIR]

Each run starts fresh emulated servers (no run inherits another's warm caches) and replays the first requests
of a shared-prefix trace (Mooncake's conversation trace by default) open-loop at ``--load`` of the fleet's
capacity. The prefix-cache hit rate is the servers' own (their vLLM counters); TTFT is the client's. Two pickers
that share nothing keep ``inflight: {end: stream}`` (each then learns the ends of its own requests); sharing ones
keep the default access log, whose entries for the other replica's requests pass through Redis. Results:
``replicas.json`` and ``replicas.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench.desrun import DesJob, capacity_rps, load_arrivals, replicated_name, run_job
from inferlb.bench.exchangecost import RATE, exchange_rows
from inferlb.bench.liverun import MAX_WALL_RPS, MAX_WALL_TOKENS_PER_S, measure
from inferlb.bench.load import cpu_seconds
from inferlb.bench.metrics import picker_samples
from inferlb.bench.quotaload import B_RPS, BURST_S, PHASE_S, quota_rows
from inferlb.bench.redisserver import RedisServer, redis_server
from inferlb.bench.report import header, table, write
from inferlb.bench.workersload import CONCURRENCY, throughput_rows, worker_ratios
from inferlb.envoyconf import EnvoyOptions
from inferlb.sim.profiles import PROFILES, get_profile
from inferlb.stack import LocalStack, StackOptions

__all__ = ["RUNS", "Setup", "add_arguments", "run"]

# The default workload: chats that share long system prompts (GROUPS of them, PREFIX_BLOCKS Mooncake blocks of
# 512 tokens each), each request a group's prefix and a block of its own, the group drawn at random. The first
# requests of the real Mooncake trace share only their first block, which every router caches alike.
GROUPS = 48
PREFIX_BLOCKS = 16
OUTPUT_TOKENS = 64
MODEL = "bench-model"
PUBLISH_INTERVAL_MS = 5.0
RESYNC_TIMEOUT_S = 30.0
MODES = ("live", "des", "throughput", "quota", "exchange")


@dataclass(frozen=True, slots=True)
class Setup:
    """One live run: how many pickers, and whether they share their state through Redis."""

    name: str
    pickers: int
    shared: bool
    redis_restart: bool = False


RUNS = (
    Setup("1 picker", 1, False),
    Setup("2 pickers, shared", 2, True),
    Setup("2 pickers, unshared", 2, False),
    Setup("2 pickers, shared, Redis restarted", 2, True, redis_restart=True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="a trace file (default: chats sharing long system prompts, made here)")
    parser.add_argument("--requests", type=int, default=300, help="requests replayed from the trace's start")
    parser.add_argument("--load", type=float, default=0.7, help="the offered rate, a fraction of the fleet's capacity")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES))
    parser.add_argument("--policy", default="default", help="the pickers' preset")
    parser.add_argument("--runs", nargs="+", choices=[s.name for s in RUNS], help="which runs (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="live: the runs without a fault this many times")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="live: the runs above; des: the simulator's replica model; throughput: 1 and 2 workers; quota: a tenant "
        "over its quota beside one under it, across two replicas; exchange: its CPU per decision (default: all)",
    )
    parser.add_argument("--throughput-rounds", type=int, default=3, help="throughput: rounds of the three runs")
    parser.add_argument("--throughput-duration", type=float, default=8.0, help="throughput: seconds per run")
    parser.add_argument("--quota-phase", type=float, default=PHASE_S, help="quota: seconds per phase")
    parser.add_argument("--des-requests", type=int, default=1500, help="the simulator's requests per run")
    parser.add_argument("--des-servers", type=int, default=8, help="the simulator's fleet")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="inferlb-bench-replicas-") as folder:
        if args.trace is None:
            trace = Path(folder) / "shared-prefix-chats.jsonl"
            shared_prefix_trace(trace, args.requests, seed=args.seed)
        else:
            trace = Path(args.trace)
            if not trace.is_file():
                print(f"inferlb bench replicas: error: trace file not found: {trace}")
                return 2
        return _run_all(args, trace, Path(folder))


def shared_prefix_trace(path: Path, requests: int, *, groups: int = GROUPS, seed: int = 0) -> None:
    """Write ``requests`` chats in Mooncake's trace format: a random one of ``groups`` shared prefixes of
    PREFIX_BLOCKS blocks, then a block of the request's own; one request every 100 ms (the replay rescales)."""
    rng = random.Random(seed)
    lines = []
    for i in range(requests):
        group = rng.randrange(groups)
        blocks = [1 + group * PREFIX_BLOCKS + k for k in range(PREFIX_BLOCKS)] + [1_000_000 + i]
        row = {
            "timestamp": i * 100,
            "input_length": 512 * len(blocks),
            "output_length": OUTPUT_TOKENS,
            "hash_ids": blocks,
        }
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _run_all(args: argparse.Namespace, trace: Path, folder: Path) -> int:
    meta = header(args.command)
    rows = _live(args, trace, folder, meta) if "live" in args.modes else []
    if "des" in args.modes:
        rows += _des(args, folder)
    if "throughput" in args.modes:
        print("throughput at 1 and 2 workers ...", flush=True)
        rows += throughput_rows(
            folder / "throughput",
            rounds=args.throughput_rounds,
            duration_s=args.throughput_duration,
            policy=args.policy,
        )
    document: dict[str, Any] = {"meta": meta, "runs": rows}
    if "quota" in args.modes:
        print("tenant quotas across two replicas ...", flush=True)
        quota, summary = quota_rows(folder / "quota", phase_s=args.quota_phase)
        rows += quota
        document["quota"] = summary
    if "exchange" in args.modes:
        print("the exchange's CPU per decision ...", flush=True)
        exchange, medians = exchange_rows(folder / "exchange")
        rows += exchange
        document["exchange_cpu_us"] = medians
    ratios = worker_ratios([r for r in rows if r["mode"] == "throughput"])
    if ratios is not None:
        document["workers_2_over_1"] = ratios
    write(args.out, "replicas", document, _markdown(document))
    return 0


DES_REPLICAS = (2, 4, 8)
DES_DELAYS_MS: tuple[float | None, ...] = (0.0, 5.0, 50.0, None)  # None: unsynced


def _des(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """The simulator's replica model (bench/policies.py `Replicated`): quality against replica count and sync delay,
    on the same kind of workload (12 shared prompts per server), through the routing unit Envoy's requests take."""
    profile = get_profile(args.profile)
    trace = folder / "des-chats.jsonl"
    if args.trace is None:
        shared_prefix_trace(trace, args.des_requests, groups=12 * args.des_servers, seed=args.seed)
    else:
        trace = Path(args.trace)
    arrivals = load_arrivals(str(trace), args.des_requests, profile.block_size)
    rate = args.load * capacity_rps(arrivals, profile, args.seed) * args.des_servers
    grid = [(1, 0.0)] + [(n, d) for n in DES_REPLICAS for d in DES_DELAYS_MS]
    rows = []
    for count, delay_ms in grid:
        name = replicated_name(args.policy, count, delay_ms)
        job = DesJob(str(trace), args.des_requests, args.des_servers, profile.name, name, args.load, rate, args.seed)
        row = run_job(job, arrivals)
        row.pop("_ttft_s", None)
        shared = delay_ms is not None and count > 1
        row.update({"replicas": count, "shared": shared, "sync_delay_ms": delay_ms if shared else None})
        row["policy"] = f"{count} picker{'s' if count > 1 else ''}" + (
            "" if count == 1 else ", unsynced" if delay_ms is None else f", sync {delay_ms:g} ms"
        )
        rows.append(row)
        print(
            f"  des {row['policy']}: prefix hit rate {row['prefix_hit_rate']}, TTFT p99 {row['ttft_p99_ms']} ms",
            flush=True,
        )
    return rows


def _live(args: argparse.Namespace, trace: Path, folder: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    profile = get_profile(args.profile)
    arrivals = load_arrivals(str(trace), args.requests, profile.block_size)
    capacity = capacity_rps(arrivals, profile, args.seed) * args.servers
    rate = args.load * capacity
    mean_output = sum(a.output_tokens for a in arrivals) / len(arrivals)
    scale = min(MAX_WALL_RPS / rate, MAX_WALL_TOKENS_PER_S / (rate * mean_output))
    setups = [s for s in RUNS if not args.runs or s.name in args.runs]
    rows = []
    # Rounds: the runs without a fault again, in turn (the machine's noise moves between them, not within a
    # round's comparison); the Redis restart once, last.
    plan = [(r, s) for r in range(1, args.rounds + 1) for s in setups if not s.redis_restart or r == args.rounds]
    for round_number, setup in plan:
        workdir = folder / f"{round_number}-{setup.name.replace(' ', '-').replace(',', '')}"
        row = _run(setup, args, trace, rate, scale, workdir)
        row["round"] = round_number
        rows.append(row)
        print(
            f"  round {round_number}, {setup.name}: prefix hit rate {row['prefix_hit_rate']}, TTFT p99 "
            f"{row['ttft_p99_ms']} ms, {row['errors']} errors",
            flush=True,
        )
    prompts = f"shared-prefix chats ({GROUPS} prompts of {PREFIX_BLOCKS * 512} tokens)"
    meta.update(
        {
            "trace": trace.name if args.trace else prompts,
            "requests": args.requests,
            "load": args.load,
            "rate_rps": round(rate, 3),
            "time_scale": round(scale, 4),
            "servers": args.servers,
            "policy": args.policy,
        }
    )
    return rows


def _run(
    setup: Setup, args: argparse.Namespace, trace: Path, rate: float, scale: float, workdir: Path
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    with redis_server(workdir / "redis") as redis:
        secret = workdir / "redis-password"
        secret.write_text(redis.password, encoding="utf-8")
        picker_config: dict[str, Any] = {}
        if setup.shared:
            picker_config["replicas"] = {"url": redis.url, "password": {"token_file": str(secret)}}
        elif setup.pickers > 1:
            picker_config["inflight"] = {"end": "stream"}
        options = StackOptions(
            backends=args.servers,
            models=(MODEL,),
            policy=args.policy,
            profile=args.profile,
            time_scale=scale,
            sim_args=("--seed", str(args.seed)),
            envoy=EnvoyOptions(access_log_path=None),
            envoy_concurrency=1,
            picker_log_level="warning",
            pickers=setup.pickers,
            # The same secret hash seed on every replica: their prefix hashes agree (scorer/replicas.py).
            picker_env={"PYTHONHASHSEED": str(secrets.randbelow(2**32 - 1) + 1)},
            picker_config=picker_config,
        )
        with LocalStack(options, workdir / "stack") as stack:
            _wait_ready(stack)
            pickers = [p for p in (stack.picker, *stack.replicas) if p is not None]
            cpu_before = [cpu_seconds(p.pid) for p in pickers]
            fault = _RedisFault(redis, stack, args.requests / rate / scale) if setup.redis_restart else None
            if fault is not None:
                fault.start()
            watched = [p for p in (stack.envoy, *pickers, stack.backends) if p is not None]
            row = measure(
                trace.as_posix(), args.requests, setup.name, args.load, rate, stack.gateway_url, stack.endpoints,
                None, watched, scale, workdir,
            )  # fmt: skip
            if fault is not None:
                fault.join()
            picker_cpu = sum(cpu_seconds(p.pid) - before for p, before in zip(pickers, cpu_before, strict=True))
            shared = _shared_stats(stack) if setup.shared else None
    row.pop("_ttft_s", None)
    row.update(
        {
            "mode": "live",
            "replicas": setup.pickers,
            "shared": setup.shared,
            "sync_delay_ms": PUBLISH_INTERVAL_MS if setup.shared else None,
            "picker_cpu_us": round(picker_cpu / max(row["requests"], 1) * 1e6, 1),
            "redis_restart": fault.report() if fault is not None else None,
            "exchange": shared,
        }
    )
    return row


RUNS_WINDOW = (1 / 3, 1 / 2)  # Redis is killed a third of the way into the replay and started again halfway


class _RedisFault(threading.Thread):
    """Kills Redis a third of the way into the replay, starts it again (empty) halfway, and measures how long the
    replicas take to be in touch again and to count each other (their /metrics)."""

    def __init__(self, redis: RedisServer, stack: LocalStack, duration_s: float) -> None:
        super().__init__(daemon=True)
        self.redis, self.stack, self.duration_s = redis, stack, duration_s
        self.down_s: float | None = None
        self.resync_s: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            started = time.monotonic()
            time.sleep(self.duration_s * RUNS_WINDOW[0])  # a scheduled fault, not a wait for readiness
            self.redis.stop()
            killed = time.monotonic()
            time.sleep(max(self.duration_s * RUNS_WINDOW[1] - (killed - started), 0.5))
            self.redis.start()
            restarted = time.monotonic()
            self.down_s = round(restarted - killed, 2)
            deadline = restarted + RESYNC_TIMEOUT_S
            while not all(_gauge(url, "inferlb_replicas_redis_up") == 1 and _gauge(url, "inferlb_replicas_peers") == 1
                          for url in self.stack.picker_admin_urls):  # fmt: skip
                if time.monotonic() > deadline:
                    self.error = f"not resynchronised within {RESYNC_TIMEOUT_S} s"
                    return
                time.sleep(0.01)
            self.resync_s = round(time.monotonic() - restarted, 3)
        except Exception as exc:  # reported in the results, not lost in a thread
            self.error = f"{type(exc).__name__}: {exc}"

    def report(self) -> dict[str, Any]:
        return {"down_s": self.down_s, "resync_s": self.resync_s, "error": self.error}


def _gauge(url: str, name: str) -> float | None:
    return picker_samples(url, name).get("")


def _wait_ready(stack: LocalStack, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for url in stack.picker_admin_urls:
        while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the picker at {url} was not ready within {timeout_s} s")
            time.sleep(0.05)


def _shared_stats(stack: LocalStack) -> dict[str, float]:
    """The exchange's counters, summed over the replicas."""
    out: dict[str, float] = {}
    for url in stack.picker_admin_urls:
        for kind, value in picker_samples(url, "inferlb_replicas_entries_total").items():
            out[kind] = out.get(kind, 0.0) + value
    return out


def _markdown(document: dict[str, Any]) -> str:
    meta, rows = document["meta"], document["runs"]
    out = ["# Picker replicas", "", f"{meta['date']} · `{meta['command']}` · {meta['machine']}", ""]
    live = [r for r in rows if r["mode"] == "live"]
    des = [r for r in rows if r["mode"] == "des"]
    throughput = [r for r in rows if r["mode"] == "throughput"]
    if live:
        out += _live_markdown(meta, live)
    if des:
        out += _des_markdown(des)
    if throughput:
        out += _throughput_markdown(throughput, document.get("workers_2_over_1"))
    quota = [r for r in rows if r["mode"] == "quota"]
    if quota:
        out += _quota_markdown(quota, document["quota"])
    exchange = [r for r in rows if r["mode"] == "exchange"]
    if exchange:
        out += [
            "## The exchange's CPU",
            "",
            f"In process: one replica and a real Redis, {RATE:g} decisions a second (each with a 1 KB prompt's "
            "blocks), against the same feed with no exchange; rounds in turn. µs of CPU per decision that the "
            "exchange adds.",
            "",
            *table(
                ["round", "publishing interval ms", "feed alone µs/decision", "exchange µs/decision"],
                [[r["round"], r["sync_delay_ms"], r["feed_cpu_us"], r["exchange_cpu_us"]] for r in exchange],
            ),
            "",
            "Median: " + ", ".join(f"{k}: {v:g} µs" for k, v in document["exchange_cpu_us"].items()) + ".",
            "",
        ]
    return "\n".join(out) + "\n"


def _quota_markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    out = [
        "## Tenant quotas across two replicas",
        "",
        f"Two picker replicas behind one real Envoy share tenant buckets in a real Redis. Tenant a's quota is "
        f"{summary['a_tokens_per_minute']:g} tokens a minute (a burst of {BURST_S:g} s; a request counts "
        f"{summary['request_tokens']:g} tokens as the picker counts them). Tenant b (far under its quota) sends "
        f"{B_RPS:g} requests a second in three phases: alone, with a sending just under its quota, and with a asking "
        "for four times its quota (its burst spent just before: what it gets admitted is about its rate, as in the "
        "phase before); each phase on a fresh gateway. TTFT: the client's, of streamed answers.",
        "",
    ]
    head = ["phase", "tenant", "requests", "admitted", "429", "other errors", "TTFT p50 ms", "TTFT p99 ms"]
    keys = ("requests", "admitted", "refused_429", "errors", "ttft_p50_ms", "ttft_p99_ms")
    out += table(head, [[r["phase"], r["tenant"], *(r[k] for k in keys)] for r in rows])
    out += [
        "",
        f"Tenant a: {summary['a_admitted_tokens']:g} tokens admitted of {summary['a_asked_tokens']:g} asked; its "
        f"bucket allows {summary['a_allowed_tokens']:g} from the burst on: error {summary['limit_error'] * 100:+.1f}%. "
        f"Tenant b: {summary['b_refused']} refused; with a over its quota, b's TTFT p50 is "
        f"{summary['b_ttft_p50_ratio']}x and p99 {summary['b_ttft_p99_ratio']}x of b's with a within its quota "
        f"(the same admitted load), p99 {summary['b_ttft_p99_ratio_to_alone']}x of b's alone.",
        "",
    ]
    return out


def _throughput_markdown(rows: list[dict[str, Any]], ratios: dict[str, float] | None) -> list[str]:
    out = [
        "## Throughput: 1 and 2 workers (`inferlb serve --workers N`)",
        "",
        f"wrk, {CONCURRENCY} connections, closed loop, buffered-body completions through real Envoy (2 worker "
        "threads) to backends that cost next to nothing, everything on this machine (wrk, both Envoys, the pickers "
        "and Redis share its cores). Picker CPU: all its workers' processes, per request; cores: picker CPU "
        "seconds per second.",
        "",
    ]
    head = ["round", "run", "workers", "Redis", "req/s", "p50 ms", "p99 ms", "picker CPU µs/req", "picker cores",
            "Envoy CPU µs/req", "errors"]  # fmt: skip
    keys = ("throughput_rps", "p50_ms", "p99_ms", "picker_cpu_us", "picker_cores", "envoy_cpu_us", "errors")
    out += table(
        head,
        [[r["round"], r["policy"], r["workers"], "yes" if r["shared"] else "no", *(r[k] for k in keys)] for r in rows],
    )
    if ratios is not None:
        out += [
            "",
            f"Two workers over one (median over rounds): requests/s {ratios['throughput']:.2f}x, picker CPU per "
            f"request {ratios['cpu_per_request']:.2f}x.",
        ]
    return [*out, ""]


def _live_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "## Live: real Envoy, emulated servers, real Redis",
        "",
        f"{meta['requests']} requests of {meta['trace']}, open-loop at {meta['load']} of {meta['servers']} emulated "
        f"servers' capacity ({meta['rate_rps']} req/s in model time, time scale {meta['time_scale']}), preset "
        f"`{meta['policy']}`, through one real Envoy; fresh servers for every run. Prefix hit rate: the servers' own "
        "counters. Sharing replicas exchange state through a real Redis (AUTH on). Picker CPU: all the pickers' CPU "
        "over the run (scrapes and the exchange included) per request.",
        "",
    ]
    head = ["round", "run", "replicas", "shared", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms",
            "throughput rps", "errors", "picker CPU µs/req"]  # fmt: skip
    keys = ("prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "throughput_rps", "errors", "picker_cpu_us")
    body = [
        [r.get("round", 1), r["policy"], r["replicas"], "yes" if r["shared"] else "no", *(r[k] for k in keys)]
        for r in rows
    ]
    out += table(head, body)
    out.append("")
    for against, label in (("1 picker", "one picker"), ("2 pickers, unshared", "two that share nothing")):
        ratios = _round_ratios(rows, "2 pickers, shared", against)
        if ratios:
            hits = ", ".join(f"{h:.3f}x" for h, _ in ratios)
            p99s = ", ".join(f"{p:.3f}x" for _, p in ratios)
            out.append(
                f"Two sharing replicas against {label}, per round: prefix hit rate {hits} (median "
                f"{statistics.median(h for h, _ in ratios):.3f}x); TTFT p99 {p99s} (median "
                f"{statistics.median(p for _, p in ratios):.3f}x)."
            )
    for r in rows:
        fault = r.get("redis_restart")
        if fault:
            out.append(
                f"Redis killed a third of the way in and started again (empty) after {fault['down_s']} s: "
                f"{r['errors']} client errors; the replicas were in touch and counting each other again "
                f"{fault['resync_s']} s after the restart" + (f" ({fault['error']})" if fault["error"] else "") + "."
            )
    return [*out, ""]


def _des_markdown(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    out = [
        "## Simulator: the replica model",
        "",
        f"{first['requests']} requests of chats sharing {12 * first['servers']} long prompts on {first['servers']} "
        f"simulated servers at {first['load']} of their capacity; each of N replicas (the routing unit Envoy's "
        "requests take, its own counts and prefix index) gets the arrivals in turn and sees the others' in-flight "
        "counts and routed prompts as they were the sync delay earlier (unsynced: never). Each cell: prefix hit "
        "rate / TTFT p99 ms.",
        "",
    ]
    delays = [d for d in DES_DELAYS_MS]
    head = ["replicas", *("unsynced" if d is None else f"sync {d:g} ms" for d in delays)]
    body = []
    for count in sorted({r["replicas"] for r in rows}):
        cells = []
        for delay in delays:
            if count == 1:  # one picker has nothing to sync: its figure stands in the first column
                row = rows[0] if delay == delays[0] and rows[0]["replicas"] == 1 else None
            else:
                row = next((r for r in rows if r["replicas"] == count and r["sync_delay_ms"] == delay), None)
            cells.append(None if row is None else f"{row['prefix_hit_rate']} / {row['ttft_p99_ms']}")
        body.append([count, *cells])
    out += table(head, body)
    return [*out, ""]


def _round_ratios(rows: list[dict[str, Any]], run: str, against: str) -> list[tuple[float, float]]:
    """Per round: (prefix hit rate, TTFT p99) of ``run`` over ``against``'s in the same round."""
    out = []
    for number in sorted({r.get("round", 1) for r in rows}):
        a = next((r for r in rows if r["policy"] == run and r.get("round", 1) == number), None)
        b = next((r for r in rows if r["policy"] == against and r.get("round", 1) == number), None)
        if a and b and a["prefix_hit_rate"] and b["prefix_hit_rate"] and a["ttft_p99_ms"] and b["ttft_p99_ms"]:
            out.append((a["prefix_hit_rate"] / b["prefix_hit_rate"], a["ttft_p99_ms"] / b["ttft_p99_ms"]))
    return out


if __name__ == "__main__":
    import sys

    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
