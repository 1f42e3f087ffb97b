"""Routing quality on real traces: ``inferlb bench quality --mode des|live --trace FILE --out DIR [--quick]``.

Every contender available in the mode replays the same trace on the same fleet with the same seed, open loop,
at each load of a sweep (a load is a fraction of the fleet's measured capacity). Per contender and load it
records TTFT p50/p90/p99, E2E p99, throughput, prefix-cache hit rate, load imbalance, errors, shed requests and
the picker's CPU per request; per contender, the goodput: the highest rate whose TTFT p99 meets the SLO.

Output in ``--out``: ``results.json`` (one object per trace x contender x load x repetition), ``summary.json``
(fleet, capacity, SLO and goodput per trace and contender; live: each trace's window, and under ``aggregate`` the
mean and 95% interval over the repetitions per trace x contender x load), ``results.md`` (tables) and, per trace,
two plots: ``<trace>-ttft-cdf.png`` (TTFT CDF per contender at the headline load, the repetitions pooled) and
``<trace>-p99-vs-load.png``.

Live only: ``--start N|auto`` replays requests N .. N + ``--requests`` of each trace, ``auto`` the window where
prefixes repeat most (`inferlb.bench.window`); ``--repeats K`` runs everything K times, interleaved
(`inferlb.bench.liverun.plan_runs`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from inferlb.bench.desrun import DES_CONTENDERS, DesJob, fleet_capacity_rps, load_arrivals, run_job
from inferlb.bench.metrics import goodput
from inferlb.bench.report import cpu_model, header, write
from inferlb.bench.stats import mean_ci95
from inferlb.bench.window import parse_start
from inferlb.sim.profiles import PROFILES, ServerProfile, fleet_name, get_profile, parse_fleet

__all__ = ["AGGREGATED", "add_arguments", "aggregate", "run"]

DES_LOADS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
DES_LOADS_QUICK = (0.3, 0.6, 0.9)
HEADLINE_LOAD = 0.6  # the load of the per-trace table and the CDF plot (the nearest one run)
SLO_FACTOR = 2.0
DEFAULT = "inferlb:default"  # default SLO: TTFT p99 within twice the oracle's at a light load
# The figures `aggregate` averages over repetitions, each with its 95% interval (``<key>_ci95``).
AGGREGATED = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms", "prefix_hit_rate", "errors", "shed")


def _start(text: str) -> int | str:
    try:
        return parse_start(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("des", "live"), required=True, help="simulator or live gateway")
    parser.add_argument("--trace", action="append", required=True, help="a trace file (repeat for several)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json, tables and plots")
    parser.add_argument("--quick", action="store_true", help="fewer requests and loads: under 5 minutes")
    parser.add_argument("--policies", nargs="+", help="contenders (default: every one available in the mode)")
    parser.add_argument("--servers", type=int, help="fleet size with --profile (default: des 16, live 4)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES), help="GPU x model")
    kind.add_argument(
        "--fleet",
        help="a mixed fleet instead: PROFILE:COUNT,... (e.g. h100-llama3.1-8b:8,a100-llama3.1-8b:4,l4-llama3.2-3b:4)",
    )
    parser.add_argument("--requests", type=int, help="requests replayed from each trace's window")
    parser.add_argument(
        "--start",
        type=_start,
        default=0,
        help="live: requests of each trace to skip first, or 'auto': the window of --requests requests where "
        "prefixes repeat most (Mooncake traces; the Azure traces name no blocks and start at 0)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="live: runs per trace x contender x load, interleaved, seeds seed.."
    )
    parser.add_argument("--loads", type=float, nargs="+", help="fractions of the fleet's capacity")
    parser.add_argument("--slo-ms", type=float, help="TTFT p99 SLO for goodput (default: 2x the oracle's, light load)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations in parallel")
    parser.add_argument(
        "--time-scale",
        type=float,
        help="live: at most this speed-up of the emulated servers (default: as fast as the machine carries)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` describe (``args.command`` is the command the report records)."""
    for path in args.trace:
        if not Path(path).is_file():
            print(f"inferlb bench: error: trace file not found: {path}", file=sys.stderr)
            return 2
    if args.repeats < 1:
        print(f"inferlb bench: error: --repeats must be >= 1; got {args.repeats}", file=sys.stderr)
        return 2
    if args.mode == "des" and (args.start != 0 or args.repeats != 1):
        print("inferlb bench: error: --start and --repeats are live-mode options", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "des":
        rows, summary = _des(args)
    else:
        from inferlb.bench.liverun import run_live  # imports Envoy plumbing only when needed

        rows, summary = run_live(args, _Progress)
    ttfts: dict[tuple[str, str, float], list[float]] = {}
    for k, row in _keyed(rows):  # the repetitions of one trace x contender x load pooled
        ttfts.setdefault(k, []).extend(row.pop("_ttft_s", ()))
    meta = {**header(args.command), "cpu": cpu_model(), "mode": args.mode}
    write(args.out, "results", rows, markdown(meta, rows, summary))
    write(args.out, "summary", {"meta": meta, **summary})
    _plots(args.out, rows, ttfts, summary)
    print(f"plots in {args.out}")
    return 0


# ---- the simulator ------------------------------------------------------------------------------------------


class Settings(NamedTuple):
    """A mode's run settings: the command line's, else the mode's defaults (quick or full). Unpacks in order.
    ``fleet`` is one profile per server; ``name`` names it as results.json's ``profile`` does (a profile's name,
    or ``PROFILE:COUNT,...`` for a mixed fleet)."""

    name: str
    fleet: tuple[ServerProfile, ...]
    requests: int
    loads: tuple[float, ...]
    policies: tuple[str, ...]


def settings(
    args: argparse.Namespace,
    mode: str,
    *,
    servers: int,
    requests: tuple[int, int],
    loads: tuple[tuple[float, ...], tuple[float, ...]],
    contenders: Sequence[str],
) -> Settings:
    """``requests`` and ``loads`` are (quick, full) defaults. SystemExit names unknown contenders and a bad
    fleet."""
    policies = tuple(args.policies or contenders)
    unknown = [p for p in policies if p not in contenders]
    if unknown:
        raise SystemExit(f"inferlb bench: error: unknown {mode} contender(s) {unknown}; known: {', '.join(contenders)}")
    if getattr(args, "fleet", None):
        if args.servers:
            raise SystemExit("inferlb bench: error: --servers goes with --profile; a --fleet counts its own servers")
        try:
            fleet = parse_fleet(args.fleet)
        except ValueError as e:
            raise SystemExit(f"inferlb bench: error: --fleet: {e}") from None
    else:
        fleet = (get_profile(args.profile),) * (args.servers or servers)
    return Settings(
        fleet_name(fleet),
        fleet,
        args.requests or requests[0 if args.quick else 1],
        tuple(args.loads or loads[0 if args.quick else 1]),
        policies,
    )


def _des(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    name, fleet, requests, loads, policies = settings(
        args,
        "DES",
        servers=16,
        requests=(300, 2000),
        loads=(DES_LOADS_QUICK, DES_LOADS),
        contenders=DES_CONTENDERS,
    )
    summary: dict[str, Any] = {
        "fleet": {"servers": len(fleet), "profile": name},
        "traces": {},
        "slo_rule": "SLO: as given" if args.slo_ms else "SLO: twice the oracle's TTFT p99 at load 0.1.",
    }
    jobs: list[DesJob] = []
    servers = len(fleet)
    for path in args.trace:
        arrivals = load_arrivals(path, requests, fleet[0].block_size)
        capacity = fleet_capacity_rps(arrivals, fleet, args.seed)
        slo_ms = args.slo_ms
        if slo_ms is None:
            light = run_job(DesJob(path, requests, servers, name, "oracle", 0.1, 0.1 * capacity, args.seed))
            slo_ms = round(SLO_FACTOR * (light["ttft_p99_ms"] or 0.0), 1)
        summary["traces"][Path(path).name] = {
            "requests": len(arrivals),
            "capacity_rps": round(capacity, 3),
            "slo_ttft_p99_ms": slo_ms,
        }
        jobs += [
            DesJob(path, requests, servers, name, policy, load, load * capacity, args.seed)
            for load in loads
            for policy in policies
        ]
    rows = _run_parallel(jobs, args.jobs)
    add_goodput(rows, summary)
    return rows, summary


def _run_parallel(jobs: Sequence[DesJob], workers: int) -> list[dict[str, Any]]:
    progress = _Progress(len(jobs))
    rows: list[dict[str, Any]] = []
    if workers <= 1:
        for job in jobs:
            rows.append(run_job(job))
            progress.step(f"{Path(job.trace).name} {job.policy} load {job.load}")
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {pool.submit(run_job, job): job for job in jobs}
            for future in as_completed(futures):
                job = futures[future]
                rows.append(future.result())
                progress.step(f"{Path(job.trace).name} {job.policy} load {job.load}")
    progress.done()
    order = {(j.trace, j.policy, j.load): k for k, j in enumerate(jobs)}
    names = {Path(j.trace).name: j.trace for j in jobs}
    rows.sort(key=lambda r: order[(names[r["trace"]], r["policy"], r["load"])])
    return rows


def aggregate(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trace x contender x load, in first-seen order: ``runs`` (how many rows it sums up), the first
    row's ``rate_rps``, and per figure of `AGGREGATED` its mean over the runs under the same key and the half-width
    of its 95% t-interval under ``<key>_ci95`` (None for one run; both None where no run has the figure)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for group_key, row in _keyed(rows):
        groups.setdefault(group_key, []).append(row)
    out = []
    for (trace, policy, load), group in groups.items():
        agg = {"trace": trace, "policy": policy, "load": load, "rate_rps": group[0]["rate_rps"], "runs": len(group)}
        for key in AGGREGATED:
            found = mean_ci95([r[key] for r in group if r.get(key) is not None])
            mean, half = found if found is not None else (None, None)
            agg[key] = None if mean is None else round(mean, 4)
            agg[f"{key}_ci95"] = None if half is None else round(half, 4)
        out.append(agg)
    return out


def add_goodput(rows: Iterable[dict[str, Any]], summary: dict[str, Any]) -> None:
    per: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for row in rows:
        per.setdefault((row["trace"], row["policy"]), []).append((row["rate_rps"], row["ttft_p99_ms"]))
    for (trace, policy), points in per.items():
        info = summary["traces"][trace]
        info.setdefault("goodput_rps", {})[policy] = goodput(points, info["slo_ttft_p99_ms"])


# ---- reporting ----------------------------------------------------------------------------------------------


class _Progress:
    """A progress bar on a terminal, one line per step otherwise (CI logs)."""

    def __init__(self, total: int) -> None:
        self.total, self.count, self.started = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.count += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.count * (self.total - self.count)
        width = 30
        filled = int(width * self.count / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.count}/{self.total} {elapsed:5.0f}s elapsed, ~{left:4.0f}s left  {what}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _keyed(rows: Iterable[dict[str, Any]]) -> Iterable[tuple[tuple[str, str, float], dict[str, Any]]]:
    for row in rows:
        yield (row["trace"], row["policy"], row["load"]), row


def _headline(loads: Iterable[float]) -> float:
    return min(loads, key=lambda load: abs(load - HEADLINE_LOAD))


def markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    fleet = summary.get("fleet", {})
    out = [
        f"# Routing quality ({meta['mode']})",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['machine']} ({meta['cpu']})",
        "",
        f"Fleet: {_fleet_text(fleet)}. Loads are fractions of the fleet's capacity "
        "(one server's saturated rate on the trace's own requests, times the fleet size). Goodput: the highest "
        "rate at which TTFT p99 meets the SLO (interpolated between the loads run; '>=' where it met the SLO at "
        "every load, '<' where at none). " + summary.get("slo_rule", ""),
    ]
    for note in summary.get("notes", ()):
        out += ["", note]
    for trace, info in summary["traces"].items():
        trace_rows = [r for r in rows if r["trace"] == trace]
        if not trace_rows:
            continue
        loads = sorted({r["load"] for r in trace_rows})
        headline = _headline(loads)
        out += [
            "",
            f"## {trace}",
            "",
            f"{info['requests']} requests · capacity {info['capacity_rps']} req/s · "
            f"SLO TTFT p99 <= {info['slo_ttft_p99_ms']} ms"
            + (f" · servers at {info['time_scale']}x real time" if "time_scale" in info else ""),
            *_window_text(info),
            *_interval_tables(trace, summary.get("aggregate", ())),
            "",
            f"At load {headline}" + (", each run (#repetition):" if info.get("repeats", 1) > 1 else ":"),
            "",
            "| contender | goodput req/s | TTFT p50 ms | p90 | p99 | E2E p99 ms | req/s | out tok/s | prefix hit "
            "| imbalance CV | errors | shed | picker µs/req |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rates = [r["rate_rps"] for r in trace_rows]
        for r in (r for r in trace_rows if r["load"] == headline):
            good = _goodput_text(info.get("goodput_rps", {}).get(r["policy"]), min(rates), max(rates))
            label = f"{r['policy']} #{r['repeat']}" if info.get("repeats", 1) > 1 else r["policy"]
            out.append(
                f"| {label} | {good} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p90_ms'])} | "
                f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['e2e_p99_ms'])} | {_fmt(r['throughput_rps'])} | "
                f"{_fmt(r['output_tokens_per_s'])} | {_fmt(r['prefix_hit_rate'])} | {_fmt(r['imbalance_cv'])} | "
                f"{r['errors']} | {r['shed']} | {_fmt(r.get('picker_cpu_us'))} |"
            )
        # With repetitions, the by-load table and the comparison take the means over them.
        means = [r for r in summary.get("aggregate", ()) if r["trace"] == trace] or trace_rows
        out += ["", "TTFT p99 ms by load" + (" (mean over the repetitions):" if means is not trace_rows else ":"), ""]
        out += ["| contender | " + " | ".join(str(load) for load in loads) + " |"]
        out += ["|---|" + "---:|" * len(loads)]
        policies = list(dict.fromkeys(r["policy"] for r in trace_rows))
        by = {(r["policy"], r["load"]): r for r in means}
        for policy in policies:
            cells = [_fmt(by[(policy, load)]["ttft_p99_ms"]) if (policy, load) in by else "—" for load in loads]
            out.append(f"| {policy} | " + " | ".join(cells) + " |")
        out += _against_default(means, loads, by)
        out += ["", f"![TTFT CDF]({_stem(trace)}-ttft-cdf.png) ![TTFT p99 by load]({_stem(trace)}-p99-vs-load.png)"]
    return "\n".join(out) + "\n"


def _against_default(
    rows: Sequence[dict[str, Any]], loads: Sequence[float], by: dict[tuple[str, float], dict[str, Any]]
) -> list[str]:
    """Where any contender beat inferlb:default by more than 5% on TTFT p50, p99 or E2E p99, load by load."""
    if not any(r["policy"] == DEFAULT for r in rows):
        return []
    out = ["", f"Where a contender beat `{DEFAULT}` by more than 5% (its figure / the default's):", ""]
    found = False
    for load in loads:
        ours = by.get((DEFAULT, load))
        if ours is None:
            continue
        for row in (r for r in rows if r["load"] == load and r["policy"] != DEFAULT):
            wins = []
            for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("e2e_p99_ms", "E2E p99")):
                theirs, mine = row.get(key), ours.get(key)
                if theirs and mine and theirs < 0.95 * mine:
                    wins.append(f"{label} {theirs / mine:.2f}x")
            if wins:
                found = True
                out.append(f"- load {load}, {row['policy']}: {', '.join(wins)}")
    if not found:
        out.append("- none")
    return out


def _window_text(info: dict[str, Any]) -> list[str]:
    """The line that says which requests of the trace ran, where the run chose a window."""
    if "start" not in info:
        return []
    start, reuse = info["start"], info.get("reuse_share")
    share = "no block ids, no reuse to measure" if reuse is None else f"reuse share {reuse:.3f}"
    runs = info.get("repeats", 1)
    return [
        "",
        f"Window: requests {start} .. {start + info['requests']} of the trace ({info.get('window', 'given')}; "
        f"{share}: of the window's prompt blocks, those an earlier request in it also had) · "
        f"{runs} repetition{'s' if runs != 1 else ''}",
    ]


def _interval_tables(trace: str, aggregated: Iterable[dict[str, Any]]) -> list[str]:
    """Where a trace ran more than once per contender and load: means -/+ the 95% interval, and which differences
    from `DEFAULT` lie outside both intervals (the intervals do not overlap)."""
    rows = [r for r in aggregated if r["trace"] == trace]
    if not rows or max(r["runs"] for r in rows) < 2:
        return []
    out = [
        "",
        "Mean ± half-width of the 95% t-interval over the repetitions:",
        "",
        "| contender | load | runs | TTFT p50 ms | TTFT p99 ms | E2E p99 ms | prefix hit | errors | shed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = " | ".join(_pm(r, key) for key in AGGREGATED)
        out.append(f"| {r['policy']} | {r['load']} | {r['runs']} | {cells} |")
    out += ["", f"Differences from `{DEFAULT}` outside both intervals (theirs / the default's):", ""]
    found = False
    ours = {r["load"]: r for r in rows if r["policy"] == DEFAULT}
    for r in rows:
        mine = ours.get(r["load"])
        if mine is None or r["policy"] == DEFAULT:
            continue
        apart = [
            f"{label} {r[key] / mine[key]:.2f}x"
            for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("prefix_hit_rate", "hit"))
            if _disjoint(r, mine, key) and mine[key]
        ]
        if apart:
            found = True
            out.append(f"- load {r['load']}, {r['policy']}: {', '.join(apart)}")
    if not found:
        out.append("- none" if ours else f"- `{DEFAULT}` did not run")
    return out


def _pm(row: dict[str, Any], key: str) -> str:
    half = row.get(f"{key}_ci95")
    return _fmt(row.get(key)) + ("" if half is None else f" ± {_fmt(half)}")


def _disjoint(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    """Whether the 95% intervals of ``key`` in two aggregated rows do not overlap (False where either is missing)."""
    values = [a.get(key), b.get(key), a.get(f"{key}_ci95"), b.get(f"{key}_ci95")]
    known = [float(v) for v in values if v is not None]
    if len(known) < len(values):
        return False
    mean_a, mean_b, half_a, half_b = known
    return abs(mean_a - mean_b) > half_a + half_b


def _fleet_text(fleet: dict[str, Any]) -> str:
    """ "16 x h100-llama3.1-8b", or a mixed fleet's "16 servers: h100-llama3.1-8b:8,l4-llama3.2-3b:8"."""
    profile = str(fleet.get("profile"))
    if ":" in profile:
        return f"{fleet.get('servers')} servers: {profile}"
    return f"{fleet.get('servers')} x {profile}"


def _goodput_text(value: float | None, lowest: float, highest: float) -> str:
    """Goodput as a bound where the sweep did not bracket it: ">= highest" if the SLO held at every load,
    "< lowest" if it held at none."""
    if value is None:
        return f"< {_fmt(lowest)}"
    return f">= {_fmt(value)}" if value >= highest else _fmt(value)


def _fmt(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.1f}".rstrip("0").rstrip(".")
    return str(value)


def _stem(trace: str) -> str:
    return Path(trace).stem


def _plots(
    out: Path,
    rows: Sequence[dict[str, Any]],
    ttfts: dict[tuple[str, str, float], list[float]],
    summary: dict[str, Any],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for trace in summary["traces"]:
        trace_rows = [r for r in rows if r["trace"] == trace]
        if not trace_rows:
            continue
        loads = sorted({r["load"] for r in trace_rows})
        headline = _headline(loads)
        policies = list(dict.fromkeys(r["policy"] for r in trace_rows))
        fig, ax = plt.subplots(figsize=(8, 5))
        for policy in policies:
            values = np.sort(np.asarray(ttfts.get((trace, policy, headline), []), dtype=float))
            if len(values):
                ax.plot(values * 1000, np.arange(1, len(values) + 1) / len(values), label=policy, linewidth=1.2)
        ax.set_xscale("log")
        title = f"{trace}: TTFT CDF at load {headline}"
        _save(fig, ax, out / f"{_stem(trace)}-ttft-cdf.png", title, "TTFT (ms, log scale)", "fraction of requests")

        fig, ax = plt.subplots(figsize=(8, 5))
        means = [r for r in summary.get("aggregate", ()) if r["trace"] == trace] or trace_rows
        for policy in policies:
            points = sorted((r["rate_rps"], r["ttft_p99_ms"]) for r in means if r["policy"] == policy)
            xs = [x for x, y in points if y is not None]
            ys = [y for _, y in points if y is not None]
            ax.plot(xs, ys, marker="o", label=policy, linewidth=1.2, markersize=3)
        slo = summary["traces"][trace]["slo_ttft_p99_ms"]
        if slo:
            ax.axhline(slo, color="black", linestyle="--", linewidth=0.8, label=f"SLO {slo:g} ms")
        ax.set_yscale("log")
        title = f"{trace}: TTFT p99 against load"
        _save(
            fig, ax, out / f"{_stem(trace)}-p99-vs-load.png", title, "offered load (req/s)", "TTFT p99 (ms, log scale)"
        )


def _save(fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Label, grid and legend a plot the same way as every other, write it and free it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from inferlb.bench.suites import script

    sys.exit(script(sys.modules[__name__]))
