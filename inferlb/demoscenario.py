"""The demo's scenario: one open-loop, shared-prefix chat workload, replayed through a gateway while one server is
slowed partway through, and what the client and the servers saw of it.

`workload` draws the arrivals (seeded: the same for every run); `replay` sends them at their times, streamed,
whatever happened to the earlier ones (open loop), slows one server by the emulated servers' fault-injection
endpoint at ``slow_at_s`` and restores it at the end, and measures TTFT at the client from the first streamed
token. `RunResult` keeps the records and the servers' prefix-cache counters over the run.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import orjson

from inferlb.procs import SERVER_HEADER
from inferlb.scorer.promtext import read_vllm

MODEL = "demo-model"
REQUEST_TIMEOUT_S = 60.0
MAX_REQUESTS = 5_000


@dataclass(frozen=True, slots=True)
class ScenarioOptions:
    """The workload and the fault. ``rate`` requests per second arrive (Poisson) for ``duration_s`` seconds; the
    prompts share one of ``prefixes`` system prompts; ``slow_at_s`` seconds into each run one server gets
    ``slowdown`` times slower (engine steps), until the run ends."""

    duration_s: float = 30.0
    rate: float = 12.0
    slow_at_s: float = 10.0
    slowdown: float = 10.0
    prefixes: int = 8
    seed: int = 18
    heatmap_bucket_s: float = 3.0

    def check(self) -> None:
        """ValueError naming the option that is out of range."""
        if not 1 <= self.duration_s <= 600:
            raise ValueError(f"--duration must be 1..600 seconds; got {self.duration_s}")
        if not 0 < self.rate <= 200:
            raise ValueError(f"--rate must be in (0, 200] requests per second; got {self.rate}")
        if not 0 <= self.slow_at_s < self.duration_s:
            raise ValueError(f"--slow-at must be in [0, --duration); got {self.slow_at_s}")
        if not 1 <= self.slowdown <= 100:
            raise ValueError(f"--slowdown must be 1..100; got {self.slowdown}")
        if not 1 <= self.prefixes <= 1000:
            raise ValueError(f"--prefixes must be 1..1000; got {self.prefixes}")
        if not 0.1 <= self.heatmap_bucket_s <= 3600:
            raise ValueError(f"the heatmap's bucket must be 0.1..3600 seconds; got {self.heatmap_bucket_s}")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the workload: sent ``at`` seconds into the run, under system prompt ``family``."""

    at: float
    family: int
    question: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Record:
    """What the client saw of one request; times in seconds, ``sent_s`` from the run's start."""

    sent_s: float
    status: int
    server: str
    request_id: str
    ttft_s: float | None
    e2e_s: float | None
    error: str | None


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: its records (in arrival order), the slowed server, and the servers' prefix-cache hits and queries
    over the run (None where a server's ``/metrics`` could not say)."""

    name: str
    records: tuple[Record, ...]
    slowed: str
    slow_at_s: float
    prefix_hits: int | None
    prefix_queries: int | None
    elapsed_s: float


def workload(options: ScenarioOptions) -> list[Arrival]:
    """The seeded arrivals: Poisson at ``rate`` for ``duration_s`` seconds (at most MAX_REQUESTS)."""
    rng = random.Random(options.seed)
    out: list[Arrival] = []
    t = rng.expovariate(options.rate)
    while t < options.duration_s and len(out) < MAX_REQUESTS:
        family = rng.randrange(options.prefixes)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(200, 900)))
        out.append(Arrival(t, family, f"question {len(out)}: {words}?", rng.randrange(32, 160)))
        t += rng.expovariate(options.rate)
    return out


_WORDS = ("batch", "cache", "prefix", "token", "queue", "latency", "server", "request", "stream", "model", "decode")


def system_prompt(family: int, salt: str, seed: int) -> str:
    """System prompt ``family``: 1-3k tokens, the same for a given seed. ``salt`` starts it, so that two runs with
    different salts share no cached prefix (each run starts from cold caches on the same servers)."""
    rng = random.Random(seed * 1_000 + family)
    body = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(700, 2_000)))
    return f"[{salt}] You are assistant {family}. Answer briefly. Background: {body}"


class Progress:
    """Counters of a run in flight, for the progress line."""

    def __init__(self, total: int) -> None:
        self.total, self.sent, self.done, self.failed = total, 0, 0, 0


async def replay(
    base_url: str,
    arrivals: Sequence[Arrival],
    *,
    name: str,
    salt: str,
    endpoints: Sequence[str],
    slowed: str,
    options: ScenarioOptions,
    report: Callable[[str], None],
    every_s: float,
) -> RunResult:
    """Send ``arrivals`` to ``base_url`` at their times; slow ``slowed`` at ``options.slow_at_s`` and restore it
    at the end. ``report`` gets a progress line every ``every_s`` seconds. Bounded: each request by
    REQUEST_TIMEOUT_S; the run ends when the last one has."""
    systems = {f: system_prompt(f, salt, options.seed) for f in {a.family for a in arrivals}}
    before = await asyncio.gather(*(_prefix_counters(a) for a in endpoints))
    progress = Progress(len(arrivals))
    # Without TCP_NODELAY a small request body waits behind its headers for the server's delayed ACK (~40 ms).
    transport = httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), transport=transport) as client:
        start = time.monotonic()
        fault = asyncio.create_task(_slow_later(client, slowed, start + options.slow_at_s, options.slowdown))
        ticker = asyncio.create_task(_tick(progress, start, name, slowed, options, report, every_s))
        try:
            records = await asyncio.gather(
                *(_one(client, base_url, a, systems[a.family], start, progress) for a in arrivals)
            )
            await fault  # a fault that could not be set is an error of the run
        finally:
            ticker.cancel()
            fault.cancel()
            await _set_slowdown(client, slowed, 1.0)
        elapsed = time.monotonic() - start
    after = await asyncio.gather(*(_prefix_counters(a) for a in endpoints))
    hits = _delta([b[0] for b in before], [a[0] for a in after])
    queries = _delta([b[1] for b in before], [a[1] for a in after])
    return RunResult(name, tuple(records), slowed, options.slow_at_s, hits, queries, elapsed)


async def _one(
    client: httpx.AsyncClient, base_url: str, arrival: Arrival, system: str, start: float, progress: Progress
) -> Record:
    delay = start + arrival.at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    progress.sent += 1
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": arrival.question}],
        "max_tokens": arrival.max_tokens,
        "stream": True,
    }
    first = None
    server = request_id = ""
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            server = response.headers.get(SERVER_HEADER) or ""
            request_id = response.headers.get("x-request-id") or ""
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _done(progress, Record(sent - start, response.status_code, server, request_id, None, None, text))
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and _has_content(line[6:]):
                    first = time.monotonic()
    except httpx.HTTPError as exc:
        failure = f"{type(exc).__name__}: {exc}"
        return _done(progress, Record(sent - start, 0, server, request_id, None, None, failure))
    end = time.monotonic()
    ttft = None if first is None else first - sent
    error = None if first is not None else "the stream had no token"
    return _done(progress, Record(sent - start, 200, server, request_id, ttft, end - sent, error))


def _has_content(data: str) -> bool:
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ()))


def _done(progress: Progress, record: Record) -> Record:
    progress.done += 1
    progress.failed += record.error is not None
    return record


async def _set_slowdown(client: httpx.AsyncClient, address: str, slowdown: float) -> None:
    response = await client.post(f"http://{address}/admin/faults", json={"slowdown": slowdown}, timeout=10.0)
    response.raise_for_status()


async def _slow_later(client: httpx.AsyncClient, address: str, at: float, slowdown: float) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    await _set_slowdown(client, address, slowdown)


async def _tick(
    progress: Progress,
    start: float,
    name: str,
    slowed: str,
    options: ScenarioOptions,
    report: Callable[[str], None],
    every_s: float,
) -> None:
    while True:
        await asyncio.sleep(every_s)
        t = time.monotonic() - start
        fault = f"{slowed} {options.slowdown:g}x slower" if t >= options.slow_at_s else f"{slowed} slows at"
        report(
            f"{name:<12} {t:5.1f} s  sent {progress.sent}/{progress.total}  answered {progress.done}  "
            f"in flight {progress.sent - progress.done}  failed {progress.failed}  "
            f"({fault} {options.slow_at_s:g} s)"
        )


async def _prefix_counters(address: str) -> tuple[int | None, int | None]:
    """(prefix-cache hits, queries) as the server's vLLM ``/metrics`` counts them; None where it cannot say."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            snapshot = read_vllm((await client.get(f"http://{address}/metrics")).content)
    except (httpx.HTTPError, ValueError):
        return None, None
    return snapshot.prefix_cache_hits, snapshot.prefix_cache_queries


def _delta(before: list[int | None], after: list[int | None]) -> int | None:
    total = 0
    for b, a in zip(before, after, strict=True):
        if a is None or b is None:
            return None
        total += a - b
    return total
