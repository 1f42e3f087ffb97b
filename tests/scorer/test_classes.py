"""Tests for scorer/classes.py's wait queue: who goes first when capacity comes back, deadlines, cancellation.
(Classification and saturation are tested over gRPC in tests/filter/test_admission.py.)"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from inferlb.scorer.classes import Admission, WaitQueue
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals

FULL = [50.0, 50.0, 50.0]


def admission(waiting: list[float]) -> tuple[Admission, Signals]:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(3)])
    signals = Signals(3, stale_after_s=3600)
    signals.publish(
        signals.snapshot.with_values(waiting=waiting, kv_usage=[0.1] * 3, scraped_at=[time.monotonic()] * 3)
    )
    return Admission(pool, signals, max_waiting=16), signals


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


async def test_highest_priority_goes_first_and_each_endpoint_with_room_takes_one_per_tick():
    adm, signals = admission(FULL)
    queue = WaitQueue(adm, poll_s=3600)  # ticks by hand
    tasks, went = await enqueue(queue, [("low", 0), ("high", 5), ("mid", 1), ("high-later", 5)])
    assert queue.release() == 0  # everything is full: nobody goes
    signals.publish(signals.snapshot.with_values(waiting=[50, 0, 50]))  # one endpoint has room
    for expected in ("high", "high-later", "mid", "low"):
        assert queue.release() == 1
        await settle()
        assert went[-1] == (expected, True)
    await asyncio.gather(*tasks)
    assert len(queue) == 0


async def test_room_on_several_endpoints_lets_several_through_in_one_tick():
    adm, signals = admission(FULL)
    queue = WaitQueue(adm, poll_s=3600)
    tasks, went = await enqueue(queue, [("a", 0), ("b", 0), ("c", 0)])
    signals.publish(signals.snapshot.with_values(waiting=[0, 0, 50]))
    assert queue.release() == 2
    await settle()
    assert went == [("a", True), ("b", True)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("priority", [0, 9])
async def test_a_waiter_whose_deadline_passed_goes_without_room(priority: int):
    adm, _ = admission(FULL)
    queue = WaitQueue(adm, poll_s=3600)
    tasks, went = await enqueue(queue, [("w", priority)], max_wait_s=1)
    assert queue.release(time.monotonic()) == 0
    assert queue.release(time.monotonic() + 2) == 1
    await asyncio.gather(*tasks)
    assert went == [("w", False)]


async def test_the_queue_ticks_by_itself_while_someone_waits():
    adm, signals = admission(FULL)
    queue = WaitQueue(adm, poll_s=0.005)
    tasks, went = await enqueue(queue, [("w", 0)])
    signals.publish(signals.snapshot.with_values(waiting=[0, 50, 50]))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert went == [("w", True)]


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_room():
    adm, signals = admission(FULL)
    queue = WaitQueue(adm, poll_s=3600)
    tasks, went = await enqueue(queue, [("gone", 9), ("stays", 0)])
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert len(queue) == 1
    signals.publish(signals.snapshot.with_values(waiting=[0, 50, 50]))
    assert queue.release() == 1
    await asyncio.gather(tasks[1])
    assert went == [("stays", True)]
