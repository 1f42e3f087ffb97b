"""``inferlb demo``: a gateway on loopback (emulated vLLM servers, the picker, a real Envoy) and traffic through it.

By default the demo compares: the same open-loop chat workload goes through Envoy's round robin and then through
the picker, one server turns slow partway through each run, and a side-by-side table and a verdict say what that
did (`inferlb.democompare`). ``--quick`` keeps the short run: a bounded burst of OpenAI-style requests through the
picker and a table of where they went.

Both check Envoy's own access log: every request the picker routed must have gone through the ORIGINAL_DST cluster
to the endpoint the picker named. The exit code says whether that held and every request was answered. In the
quick run each row also shows what the server itself reported: its median time to first token (engine time, from
its request log) and its prefix-cache hit rate (from its vLLM ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from inferlb.democompare import run_comparison
from inferlb.demogateway import DemoStack, refusals, save_heatmap, wait_for_access_log
from inferlb.demoscenario import ScenarioOptions
from inferlb.procs import SERVER_HEADER, ProcessError
from inferlb.scorer.presets import PRESET_NAMES
from inferlb.scorer.promtext import read_vllm
from inferlb.stack import LocalStack, StackOptions

MODEL = "demo-model"
REQUEST_TIMEOUT_S = 30.0
BURST_DEADLINE_S = 120.0
QUICK_HEATMAP_BUCKET_S = 0.5


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """Add ``inferlb demo``'s arguments to its subparser (`inferlb.cli` names this module by string)."""
    demo.add_argument("--backends", type=int, default=3, help="emulated vLLM servers (default 3)")
    demo.add_argument(
        "--policy", default="default", choices=PRESET_NAMES, help="the picker's preset (default: default)"
    )
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="logs and rendered configs go here")
    demo.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals in each run (default 30)")
    demo.add_argument("--rate", type=float, default=12.0, help="requests per second, Poisson arrivals (default 12)")
    demo.add_argument(
        "--slow-at", type=float, default=10.0, help="seconds into each run a server turns slow (default 10)"
    )
    demo.add_argument("--slowdown", type=float, default=10.0, help="how many times slower it turns (default 10)")
    demo.add_argument("--seed", type=int, default=18, help="seed of the workload (default 18)")
    quick = demo.add_argument_group("--quick", "the short run: a burst through the picker alone, no comparison")
    quick.add_argument("--quick", action="store_true", help="the short run (CI)")
    quick.add_argument("--requests", type=int, default=120, help="requests in the burst (default 120)")
    quick.add_argument("--concurrency", type=int, default=8, help="workers sending the burst (default 8)")


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """``quick``: the short burst (``requests`` from ``concurrency`` workers); otherwise the comparison that
    ``scenario`` describes. ``policy``: the picker's preset in both."""

    backends: int = 3
    quick: bool = False
    requests: int = 120
    concurrency: int = 8
    policy: str = "default"
    scenario: ScenarioOptions = field(default_factory=ScenarioOptions)


@dataclass(slots=True)
class Outcome:
    status: int
    backend: str
    streamed: bool
    events: int
    request_id: str
    error: str = ""


def run_demo(options: DemoOptions, out_dir: Path, stream: TextIO = sys.stdout) -> int:
    """Run the demo; returns the process exit code (0: every check passed). ValueError for a bad option."""
    if options.quick:
        if options.backends < 1 or options.requests < options.backends or options.concurrency < 1:
            raise ValueError("need backends >= 1, requests >= backends and concurrency >= 1")
    else:
        options.scenario.check()
        if options.backends < 2:
            raise ValueError("the comparison needs --backends >= 2: one server is slowed, the others are not")
    out_dir = out_dir.resolve()
    stack_options = StackOptions(
        backends=options.backends,
        models=(MODEL,),
        policy=options.policy,
        spans=True,
        # Buckets that fit the run: the burst lasts a second or two, the comparison's runs half a minute each.
        heatmap_bucket_s=QUICK_HEATMAP_BUCKET_S if options.quick else options.scenario.heatmap_bucket_s,
    )
    print(f"inferlb demo: starting {options.backends} emulated vLLM servers, the picker and Envoy ...", file=stream)
    try:
        if not options.quick:
            demo_stack = DemoStack(stack_options, out_dir)
            with demo_stack:
                print(
                    f"gateway {demo_stack.gateway_url} -> picker {demo_stack.picker_address} ({options.policy})",
                    file=stream,
                )
                print(
                    f"round robin {demo_stack.round_robin_url} -> Envoy's ROUND_ROBIN over the same servers",
                    file=stream,
                )
                return run_comparison(demo_stack, options.scenario, options.policy, out_dir, stream)
        with LocalStack(stack_options, out_dir) as stack:
            print(f"gateway {stack.gateway_url} -> picker {stack.picker_address} ({options.policy})", file=stream)
            started = time.monotonic()
            outcomes = asyncio.run(_burst(stack.gateway_url, options))
            elapsed = time.monotonic() - started
            refused = asyncio.run(refusals(stack.gateway_url))
            expected = len(outcomes) + len(refused)
            log = wait_for_access_log(stack, lambda entries: len(entries) >= expected)
            code = _report(stack, options, outcomes, refused, log, elapsed, out_dir, stream)
            heatmap = save_heatmap(stack, sum(o.status == 200 for o in outcomes), out_dir / "heatmap.png")
            print(f"latency heatmap from the servers' spans: {heatmap}", file=stream)
            return code
    except (ProcessError, httpx.HTTPError) as exc:
        print(f"inferlb demo: a process failed: {exc}\n(logs in {out_dir})", file=stream)
        return 1


def _request(i: int) -> tuple[str, dict[str, Any]]:
    """Request ``i`` of the burst: completions and chat, streamed and not, prompts of different lengths."""
    prompt = "Explain continuous batching in one sentence. " * (1 + i % 7)
    stream = i % 2 == 1
    if i % 4 < 2:
        return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8 + i % 9, "stream": stream}
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": stream}
    return "/v1/chat/completions", body


async def _burst(base_url: str, options: DemoOptions) -> list[Outcome]:
    """``options.requests`` requests from ``options.concurrency`` workers (closed loop); no new request
    starts after ``BURST_DEADLINE_S`` seconds."""
    outcomes: list[Outcome] = []
    numbers = iter(range(options.requests))
    deadline = time.monotonic() + BURST_DEADLINE_S
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:

        async def worker() -> None:
            for i in numbers:  # shared: each request number is taken by exactly one worker
                if time.monotonic() > deadline:
                    return
                path, body = _request(i)
                try:
                    outcomes.append(await _send(client, path, body))
                except httpx.HTTPError as exc:
                    outcomes.append(Outcome(0, "", False, 0, "", repr(exc)))

        await asyncio.gather(*(worker() for _ in range(options.concurrency)))
    return outcomes


async def _send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    streamed = bool(body.get("stream"))
    async with client.stream("POST", path, json=body) as response:
        events = 0
        if streamed:
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
        else:
            await response.aread()
        return Outcome(
            status=response.status_code,
            backend=response.headers.get(SERVER_HEADER, ""),
            streamed=streamed,
            events=events,
            request_id=response.headers.get("x-request-id", ""),
        )


def _server_view(address: str) -> tuple[str, str]:
    """(median TTFT, prefix-cache hit rate) as the server at ``address`` reports them; "-" where it cannot say."""
    try:
        log = httpx.get(f"http://{address}/admin/requests", timeout=5).json()["requests"]
        snapshot = read_vllm(httpx.get(f"http://{address}/metrics", timeout=5).content)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return "-", "-"
    ttfts = [e["ttft_s"] for e in log if isinstance(e.get("ttft_s"), float)]
    ttft = f"{1000 * statistics.median(ttfts):.0f} ms" if ttfts else "-"
    queries, hits = snapshot.prefix_cache_queries, snapshot.prefix_cache_hits
    rate = f"{hits / queries:.0%}" if queries and hits is not None else "-"
    return ttft, rate


def _report(
    stack: LocalStack,
    options: DemoOptions,
    outcomes: list[Outcome],
    refusals: list[tuple[str, int, str]],
    log: list[dict[str, Any]],
    elapsed: float,
    out_dir: Path,
    stream: TextIO,
) -> int:
    ok = [o for o in outcomes if o.status == 200]
    per_backend = Counter(o.backend for o in ok)
    streamed = Counter(o.backend for o in ok if o.streamed)
    routed = [e for e in log if e.get("path", "").startswith("/v1/") and str(e.get("status")) == "200"]
    by_picker = [e for e in routed if e.get("cluster") == "inferlb_picked" and e.get("upstream") == e.get("picked")]
    fallback = [e for e in routed if e.get("cluster") == "inferlb_fallback"]

    p = lambda *a: print(*a, file=stream)  # noqa: E731
    p("")
    p(f"{'endpoint':<22}{'requests':>9}{'streamed':>10}{'share':>8}{'TTFT p50':>11}{'prefix hits':>13}")
    for address in stack.endpoints:
        n = per_backend.get(address, 0)
        ttft, hits = _server_view(address)
        p(f"{address:<22}{n:>9}{streamed.get(address, 0):>10}{n / max(len(ok), 1):>8.0%}{ttft:>11}{hits:>13}")
    p(f"{'total':<22}{len(ok):>9}{sum(streamed.values()):>10}")
    p("")
    p(f"{len(ok)}/{len(outcomes)} requests answered 200 in {elapsed:.1f} s (concurrency {options.concurrency})")
    p(f"routed by the picker through Envoy's ORIGINAL_DST cluster: {len(by_picker)}/{len(routed)} (access log)")
    p(f"sent to the fallback cluster: {len(fallback)}")
    for name, status, text in refusals:
        p(f"refused by the picker, {name}: HTTP {status} {text.strip()}")
    p(f"logs, picker config and Envoy bootstrap: {out_dir}")

    failures = []
    if len(outcomes) < options.requests:
        failures.append(
            f"only {len(outcomes)} of {options.requests} requests were sent within {BURST_DEADLINE_S:.0f} s"
        )
    if len(ok) != len(outcomes):
        errors = Counter(o.error or f"HTTP {o.status}" for o in outcomes if o.status != 200)
        failures.append(f"{len(outcomes) - len(ok)} requests failed: {dict(errors)}")
    if missing := [a for a in stack.endpoints if not per_backend.get(a)]:
        failures.append(f"endpoints that got no requests: {', '.join(missing)}")
    if len(by_picker) != len(ok):
        failures.append(f"only {len(by_picker)} of {len(ok)} requests were routed by the picker")
    if [s for _, s, _ in refusals] != [400, 404]:
        failures.append(f"refusals answered {[s for _, s, _ in refusals]}, expected [400, 404]")
    for failure in failures:
        p(f"FAILED: {failure}")
    if not failures:
        p("OK: every endpoint got requests, all of them routed by the picker through a real Envoy.")
    return 1 if failures else 0
