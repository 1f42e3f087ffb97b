"""inferlb's own work per request, without gRPC: parse what Envoy sends, pick, build the reply.

Measured in process, so that the machine's noise and gRPC's cost (the larger part of a real hop) stay out.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import timeit
from collections.abc import AsyncIterator, Callable

import numpy as np
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from inferlb.bench import callgrind
from inferlb.bench.stats import percentiles
from inferlb.filter.request import apply_body, features_from_headers
from inferlb.filter.server import ExtProcService
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile

# What our bootstrap's forward_rules let Envoy send to the picker.
HEADERS = [(":path", "/v1/completions"), (":method", "POST"), ("x-request-id", "0b55dbbe-f48a-4ba1-8161-2289f44aac2f")]
BODY = json.dumps({"model": "bench-model", "prompt": "Summarise the following text. " * 33, "max_tokens": 64})


def request_messages(with_body: bool) -> list[bytes]:
    """The serialized ProcessingRequest messages of one request, as they arrive on the wire."""
    headers = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in HEADERS]),
            end_of_stream=not with_body,
        )
    )
    if not with_body:
        return [headers.SerializeToString()]
    headers.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    body = ProcessingRequest(request_body=HttpBody(body=BODY.encode(), end_of_stream=True))
    return [headers.SerializeToString(), body.SerializeToString()]


def make_service(endpoints: int, policy: str) -> ExtProcService:
    addresses = [
        {"address": f"10.0.{i // 250}.{i % 250 + 1}:8000", "models": ["bench-model"]} for i in range(endpoints)
    ]
    config = parse_config({"policy": policy, "pool": {"endpoints": addresses}})
    return ExtProcService(
        Engine(Pool(config.endpoints), build_profile(policy, size=len(config.endpoints))),
        max_body_bytes=config.max_body_bytes,
    )


def per_request_us(service: ExtProcService, with_body: bool, rounds: int = 40, n: int = 1000) -> dict[str, float]:
    """Microseconds per request, the best of ``rounds`` interleaved runs of ``n`` (on a noisy machine the
    best run is the least disturbed one, and interleaving keeps a slow spell from hitting one figure only):

    - ``own``: what inferlb adds to any ext_proc server: protobuf parse of Envoy's messages, features from
      headers and body, the pick, the in-flight count, serialising the reply;
    - ``handler``: the same driven through the servicer's async stream handler, without gRPC.
    """
    wire = request_messages(with_body)
    router = service.router

    def own() -> None:
        first = ProcessingRequest.FromString(wire[0])
        features = features_from_headers(first.request_headers.headers.headers)
        replies = service.replies.headers
        if with_body:
            body = ProcessingRequest.FromString(wire[1]).request_body
            features = apply_body(features, body.body, complete=body.end_of_stream, max_bytes=service.max_body_bytes)
            replies = service.replies.body
        routed = router.route(router.admit(features).request)
        replies[routed.decision.endpoint.index].SerializeToString()
        routed.lease.release()

    async def one() -> None:
        async def messages() -> AsyncIterator[ProcessingRequest]:
            for raw in wire:
                yield ProcessingRequest.FromString(raw)

        async for reply in service.Process(messages(), None):
            reply.SerializeToString()

    async def measure() -> dict[str, float]:
        best = {"own": float("inf"), "handler": float("inf")}
        for _ in range(rounds):
            best["own"] = min(best["own"], timeit.timeit(own, number=n) / n * 1e6)
            start = time.perf_counter()
            for _ in range(n):
                await one()
            best["handler"] = min(best["handler"], (time.perf_counter() - start) / n * 1e6)
        return best

    return asyncio.run(measure())


EVICT_BYTES = 8 << 20  # more than this machine's L2 (4 MiB a core): touching it pushes the picker's code and data out


def decide_cold_us(policy: str, endpoints: int = 4, n: int = 2000) -> float:
    """p50 µs of one ``Engine.decide`` + in-flight acquire/release when the CPU caches have just been evicted (one
    byte of every cache line of `EVICT_BYTES` touched before each), as in a picker that shares its core with Envoy
    and the load: under load every request runs this way, so this, not the warm figure, is what a pick costs there.
    """
    service = make_service(endpoints, policy)
    engine = service.engine
    features = RequestFeatures(model="bench-model", prompt_tokens=300, max_tokens=64)
    evict = np.zeros(EVICT_BYTES, dtype=np.uint8)
    timings = []
    clock: Callable[[], int] = time.perf_counter_ns
    for _ in range(n):
        evict[::64] += 1
        start = clock()
        decision = engine.decide(features)
        engine.inflight.acquire(decision.endpoint.index, 364).release()
        timings.append(clock() - start)
    p50 = percentiles(timings, (50,), method="higher")[50]
    assert p50 is not None, "n >= 1 timings"
    return p50 / 1000


def decide_us(endpoints: int, policy: str, n: int = 20000) -> tuple[float, float]:
    """(p50, p99) in µs of one ``Engine.decide`` + in-flight acquire/release on a pool of ``endpoints``."""
    service = make_service(endpoints, policy)
    engine = service.engine
    features = RequestFeatures(model="bench-model", prompt_tokens=300, max_tokens=64)
    timings = []
    clock: Callable[[], int] = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        decision = engine.decide(features)
        engine.inflight.acquire(decision.endpoint.index, 364).release()
        timings.append(clock() - start)
    found = percentiles(timings, (50, 99), method="higher")
    p50, p99 = found[50], found[99]
    assert p50 is not None and p99 is not None, "n >= 1 timings"
    return p50 / 1000, p99 / 1000


# One request through the stream handler, as `per_request_us` drives it, counted in CPU instructions (`callgrind`):
# ``policy`` is a preset, or "noop" for the do-nothing picker (the hop benchmark's floor). The routing core runs on a
# clock of the workload's own (a request every millisecond), so that every run counts the same.
_HANDLER_CODE = """
import asyncio, sys
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from inferlb.bench.micro import make_service, request_messages
steps, policy, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
service = make_service(4, "round-robin" if policy == "noop" else policy)
now = [0.0]
service.engine.signals.clock = service.engine.inflight.clock = lambda: now[0]
if policy == "noop":
    from inferlb.bench.noop_picker import NoopService
    service = NoopService(service.engine.pool)
wire = request_messages(kind == "body")
async def one():
    async def messages():
        for raw in wire:
            yield ProcessingRequest.FromString(raw)
    async for reply in service.Process(messages(), None):
        reply.SerializeToString()
async def main():
    for _ in range(steps):
        now[0] += 0.001
        await one()
asyncio.run(main())
"""
HANDLER_WARM = 300  # requests before the counted ones (imports, first-call set-up), subtracted


def handler_instructions(policy: str, with_body: bool, counted: int = 1000, python: str = sys.executable) -> float:
    """CPU instructions per request through the stream handler (``policy``: a preset, or "noop" for the do-nothing
    picker), in process, without gRPC; needs valgrind (`callgrind.count`)."""
    kind = "body" if with_body else "headers"
    return callgrind.per_step(python, _HANDLER_CODE, HANDLER_WARM, counted, policy, kind)
