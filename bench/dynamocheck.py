"""The model of Dynamo's KV router (`inferlb.bench.peermodels.DynamoKv`) against Dynamo's real router
(`inferlb.bench.dynamoreal.RealDynamoKv`, its ``KvRouter`` in process), on common simulated runs: the same trace,
16 servers, load and seed, both reading the servers' exact caches through KV events.

    make bench-dynamo    # .venv/dynamo/bin/inferlb bench dynamocheck --out bench/results/quality/peer-models

The first ``--requests`` of each ``--trace`` at each ``--loads`` (fractions of the fleet's capacity, measured as
the quality suite measures it, with seed 0), ``--seeds`` seeds each. The real router's runs are not exactly
repeatable (its KV events travel through its event plane, as live), so agreement is read against the spread over
seeds. Results: ``dynamocheck.json`` and ``dynamocheck.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from inferlb.bench.desrun import fleet_capacity_rps, load_arrivals, scaled, sim_figures
from inferlb.bench.peermodels import peer_model
from inferlb.bench.report import header, spread, table, write
from inferlb.bench.stats import mean
from inferlb.sim.des import simulate
from inferlb.sim.profiles import fleet_of

__all__ = ["add_arguments", "run", "summarise"]

TRACES = (
    "../shared/traces/mooncake_conversation_trace.jsonl",
    "../shared/traces/mooncake_synthetic_trace.jsonl",
    "../shared/traces/AzureLLMInferenceTrace_code.csv",
    "../shared/traces/AzureLLMInferenceTrace_conv.csv",
)
CONTENDERS = ("dynamo (real router)", "peer-model:dynamo-kv")
METRICS = ("prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", action="append", help="a trace (repeat; default: the four shipped ones)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quality/peer-models"))
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    parser.add_argument("--seeds", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    from inferlb.bench.dynamoreal import DYNAMO_RUNTIME_VERSION, RealDynamoKv

    traces = args.trace or [t for t in TRACES if Path(t).is_file()]
    if not traces:
        print("inferlb bench dynamocheck: no trace: give --trace FILE (the shipped ones are in ../shared/traces)")
        return 2
    profiles = fleet_of(args.profile, args.servers)
    rows: list[dict[str, Any]] = []
    for trace in traces:
        arrivals = load_arrivals(trace, args.requests, profiles[0].block_size)
        capacity = fleet_capacity_rps(arrivals, profiles, 0)
        for load in args.loads:
            timed = scaled(arrivals, load * capacity)
            for seed in range(args.seeds):
                for contender in CONTENDERS:
                    started = time.monotonic()
                    policy: Any = (
                        RealDynamoKv(profiles, seed)
                        if contender == CONTENDERS[0]
                        else peer_model("dynamo-kv", profiles, seed)
                    )
                    try:
                        result = simulate(
                            timed, policy, profiles, seed=seed, scrape_interval_s=0.1, on_finish=policy.finished
                        )
                    finally:
                        if hasattr(policy, "close"):
                            policy.close()
                    figures = sim_figures(result)
                    row = {"trace": Path(trace).name, "load": load, "seed": seed, "contender": contender}
                    row.update({m: figures.get(m) for m in (*METRICS, "errors")})
                    rows.append(row)
                    print(
                        f"  {Path(trace).name} load {load} seed {seed} {contender}: hit {row['prefix_hit_rate']}, "
                        f"TTFT p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} ms "
                        f"({time.monotonic() - started:.0f} s)",
                        flush=True,
                    )
    document = {
        "meta": {**header(args.command), "dynamo_runtime": DYNAMO_RUNTIME_VERSION, "profile": args.profile,
                 "servers": args.servers, "requests": args.requests},
        "rows": rows,
        "summary": summarise(rows),
    }  # fmt: skip
    write(args.out, "dynamocheck", document, _markdown(document))
    return 0


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trace and load: each contender's mean, lowest and highest of each metric over seeds, and whether the
    model's mean lies within the real router's range widened by 5% (``agrees``, per metric)."""
    groups: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        groups.setdefault((row["trace"], row["load"]), {}).setdefault(row["contender"], []).append(row)
    out = []
    for (trace, load), by in groups.items():
        entry: dict[str, Any] = {"trace": trace, "load": load}
        for contender, members in by.items():
            for metric in METRICS:
                values = [m[metric] for m in members if m.get(metric) is not None]
                entry[f"{contender}|{metric}"] = [mean(values), min(values), max(values)] if values else None
        agrees = {}
        for metric in METRICS:
            real, model = entry.get(f"{CONTENDERS[0]}|{metric}"), entry.get(f"{CONTENDERS[1]}|{metric}")
            if real and model:
                low, high = real[1] * 0.95, real[2] * 1.05
                agrees[metric] = low <= model[0] <= high
        entry["agrees"] = agrees
        out.append(entry)
    return out


def _markdown(document: dict[str, Any]) -> str:
    meta = document["meta"]
    lines = [
        "# Dynamo's KV router: the model against the real router, on common simulated runs",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['machine']} · ai-dynamo-runtime {meta['dynamo_runtime']}",
        "",
        f"{meta['servers']} x {meta['profile']}, the first {meta['requests']:,} requests of each trace. Cells: the "
        "mean over seeds [lowest-highest]; the model's figure is marked `*` where its mean lies outside the real "
        "router's range widened by 5%.",
        "",
    ]
    head = ["trace", "load"]
    for label in ("hit rate", "TTFT p50 ms", "TTFT p99 ms"):
        head += [f"{label}: real", "model"]
    rows = []
    for entry in document["summary"]:
        cells: list[Any] = [entry["trace"], entry["load"]]
        for metric, digits in zip(METRICS, (3, 0, 0), strict=True):
            for contender in CONTENDERS:
                value = entry.get(f"{contender}|{metric}")
                text = "-" if value is None else spread(*value, digits)
                if contender == CONTENDERS[1] and entry["agrees"].get(metric) is False:
                    text += " *"
                cells.append(text)
        rows.append(cells)
    lines += table(head, rows, "lr" + "r" * 6)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
