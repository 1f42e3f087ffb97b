"""What the picker saves by running its helper threads under SCHED_BATCH (`inferlb.threads`): the same pickers,
the do-nothing floor and inferlb with the ``default`` preset, with their helper threads (gRPC's poller and event
engine) under SCHED_BATCH, as they run, and set back to the normal policy, in the same run.

    inferlb bench helperthreads --out bench/results

The hop benchmark's gateways and backends (`bench.hop`); the policy is switched from outside, on the running
pickers' threads, between runs. Rounds interleave the policies and the pickers in rotating order, each run with
its stack alone (the others paused). Per concurrency, request kind, picker and policy: picker CPU per request (all
rounds' CPU over all their requests), requests a second, and the median round's p50 and p99.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from inferlb.bench.hop import MODEL, POLICY, Variant, alone, machine, measure, start_backends
from inferlb.bench.report import table, write
from inferlb.bench.stats import median
from inferlb.envoyconf import EnvoyOptions
from inferlb.stack import LocalStack, StackOptions
from inferlb.threads import set_policy

__all__ = ["POLICIES", "add_arguments", "run", "summarise"]

POLICIES = (("batch", os.SCHED_BATCH), ("normal", os.SCHED_OTHER)) if hasattr(os, "SCHED_BATCH") else ()
PICKERS = ("noop", "inferlb")
KINDS = (("body", "/v1/completions", True), ("headers", "/v1/embeddings", False))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measured run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs per picker, policy and concurrency, interleaved")


def run(args: argparse.Namespace) -> int:
    if not POLICIES:
        print("thread scheduling policies are Linux's: nothing to compare", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="inferlb-helperthreads-"))
    print(f"working files in {workdir}", flush=True)
    started = datetime.now(UTC)
    backends = start_backends(4, workdir)
    stacks: dict[str, LocalStack] = {}
    rows: list[dict[str, Any]] = []
    try:
        common = StackOptions(servers=tuple(backends.addresses), models=(MODEL,), envoy_concurrency=1)
        no_log = EnvoyOptions(access_log_path=None)
        noop = (sys.executable, "-m", "inferlb.bench.noop_picker")
        stacks["noop"] = LocalStack(replace(common, envoy=no_log, picker_command=noop), workdir / "noop")
        ours = replace(common, envoy=no_log, policy=POLICY, picker_log_level="warning")
        stacks["inferlb"] = LocalStack(ours, workdir / "inferlb")
        for stack in stacks.values():
            stack.start()
        for concurrency in args.concurrency:
            for kind, path, body in KINDS:
                for r in range(args.rounds):
                    policies = POLICIES[r % 2 :] + POLICIES[: r % 2]
                    pickers = PICKERS[r % 2 :] + PICKERS[: r % 2]
                    for policy_name, policy in policies:
                        for name in pickers:
                            stack = stacks[name]
                            assert stack.picker is not None and stack.picker.pid is not None
                            set_policy(stack.picker.pid, policy, skip=stack.picker.pid)  # all but the event loop's
                            with alone(stacks, name):
                                row = measure(
                                    stack, Variant(f"{name} {kind}", name, path, body), concurrency, args.duration
                                )
                            cpu = row.picker_cpu_us or 0.0
                            print(f"  c={concurrency:<3} {kind:<7} {policy_name:<6} {name:<7} {cpu:6.0f} µs/req")
                            rows.append(
                                {**asdict(row), "picker": name, "kind": kind, "policy": policy_name, "round": r}
                            )
    finally:
        for stack in stacks.values():
            stack.stop()
        backends.process.stop()
    results = {"meta": machine(args.command, started), "rows": rows, "summary": summarise(rows)}
    report = _markdown(results)
    write(args.out, "helperthreads", results, report)
    print(report)
    return 0


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, kind, picker and policy: CPU per request over all its runs, requests a second over all
    their seconds, the median run's p50 and p99; and, on the batch rows, each figure over the normal policy's."""
    groups: dict[tuple[int, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["concurrency"], row["kind"], row["picker"], row["policy"]), []).append(row)
    found: dict[tuple[int, str, str, str], dict[str, Any]] = {}
    for (concurrency, kind, picker, policy), runs in groups.items():
        requests = sum(r["requests"] for r in runs)
        found[concurrency, kind, picker, policy] = {
            "concurrency": concurrency,
            "kind": kind,
            "picker": picker,
            "policy": policy,
            "runs": len(runs),
            "picker_cpu_us": sum(r["picker_cpu_us"] * r["requests"] for r in runs) / max(requests, 1),
            "rps": sum(r["rps"] for r in runs) / len(runs),
            "p50_ms": median([r["p50_ms"] for r in runs]),
            "p99_ms": median([r["p99_ms"] for r in runs]),
        }
    for (concurrency, kind, picker, policy), entry in found.items():
        normal = found.get((concurrency, kind, picker, "normal"))
        if policy == "batch" and normal is not None:
            for key in ("picker_cpu_us", "rps", "p50_ms", "p99_ms"):
                entry[f"{key}_to_normal"] = entry[key] / normal[key] if normal[key] else None
    return sorted(found.values(), key=lambda e: (e["concurrency"], e["kind"], e["picker"], e["policy"]))


def _markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out = [
        "# The picker's helper threads: SCHED_BATCH against the normal policy",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['cpus']} CPUs ({meta['cpu_model']}) · Python {meta['python']}",
        "",
        "The hop benchmark's stacks (wrk, the gateway Envoy, the picker, a backend Envoy on the same cores): the",
        f"do-nothing floor (noop) and inferlb (`{POLICY}`), each with its helper threads (gRPC's poller and event",
        "engine) under SCHED_BATCH, as they run, and set back to the normal policy; interleaved rounds, each run",
        "with its stack alone. CPU per request is over all the rounds' runs, req/s their mean, p50 and p99 the",
        "median run's. The last columns are batch over normal.",
        "",
    ]
    rows = []
    for e in results["summary"]:
        ratios = [e.get(f"{k}_to_normal") for k in ("picker_cpu_us", "rps", "p50_ms", "p99_ms")]
        rows.append(
            [
                e["concurrency"],
                e["kind"],
                e["picker"],
                e["policy"],
                f"{e['picker_cpu_us']:.0f}",
                f"{e['rps']:.0f}",
                f"{e['p50_ms']:.2f}",
                f"{e['p99_ms']:.2f}",
                *(None if r is None else f"{r:.2f}x" for r in ratios),
            ]
        )
    head = ["concurrency", "request", "picker", "threads", "picker CPU µs/req", "req/s", "p50 ms", "p99 ms"]
    head += ["CPU", "req/s", "p50", "p99"]
    out += table(head, rows, "rlll" + "r" * 8)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from inferlb.bench.suites import script

    sys.exit(script(sys.modules[__name__]))
