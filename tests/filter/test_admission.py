"""Request classes and admission control: classification rules, saturation, 429 with retry-after for classes
that shed, a bounded wait for classes that wait, and class pools; driven over real gRPC like Envoy does."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.classes import Admission, Classifier, ClassRule, RequestClass
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.loadscorers import DEFAULT_PREFILL_TOKENS_PER_S
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.registry import PluginSpec, ProfileSpec
from inferlb.scorer.signals import Signals

from .test_server import MODEL, destination, route_buffered

ENDPOINTS = [("127.0.0.1:9101", "fast"), ("127.0.0.1:9102", "fast"), ("127.0.0.1:9103", "long")]
BATCH = RequestClass("batch", on_saturation="shed", retry_after_s=7)
INTERACTIVE = RequestClass("interactive", ttft_slo_s=0.5, max_wait_s=0.3)
LONG = RequestClass("long", labels={"pool": "long"})
RULES = (
    ClassRule(BATCH, header_values=frozenset({"batch"})),
    ClassRule(LONG, min_prompt_tokens=4000),
    ClassRule(INTERACTIVE, max_prompt_tokens=3999, stream=True),
)


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        pytest.param(RequestFeatures(class_hint="batch", prompt_tokens=10, stream=True), "batch", id="header-first"),
        pytest.param(RequestFeatures(prompt_tokens=5000, stream=True), "long", id="long-prompt"),
        pytest.param(RequestFeatures(prompt_tokens=100, stream=True), "interactive", id="short-stream"),
        pytest.param(RequestFeatures(prompt_tokens=100, stream=False), "default", id="no-rule-matches"),
        pytest.param(RequestFeatures(class_hint="other", prompt_tokens=100, stream=True), "interactive", id="hint"),
    ],
)
def test_the_first_matching_rule_classifies(features: RequestFeatures, expected: str) -> None:
    assert Classifier(RULES).classify(features).name == expected


def pool_and_signals(waiting: list[float], ages: list[float]) -> tuple[Pool, Signals]:
    config = parse_config(
        {
            "pool": {
                "endpoints": [{"address": a, "models": [MODEL], "labels": {"pool": p}} for a, p in ENDPOINTS],
            }
        }
    )
    pool = Pool(config.endpoints)
    signals = Signals(len(pool), stale_after_s=1.0)
    now = time.monotonic()
    scraped = [now - a if math.isfinite(a) else math.nan for a in ages]
    signals.publish(signals.snapshot.with_values(waiting=waiting, kv_usage=[0.1] * 3, scraped_at=scraped))
    return pool, signals


@pytest.mark.parametrize(
    ("waiting", "ages", "saturated"),
    [
        pytest.param([0, 0, 0], [0, 0, 0], False, id="idle"),
        pytest.param([50, 50, 0], [0, 0, 0], False, id="one-has-room"),
        pytest.param([50, 50, 50], [0, 0, 0], True, id="all-full"),
        pytest.param([50, 50, 0], [0, 0, 9], True, id="full-or-stale"),
        pytest.param([0, 0, 0], [9, 9, 9], False, id="all-stale-nothing-known"),
        pytest.param([0, 0, 0], [math.inf] * 3, False, id="never-scraped"),
    ],
)
def test_saturation(waiting: list[float], ages: list[float], saturated: bool) -> None:
    pool, signals = pool_and_signals(waiting, ages)
    assert Admission(pool, signals, max_waiting=16).saturated(pool.all_indices) is saturated


def test_a_class_pool_masks_the_endpoints() -> None:
    pool, signals = pool_and_signals([0, 0, 0], [0, 0, 0])
    admission = Admission(pool, signals)
    assert admission.pool_mask(INTERACTIVE) is None
    assert list(admission.pool_mask(LONG)) == [False, False, True]


@pytest.fixture
async def saturated() -> AsyncIterator[tuple[PickerServer, Signals]]:
    pool, signals = pool_and_signals([50, 50, 0], [0, 0, 0])
    engine = Engine(pool, build_profile("kv-aware", np.random.default_rng(1), size=3), signals=signals)
    service = ExtProcService(
        engine,
        max_body_bytes=1 << 20,
        class_header="x-class",
        classifier=Classifier(RULES),
        admission=Admission(pool, signals, max_waiting=16),
    )
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


async def test_waiting_classes_wait_a_bounded_time_then_go(saturated) -> None:
    server, signals = saturated
    signals.publish(signals.snapshot.with_values(waiting=[50, 50, 50]))
    started = time.monotonic()
    reply = await send(server, {"model": MODEL, "prompt": "hi", "stream": True})  # interactive: waits 0.3 s
    waited = time.monotonic() - started
    assert destination(reply) in {a for a, _ in ENDPOINTS} and waited >= 0.3
    assert (server.service.stats.waited, server.service.stats.waited_out) == (1, 1)
    assert server.service.decisions.recent(1)[0]["reason"] == "saturated"

    async def free_capacity() -> None:
        await asyncio.sleep(0.05)
        signals.publish(signals.snapshot.with_values(waiting=[50, 0, 50]))

    freeing = asyncio.create_task(free_capacity())
    reply = await send(server, {"model": MODEL, "prompt": "hi", "stream": True})
    await freeing
    # It went as soon as the second endpoint had room (no second timeout), and there.
    assert destination(reply) == "127.0.0.1:9102"
    assert (server.service.stats.waited, server.service.stats.waited_out) == (2, 1)
    assert server.service.decisions.recent(1)[0]["reason"] == "only-candidate"  # the others are full


@pytest.mark.parametrize(
    ("classes", "extra", "message"),
    [
        pytest.param([{"name": "a", "on_saturation": "drop"}], {}, r"classes\[0\]\.on_saturation", id="mode"),
        pytest.param([{"name": "a"}, {"name": "a"}], {}, r"classes\[1\]\.name 'a' repeats", id="repeat"),
        pytest.param([{"name": "a", "max_wait_s": -1}], {}, r"classes\[0\]\.max_wait_s must be", id="wait"),
        pytest.param([{"name": "a", "retry_after_s": 0}], {}, r"classes\[0\]\.retry_after_s", id="retry"),
        pytest.param([{"name": "a", "match": {"tokens": 3}}], {}, r"classes\[0\]\.match: unknown key", id="match"),
        pytest.param([{"name": "a", "labels": {"pool": "gpu9"}}], {}, r"no endpoint of the pool has them", id="labels"),
        pytest.param([{"name": "a", "match": {"header": "batch"}}], {}, r"class_header must name", id="no-header"),
        pytest.param([{"name": "a"}], {"default_class": "b"}, r"default_class 'b' is not one of", id="default"),
        pytest.param([], {"admission": {"max_kv_usage": 2}}, r"admission\.max_kv_usage must be", id="admission"),
    ],
)
def test_class_config_errors_name_the_field(classes: list, extra: dict, message: str) -> None:
    doc = {"pool": {"endpoints": [{"address": "10.0.0.1:80", "labels": {"pool": "a"}}]}, "classes": classes, **extra}
    with pytest.raises(ConfigError, match=message):
        parse_config(doc)


def test_class_config_parses() -> None:
    config = parse_config(
        {
            "class_header": "X-Class",
            "classes": [
                {"name": "batch", "match": {"header": ["batch", "offline"]}, "on_saturation": "shed"},
                {"name": "chat", "match": {"max_prompt_tokens": 4000, "stream": True}, "ttft_slo_s": 0.5},
            ],
            "default_class": "chat",
            "admission": {"max_waiting": 4},
            "pool": {"endpoints": [{"address": "10.0.0.1:80"}]},
        }
    )
    assert config.class_header == "x-class"
    assert [r.request_class.name for r in config.classes] == ["batch", "chat"]
    assert config.classes[0].header_values == frozenset({"batch", "offline"})
    assert config.default_class.name == "chat" and config.default_class.ttft_slo_s == 0.5
    assert config.admission.max_waiting == 4


async def test_a_class_with_a_ttft_objective_avoids_endpoints_predicted_to_miss_it() -> None:
    pool, signals = pool_and_signals([0, 0, 0], [0, 0, 0])
    spec = ProfileSpec(
        "p", (PluginSpec("model"), PluginSpec("ttft-slo")), (PluginSpec("in-flight"),), PluginSpec("max-score")
    )
    engine = Engine(pool, build_profile(spec, np.random.default_rng(1), size=3), signals=signals)
    engine.inflight.clock = lambda: 0.0  # the backlog does not drain while the test runs
    for endpoint in (0, 2):  # two seconds of prefill queued at the default rate
        engine.inflight.add_prefill(endpoint, 40_000, DEFAULT_PREFILL_TOKENS_PER_S, object())
    engine.inflight.requests[:] = [1, 9, 1]  # the only endpoint that can meet it has the most requests
    service = ExtProcService(engine, max_body_bytes=1 << 20, classifier=Classifier(RULES), admission=None)
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    try:
        for _ in range(5):  # interactive (0.5 s objective): to the one endpoint predicted to meet it
            assert destination(await send(server, {"model": MODEL, "prompt": "hi", "stream": True})) == ENDPOINTS[1][0]
        chosen = {destination(await send(server, {"model": MODEL, "prompt": "hi"})) for _ in range(10)}
        assert ENDPOINTS[1][0] not in chosen  # no objective: the in-flight count weighs as usual
    finally:
        await server.stop(0)
