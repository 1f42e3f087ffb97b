"""Request classes and admission control through the ext_proc service, driven over real gRPC like Envoy does: 429
with retry-after for classes that shed, a bounded wait for classes that wait, class pools, TTFT objectives.
(Classification, saturation and the wait queue themselves: tests/scorer/test_classes.py; their config:
tests/scorer/test_config.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.classes import Classifier, ClassRule, RequestClass
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.loadscorers import DEFAULT_PREFILL_TOKENS_PER_S
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.quotas import Quotas
from inferlb.scorer.registry import PluginSpec, ProfileSpec
from inferlb.scorer.router import Router
from inferlb.scorer.signals import Signals

from ..conftest import until
from .test_server import MODEL, FakeEnvoy, body_message, destination, headers_message, immediate, route_buffered

ENDPOINTS = [("127.0.0.1:9101", "fast"), ("127.0.0.1:9102", "fast"), ("127.0.0.1:9103", "long")]
BATCH = RequestClass("batch", on_saturation="shed", retry_after_s=7)
INTERACTIVE = RequestClass("interactive", ttft_slo_s=0.5, max_wait_s=0.3)
LONG = RequestClass("long", labels={"pool": "long"})
RULES = (
    ClassRule(BATCH, header_values=frozenset({"batch"})),
    ClassRule(LONG, min_prompt_tokens=4000),
    ClassRule(INTERACTIVE, max_prompt_tokens=3999, stream=True),
)


def pool_and_signals(
    waiting: list[float], ages: list[float], clock: Callable[[], float] = time.monotonic
) -> tuple[Pool, Signals]:
    config = parse_config(
        {
            "pool": {
                "endpoints": [{"address": a, "models": [MODEL], "labels": {"pool": p}} for a, p in ENDPOINTS],
            }
        }
    )
    pool = Pool(config.endpoints)
    signals = Signals(len(pool), stale_after_s=1.0, clock=clock)
    now = clock()
    scraped = [now - a if math.isfinite(a) else math.nan for a in ages]
    signals.publish(signals.snapshot.with_values(waiting=waiting, kv_usage=[0.1] * 3, scraped_at=scraped))
    return pool, signals


@pytest.fixture
async def saturated(clock) -> AsyncIterator[tuple[PickerServer, Signals]]:
    """A picker whose first two endpoints are full, on the test's clock; its wait queue ticks only when told."""
    pool, signals = pool_and_signals([50, 50, 0], [0, 0, 0], clock)
    engine = Engine(pool, build_profile("kv-aware", np.random.default_rng(1), size=3), signals=signals)
    service = ExtProcService(engine, max_body_bytes=1 << 20, class_header="x-class")
    service.swap_router(Router(engine, Classifier(RULES), poll_s=3600))
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    yield server, signals
    await server.stop(0)


async def send(server: PickerServer, body: dict, *, class_hint: str | None = None):
    return await route_buffered(server, body, {"x-class": class_hint})


async def test_only_the_class_pool_counts_and_is_used(saturated) -> None:
    server, _ = saturated
    # The "fast" endpoints are full but the long-context class only uses the third, which has room.
    reply = await send(server, {"model": MODEL, "prompt": "x" * 20_000, "stream": True})
    assert destination(reply) == "127.0.0.1:9103"
    for _ in range(5):
        reply = await send(server, {"model": MODEL, "prompt": "x" * 20_000})
        assert destination(reply) == "127.0.0.1:9103"


async def test_shed_classes_get_429_with_retry_after_when_everything_is_full(saturated) -> None:
    server, signals = saturated
    signals.publish(signals.snapshot.with_values(waiting=[50, 50, 50]))
    reply = await send(server, {"model": MODEL, "prompt": "hi"}, class_hint="batch")
    response = reply.immediate_response
    assert response.status.code == 429
    headers = {o.header.key: o.header.raw_value.decode() for o in response.headers.set_headers}
    assert headers["retry-after"] == "7" and headers["content-type"] == "application/json"
    assert b"'batch' are shed under load" in response.body
    service = server.service
    assert service.decisions.shed["batch"] == 1 and service.stats.refused[429] == 1


@pytest.mark.parametrize("header", ["x-gateway-inference-objective", "x-llm-d-inference-objective"])
async def test_a_sheddable_inference_objective_gets_429_when_everything_is_full(saturated, header: str) -> None:
    """The Endpoint Picker protocol's objective names the class; a negative priority is sheddable."""
    server, signals = saturated
    sheddable = parse_config(
        {"pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}, "classes": [{"name": "bulk", "priority": -1}]}
    ).classes
    engine = server.service.engine
    server.service.swap_router(Router(engine, Classifier((*RULES, *sheddable)), poll_s=3600))
    server.service.objectives = True  # config inference_objectives: true
    signals.publish(signals.snapshot.with_values(waiting=[50, 50, 50]))
    body = {"model": MODEL, "prompt": "hi", "stream": True}  # would be "interactive" (which waits) by the rules
    reply = await route_buffered(server, body, {header: "bulk"})
    assert (
        reply.immediate_response.status.code == 429 and b"'bulk' are shed under load" in reply.immediate_response.body
    )
    assert server.service.decisions.shed["bulk"] == 1


async def test_waiting_classes_wait_a_bounded_time_then_go(saturated, clock) -> None:
    server, signals = saturated
    service = server.service
    queue = service.router.queue
    signals.publish(signals.snapshot.with_values(waiting=[50, 50, 50]))
    body = {"model": MODEL, "prompt": "hi", "stream": True}  # interactive: waits up to 0.3 s
    sending = asyncio.create_task(send(server, body))
    while not len(queue):
        await asyncio.sleep(0)
    clock.advance(0.299)
    assert queue.release() == 0 and not sending.done()
    clock.advance(0.001)
    assert queue.release() == 1
    assert destination(await sending) in {a for a, _ in ENDPOINTS}
    assert (service.stats.waited, service.stats.waited_out) == (1, 1)
    assert service.decisions.recent(1)[0]["reason"] == "saturated"

    sending = asyncio.create_task(send(server, body))
    while not len(queue):
        await asyncio.sleep(0)
    signals.publish(signals.snapshot.with_values(waiting=[50, 0, 50]))
    assert queue.release() == 1  # it goes as soon as the second endpoint has room, and there
    assert destination(await sending) == "127.0.0.1:9102"
    assert (service.stats.waited, service.stats.waited_out) == (2, 1)
    assert service.decisions.recent(1)[0]["reason"] == "only-candidate"  # the others are full


async def test_a_class_with_a_ttft_objective_avoids_endpoints_predicted_to_miss_it() -> None:
    pool, signals = pool_and_signals([0, 0, 0], [0, 0, 0])
    spec = ProfileSpec(
        "p", (PluginSpec("model"), PluginSpec("ttft-slo")), (PluginSpec("in-flight"),), PluginSpec("max-score")
    )
    engine = Engine(pool, build_profile(spec, np.random.default_rng(1), size=3), signals=signals)
    engine.inflight.clock = lambda: 0.0  # the backlog does not drain while the test runs
    for endpoint in (0, 2):  # two seconds of prefill queued at the default rate
        engine.inflight.acquire(endpoint, 0, (40_000, DEFAULT_PREFILL_TOKENS_PER_S))
    for _ in range(8):  # the only endpoint that can meet it has the most requests
        engine.inflight.acquire(1, 0)
    service = ExtProcService(engine, max_body_bytes=1 << 20, classifier=Classifier(RULES))
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        for _ in range(5):  # interactive (0.5 s objective): to the one endpoint predicted to meet it
            assert destination(await send(server, {"model": MODEL, "prompt": "hi", "stream": True})) == ENDPOINTS[1][0]
        chosen = {destination(await send(server, {"model": MODEL, "prompt": "hi"})) for _ in range(10)}
        assert ENDPOINTS[1][0] not in chosen  # no objective: the in-flight count weighs as usual
    finally:
        await server.stop(0)


def _tenant_a_quotas() -> Quotas:
    """Tenant a's quotas (header x-tenant): 600 tokens a minute, a burst of 60."""
    config = parse_config(
        {
            "pool": {"endpoints": [{"address": "127.0.0.1:9101"}]},
            "quotas": {
                "header": "x-tenant",
                "source": "gateway",
                "tenants": {"a": {"tokens_per_minute": 600, "burst_s": 6}},
            },
        }
    )
    assert config.quotas is not None
    return Quotas(config.quotas)


async def test_a_request_whose_client_leaves_while_it_waits_gets_its_quota_back(saturated, clock) -> None:
    # It never reached a server; once, its tenant paid for it all the same (a 60-token bucket then refused 51).
    server, signals = saturated
    service = server.service
    service.experiment_headers = frozenset({"x-tenant"})
    service.quotas = _tenant_a_quotas()
    signals.publish(signals.snapshot.with_values(waiting=[50, 50, 50]))
    envoy = FakeEnvoy(server)
    message = headers_message(body_mode=ProcessingMode.BUFFERED)
    for key, value in (("x-tenant", "a"), ("x-class", "interactive")):
        header = message.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    await envoy.send(message)
    await envoy.call.write(body_message({"model": MODEL, "prompt": "hi", "max_tokens": 50}))
    await until(lambda: len(service.router.queue) == 1, "the request waiting")
    envoy.call.cancel()  # the client went away: Envoy resets the stream
    await until(lambda: len(service.router.queue) == 0, "the waiter gone")
    await until(lambda: service.quotas.stats.refunded.get("a"), "the refund")
    assert service.quotas.charge("a", 60) is None  # the whole burst is there again
    await envoy.channel.close()


async def test_a_tenant_name_longer_than_any_configured_one_is_kept_as_a_digest(saturated) -> None:
    # The tenant header should come from something the operator trusts; where it does not, a client's 20 KB names
    # would each be kept, up to max_tenants of them.
    server, _ = saturated
    service = server.service
    service.experiment_headers = frozenset({"x-tenant"})
    document = {
        "header": "x-tenant",
        "source": "gateway",
        "default": {"requests_per_minute": 60},
        "tenants": {"a": {"requests_per_minute": 6}},
    }
    service.quotas = Quotas(
        parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "quotas": document}).quotas
    )
    for tenant in ("x" * 20_000, "y" * 20_000, "a"):
        reply = await route_buffered(server, {"model": MODEL, "prompt": "hi"}, {"x-tenant": tenant})
        assert destination(reply) in {a for a, _ in ENDPOINTS}
    kept = list(service.quotas._buckets)
    assert len(kept) == 3 and max(map(len, kept)) <= 40 and kept[2] == "a"


async def test_with_jwt_tenants_a_request_naming_no_usable_tenant_is_refused_before_any_charge(saturated) -> None:
    server, _ = saturated
    service = server.service
    service.experiment_headers = frozenset({"x-tenant"})
    jwt = {"issuer": "https://auth.test", "jwks_file": "/etc/jwks.json", "claim": "org"}
    document = {"header": "x-tenant", "source": "jwt", "jwt": jwt, "default": {"requests_per_minute": 60}}
    service.quotas = Quotas(
        parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:80"}]}, "quotas": document}).quotas
    )
    for headers, says in (({}, "its claim 'org' is missing or empty"), ({"x-tenant": "a\tb"}, "control characters")):
        status, body = immediate(await route_buffered(server, {"model": MODEL, "prompt": "hi"}, headers))
        assert status == 403 and body["error"]["type"] == "tenant_refused" and says in body["error"]["message"]
    assert not service.quotas._buckets  # nothing charged
    assert service.stats.refused[403] == 2
    reply = await route_buffered(server, {"model": MODEL, "prompt": "hi"}, {"x-tenant": "a"})
    assert destination(reply) in {a for a, _ in ENDPOINTS}


def test_a_request_for_n_completions_is_charged_their_output_n_times() -> None:
    # n (or best_of) completions generate max_tokens each: a 60-token bucket let 64 completions of 16 tokens
    # through for 17 tokens.
    pool = Pool(parse_config({"pool": {"endpoints": [{"address": "127.0.0.1:9101"}]}}).endpoints)
    service = ExtProcService(Engine(pool, build_profile("round-robin", None)), max_body_bytes=1 << 20)
    quotas = _tenant_a_quotas()
    one = RequestFeatures(model=MODEL, prompt_tokens=1, max_tokens=16, headers={"x-tenant": "a"})
    refusal, charged = service._over_quota(quotas, dataclasses.replace(one, output_copies=64))
    assert refusal is not None and charged is None and "1025 tokens exceed" in str(refusal)
    refusal, charged = service._over_quota(quotas, one)
    assert refusal is None and charged == ("a", 17)
