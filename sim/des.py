"""The discrete-event fleet simulator: the emulated engine on a virtual clock, driven by a list of arrivals.

A routing policy is a plain callable ``policy(request, view) -> server index``, or `Hold` to be asked again later
(admission control holding a request for capacity: the wait counts in the request's times), or `Refuse` (the
request ends at once, as a 429 would end it). It sees what a real picker sees
(`FleetView`): each server's metrics as of the last scrape (scraped every ``scrape_interval_s``, so up to that old),
and its own counts of requests and prompt tokens routed to each server and not yet finished. ``view.engines``
exposes the exact engine state for an oracle policy, the bound to measure others against; a fair policy must not
read it.

A request routed to a server that is not ready (cold start after a crash) or that the error-rate fault rejects
ends at once with an error, as a real request would get a 503 or a 500. Faults can be scheduled at given times.
Each arrival's record says where it went and its queue time, time to first token, end-to-end time and cached
prompt tokens. Time is in seconds from the first arrival's clock origin (0).
"""

from __future__ import annotations

import heapq
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inferlb.sim.engine import EngineModel, EngineOptions, RequestState, SimRequest
from inferlb.sim.profiles import ServerProfile
from inferlb.sim.traces import Trace, block_keys

__all__ = [
    "Arrival",
    "FaultEvent",
    "FleetView",
    "Hold",
    "Policy",
    "Refuse",
    "RequestRecord",
    "ServerSnapshot",
    "SimResult",
    "simulate",
    "trace_arrivals",
]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to replay: arrives at ``at`` seconds; ``prompt_hashes`` at the servers' block size."""

    id: str
    at: float
    prompt_tokens: int
    output_tokens: int
    prompt_hashes: Sequence[int] = ()
    tag: object = None


@dataclass(frozen=True, slots=True)
class ServerSnapshot:
    """One scrape of a server's metrics, the fields a picker reads from vLLM's ``/metrics`` and the GPU agent's
    view (``gpu_utilization``: the share of time in steps since the previous scrape, 0..1)."""

    scraped_at: float
    ready: bool
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_gpu_blocks: int
    block_size: int
    gpu_utilization: float = 0.0


@dataclass(slots=True)
class FleetView:
    """What a policy may look at. Lists are indexed by server; ``snapshots[i]`` is None before the first scrape.

    Treat it as read-only; it is updated in place between calls.
    """

    now: float
    servers: tuple[str, ...]
    snapshots: list[ServerSnapshot | None]
    inflight: list[int]
    inflight_tokens: list[int]
    engines: tuple[EngineModel, ...]


@dataclass(frozen=True, slots=True)
class Hold:
    """A policy's answer: present this arrival again at ``until`` (seconds, not before now)."""

    until: float


@dataclass(frozen=True, slots=True)
class Refuse:
    """A policy's answer: the request is refused (its record's error is ``reason``); it reaches no server."""

    reason: str = "refused"


Policy = Callable[[Arrival, FleetView], "int | Hold | Refuse"]


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """At ``at`` seconds, on server ``server``: ``kind`` is "slowdown" (value: factor), "hang" (value: 1 on,
    0 off), "error_rate" (value: 0..1) or "crash" (value ignored; the server restarts with a cold start)."""

    at: float
    server: int
    kind: str
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("slowdown", "hang", "error_rate", "crash"):
            raise ValueError(f"FaultEvent.kind must be slowdown, hang, error_rate or crash; got {self.kind!r}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one arrival. Times in seconds; None when the request never got that far.

    ``error`` is None on success, else "unavailable" (server not ready), "rejected" (error fault), "aborted"
    (lost in a crash), "unfinished" (still running when the simulation stopped) or the reason of a policy's
    `Refuse` (then ``server`` is -1). Times count from the arrival, a policy's `Hold` included.
    """

    id: str
    server: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    cached_tokens: int
    preemptions: int
    error: str | None


@dataclass(frozen=True, slots=True)
class ServerStats:
    """Totals of one server over the run."""

    name: str
    requests: int
    busy_s: float
    steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """Records in arrival order, per-server totals, the simulated span and the wall time the run took."""

    records: tuple[RequestRecord, ...]
    servers: tuple[ServerStats, ...]
    simulated_s: float
    wall_s: float
    events: int = 0
    policy_errors: int = 0
    notes: tuple[str, ...] = field(default=())


_SERVER, _FAULT, _SCRAPE, _ARRIVAL = 0, 1, 2, 3  # ties at one instant: steps end before anything else happens


def _snapshot(engine: EngineModel, now: float, utilization: float) -> ServerSnapshot:
    return ServerSnapshot(
        scraped_at=now,
        ready=engine.ready,
        running=len(engine.running),
        waiting=len(engine.waiting),
        kv_cache_usage=engine.cache.usage,
        prefix_cache_queries=engine.prefix_queries,
        prefix_cache_hits=engine.prefix_hits,
        num_gpu_blocks=engine.cache.num_blocks,
        block_size=engine.cache.block_size,
        gpu_utilization=utilization,
    )


def simulate(
    arrivals: Sequence[Arrival],
    policy: Policy,
    profiles: Sequence[ServerProfile],
    *,
    seed: int = 0,
    jitter: float = 0.02,
    scrape_interval_s: float = 0.1,
    faults: Sequence[FaultEvent] = (),
    drain: bool = True,
    max_time_s: float | None = None,
    on_finish: Callable[[RequestRecord, float], None] | None = None,
) -> SimResult:
    """Replay ``arrivals`` (any order; sorted by time here) on one server per profile, routed by ``policy``.

    Server i is seeded with ``seed + i``. With ``drain`` the run goes on until every request has ended (bounded
    by ``max_time_s`` if given); otherwise it stops at the last arrival. A policy that raises or returns an index
    out of range is counted in ``policy_errors`` and its request goes to server ``hash(id) % n`` instead.
    ``on_finish(record, now)`` is told of every request that ends, when it ends (a span's moment), the ones a
    server refused at once included.
    """
    if not profiles:
        raise ValueError("simulate() needs at least one server profile")
    if not scrape_interval_s > 0:
        raise ValueError(f"scrape_interval_s must be > 0; got {scrape_interval_s!r}")
    started = time.perf_counter()
    n = len(profiles)
    engines = tuple(
        EngineModel(profile, EngineOptions(seed=seed + i, jitter=jitter)) for i, profile in enumerate(profiles)
    )
    names = tuple(f"server-{i}" for i in range(n))
    view = FleetView(0.0, names, [None] * n, [0] * n, [0] * n, engines)
    ordered = sorted(arrivals, key=lambda a: a.at)
    records: list[RequestRecord | None] = [None] * len(ordered)
    pending: dict[int, tuple[int, int]] = {}  # id(SimRequest) -> (arrival index, server)
    routed_at: dict[int, float] = {}  # arrival index -> when a policy that held it routed it
    live: dict[int, SimRequest] = {}
    requests_per_server = [0] * n
    policy_errors = 0
    events = 0

    heap: list[tuple[float, int, int, int]] = []  # (time, kind, seq, payload)
    seq = 0
    versions = [0] * n
    ends: list[float | None] = [None] * n

    other_events = 0  # entries in the heap that are not scrapes; scraping stops when none are left

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq, other_events
        seq += 1
        if kind != _SCRAPE:
            other_events += 1
        heapq.heappush(heap, (t, kind, seq, payload))

    def resync(i: int) -> None:
        end = engines[i].segment_end()
        if end != ends[i]:
            ends[i] = end
            versions[i] += 1
            if end is not None:
                push(end, _SERVER, i * (1 << 32) + versions[i])

    def settle(i: int) -> None:
        engine = engines[i]
        while engine.finished:
            request = engine.finished.popleft()
            k, server = pending.pop(id(request))
            arrival = ordered[k]
            live.pop(id(request), None)
            view.inflight[server] -= 1
            view.inflight_tokens[server] -= arrival.prompt_tokens
            error = None if request.state is RequestState.FINISHED else "aborted"
            record = records[k] = _record(arrival, server, request, error, routed_at.get(k))
            if on_finish is not None:
                on_finish(record, view.now)

    for k, arrival in enumerate(ordered):
        push(arrival.at, _ARRIVAL, k)
    for k, fault in enumerate(faults):
        if not 0 <= fault.server < n:
            raise ValueError(f"faults[{k}].server must be in 0..{n - 1}; got {fault.server}")
        push(fault.at, _FAULT, k)
    last_arrival = ordered[-1].at if ordered else 0.0
    push(0.0, _SCRAPE, 0)
    now = 0.0
    last_scrape = 0.0
    last_busy = [0.0] * n

    while heap:
        t, kind, _, payload = heapq.heappop(heap)
        if max_time_s is not None and t > max_time_s:
            break
        if kind != _SCRAPE:
            other_events -= 1
        elif t > last_arrival and (not drain or other_events == 0):
            continue
        now = t
        view.now = t
        events += 1
        if kind == _SERVER:
            i, version = divmod(payload, 1 << 32)
            if version != versions[i]:
                continue
            ends[i] = None
            engines[i].advance(t)
            settle(i)
            resync(i)
        elif kind == _ARRIVAL:
            arrival = ordered[payload]
            try:
                answer = policy(arrival, view)
                if isinstance(answer, Hold):
                    push(max(answer.until, t), _ARRIVAL, payload)
                    continue
                if isinstance(answer, Refuse):
                    records[payload] = record = _refused(arrival, answer.reason)
                    if on_finish is not None:
                        on_finish(record, t)
                    continue
                if not (isinstance(answer, int) and 0 <= answer < n):
                    raise ValueError(f"policy returned {answer!r}")
                i = answer
            except Exception:
                policy_errors += 1
                i = zlib.crc32(arrival.id.encode()) % n
            if t > arrival.at:
                routed_at[payload] = t
            requests_per_server[i] += 1
            engine = engines[i]
            engine.advance(t)
            settle(i)
            request = SimRequest(arrival.id, arrival.prompt_tokens, arrival.output_tokens, arrival.prompt_hashes)
            if not engine.ready or not engine.add(request):
                error = "unavailable" if not engine.ready else "rejected"
                records[payload] = record = _record(arrival, i, request, error, routed_at.get(payload))
                if on_finish is not None:
                    on_finish(record, t)
            else:
                pending[id(request)] = (payload, i)
                live[id(request)] = request
                view.inflight[i] += 1
                view.inflight_tokens[i] += arrival.prompt_tokens
            resync(i)
        elif kind == _SCRAPE:
            span = t - last_scrape
            for i, engine in enumerate(engines):
                engine.advance(t)
                settle(i)
                resync(i)
                utilization = min(1.0, (engine.busy_s - last_busy[i]) / span) if span > 0 else 0.0
                last_busy[i] = engine.busy_s
                view.snapshots[i] = _snapshot(engine, t, utilization)
            last_scrape = t
            push(t + scrape_interval_s, _SCRAPE, 0)
        else:
            fault = faults[payload]
            engine = engines[fault.server]
            engine.advance(t)
            settle(fault.server)
            if fault.kind == "slowdown":
                engine.set_slowdown(fault.value)
            elif fault.kind == "hang":
                engine.set_hung(bool(fault.value))
            elif fault.kind == "error_rate":
                engine.error_rate = fault.value
            else:
                engine.restart()
                settle(fault.server)
            resync(fault.server)
        if not drain and t >= last_arrival and kind == _ARRIVAL and payload == len(ordered) - 1:
            break

    for request in live.values():
        k, server = pending[id(request)]
        records[k] = _record(ordered[k], server, request, "unfinished", routed_at.get(k))
    stats = tuple(
        ServerStats(
            name=names[i],
            requests=requests_per_server[i],
            busy_s=engine.busy_s,
            steps=engine.steps,
            prefix_cache_queries=engine.prefix_queries,
            prefix_cache_hits=engine.prefix_hits,
            preemptions=engine.preemptions,
        )
        for i, engine in enumerate(engines)
    )
    return SimResult(
        records=tuple(r for r in records if r is not None),
        servers=stats,
        simulated_s=now,
        wall_s=time.perf_counter() - started,
        events=events,
        policy_errors=policy_errors,
    )


def trace_arrivals(trace: Trace, block_size: int) -> list[Arrival]:
    """The requests of ``trace`` as arrivals with prompt block keys at ``block_size`` (the servers' block size).

    Ids are ``"<trace name>/<row index>"``; the keys share leading runs exactly where the synthetic prompts a live
    replay sends (`inferlb.sim.traces.prompt_text`) share leading blocks.
    """
    return [
        Arrival(
            f"{trace.name}/{r.index}",
            r.arrival_s,
            r.prompt_tokens,
            r.output_tokens,
            block_keys(r, block_size, trace.name),
        )
        for r in trace.requests
    ]


def _record(
    arrival: Arrival, server: int, request: SimRequest, error: str | None, routed_at: float | None = None
) -> RequestRecord:
    held = 0.0 if routed_at is None else routed_at - arrival.at  # a policy's Hold: part of every time

    def plus(seconds: float | None) -> float | None:
        return None if seconds is None else seconds + held

    return RequestRecord(
        id=arrival.id,
        server=server,
        arrival_s=arrival.at,
        prompt_tokens=arrival.prompt_tokens,
        output_tokens=request.output,
        queue_s=plus(request.queue_s),
        ttft_s=plus(request.ttft_s),
        e2e_s=plus(request.e2e_s) if error is None else None,
        cached_tokens=request.cached_tokens,
        preemptions=request.preemptions,
        error=error,
    )


def _refused(arrival: Arrival, reason: str) -> RequestRecord:
    return RequestRecord(arrival.id, -1, arrival.at, arrival.prompt_tokens, 0, None, None, None, 0, 0, reason)
