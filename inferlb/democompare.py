"""``inferlb demo``'s comparison: the same workload through Envoy's round robin and through the picker, on one
Envoy and one fleet of emulated servers, with one server slowed partway through each run; a side-by-side table,
a verdict computed from it, and the picker's heatmap of the second run.

Both runs go through the same Envoy process (two listeners) to the same servers. Each run's prompts start with
their own salt, so the second run finds none of the first run's prefixes in the servers' caches: both start cold.
The picker sees no request of the round-robin run (its span receiver joins spans to its own decisions only), so
the second run starts from what the picker would know of a fresh fleet. The exit code says whether every request
was answered and went where the run meant it to go (Envoy's access log), and the picker refused the two bad
requests; it does not depend on which policy did better.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from inferlb.demogateway import (
    PICKED_CLUSTER,
    ROUND_ROBIN_CLUSTER,
    DemoStack,
    refusals,
    save_heatmap,
    wait_for_access_log,
)
from inferlb.demoscenario import RunResult, ScenarioOptions, replay, workload


def run_comparison(stack: DemoStack, options: ScenarioOptions, policy: str, out_dir: Path, stream: TextIO) -> int:
    """Both runs on a started ``stack``; prints progress, the table and the verdict; returns the exit code."""
    p = _printer(stream)
    arrivals = workload(options)
    slowed = stack.endpoints[0]
    p(
        f"workload: {len(arrivals)} streamed chat requests over {options.duration_s:g} s (open loop, "
        f"{options.rate:g}/s, {options.prefixes} shared system prompts), the same in both runs; "
        f"{slowed} turns {options.slowdown:g}x slower {options.slow_at_s:g} s into each run"
    )
    p(
        "both runs go through this one Envoy to the same servers; each run's prompts start with a salt of their own, "
        "so each run starts from cold prefix caches"
    )
    png, page = out_dir / "heatmap.png", out_dir / "heatmap.html"
    p(f"live heatmap while inferlb routes: {stack.picker_admin_url}/heatmap (saved at the end to {png} and {page})")
    runs = []
    for name, url, salt in (
        ("round robin", stack.round_robin_url, "run 1"),
        (f"inferlb {policy}", stack.gateway_url, "run 2"),
    ):
        p(f"{name}: through {url} ...")
        result = asyncio.run(
            replay(
                url,
                arrivals,
                name=name,
                salt=salt,
                endpoints=stack.endpoints,
                slowed=slowed,
                options=options,
                report=_progress(stream),
                every_s=0.5 if stream.isatty() else 5.0,
            )
        )
        if stream.isatty():
            stream.write("\n")
        runs.append(result)
    rr, ours = runs
    refused = asyncio.run(refusals(stack.gateway_url))
    ids = {r.request_id for run in runs for r in run.records if r.request_id}
    log = wait_for_access_log(stack, lambda entries: ids <= {e.get("request_id") for e in entries})

    p("")
    for line in table(rr, ours):
        p(line)
    p("")
    for line in share_timeline(rr, ours):
        p(line)
    p("")
    p(verdict(rr, ours))
    p("")
    failures = route_failures(rr, ours, log, p)
    for name, status, text in refused:
        p(f"refused by the picker, {name}: HTTP {status} {text.strip()}")
    if [s for _, s, _ in refused] != [400, 404]:
        failures.append(f"refusals answered {[s for _, s, _ in refused]}, expected [400, 404]")
    heatmap = save_heatmap(stack, sum(r.status == 200 for r in ours.records), png, page)
    p(f"latency heatmap of the inferlb run, from the servers' spans: {heatmap}")
    p(f"logs, picker config and Envoy bootstrap: {out_dir}")
    for failure in failures:
        p(f"FAILED: {failure}")
    if not failures:
        p("OK: every request answered, each run through the route it was meant to take, through one real Envoy.")
    return 1 if failures else 0


def route_failures(rr: RunResult, ours: RunResult, log: list[dict[str, Any]], p: Callable[..., None]) -> list[str]:
    """Print where each run's requests went by Envoy's access log; what was not as meant, and the failed requests."""
    by_id = {e.get("request_id"): e for e in log}
    failures = []
    for run, cluster in ((rr, ROUND_ROBIN_CLUSTER), (ours, PICKED_CLUSTER)):
        entries = [by_id.get(r.request_id) for r in run.records]
        if cluster == PICKED_CLUSTER:
            routed = sum(
                1 for e in entries if e and e.get("cluster") == cluster and e.get("upstream") == e.get("picked")
            )
            how = "routed by the picker through Envoy's ORIGINAL_DST cluster"
        else:
            routed = sum(1 for e in entries if e and e.get("cluster") == cluster)
            how = "routed by Envoy's ROUND_ROBIN cluster"
        p(f"{run.name}: {how}: {routed}/{len(run.records)} (access log)")
        if routed != len(run.records):
            failures.append(f"{run.name}: only {routed} of {len(run.records)} requests went through {cluster}")
        if errors := [r for r in run.records if r.error is not None]:
            failures.append(f"{run.name}: {len(errors)} requests failed, e.g. {errors[0].error!r}")
    return failures


def table(rr: RunResult, ours: RunResult) -> list[str]:
    """The side-by-side table: one row per measure, one column per run."""

    def row(label: str, cell: Callable[[RunResult], str]) -> tuple[str, str, str]:
        return label, cell(rr), cell(ours)

    rows = [
        ("", rr.name, ours.name),
        row("requests answered", lambda r: f"{_ok(r)}/{len(r.records)}"),
        row("TTFT p50 (client)", lambda r: _seconds(quantile(_ttfts(r), 0.5))),
        row("TTFT p99 (client)", lambda r: _seconds(quantile(_ttfts(r), 0.99))),
        row(f"to the slowed server after {rr.slow_at_s:g} s", _slowed_text),
        row("prefix-cache hit rate (servers)", _hit_rate),
        row("errors", lambda r: str(sum(x.error is not None for x in r.records))),
    ]
    width = max(len(label) for label, _, _ in rows) + 2
    return [f"{label:<{width}}{a:>18}{b:>22}" for label, a, b in rows]


def share_timeline(rr: RunResult, ours: RunResult, windows: int = 6) -> list[str]:
    """The share of each run's requests that went to the slowed server, by when they were sent: about ``windows``
    windows of whole seconds over the arrivals (traffic leaving the slowed server shows as a falling row)."""
    end = max((r.sent_s for run in (rr, ours) for r in run.records), default=0.0)
    width = max(1, math.ceil(end / windows))
    windows = max(1, math.ceil(end / width))
    edges = [f"{i * width}-{(i + 1) * width}" for i in range(windows)]
    label = "sent to the slowed server, by time sent"
    lines = [f"{label:<42}" + "".join(f"{e:>8}" for e in edges) + " s"]
    for run in (rr, ours):
        cells = []
        for i in range(windows):
            sent = [r for r in run.records if r.status == 200 and min(int(r.sent_s / width), windows - 1) == i]
            share = sum(r.server == run.slowed for r in sent) / len(sent) if sent else None
            cells.append("-" if share is None else f"{share:.0%}")
        lines.append(f"{run.name:<42}" + "".join(f"{c:>8}" for c in cells))
    return lines


def verdict(rr: RunResult, ours: RunResult) -> str:
    """One line that compares the runs from the measured numbers, whichever way they went."""
    parts = []
    for label, q in (("TTFT p99", 0.99), ("TTFT p50", 0.5)):
        a, b = quantile(_ttfts(ours), q), quantile(_ttfts(rr), q)
        if a is None or b is None:
            parts.append(f"{label}: not measured")
        else:
            parts.append(f"{label} {_ratio(a, b)} ({_seconds(a)} vs {_seconds(b)})")
    share_ours, share_rr = slowed_share(ours), slowed_share(rr)
    if share_ours is not None and share_rr is not None:
        parts.append(
            f"{share_ours:.0%} of the requests after the slowdown to the slowed server (round robin {share_rr:.0%})"
        )
    return f"{ours.name} vs round robin: " + "; ".join(parts) + "."


def slowed_share(run: RunResult) -> float | None:
    """The share of the requests sent after the slowdown that the slowed server answered (None: none were sent)."""
    after = [r for r in run.records if r.sent_s >= run.slow_at_s and r.status == 200]
    return sum(r.server == run.slowed for r in after) / len(after) if after else None


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered) - 1e-9)  # 1-based; the epsilon keeps 0.99 * 100 at 99
    return ordered[min(len(ordered), max(1, rank)) - 1]


def _ttfts(run: RunResult) -> list[float]:
    return [r.ttft_s for r in run.records if r.ttft_s is not None]


def _ok(run: RunResult) -> int:
    return sum(r.status == 200 and r.error is None for r in run.records)


def _slowed_text(run: RunResult) -> str:
    after = [r for r in run.records if r.sent_s >= run.slow_at_s and r.status == 200]
    share = slowed_share(run)
    slowed = sum(r.server == run.slowed for r in after)
    return f"{slowed}/{len(after)} ({share:.0%})" if share is not None else "-"


def _hit_rate(run: RunResult) -> str:
    if not run.prefix_queries or run.prefix_hits is None:
        return "-"
    return f"{run.prefix_hits / run.prefix_queries:.0%}"


def _ratio(ours: float, theirs: float) -> str:
    """How ``ours`` compares with ``theirs``, lower being better."""
    if ours <= 0 or theirs <= 0 or abs(ours - theirs) / max(ours, theirs) < 0.05:
        return "about the same"
    return f"{theirs / ours:.1f}x lower" if ours < theirs else f"{ours / theirs:.1f}x higher"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _printer(stream: TextIO) -> Callable[..., None]:
    return lambda *a: print(*a, file=stream)


def _progress(stream: TextIO) -> Callable[[str], None]:
    """A progress line: rewritten in place on a terminal, one line each time otherwise."""

    def report(line: str) -> None:
        if stream.isatty():
            stream.write(f"\r{line:<110}")
        else:
            stream.write(line + "\n")
        stream.flush()

    return report
