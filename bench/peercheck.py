"""The peer routers' simulator models against the live peers, on one common run:

    inferlb bench peercheck --trace ../shared/traces/mooncake_conversation_trace.jsonl --start 11500 \\
        --requests 300 --loads 0.8 --out bench/results/quality/peer-models

A window of a JSONL trace (``--requests`` rows from row ``--start``, where later turns of conversations repeat
earlier prefixes; timestamps rebased to 0) is written to a file of its own. Each live peer of
`inferlb.bench.peers` replays it through the live harness (`inferlb.bench.liverun.run_live`: 4 fresh emulated
servers, the peer as deployed, the harness's capacity, load and time scale), and its model
(`inferlb.bench.peermodels`) replays it in the simulator on the same fleet at the same rate (the fleet's capacity
is measured the same way by both, `inferlb.bench.desrun.fleet_capacity_rps`), once per ``--seeds`` seed. Compared
per model: the share of requests per server (sorted, largest first: which server is which differs between runs),
the servers' prefix-cache hit rate and TTFT p50/p99. Output: ``check.json`` and ``check.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferlb.bench.desrun import fleet_capacity_rps, load_arrivals, make_policy, scaled, sim_figures
from inferlb.bench.report import header, table, write
from inferlb.bench.stats import mean as _maybe_mean
from inferlb.sim.des import Arrival, FleetView, Hold, Refuse, simulate
from inferlb.sim.profiles import PROFILES, ServerProfile, get_profile

__all__ = ["PAIRS", "Figures", "add_arguments", "compare", "live_figures", "live_records", "run", "simulated", "window"]

# live peer (bench/peers.py) -> its model's DES contender
PAIRS: dict[str, str] = {
    "sglang-router cache_aware": "peer-model:sglang-cache-aware",
    "sglang-router power_of_two": "peer-model:sglang-power-of-two",
    "vllm-router cache_aware": "peer-model:vllm-router-cache-aware",
    "vllm-router power_of_two": "peer-model:vllm-router-power-of-two",
    "vllm-router consistent_hash": "peer-model:vllm-router-consistent-hash",
    "dynamo kv": "peer-model:dynamo-kv",
}
# What "agrees" means: hit rates within 0.02 (absolute), each sorted server share within 0.10, TTFT p50 and p99
# within a factor 1.5 (live times carry the machine's noise; a 300-request p99 is the 3rd-worst request).
HIT_TOLERANCE = 0.02
SHARE_TOLERANCE = 0.10
TTFT_FACTOR = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="a JSONL trace (Mooncake's format)")
    parser.add_argument("--out", type=Path, required=True, help="folder for check.json and check.md")
    parser.add_argument("--start", type=int, default=11500, help="the window's first row")
    parser.add_argument("--requests", type=int, default=300, help="rows in the window")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8], help="fractions of the fleet's capacity")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES))
    parser.add_argument("--peers", nargs="+", choices=sorted(PAIRS), default=list(PAIRS), help="live peers to check")
    parser.add_argument("--seeds", type=int, default=3, help="simulator runs per model (seeds 0..N-1)")
    parser.add_argument("--seed", type=int, default=0, help="the live run's seed")
    parser.add_argument(
        "--time-scale",
        type=float,
        help="the live servers' time scale (default: the live harness's choice); 1 for a peer whose own hop is slow",
    )
    live = parser.add_mutually_exclusive_group()
    live.add_argument("--no-live", action="store_true", help="the simulator's half only (no peers started)")
    live.add_argument(
        "--reuse-live", type=Path, help="take the live half from this earlier check.json (same window and loads)"
    )


@dataclass(frozen=True, slots=True)
class Figures:
    """One run's compared figures: shares sorted largest first, hit rate 0..1, TTFT in ms."""

    shares: tuple[float, ...]
    hit_rate: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    errors: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "shares": [round(s, 3) for s in self.shares],
            "prefix_hit_rate": self.hit_rate,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "errors": self.errors,
        }


def window(trace: Path, start: int, requests: int, folder: Path) -> Path:
    """Rows ``start .. start + requests`` of the JSONL ``trace``, timestamps rebased to 0, as a new file in
    ``folder`` (its name, hence the synthetic prompts' filler text, is fixed by the arguments). ValueError if the
    trace has fewer rows or is not JSONL."""
    if trace.suffix != ".jsonl":
        raise ValueError(f"--trace must be a JSONL trace (Mooncake's format); got {trace.name}")
    with trace.open(encoding="utf-8") as f:
        lines = [line for line in f if line.strip()][start : start + requests]
    if len(lines) < requests or requests < 2:
        raise ValueError(f"{trace.name} has no {requests} rows from row {start}")
    rows = [json.loads(line) for line in lines]
    first = min(r["timestamp"] for r in rows)
    path = folder / f"{trace.stem}-rows{start}-{start + requests}.jsonl"
    path.write_text("".join(json.dumps({**r, "timestamp": r["timestamp"] - first}) + "\n" for r in rows), "utf-8")
    return path


class _Counting:
    """Wraps a policy and counts the requests it sends to each server."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.sent: Counter[int] = Counter()

    def __call__(self, arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        answer: int | Hold | Refuse = self.policy(arrival, view)
        if isinstance(answer, int):
            self.sent[answer] += 1
        return answer


def _shares(counts: Sequence[int], servers: int) -> tuple[float, ...]:
    padded = sorted([*counts, *[0] * (servers - len(counts))], reverse=True)
    total = sum(padded) or 1
    return tuple(c / total for c in padded)


def simulated(
    name: str, arrivals: Sequence[Arrival], fleet: Sequence[ServerProfile], rate: float, seed: int
) -> Figures:
    """One simulator run of contender ``name`` at ``rate`` requests/s, as `inferlb.bench.desrun.run_job` runs it."""
    policy = make_policy(name, fleet, seed)
    counting = _Counting(policy)
    result = simulate(scaled(arrivals, rate), counting, fleet, seed=seed, on_finish=getattr(policy, "finished", None))
    figures = sim_figures(result)
    return Figures(
        _shares([counting.sent[i] for i in range(len(fleet))], len(fleet)),
        _float(figures["prefix_hit_rate"]),
        _float(figures["ttft_p50_ms"]),
        _float(figures["ttft_p99_ms"]),
        int(figures["errors"] or 0),
    )


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; 0 for no values."""
    return _maybe_mean(values) or 0.0


def _float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def live_figures(row: dict[str, Any], records: Path, servers: int) -> Figures:
    """A live run's figures: its results row, and the shares from the load generator's records (each response names
    its server), or from the servers' own counts (``server_requests``) where a router does not pass that name on."""
    counts = Counter(json.loads(line)["server"] for line in records.read_text("utf-8").splitlines() if line.strip())
    shares = list(counts.values())
    if "" in counts and row.get("server_requests"):
        shares = list(row["server_requests"])
    return Figures(
        _shares(shares, servers),
        row["prefix_hit_rate"],
        row["ttft_p50_ms"],
        row["ttft_p99_ms"],
        int(row["errors"]),
    )


def compare(live: Figures, model: Sequence[Figures]) -> tuple[bool, list[str]]:
    """Whether the model (its seeds' mean) agrees with the live peer within the tolerances above, and the reasons
    where it does not."""
    reasons: list[str] = []
    hits = [m.hit_rate for m in model if m.hit_rate is not None]
    hit = mean(hits)
    if live.hit_rate is not None and hits and abs(hit - live.hit_rate) > HIT_TOLERANCE:
        reasons.append(f"hit rate {hit:.3f} simulated vs {live.hit_rate:.3f} live")
    shares = [mean([m.shares[k] for m in model]) for k in range(len(live.shares))]
    worst = max(abs(a - b) for a, b in zip(shares, live.shares, strict=True))
    if worst > SHARE_TOLERANCE:
        reasons.append(f"server shares differ by up to {worst:.2f}")
    for label, sim_ms, live_ms in (
        ("TTFT p50", mean([m.ttft_p50_ms or 0.0 for m in model]), live.ttft_p50_ms),
        ("TTFT p99", mean([m.ttft_p99_ms or 0.0 for m in model]), live.ttft_p99_ms),
    ):
        if live_ms and sim_ms and max(sim_ms / live_ms, live_ms / sim_ms) > TTFT_FACTOR:
            reasons.append(f"{label} {sim_ms:.0f} ms simulated vs {live_ms:.0f} ms live")
    return not reasons, reasons


def run(args: argparse.Namespace) -> int:
    """Run the check ``args`` describe (``args.command`` is the command the report records)."""
    workdir = Path(tempfile.mkdtemp(prefix="inferlb-peercheck-"))
    try:
        path = window(Path(args.trace), args.start, args.requests, workdir)
    except (OSError, ValueError) as e:
        print(f"inferlb bench peercheck: error: {e}", file=sys.stderr)
        return 2
    fleet = (get_profile(args.profile),) * args.servers
    arrivals = load_arrivals(str(path), args.requests, fleet[0].block_size)
    capacity = fleet_capacity_rps(arrivals, fleet, args.seed)
    live: dict[tuple[str, float], Figures] = {}
    notes: list[str] = []
    if args.reuse_live is not None:
        live, notes = _reused(args.reuse_live)
    elif not args.no_live:
        live, notes = _live(args, path)
    rows: list[dict[str, Any]] = []
    for peer in args.peers:
        for load in args.loads:
            model = [simulated(PAIRS[peer], arrivals, fleet, load * capacity, seed) for seed in range(args.seeds)]
            row: dict[str, Any] = {
                "peer": peer,
                "model": PAIRS[peer],
                "load": load,
                "rate_rps": round(load * capacity, 3),
                "simulated": [m.as_dict() for m in model],
            }
            seen = live.get((peer, load))
            if seen is not None:
                agrees, reasons = compare(seen, model)
                row |= {"live": seen.as_dict(), "agrees": agrees, "differences": reasons}
            rows.append(row)
    meta = {**header(args.command), "window": path.name, "capacity_rps": round(capacity, 3), "notes": notes}
    write(args.out, "check", {"meta": meta, "rows": rows}, _markdown(meta, rows))
    return 0


def _live(args: argparse.Namespace, path: Path) -> tuple[dict[tuple[str, float], Figures], list[str]]:
    from inferlb.bench.liverun import run_live  # imports Envoy plumbing only when needed

    live_args = argparse.Namespace(
        trace=[str(path)],
        policies=list(args.peers),
        servers=args.servers,
        profile=args.profile,
        fleet=None,
        requests=args.requests,
        loads=list(args.loads),
        quick=False,
        seed=args.seed,
        slo_ms=None,
        time_scale=getattr(args, "time_scale", None),
    )
    rows, summary = run_live(live_args, _Progress)
    root = Path(summary["workdir"]) / path.stem
    out = {(row["policy"], row["load"]): live_figures(row, live_records(root, row), args.servers) for row in rows}
    return out, [*summary.get("notes", []), f"live time scale {summary['traces'][path.name]['time_scale']}"]


def live_records(root: Path, row: dict[str, Any]) -> Path:
    """The load generator's records of one live run: its folder is named after the contender, the load and (since
    the harness repeats runs) the repetition."""
    for slug in {row["policy"].replace(":", "-").replace(" ", "-"), row["policy"].replace(":", "-")}:
        for name in (f"{slug}-{row['load']}-r{row.get('repeat', 0)}", f"{slug}-{row['load']}"):
            if (root / name / "records.jsonl").is_file():
                return root / name / "records.jsonl"
    raise FileNotFoundError(f"no records of the live run {row['policy']} at load {row['load']} under {root}")


def _reused(path: Path) -> tuple[dict[tuple[str, float], Figures], list[str]]:
    """The live figures of an earlier check.json, and a note of where they come from."""
    earlier = json.loads(path.read_text(encoding="utf-8"))
    live = {
        (row["peer"], row["load"]): Figures(
            tuple(row["live"]["shares"]),
            row["live"]["prefix_hit_rate"],
            row["live"]["ttft_p50_ms"],
            row["live"]["ttft_p99_ms"],
            row["live"]["errors"],
        )
        for row in earlier["rows"]
        if "live" in row
    }
    meta = earlier["meta"]
    note = f"live half from {path.name}: measured {meta['date']} by `{meta['command']}`"
    return live, [note, *meta.get("notes", [])]


class _Progress:
    """One line per live run on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.count = total, 0

    def step(self, what: str) -> None:
        self.count += 1
        print(f"[{self.count}/{self.total}] {what}", file=sys.stderr, flush=True)

    def done(self) -> None:
        pass


def _fmt(value: float | None, digits: int = 0) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def _markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    out = [
        "# Peer models against the live peers",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['machine']}",
        "",
        f"Window: `{meta['window']}`; fleet capacity {meta['capacity_rps']} requests/s. Simulated: the mean of "
        "the seeds (their range in brackets). Shares: per server, largest first.",
        "",
    ]
    body = []
    for row in rows:
        sims = row["simulated"]

        def span(key: str, digits: int, sims: list[dict[str, Any]] = sims) -> str:
            values = [s[key] for s in sims if s[key] is not None]
            if not values:
                return "—"
            return f"{mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

        shares = " / ".join(f"{mean([s['shares'][k] for s in sims]):.2f}" for k in range(len(sims[0]["shares"])))
        live = row.get("live")
        body.append([row["peer"], row["load"], "simulated", shares, span("prefix_hit_rate", 3), span("ttft_p50_ms", 0),
                     span("ttft_p99_ms", 0), ""])  # fmt: skip
        if live is not None:
            verdict = "agrees" if row["agrees"] else "differs: " + "; ".join(row["differences"])
            body.append([row["peer"], row["load"], "live", " / ".join(f"{s:.2f}" for s in live["shares"]),
                         _fmt(live["prefix_hit_rate"], 3), _fmt(live["ttft_p50_ms"]), _fmt(live["ttft_p99_ms"]),
                         verdict])  # fmt: skip
    out += table(["peer", "load", "run", "shares", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "verdict"], body,
                 "lrlllll" + "l")  # fmt: skip
    if meta["notes"]:
        out += ["", *(f"- {note}" for note in meta["notes"])]
    return "\n".join(out)


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))
