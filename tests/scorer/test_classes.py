"""Tests for scorer/classes.py: classification, when admission counts a pool as saturated (the one rule the
saturation filter uses too), class pools, and the wait queue: who goes first when capacity comes back, deadlines,
cancellation. All on a clock the test moves. (The same over gRPC, as Envoy drives it:
tests/filter/test_server_admission.py.)
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from inferlb.scorer.classes import Admission, Classifier, ClassRule, RequestClass, WaitQueue
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine, State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.filters import SaturationFilter
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.saturation import Saturation
from inferlb.scorer.signals import Signals

FULL = [50.0, 50.0, 50.0]
BATCH = RequestClass("batch", on_saturation="shed", retry_after_s=7)
INTERACTIVE = RequestClass("interactive", ttft_slo_s=0.5, max_wait_s=0.3)
LONG = RequestClass("long", labels={"pool": "long"})
RULES = (
    ClassRule(BATCH, header_values=frozenset({"batch"})),
    ClassRule(LONG, min_prompt_tokens=4000),
    ClassRule(INTERACTIVE, max_prompt_tokens=3999, stream=True),
)


def state(clock, waiting: list[float], ages: list[float] | None = None, *, inflight_known: bool = False) -> State:
    """Three endpoints (the third labelled pool=long) scraped ``ages`` seconds ago (inf: never) on ``clock``."""
    pool = Pool(
        [EndpointConfig(f"10.0.0.{i + 1}:8000", None, labels={"pool": "long" if i == 2 else "fast"}) for i in range(3)]
    )
    signals = Signals(3, stale_after_s=1.0, clock=clock)
    ages = ages if ages is not None else [0.0] * 3
    scraped = [clock() - a if math.isfinite(a) else math.nan for a in ages]
    at_scrape = [0.0] * 3 if inflight_known else [math.nan] * 3
    signals.publish(
        signals.snapshot.with_values(
            waiting=waiting, kv_usage=[0.1] * 3, scraped_at=scraped, inflight_at_scrape=at_scrape
        )
    )
    profile = build_profile("round-robin", np.random.default_rng(0), size=3)
    return Engine(pool, profile, signals=signals, saturation=Saturation(max_waiting=16)).state


def publish(st: State, **values: list[float]) -> None:
    st.signals.publish(st.signals.snapshot.with_values(**values))


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        pytest.param(RequestFeatures(class_hint="batch", prompt_tokens=10, stream=True), "batch", id="header-first"),
        pytest.param(RequestFeatures(prompt_tokens=5000, stream=True), "long", id="long-prompt"),
        pytest.param(RequestFeatures(prompt_tokens=100, stream=True), "interactive", id="short-stream"),
        pytest.param(RequestFeatures(prompt_tokens=100, stream=False), "default", id="no-rule-matches"),
        pytest.param(RequestFeatures(class_hint="other", prompt_tokens=100, stream=True), "interactive", id="hint"),
        # The gateway's inference objective names a class: it wins over the rules.
        pytest.param(RequestFeatures(objective="long", prompt_tokens=100, stream=True), "long", id="objective"),
        pytest.param(RequestFeatures(objective="nope", prompt_tokens=100, stream=True), "interactive", id="unknown"),
    ],
)
def test_the_first_matching_rule_classifies(features: RequestFeatures, expected: str) -> None:
    assert Classifier(RULES).classify(features).name == expected


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
def test_saturation(clock, waiting: list[float], ages: list[float], saturated: bool) -> None:
    st = state(clock, waiting, ages)
    assert Admission(st).saturated(st.pool.all_indices) is saturated


def test_an_endpoint_goes_stale_on_the_routing_clock(clock) -> None:
    st = state(clock, [50, 50, 0])
    admission = Admission(st)
    assert not admission.saturated(st.pool.all_indices)
    clock.advance(1.5)  # the third endpoint's scrape is now older than stale_after_s; so are the others'
    assert not admission.saturated(st.pool.all_indices)  # nothing fresh: nothing known
    publish(st, scraped_at=[clock(), clock(), clock() - 1.5])
    assert admission.saturated(st.pool.all_indices)  # two full, one stale


def test_admission_and_the_saturation_filter_count_what_was_added_since_the_scrape(clock) -> None:
    # Queues of 10, 10 and 14 under a limit of 16: room for 6, 6 and 2 more before the next scrape.
    st = state(clock, [10, 10, 14], inflight_known=True)
    admission, saturation_filter = Admission(st), SaturationFilter()
    everyone = st.pool.all_indices
    request = RequestFeatures()
    for endpoint, count in ((0, 7), (1, 7)):
        for _ in range(count):
            st.inflight.acquire(endpoint, 10)
    assert list(saturation_filter.filter(request, st, everyone)) == [2]
    assert not admission.saturated(everyone)
    assert list(admission.room(everyone)) == [2]
    for _ in range(3):
        st.inflight.acquire(2, 10)
    assert admission.saturated(everyone)  # the scrape still says 10, 10 and 14: the sent requests filled them
    assert list(saturation_filter.filter(request, st, everyone)) == [0, 1, 2]  # all over: the filter keeps all


def test_a_class_pool_masks_the_endpoints(clock) -> None:
    admission = Admission(state(clock, [0, 0, 0]))
    assert admission.pool_mask(INTERACTIVE) is None
    assert list(admission.pool_mask(LONG)) == [False, False, True]


async def enqueue(queue: WaitQueue, waiters: list[tuple[str, int]], max_wait_s: float = 60):
    """Start one waiting request per (name, priority); returns the tasks and the list they append to on release."""
    went: list[tuple[str, bool]] = []

    async def wait(name: str, priority: int) -> None:
        went.append((name, await queue.wait(np.arange(3), priority, max_wait_s)))

    tasks = [asyncio.create_task(wait(name, priority)) for name, priority in waiters]
    while len(queue) < len(waiters):
        await asyncio.sleep(0)
    return tasks, went


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_highest_priority_goes_first_and_each_endpoint_with_room_takes_one_per_tick(clock):
    st = state(clock, FULL)
    queue = WaitQueue(Admission(st), poll_s=3600)  # ticks by hand
    tasks, went = await enqueue(queue, [("low", 0), ("high", 5), ("mid", 1), ("high-later", 5)])
    assert queue.release() == 0  # everything is full: nobody goes
    publish(st, waiting=[50, 0, 50])  # one endpoint has room
    for expected in ("high", "high-later", "mid", "low"):
        assert queue.release() == 1
        await settle()
        assert went[-1] == (expected, True)
    await asyncio.gather(*tasks)
    assert len(queue) == 0


async def test_room_on_several_endpoints_lets_several_through_in_one_tick(clock):
    st = state(clock, FULL)
    queue = WaitQueue(Admission(st), poll_s=3600)
    tasks, went = await enqueue(queue, [("a", 0), ("b", 0), ("c", 0)])
    publish(st, waiting=[0, 0, 50])
    assert queue.release() == 2
    await settle()
    assert went == [("a", True), ("b", True)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("priority", [0, 9])
async def test_a_waiter_whose_deadline_passed_goes_without_room(clock, priority: int):
    queue = WaitQueue(Admission(state(clock, FULL)), poll_s=3600)
    tasks, went = await enqueue(queue, [("w", priority)], max_wait_s=1)
    assert queue.release() == 0
    clock.advance(0.999)
    assert queue.release() == 0
    clock.advance(0.001)
    assert queue.release() == 1
    await asyncio.gather(*tasks)
    assert went == [("w", False)]


def test_the_queue_runs_without_an_event_loop_on_a_clock_of_its_own(clock):
    st = state(clock, FULL)
    queue = WaitQueue(Admission(st), poll_s=0.02)
    late, early = queue.enter(np.arange(3), 0, 0.5), queue.enter(np.arange(3), 0, 0.1)
    clock.advance(0.1)
    assert queue.release() == 1 and (early.outcome, late.outcome) == (False, None)
    publish(st, waiting=[50, 0, 50], scraped_at=[clock()] * 3)
    assert queue.release() == 1 and late.outcome is True
    assert len(queue) == 0


async def test_the_queue_ticks_by_itself_while_someone_waits(clock):
    st = state(clock, FULL)
    queue = WaitQueue(Admission(st), poll_s=0.005)
    tasks, went = await enqueue(queue, [("w", 0)])
    publish(st, waiting=[0, 50, 50])
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert went == [("w", True)]


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_room(clock):
    st = state(clock, FULL)
    queue = WaitQueue(Admission(st), poll_s=3600)
    tasks, went = await enqueue(queue, [("gone", 9), ("stays", 0)])
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert len(queue) == 1
    publish(st, waiting=[0, 50, 50])
    assert queue.release() == 1
    await asyncio.gather(tasks[1])
    assert went == [("stays", True)]


def test_a_class_with_a_negative_priority_is_shed_unless_it_says_otherwise() -> None:
    from inferlb.scorer.config import parse_config

    classes = [
        {"name": "sheddable", "priority": -1},
        {"name": "sheddable-but-waits", "priority": -1, "on_saturation": "wait"},
        {"name": "critical", "priority": 5},
    ]
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}, "classes": classes})
    got = {rule.request_class.name: rule.request_class.on_saturation for rule in config.classes}
    assert got == {"sheddable": "shed", "sheddable-but-waits": "wait", "critical": "wait"}
