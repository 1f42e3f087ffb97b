"""What the servers' KV events change: the prefix-cache hit rate and TTFT with the exact index (the servers' own
account of their caches, `scorer.kvindex`) against the approximate one (what the picker sent where), for one picker
and for replicas that share nothing, in the simulator and through the real gateway.

    inferlb bench kv-events [--trace FILE ...] [--out DIR] [--modes des live] [--seeds N] [--rounds N]

Simulator: 16 servers (``--profile``), 2,000 requests of each trace at each ``--loads``, ``--seeds`` seeds, five
contenders: one picker with and without events, four replicas sharing nothing with and without events, and four
replicas sharing their state through Redis (5 ms; `bench.policies.Replicated`) for reference. Live:
``--live-servers`` emulated servers (4) behind real Envoy, ``--live-requests`` requests from the window of the trace
where prompts share the most blocks (`bench.window.reuse_window`), one picker and four unshared pickers (as in the
simulator), each with and without events, in ``--rounds`` rounds (each round runs every setup once, in turn, on
fresh servers). Hit rates are the servers' own (their counters); TTFT is the client's. Results: ``kvevents.json``
and ``kvevents.md``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from inferlb.bench.desrun import DesJob, capacity_rps, load_arrivals, replicated_name, run_job
from inferlb.bench.liverun import MAX_WALL_RPS, MAX_WALL_TOKENS_PER_S, measure
from inferlb.bench.report import header, spread, table, write
from inferlb.bench.window import choose_window
from inferlb.envoyconf import EnvoyOptions
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.tokenizer import CacheKeyer, HuggingFaceTokenizer, PieceTokenizer
from inferlb.sim.profiles import PROFILES, get_profile
from inferlb.stack import LocalStack, StackOptions

__all__ = ["add_arguments", "run"]

MODEL = "bench-model"
TRACES = ("../shared/traces/mooncake_conversation_trace.jsonl", "../shared/traces/mooncake_synthetic_trace.jsonl")
DES_CONTENDERS = (
    ("one picker", "inferlb:default"),
    ("one picker, KV events", "inferlb-kv-events:default"),
    ("4 pickers, unshared", replicated_name("default", 4, None)),
    ("4 pickers, unshared, KV events", "inferlb-kv-events:" + replicated_name("default", 4, None).split(":", 1)[1]),
    ("4 pickers, Redis 5 ms", replicated_name("default", 4, 5.0)),
)


@dataclass(frozen=True, slots=True)
class LiveSetup:
    name: str
    pickers: int
    kv_events: bool


LIVE_SETUPS = (
    LiveSetup("one picker", 1, False),
    LiveSetup("one picker, KV events", 1, True),
    LiveSetup("4 pickers, unshared", 4, False),
    LiveSetup("4 pickers, unshared, KV events", 4, True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", action="append", help="a Mooncake trace (repeat; default: both shipped ones)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--modes", nargs="+", choices=("des", "live", "cost"), default=["des", "live", "cost"])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100-llama3.1-8b")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.8, 1.0])
    parser.add_argument("--seeds", type=int, default=3, help="simulator: seeds per trace and load")
    parser.add_argument("--des-requests", type=int, default=2000)
    parser.add_argument("--live-requests", type=int, default=400)
    parser.add_argument("--live-load", type=float, default=0.8)
    parser.add_argument("--live-servers", type=int, default=4, help="live: emulated servers behind the gateway")
    parser.add_argument("--rounds", type=int, default=3, help="live: every setup once per round")
    parser.add_argument(
        "--update", action="store_true", help="keep what OUT/kvevents.json holds of the modes not run this time"
    )


def run(args: argparse.Namespace) -> int:
    traces = args.trace or [t for t in TRACES if Path(t).is_file()]
    if not traces:
        print("inferlb bench kv-events: no trace: give --trace FILE (the shipped ones are in ../shared/traces)")
        return 2
    document: dict[str, Any] = {"meta": header(args.command), "des": [], "live": [], "windows": {}, "cost": []}
    previous = args.out / "kvevents.json"
    if args.update and previous.is_file():
        kept = json.loads(previous.read_text(encoding="utf-8"))
        for mode, keys in (("des", ("des",)), ("live", ("live", "windows")), ("cost", ("cost",))):
            if mode not in args.modes:
                document.update({key: kept.get(key, document[key]) for key in keys})
        document["meta"]["earlier"] = [
            *kept["meta"].get("earlier", []),
            {k: kept["meta"][k] for k in ("date", "command")},
        ]
    with tempfile.TemporaryDirectory(prefix="inferlb-bench-kvevents-") as folder:
        if "cost" in args.modes:
            document["cost"] = cost_rows(Path(folder))
        if "des" in args.modes:
            document["des"] = _des(args, traces)
        if "live" in args.modes:
            document["live"] = _live(args, traces, Path(folder), document["windows"])
    document["des_summary"] = _summary(document["des"], ("trace", "load", "setup"))
    document["live_summary"] = _summary(document["live"], ("trace", "setup"))
    write(args.out, "kvevents", document, _markdown(document))
    return 0


COST_PROMPT_KB = (1, 4, 16)


def cost_rows(folder: Path, rounds: int = 200) -> list[dict[str, Any]]:
    """What the exact index adds to a request's routing, in process: the prompt's cache keys (tokenized with the
    emulator's pieces and with a Hugging Face BPE tokenizer trained here on the repository's README) and the exact
    index's match, per prompt size; the median of ``rounds`` calls, in µs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = Path(__file__).resolve().parents[1] / "README.md"
    text = corpus.read_text(encoding="utf-8") if corpus.is_file() else "the prompt of a request " * 4000
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=8000, show_progress=False))
    bpe.save(str(folder / "tokenizer.json"))
    keyers = {
        "pieces": CacheKeyer({MODEL: PieceTokenizer()}, 16),
        "huggingface-bpe": CacheKeyer({MODEL: HuggingFaceTokenizer(folder)}, 16),
    }
    rows = []
    for kb in COST_PROMPT_KB:
        prompt = (text * (1 + kb * 1024 // max(len(text), 1)))[: kb * 1024]
        document = {"model": MODEL, "prompt": prompt}
        for name, keyer in keyers.items():
            keys = keyer.keys(MODEL, document)
            index = KVBlockIndex(16, clock=time.monotonic, block_size=16)
            for endpoint in range(16):
                index.subscribed(endpoint, True)
            index.store(3, list(range(len(keys) // 2)), keys[: len(keys) // 2])
            rows.append(
                {
                    "tokenizer": name,
                    "prompt_kb": kb,
                    "blocks": len(keys),
                    "keys_us": _median_us(partial(keyer.keys, MODEL, document), rounds),
                    # Two equal tuples in turn: the index remembers only the last keys object it matched.
                    "match_us": _median_us(partial(_alternate, index, (keys, tuple(list(keys))), [0]), rounds),
                }
            )
    return rows


def _alternate(index: KVBlockIndex, keys: tuple[tuple[int, ...], ...], turn: list[int]) -> None:
    turn[0] += 1
    index.match_depth(keys[turn[0] % 2])


def _median_us(call: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def _des(args: argparse.Namespace, traces: list[str]) -> list[dict[str, Any]]:
    profile = get_profile(args.profile)
    servers = 16
    rows = []
    for trace in traces:
        arrivals = load_arrivals(trace, args.des_requests, profile.block_size)
        capacity = capacity_rps(arrivals, profile, 0) * servers
        for load in args.loads:
            for seed in range(args.seeds):
                for setup, name in DES_CONTENDERS:
                    job = DesJob(trace, args.des_requests, servers, profile.name, name, load, load * capacity, seed)
                    row = run_job(job, arrivals)
                    row.pop("_ttft_s", None)
                    row.update({"trace": Path(trace).name, "setup": setup, "seed": seed})
                    rows.append(row)
                    print(
                        f"  des {Path(trace).name} load {load} seed {seed} {setup}: hit rate "
                        f"{row['prefix_hit_rate']}, TTFT p99 {row['ttft_p99_ms']} ms",
                        flush=True,
                    )
    return rows


def _live(args: argparse.Namespace, traces: list[str], folder: Path, windows: dict[str, Any]) -> list[dict[str, Any]]:
    profile = get_profile(args.profile)
    servers = args.live_servers
    if servers < 1:
        raise ValueError(f"--live-servers must be >= 1; got {servers}")
    rows = []
    for trace in traces:
        chosen = choose_window(trace, args.live_requests, "auto")
        start, share = chosen.start, chosen.reuse or 0.0
        windows[Path(trace).name] = {
            "start": start, "requests": args.live_requests, "shared_block_share": share, "servers": servers,
        }  # fmt: skip
        arrivals = load_arrivals(trace, args.live_requests, profile.block_size, start=start)
        rate = args.live_load * capacity_rps(arrivals, profile, 0) * servers
        mean_output = sum(a.output_tokens for a in arrivals) / len(arrivals)
        scale = min(MAX_WALL_RPS / rate, MAX_WALL_TOKENS_PER_S / (rate * mean_output))
        for round_number in range(1, args.rounds + 1):
            for setup in LIVE_SETUPS:
                name = f"{Path(trace).stem}-{round_number}-{setup.name.replace(' ', '-').replace(',', '')}"
                row = _live_run(setup, args, trace, start, rate, scale, folder / name, servers)
                row.update({"trace": Path(trace).name, "setup": setup.name, "round": round_number, "start": start})
                rows.append(row)
                print(
                    f"  live {Path(trace).name} round {round_number} {setup.name}: hit rate {row['prefix_hit_rate']}, "
                    f"TTFT p99 {row['ttft_p99_ms']} ms, {row['errors']} errors",
                    flush=True,
                )
    return rows


def _live_run(
    setup: LiveSetup,
    args: argparse.Namespace,
    trace: str,
    start: int,
    rate: float,
    scale: float,
    workdir: Path,
    servers: int,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    options = StackOptions(
        backends=servers,
        models=(MODEL,),
        policy="default",
        profile=args.profile,
        time_scale=scale,
        envoy=EnvoyOptions(access_log_path=None),
        envoy_concurrency=1,
        picker_log_level="warning",
        pickers=setup.pickers,
        # Unshared replicas each learn the ends of their own requests from their streams.
        picker_config={"inflight": {"end": "stream"}} if setup.pickers > 1 else {},
        picker_env={"PYTHONHASHSEED": str(secrets.randbelow(2**32 - 1) + 1)},
        latency_source="stream",
        kv_events="map" if setup.kv_events else None,
    )
    with LocalStack(options, workdir / "stack") as stack:
        watched = [p for p in (stack.envoy, stack.picker, *stack.replicas, stack.backends) if p is not None]
        row = measure(
            trace, args.live_requests, setup.name, args.live_load, rate, stack.gateway_url,
            stack.endpoints, None, watched, scale, workdir, start,
        )  # fmt: skip
    row.pop("_ttft_s", None)
    row.update(
        {
            "mode": "live",
            "servers": servers,
            "pickers": setup.pickers,
            "kv_events": setup.kv_events,
            "time_scale": round(scale, 4),
        }
    )
    return row


def _summary(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per group of ``keys``: the mean, lowest and highest hit rate and TTFT p50/p99 over seeds or rounds."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for group, members in groups.items():
        entry: dict[str, Any] = dict(zip(keys, group, strict=True))
        entry["runs"] = len(members)
        for metric in ("prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms"):
            values = [m[metric] for m in members if m.get(metric) is not None]
            entry[metric] = round(statistics.fmean(values), 4) if values else None
            entry[f"{metric}_range"] = [min(values), max(values)] if values else None
        entry["errors"] = sum(m.get("errors") or 0 for m in members)
        out.append(entry)
    return out


def _markdown(document: dict[str, Any]) -> str:
    meta = document["meta"]
    lines = [
        "# KV events: the servers' own account of their caches against the picker's guess",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['machine']}",
        *(f"(the other parts: {e['date']} · `{e['command']}`)" for e in meta.get("earlier", [])),
        "",
        "Hit rate: the servers' prefix-cache hits over queries (their own counters); TTFT: the client's. Means over",
        "seeds (simulator) or rounds (live), with the lowest and highest in brackets.",
    ]
    live_servers = sorted({w.get("servers", 4) for w in document["windows"].values()}) or [4]
    live_requests = sorted({w["requests"] for w in document["windows"].values()}) or [400]
    live_title = (
        f"Live ({', '.join(map(str, live_servers))} servers, {', '.join(f'{n:,}' for n in live_requests)} requests)"
    )
    for title, key in (("Simulator (16 servers, 2,000 requests)", "des_summary"), (live_title, "live_summary")):
        summary = document[key]
        if not summary:
            continue
        lines += ["", f"## {title}", ""]
        head = ["trace", *(["load"] if key == "des_summary" else []), "setup", "runs", "hit rate", "TTFT p50 ms"]
        head += ["TTFT p99 ms", "errors"]
        rows = []
        for entry in summary:
            rows.append(
                [
                    entry["trace"],
                    *([entry["load"]] if key == "des_summary" else []),
                    entry["setup"],
                    entry["runs"],
                    _cell(entry, "prefix_hit_rate", 3),
                    _cell(entry, "ttft_p50_ms", 0),
                    _cell(entry, "ttft_p99_ms", 0),
                    entry["errors"],
                ]
            )
        lines += table(head, rows, "l" + ("r" if key == "des_summary" else "") + "l" + "r" * 5)
    if document["cost"]:
        lines += ["", "## What it costs a request (in process, median µs)", ""]
        lines += table(
            ["tokenizer", "prompt KB", "blocks of 16 tokens", "cache keys µs", "exact match µs"],
            [[r["tokenizer"], r["prompt_kb"], r["blocks"], r["keys_us"], r["match_us"]] for r in document["cost"]],
        )
    if document["windows"]:
        lines += ["", "Live windows (the requests whose prompts share the most blocks):", ""]
        for trace, window in document["windows"].items():
            lines.append(
                f"- {trace}: requests {window['start']}..{window['start'] + window['requests'] - 1}, "
                f"{window['shared_block_share']:.0%} of their prompt blocks shared with an earlier one"
            )
    return "\n".join(lines) + "\n"


def _cell(entry: dict[str, Any], metric: str, digits: int) -> str | None:
    value, span = entry[metric], entry[f"{metric}_range"]
    return None if value is None else spread(value, span[0], span[1], digits)


if __name__ == "__main__":
    import sys

    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
