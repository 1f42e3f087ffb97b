"""What the picker hop adds: Envoy + inferlb (the ``default`` preset, what users run) against Envoy alone
(ROUND_ROBIN) and against Envoy + a do-nothing ext_proc server (the floor), over the same backends, in the same
run, at several concurrencies.

    inferlb bench hop --out bench/results [--quick]

The backends are one Envoy answering with a fixed completion on several ports, so they cost next to nothing;
the load is wrk (closed loop, one connection per concurrent client). Per variant and concurrency it reports
req/s, latency p50/p90/p99, and the CPU time per request of the picker process and of the gateway Envoy; per
inferlb variant and concurrency, its picker CPU per request over the floor's (``cpu_ratio_to_floor``). It also
measures inferlb's own per-request work in process (no gRPC), and samples the picker with py-spy under load to
show where its time goes, and the floor's, round robin's and the default's pickers with perf (where it may) to split
their CPU by library: the kernel, gRPC's core, the interpreter, numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
import jinja2
from prometheus_client.parser import text_string_to_metric_families

from inferlb.bench import micro, perfprof, pyspy
from inferlb.bench.load import LoadResult, cpu_seconds, run_wrk
from inferlb.bench.report import cpu_model, header, table, write
from inferlb.bench.stats import median
from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import ManagedProcess, find_tool, free_port, http_ok
from inferlb.sim.metrics import CONTENT_TYPE, VllmMetrics
from inferlb.stack import LocalStack, StackOptions

__all__ = [
    "BODY",
    "MODEL",
    "POLICY",
    "VARIANTS",
    "Backends",
    "Variant",
    "add_arguments",
    "alone",
    "backend_metrics",
    "cpu_ratio_rounds",
    "cpu_ratio_to_floor",
    "machine",
    "measure",
    "run",
    "start_backends",
    "weights_to_envoy",
]

POLICY = "default"  # the preset every inferlb variant runs
MODEL = "bench-model"
PROMPT = "Summarise the following text. " * 33  # ~1 KB of prompt, a typical chat turn
BODY = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 64})
COMPLETION = json.dumps(
    {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": "ok"}]}
)


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    # which stack serves it: "envoy" (no picker), "noop", "inferlb", "inferlb-rr", "inferlb-timed", "inferlb-held"
    gateway: str
    path: str
    body: bool


VARIANTS = (
    Variant("envoy-rr headers", "envoy", "/v1/embeddings", False),
    Variant("noop headers", "noop", "/v1/embeddings", False),
    Variant("inferlb headers", "inferlb", "/v1/embeddings", False),
    Variant("envoy-rr body", "envoy", "/v1/completions", True),
    Variant("noop body", "noop", "/v1/completions", True),
    Variant("inferlb body", "inferlb", "/v1/completions", True),
    # The round-robin preset: the whole routing path (parse, admission, lease, access-log end, decision log) with
    # the cheapest pick, to split inferlb's CPU over the floor into that path and the default preset's scoring.
    Variant("inferlb rr headers", "inferlb-rr", "/v1/embeddings", False),
    Variant("inferlb rr body", "inferlb-rr", "/v1/completions", True),
    # otel.latency_source: stream: a second, observing ext_proc stream per request times the response.
    Variant("inferlb body timed", "inferlb-timed", "/v1/completions", True),
    # inflight.end: stream: the routing stream stays open for the whole request (no access log), the behaviour
    # before the access log ended the count.
    Variant("inferlb body held", "inferlb-held", "/v1/completions", True),
)

# The weights tier (Envoy's own LEAST_REQUEST over the weights the picker pushes, EDS over ADS, no hop) against
# Envoy alone, with its default round robin and with the same least-request policy: measured apart from the
# table above, in rounds of one run each, back to back and in rotating order, so that a ratio is taken between
# runs a few seconds apart and drift on a noisy machine moves all three alike.
TIER = (("envoy", "envoy-rr"), ("envoy-lr", "envoy-lr"), ("inferlb-weights", "inferlb weights"))
KINDS = (("headers", "/v1/embeddings", False), ("body", "/v1/completions", True))
IDLE_S = 10.0  # seconds over which each picker's CPU with no request coming is measured


@dataclass(slots=True)
class Row:
    variant: str
    concurrency: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    requests: int
    picker_cpu_us: float | None
    envoy_cpu_us: float
    # inferlb's own figure for the run: the mean time of one decision (Engine.decide + the lease), µs, from the
    # picker's pick histogram (inferlb_pick_seconds); None for the pickers that keep none.
    pick_us: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per measured run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant and concurrency, interleaved")
    parser.add_argument("--tier-rounds", type=int, default=4, help="rounds of the weights tier against Envoy alone")
    parser.add_argument("--quick", action="store_true", help="2 s runs, no profile")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count the CPU instructions of one request through the stream handler (the floor's, round robin's"
        " and the default's; in process, under valgrind's callgrind: a figure the machine's load does not move)",
    )


def run(args: argparse.Namespace) -> int:
    duration = 2.0 if args.quick else args.duration
    workdir = Path(tempfile.mkdtemp(prefix="inferlb-hop-"))  # configs, logs and the raw profile
    print(f"working files in {workdir}", flush=True)
    started = datetime.now(UTC)

    print("in-process per-request work (no gRPC) ...", flush=True)
    own = {
        "headers": micro.per_request_us(micro.make_service(args.backends, POLICY), with_body=False),
        "body": micro.per_request_us(micro.make_service(args.backends, POLICY), with_body=True),
        "decide": {n: micro.decide_us(n, POLICY) for n in (8, 64, 1024)},
        "decide_cold": {policy: micro.decide_cold_us(policy) for policy in ("round-robin", "least-request", POLICY)},
    }
    if args.instructions:
        print("instructions per request through the stream handler (callgrind) ...", flush=True)
        own["instructions"] = handler_instructions(200 if args.quick else 1000)

    backends = start_backends(args.backends, workdir)
    stacks: dict[str, LocalStack] = {}
    try:
        common = StackOptions(servers=tuple(backends.addresses), models=(MODEL,), envoy_concurrency=1)
        no_log = EnvoyOptions(access_log_path=None)
        stacks["envoy"] = LocalStack(
            replace(common, envoy=EnvoyOptions(access_log_path=None, picker=False, fallback_lb_policy="ROUND_ROBIN")),
            workdir / "envoy",
        )
        stacks["envoy-lr"] = LocalStack(
            replace(common, envoy=EnvoyOptions(access_log_path=None, picker=False, fallback_lb_policy="LEAST_REQUEST")),
            workdir / "envoy-lr",
        )
        noop = (sys.executable, "-m", "inferlb.bench.noop_picker")
        stacks["noop"] = LocalStack(replace(common, envoy=no_log, picker_command=noop), workdir / "noop")
        ours = replace(common, envoy=no_log, policy=POLICY, picker_log_level="warning")
        stacks["inferlb"] = LocalStack(ours, workdir / "inferlb")
        stacks["inferlb-rr"] = LocalStack(replace(ours, policy="round-robin"), workdir / "inferlb-rr")
        stacks["inferlb-timed"] = LocalStack(replace(ours, latency_source="stream"), workdir / "inferlb-timed")
        held = replace(ours, picker_config={"inflight": {"end": "stream"}})
        stacks["inferlb-held"] = LocalStack(held, workdir / "inferlb-held")
        weights = EnvoyOptions(access_log_path=None, xds=True, tier="weights")
        stacks["inferlb-weights"] = LocalStack(replace(ours, envoy=weights), workdir / "inferlb-weights")
        for stack in stacks.values():
            stack.start()
        # What each picker spends with no request coming (inferlb scrapes its servers; the floor does nothing): a
        # share of every request's CPU figure below, larger where fewer requests come.
        idle = {}
        for name in ("noop", "inferlb", "inferlb-rr"):
            with alone(stacks, name):
                idle[name] = _idle_cpu(stacks[name], IDLE_S)
        print("  picker CPU while idle, ms/s: " + ", ".join(f"{k} {v:.1f}" for k, v in idle.items()), flush=True)
        rows = []
        round_rows: list[dict[str, Any]] = []  # every run, with its round
        repeats = 1 if args.quick else args.repeats
        for concurrency in args.concurrency:
            runs: dict[str, list[Row]] = {v.name: [] for v in VARIANTS}
            for r in range(repeats):
                # Rotate the order between rounds so that drift on a noisy machine does not favour one variant.
                shift = (r * 2 + concurrency) % len(VARIANTS)
                for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                    with alone(stacks, variant.gateway):
                        row = measure(stacks[variant.gateway], variant, concurrency, duration)
                    print(f"  c={concurrency:<3} {variant.name:<18} {row.rps:8.0f} req/s  p50 {row.p50_ms:.2f} ms")
                    runs[variant.name].append(row)
                    round_rows.append({**asdict(row), "round": r})
            rows += [_combine(runs[v.name]) for v in VARIANTS]
        tier_rounds = 1 if args.quick else args.tier_rounds
        tier_rows = _tier_runs(stacks, args.concurrency, duration / 2 if not args.quick else duration, tier_rounds)
        profile = None
        native: dict[str, Any] = {"skipped": "--quick"}
        if not args.quick:
            with alone(stacks, "inferlb"):
                profile = _profile(stacks["inferlb"], workdir, duration=10.0)
            native = _native_split(
                stacks, workdir, NATIVE_AT if NATIVE_AT in args.concurrency else max(args.concurrency)
            )
    finally:
        for stack in stacks.values():
            stack.stop()
        backends.process.stop()

    table_rows = [asdict(r) for r in rows]
    results = {
        "meta": machine(args.command, started),
        "own_work": own,
        "rows": table_rows,
        "cpu_ratio_to_floor": cpu_ratio_to_floor(table_rows),
        "round_rows": round_rows,
        "idle_cpu_ms_per_s": idle,
        "cpu_ratio_rounds": cpu_ratio_rounds(round_rows),
        "tier_rows": tier_rows,
        "weights_to_envoy": weights_to_envoy(tier_rows),
        "profile": profile,
        "native_profile": native,
    }
    report = _markdown(results)
    write(args.out, "hop", results, report)
    print(report)
    return 0


def _tier_runs(
    stacks: dict[str, LocalStack], concurrencies: Sequence[int], duration: float, rounds: int
) -> list[dict[str, Any]]:
    """The runs behind ``weights_to_envoy``: per concurrency, kind of request and round, one run of each of
    ``TIER``, the order rotated from round to round."""
    out = []
    for concurrency in concurrencies:
        for kind, path, body in KINDS:
            for r in range(rounds):
                for gateway, name in TIER[r % len(TIER) :] + TIER[: r % len(TIER)]:
                    with alone(stacks, gateway):
                        row = measure(
                            stacks[gateway], Variant(f"{name} {kind}", gateway, path, body), concurrency, duration
                        )
                    print(f"  c={concurrency:<3} {row.variant:<24} {row.rps:8.0f} req/s  p50 {row.p50_ms:.2f} ms")
                    out.append({**asdict(row), "round": r})
    return out


def weights_to_envoy(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """The weights tier against Envoy alone, per kind of request and concurrency (a string key), from the rounds
    of ``_tier_runs``: the CPU per request (Envoy's plus the picker's, which only pushes weights) over Envoy
    alone's, and the p50 over its, taken within each round; the median over rounds (``cpu``, ``p50`` against
    round robin, ``*_vs_least_request`` against Envoy alone with the same policy), with the lowest and highest
    round. A round without both runs is left out."""
    by = {(r["variant"], r["concurrency"], r.get("round", 0)): r for r in rows}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind, _, _ in KINDS:
        for concurrency in sorted({r["concurrency"] for r in rows}):
            ratios: dict[str, list[float]] = {}
            for r in sorted({key[2] for key in by}):
                ours = by.get((f"inferlb weights {kind}", concurrency, r))
                for baseline, suffix in (("envoy-rr", ""), ("envoy-lr", "_vs_least_request")):
                    alone = by.get((f"{baseline} {kind}", concurrency, r))
                    if not (ours and alone and alone["envoy_cpu_us"] and alone["p50_ms"]):
                        continue
                    cpu = ours["envoy_cpu_us"] + (ours["picker_cpu_us"] or 0.0)
                    ratios.setdefault("cpu" + suffix, []).append(cpu / alone["envoy_cpu_us"])
                    ratios.setdefault("p50" + suffix, []).append(ours["p50_ms"] / alone["p50_ms"])
            if "cpu" not in ratios:
                continue
            entry: dict[str, Any] = {name: round(_median(values), 3) for name, values in ratios.items()}
            entry["rounds"] = len(ratios["cpu"])
            entry["cpu_range"] = [round(min(ratios["cpu"]), 3), round(max(ratios["cpu"]), 3)]
            entry["p50_range"] = [round(min(ratios["p50"]), 3), round(max(ratios["p50"]), 3)]
            out.setdefault(kind, {})[str(concurrency)] = entry
    return out


def cpu_ratio_to_floor(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per inferlb variant, per concurrency (a string key, as in JSON): its picker CPU per request over the
    do-nothing picker's for the same kind of request at the same concurrency, in the same run. A pair without
    both figures is left out."""
    by = {(r["variant"], r["concurrency"]): r for r in rows}
    ratios: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        if not variant.gateway.startswith("inferlb"):
            continue
        floor_name = "noop body" if variant.body else "noop headers"
        for concurrency in sorted({r["concurrency"] for r in rows}):
            ours, floor = by.get((variant.name, concurrency)), by.get((floor_name, concurrency))
            if ours and floor and ours["picker_cpu_us"] and floor["picker_cpu_us"]:
                ratio = round(ours["picker_cpu_us"] / floor["picker_cpu_us"], 3)
                ratios.setdefault(variant.name, {})[str(concurrency)] = ratio
    return ratios


def cpu_ratio_rounds(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``cpu_ratio_to_floor`` taken within each round of the interleaved runs (``rows``: one per run, with its
    ``round``), per variant and concurrency: the median over rounds, the lowest and highest round, and how many
    rounds. How far apart the rounds are is how much one run's ratio can be trusted on this machine."""
    by = {(r["variant"], r["concurrency"], r["round"]): r for r in rows}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant in VARIANTS:
        if not variant.gateway.startswith("inferlb"):
            continue
        floor_name = "noop body" if variant.body else "noop headers"
        for concurrency in sorted({r["concurrency"] for r in rows}):
            ratios = []
            for r in sorted({key[2] for key in by}):
                ours, floor = by.get((variant.name, concurrency, r)), by.get((floor_name, concurrency, r))
                if ours and floor and ours["picker_cpu_us"] and floor["picker_cpu_us"]:
                    ratios.append(ours["picker_cpu_us"] / floor["picker_cpu_us"])
            if ratios:
                out.setdefault(variant.name, {})[str(concurrency)] = {
                    "median": round(_median(ratios), 3),
                    "range": [round(min(ratios), 3), round(max(ratios), 3)],
                    "rounds": len(ratios),
                }
    return out


@dataclass
class Backends:
    process: ManagedProcess
    addresses: list[str]


def backend_metrics() -> str:
    """What the backends answer ``GET /metrics`` with: a vLLM exposition (the emulator's rendering) of a server with
    two requests running, none waiting and 10% of its KV cache in use, that has served a few. Fixed: what it gives the
    picker is fresh signals to score with on every scrape, and the scrape's cost, as a real fleet does."""
    metrics = VllmMetrics(MODEL, block_size=16, num_gpu_blocks=8192, max_num_seqs=256, max_num_batched_tokens=8192)
    for _ in range(20):
        metrics.record_finished(
            queue_s=0.001,
            ttft_s=0.02,
            e2e_s=0.3,
            prefill_s=0.02,
            decode_s=0.28,
            prompt_tokens=300,
            generation_tokens=64,
        )
    metrics.set_state(2, 0, 0.1)
    return metrics.render().decode()


def start_backends(count: int, workdir: Path) -> Backends:
    """``count`` backends that cost next to nothing: one Envoy answering ``GET /metrics`` with `backend_metrics` and
    every other request with COMPLETION."""
    ports = [free_port() for _ in range(count)]
    admin = free_port()
    template = files("inferlb.bench").joinpath("backends.yaml.j2").read_text(encoding="utf-8")
    text = (
        jinja2.Environment(undefined=jinja2.StrictUndefined)
        .from_string(template)
        .render(ports=ports, admin_port=admin, body=COMPLETION, metrics=backend_metrics(), metrics_type=CONTENT_TYPE)
    )
    path = workdir / "backends.yaml"
    path.write_text(text, encoding="utf-8")
    argv = [find_tool("envoy"), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]
    process = ManagedProcess("backend envoy", argv, workdir / "backends.log").start()
    process.wait_ready(http_ok(f"http://127.0.0.1:{admin}/ready"), 30, "ready")
    return Backends(process, [f"127.0.0.1:{p}" for p in ports])


@contextlib.contextmanager
def alone(stacks: dict[str, LocalStack], measured: str) -> Iterator[None]:
    """Every stack but ``measured`` paused (SIGSTOP) meanwhile. Idle, each inferlb picker still scrapes the backends
    ten times a second (17-22 ms of CPU a second each; `_idle_cpu`), and its Envoy keeps its timers: five of them
    took about a tenth of a core beside the stack being measured, on its two cores and in its caches. The shared
    backends keep running."""
    others = [stack for name, stack in stacks.items() if name != measured]
    for stack in others:
        stack.pause()
    try:
        yield
    finally:
        for stack in others:
            stack.resume()


def measure(stack: LocalStack, variant: Variant, concurrency: int, duration: float) -> Row:
    url = stack.gateway_url + variant.path
    method, body = ("POST", BODY) if variant.body else ("GET", "")
    run_wrk(url, connections=concurrency, duration_s=1.0, method=method, body=body)  # warm-up
    picker_pid = stack.picker.pid if stack.picker else None
    envoy_pid = stack.envoy.pid if stack.envoy else 0
    picks_before = _picks(stack)
    picker_before = cpu_seconds(picker_pid) if picker_pid else 0.0
    envoy_before = cpu_seconds(envoy_pid)
    result: LoadResult = run_wrk(url, connections=concurrency, duration_s=duration, method=method, body=body)
    picker_cpu = (cpu_seconds(picker_pid) - picker_before) if picker_pid else None
    envoy_cpu = cpu_seconds(envoy_pid) - envoy_before
    picks_after = _picks(stack)
    pick_us = None
    if picks_before is not None and picks_after is not None and picks_after[1] > picks_before[1]:
        pick_us = (picks_after[0] - picks_before[0]) / (picks_after[1] - picks_before[1]) * 1e6
    n = max(result.requests, 1)
    return Row(
        variant=variant.name,
        concurrency=concurrency,
        rps=result.rps,
        p50_ms=result.p50_us / 1000,
        p90_ms=result.p90_us / 1000,
        p99_ms=result.p99_us / 1000,
        errors=result.errors,
        requests=result.requests,
        picker_cpu_us=None if picker_cpu is None else picker_cpu / n * 1e6,
        envoy_cpu_us=envoy_cpu / n * 1e6,
        pick_us=pick_us,
    )


COUNTED = ("noop", "round-robin", POLICY)  # the pickers whose stream handler `--instructions` counts


def handler_instructions(counted: int) -> dict[str, dict[str, float]]:
    """Per picker of `COUNTED` and request kind, the CPU instructions of one request through the stream handler
    (`micro.handler_instructions`), the counts run side by side on the machine's CPUs."""
    jobs = [(policy, kind) for policy in COUNTED for kind in ("headers", "body")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = pool.map(lambda job: micro.handler_instructions(job[0], job[1] == "body", counted), jobs)
        found: dict[str, dict[str, float]] = {}
        for (policy, kind), value in zip(jobs, counts, strict=True):
            found.setdefault(policy, {})[kind] = round(value)
    return found


def _idle_cpu(stack: LocalStack, seconds: float) -> float:
    """The picker's CPU milliseconds per second over ``seconds`` in which no request comes."""
    assert stack.picker is not None and stack.picker.pid is not None
    before = cpu_seconds(stack.picker.pid)
    time.sleep(seconds)  # the measurement's window, not a wait for readiness
    return (cpu_seconds(stack.picker.pid) - before) / seconds * 1000


def _picks(stack: LocalStack) -> tuple[float, float] | None:
    """(seconds, decisions) of inferlb's pick histogram so far; None for a stack without inferlb's picker."""
    if stack.picker is None or stack.options.picker_command:
        return None
    text = httpx.get(f"{stack.picker_admin_url}/metrics", headers=stack.admin_headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "inferlb_pick_seconds":
            found = {sample.name: sample.value for sample in family.samples}
            return found["inferlb_pick_seconds_sum"], found["inferlb_pick_seconds_count"]
    raise ValueError("the picker's /metrics has no inferlb_pick_seconds")


def _combine(runs: list[Row]) -> Row:
    """One row from repeated runs: totals for throughput and CPU, the median run for each latency figure."""
    requests = sum(r.requests for r in runs)
    seconds = sum(r.requests / r.rps for r in runs if r.rps)
    pickers = [r.picker_cpu_us * r.requests for r in runs if r.picker_cpu_us is not None]
    picks = [(r.pick_us, r.requests) for r in runs if r.pick_us is not None]
    return Row(
        variant=runs[0].variant,
        concurrency=runs[0].concurrency,
        rps=requests / seconds if seconds else 0.0,
        p50_ms=_median([r.p50_ms for r in runs]),
        p90_ms=_median([r.p90_ms for r in runs]),
        p99_ms=_median([r.p99_ms for r in runs]),
        errors=sum(r.errors for r in runs),
        requests=requests,
        picker_cpu_us=sum(pickers) / requests if pickers else None,
        envoy_cpu_us=sum(r.envoy_cpu_us * r.requests for r in runs) / requests,
        pick_us=sum(us * n for us, n in picks) / sum(n for _, n in picks) if picks else None,
    )


def _median(values: list[float]) -> float:
    found = median(values)
    if found is None:
        raise ValueError("no run to combine: --repeats must be >= 1")
    return found


def _profile(stack: LocalStack, workdir: Path, duration: float) -> dict[str, Any] | None:
    if stack.picker is None:
        return None
    raw = workdir / "pyspy-inferlb-body.txt"
    sampler = pyspy.start(stack.picker.pid, duration, raw)
    if sampler is None:
        print("py-spy not installed: no profile", flush=True)
        return None
    time.sleep(0.5)  # py-spy attaches; the load below is what it samples
    run_wrk(stack.gateway_url + "/v1/completions", connections=16, duration_s=duration - 1, method="POST", body=BODY)
    sampler.wait(duration + 30)
    if sampler.returncode != 0 or not raw.exists():
        print(f"py-spy failed (exit {sampler.returncode}): no profile", flush=True)
        return None
    return pyspy.summarise(raw)


NATIVE_AT = 16  # the concurrency at which perf splits the pickers' CPU (body requests), if the run has it
NATIVE_PICKERS = (("noop", "floor"), ("inferlb-rr", "round robin"), ("inferlb", POLICY))
NATIVE_S = 6.0  # seconds of load per picker sampled


def _native_split(stacks: dict[str, LocalStack], workdir: Path, concurrency: int) -> dict[str, Any]:
    """The floor's, round robin's and the default's picker CPU per request split by library (`perfprof`), each
    stack alone under the same load (body requests at ``concurrency``); ``{"skipped": why}`` where perf cannot."""
    why = perfprof.unavailable()
    if why is not None:
        print(f"{why}: no split by library", flush=True)
        return {"skipped": why}
    found: dict[str, Any] = {}
    for name, label in NATIVE_PICKERS:
        stack = stacks[name]
        assert stack.picker is not None and stack.picker.pid is not None
        data = workdir / f"perf-{name}.data"
        # The record covers the warm-up second of `measure` and its run: the shares are of the same load.
        sampler = perfprof.record(stack.picker.pid, NATIVE_S + 1.0, data)
        with alone(stacks, name):
            row = measure(stack, Variant(f"{name} body", name, "/v1/completions", True), concurrency, NATIVE_S)
        # A perf that fails or hangs costs this section only, not the run's other results.
        try:
            sampler.wait(NATIVE_S + 60)
            if sampler.returncode != 0 or not data.exists():
                raise RuntimeError(f"perf record exited {sampler.returncode}")
            parts = perfprof.by_part(perfprof.shares(data))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            sampler.kill()
            sampler.wait()
            why = f"perf failed for the {label} picker: {exc}"
            print(f"{why}: no split by library", flush=True)
            return {"skipped": why}
        cpu = row.picker_cpu_us or 0.0
        found[name] = {
            "label": label,
            "picker_cpu_us": cpu,
            "requests": row.requests,
            "share": parts,
            "us_per_request": {part: share * cpu for part, share in parts.items()},
        }
    return {"concurrency": concurrency, "request": "body", "pickers": found}


def machine(command: str, started: datetime) -> dict[str, Any]:
    envoy_version = subprocess.run([find_tool("envoy"), "--version"], capture_output=True, text=True).stdout.strip()
    return {
        **header(command, started),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "envoy": envoy_version.split("version:")[-1].strip(),
        "policy": POLICY,
    }


def _split(
    by: dict[tuple[str, int], dict[str, Any]],
    concurrencies: list[int],
    policy: str,
    cold: dict[str, float] | None,
    idle: dict[str, float] | None = None,
) -> list[str]:
    """Where inferlb's picker CPU over the floor goes: the routing path (what the round-robin preset costs over
    the floor) and the scoring of ``policy`` (what it costs over round-robin); with ``idle`` (each picker's CPU
    ms/s with no request coming), the share of ``policy``'s figure that its background work (the scrapes) makes at
    that run's request rate. Empty for runs without the round-robin variants."""
    rows: list[list[object]] = []
    for c in concurrencies:
        for kind in ("headers", "body"):
            floor, rr, ours = (by.get((name, c)) for name in (f"noop {kind}", f"inferlb rr {kind}", f"inferlb {kind}"))
            if not (floor and rr and ours and floor["picker_cpu_us"] and rr["picker_cpu_us"] and ours["picker_cpu_us"]):
                continue
            base, path, full = floor["picker_cpu_us"], rr["picker_cpu_us"], ours["picker_cpu_us"]
            added = [f"{path - base:+.0f}", f"{full - path:+.0f}"]
            picks = [rr.get("pick_us"), ours.get("pick_us")]
            shown = "—" if None in picks else f"{picks[0]:.0f}, {picks[1]:.0f}"
            row: list[object] = [c, kind, f"{base:.0f}", *added, shown, f"{path / base:.2f}x", f"{full / base:.2f}x"]
            if idle and "inferlb" in idle:
                row.append(f"{idle['inferlb'] * 1000 / ours['rps']:.0f}" if ours.get("rps") else None)
            rows.append(row)
    if not rows:
        return []
    out = ["", "## Where inferlb's picker CPU over the floor goes (same run)", ""]
    out += [
        "The round-robin preset runs the whole routing path (parse, admission, lease, access-log end, decision",
        f"log) with the cheapest pick; what `{policy}` costs beyond it is its filters and scorers. The pick",
        "column is the picker's own mean time per decision (`Engine.decide` + the lease, from its",
        "`inferlb_pick_seconds` histogram) during the same runs, round-robin then the default: under load it is",
        "several times the in-process figures below, and it accounts for most of the scoring's share.",
        "",
    ]
    head = ["concurrency", "request", "floor µs/req", "routing path µs", f"{policy} scoring µs", "pick µs rr, default"]
    head += ["round-robin/floor", f"{policy}/floor"]
    if idle and "inferlb" in idle:
        shown_idle = ", ".join(f"{name} {ms:.1f}" for name, ms in idle.items())
        out += [
            "With no request coming (inferlb scrapes its servers ten times a second; the floor does nothing) the",
            f"pickers spend, in CPU ms a second: {shown_idle}. The last column is that background work's share",
            f"of `{policy}`'s figure at that run's request rate: part of what it costs over the floor.",
            "",
        ]
        head.append(f"{policy} idle µs/req")
    out += table(head, rows, "rlrrrrrr" + "r" * (len(head) - 8))
    if cold:
        out += [
            "",
            "Under load the picker shares its core with Envoy and the load, so each pick runs with its caches cold:",
            "`Engine.decide` + the in-flight count on 4 endpoints, p50 µs, with the CPU caches evicted before each",
            "pick (`micro.decide_cold_us`; the warm figures are in the next section):",
            "",
        ]
        out += table(["preset", "caches evicted µs"], ([p, f"{us:.1f}"] for p, us in cold.items()), "lr")
    return out


def _ratio(entry: dict[str, Any], name: str) -> str:
    """A median ratio with its lowest and highest round, where the entry has them."""
    span = entry.get(f"{name}_range")
    shown = f"{entry[name]:.2f}x"
    return f"{shown} ({span[0]:.2f} to {span[1]:.2f})" if span else shown


def _tier_section(tier: dict[str, dict[str, dict[str, Any]]], rows: Sequence[dict[str, Any]]) -> list[str]:
    """The weights tier against Envoy alone: the ratios of ``weights_to_envoy`` and the medians of the runs."""
    if not tier:
        return []
    out = ["", "## The weights tier against Envoy alone (same run, paired rounds)", ""]
    out += [
        "Every /v1/ route goes to Envoy's own LEAST_REQUEST over the endpoint weights the picker pushes over ADS:",
        "no ext_proc hop. Envoy alone has no picker, round robin (its default) or least request (the tier's own",
        "policy). Each round runs the three back to back, in rotating order; a ratio is taken within a round and",
        "the median over rounds is shown, with the lowest and highest round. CPU is Envoy's per request plus the",
        "picker's (which only scrapes the servers and pushes weights).",
        "",
    ]
    ratio_rows = []
    for kind, per in tier.items():
        for c, v in sorted(per.items(), key=lambda item: int(item[0])):
            cpu_lr, p50_lr = v.get("cpu_vs_least_request"), v.get("p50_vs_least_request")
            ratio_rows.append(
                [
                    int(c),
                    kind,
                    _ratio(v, "cpu"),
                    _ratio(v, "p50"),
                    "—" if cpu_lr is None else f"{cpu_lr:.2f}x",
                    "—" if p50_lr is None else f"{p50_lr:.2f}x",
                    v.get("rounds", 1),
                ]
            )
    head = ["concurrency", "request", "CPU / Envoy rr", "p50 / Envoy rr", "CPU / Envoy lr", "p50 / Envoy lr", "rounds"]
    out += table(head, ratio_rows, "rlrrrrr")
    if rows:
        grouped: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for r in rows:
            grouped.setdefault((r["concurrency"], r["variant"]), []).append(r)
        run_rows = [
            [
                c,
                name,
                f"{_median([r['rps'] for r in runs]):.0f}",
                f"{_median([r['p50_ms'] for r in runs]):.3f}",
                f"{_median([r['envoy_cpu_us'] for r in runs]):.1f}",
                f"{_median([r['picker_cpu_us'] for r in runs]):.1f}" if runs[0]["picker_cpu_us"] is not None else "—",
                sum(r["errors"] for r in runs),
            ]
            for (c, name), runs in sorted(grouped.items())
        ]
        out += ["", "Medians of the rounds:", ""]
        out += table(
            ["concurrency", "variant", "req/s", "p50 ms", "Envoy CPU µs/req", "picker CPU µs/req", "errors"],
            run_rows,
            "rlrrrrr",
        )
    return out


def _instructions_section(counts: dict[str, dict[str, float]] | None) -> list[str]:
    """The stream handler's CPU instructions per request (``--instructions``); empty for runs without them."""
    if not counts or "noop" not in counts:
        return []
    out = [
        "",
        "CPU instructions per request through the stream handler, counted by valgrind's callgrind (the same",
        "requests in process, on a clock of their own: the count is the same on every run; `--instructions`),",
        "the do-nothing picker's (the floor) beside inferlb's:",
        "",
    ]
    names = [name for name in counts if name != "noop"]
    head = ["request", "noop", *names, *(f"{name} - noop" for name in names)]
    rows = []
    for kind in ("headers", "body"):
        floor = counts["noop"][kind]
        rows.append(
            [kind, f"{floor:,.0f}", *(f"{counts[n][kind]:,.0f}" for n in names)]
            + [f"{counts[n][kind] - floor:+,.0f}" for n in names]
        )
    return out + table(head, rows)


def _markdown(results: dict[str, Any]) -> str:
    meta, own, rows = results["meta"], results["own_work"], results["rows"]
    policy = meta.get("policy", "least-request")  # the preset of the results made before the key
    out = [
        "# Picker hop cost",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['cpus']} CPUs ({meta['cpu_model']}) · Python {meta['python']}"
        f" · Envoy {meta['envoy']}",
        "",
        "Everything on one machine: wrk (1 thread), the gateway Envoy (1 worker), the picker (1 process), the",
        "backend Envoy (1 worker). Latency is wrk's, client to client; CPU is per request, from /proc. Every",
        f"inferlb variant runs the `{policy}` preset; noop is the do-nothing picker (the floor). Each run has the",
        "machine to its stack and the backends: the other stacks are paused (SIGSTOP) meanwhile.",
        "",
    ]
    head = ["concurrency", "variant", "req/s", "p50 ms", "p90 ms", "p99 ms", "picker CPU µs/req", "Envoy CPU µs/req"]
    out += table(
        [*head, "errors"],
        (
            [
                r["concurrency"],
                r["variant"],
                f"{r['rps']:.0f}",
                f"{r['p50_ms']:.2f}",
                f"{r['p90_ms']:.2f}",
                f"{r['p99_ms']:.2f}",
                None if r["picker_cpu_us"] is None else f"{r['picker_cpu_us']:.0f}",
                f"{r['envoy_cpu_us']:.0f}",
                r["errors"],
            ]
            for r in rows
        ),
        "rlrrrrrrr",
    )
    ratios = results.get("cpu_ratio_to_floor", {})
    rounds = results.get("cpu_ratio_rounds", {})
    by = {(r["variant"], r["concurrency"]): r for r in rows}
    concurrencies = sorted({r["concurrency"] for r in rows})
    floor_rows = []
    for c in concurrencies:
        for kind in ("headers", "body"):
            base, noop, ours = (by.get((f"{g} {kind}", c)) for g in ("envoy-rr", "noop", "inferlb"))
            ratio = ratios.get(f"inferlb {kind}", {}).get(str(c))
            if not (base and noop and ours and ratio):
                continue
            added = f"{noop['p50_ms'] - base['p50_ms']:+.2f}, {ours['p50_ms'] - base['p50_ms']:+.2f}"
            each = rounds.get(f"inferlb {kind}", {}).get(str(c))
            spread = "—" if each is None else f"{each['range'][0]:.2f} to {each['range'][1]:.2f} ({each['rounds']})"
            floor_rows.append([c, kind, f"{ratio:.2f}x", spread, added])
    out += ["", f"## inferlb ({policy}) against the floor (same run)", ""]
    if rounds:
        out += [
            "The ratio is over all the runs of each; the rounds column takes it within each round of the interleaved",
            "runs (lowest to highest, and how many rounds): the spread is the machine's noise.",
            "",
        ]
    head = [
        "concurrency",
        "request",
        "picker CPU inferlb/noop",
        "within each round",
        "p50 added vs Envoy alone: noop, inferlb (ms)",
    ]
    out += table(head, floor_rows, "rlrll")
    out += _split(by, concurrencies, policy, own.get("decide_cold"), results.get("idle_cpu_ms_per_s"))
    out += _tier_section(results.get("weights_to_envoy", {}), results.get("tier_rows", []))
    out += ["", "## What timing responses in the filter costs (otel.latency_source: stream, same run)", ""]
    out += [
        "The picker times each response from a second ext_proc stream that Envoy feeds in observability mode",
        "(request headers, response headers, the first body chunk; then the picker closes it). Envoy never",
        "waits on that stream, so latency should move little; the price is the picker's CPU per request.",
        "",
    ]
    timed_rows = []
    for c in concurrencies:
        plain, timed = by.get(("inferlb body", c)), by.get(("inferlb body timed", c))
        if not (plain and timed and plain["picker_cpu_us"] and timed["picker_cpu_us"]):
            continue
        timed_rows.append(
            [
                c,
                f"{plain['picker_cpu_us']:.0f} → {timed['picker_cpu_us']:.0f}",
                f"{timed['picker_cpu_us'] / plain['picker_cpu_us']:.2f}x",
                f"{plain['envoy_cpu_us']:.0f} → {timed['envoy_cpu_us']:.0f}",
                f"{plain['p50_ms']:.2f} → {timed['p50_ms']:.2f}",
            ]
        )
    head = ["concurrency", "picker CPU µs/req untimed → timed", "ratio", "Envoy CPU µs/req untimed → timed"]
    out += table([*head, "p50 ms untimed → timed"], timed_rows, "rlrll")
    out += [
        "",
        "## inferlb's own work per request (in process, no gRPC)",
        "",
        "Protobuf parse of Envoy's messages (the headers our bootstrap forwards), features from headers and body,",
        f"the pick ({policy}, 4 endpoints), the in-flight count, serialising the reply; the best of 40",
        "interleaved runs of 1,000 requests:",
        "",
    ]
    out += table(
        ["request", "inferlb's own work µs", "through the async stream handler µs"],
        [
            ["headers only", f"{own['headers']['own']:.1f}", f"{own['headers']['handler']:.1f}"],
            ["1 KB JSON body", f"{own['body']['own']:.1f}", f"{own['body']['handler']:.1f}"],
        ],
    )
    out += [""]
    out += table(
        ["endpoints", "Engine.decide + in-flight p50 µs", "p99 µs"],
        ([n, f"{p50:.1f}", f"{p99:.1f}"] for n, (p50, p99) in own["decide"].items()),
        "rrr",
    )
    out += _instructions_section(own.get("instructions"))
    profile = results.get("profile")
    if profile:
        out += ["", f"## Where the picker's CPU goes (py-spy, {profile['samples']} samples, body requests, c=16)", ""]
        out += table(["share of samples", "where"], ([f"{v:.1%}", k] for k, v in profile["by_category"].items()), "rl")
        out += [
            "",
            "py-spy sees Python frames only: native time shows under the last Python frame above it. The event",
            "loop's callbacks and the extra thread run gRPC's Cython/C core; `ExtProcService.Process` at its",
            "`async for` line is gRPC reading the next message.",
            "",
        ]
        out += table(["self time", "function"], ([f"{v:.1%}", f"`{f}`"] for f, v in profile["top_self"]), "rl")
        out += [""]
        inclusive = ([f"{v:.1%}", f"`{f}`"] for f, v in profile["top_inferlb_inclusive"])
        out += table(["inclusive", "inferlb function"], inclusive, "rl")
    out += _native_section(results.get("native_profile"))
    return "\n".join(out) + "\n"


def _native_section(native: dict[str, Any] | None) -> list[str]:
    """The pickers' CPU per request by library (`_native_split`), or why it was skipped."""
    if not native:
        return []
    if "skipped" in native:
        return ["", f"The split of the pickers' CPU by library (perf) was skipped: {native['skipped']}."]
    pickers = native["pickers"]
    names = list(pickers)
    floor, default = pickers[names[0]], pickers[names[-1]]
    out = [
        "",
        f"## Where each picker's CPU goes, by library (perf, body requests, c={native['concurrency']})",
        "",
        "perf samples the CPU wherever it runs (py-spy sees only Python frames): µs of CPU per request in each",
        "part, each picker alone under the same load, one run each (so its total is not the table's figure above).",
        "The kernel part is the sockets, epoll and the wake-ups between gRPC's thread and the event loop.",
        "",
    ]
    rows = []
    for part in floor["us_per_request"]:
        each = [pickers[n]["us_per_request"][part] for n in names]
        added = default["us_per_request"][part] - floor["us_per_request"][part]
        rows.append([part, *(f"{v:.0f}" for v in each), f"{added:+.0f}"])
    totals = [pickers[n]["picker_cpu_us"] for n in names]
    rows.append(["all", *(f"{v:.0f}" for v in totals), f"{totals[-1] - totals[0]:+.0f}"])
    head = ["part", *(f"{pickers[n]['label']} µs" for n in names), f"{default['label']} - {floor['label']} µs"]
    return out + table(head, rows, "l" + "r" * (len(names) + 1))


if __name__ == "__main__":
    from inferlb.bench.suites import script

    sys.exit(script(sys.modules[__name__]))
