"""Tests for otel/heatmapviews.py: the heatmap's views made in a worker process, one render for many requests, kept
for ``max_age_s``, never from a replaced aggregator; the worker stops when idle, on close, and a dead one is
replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import pytest

from inferlb.otel.heatmap import HeatmapAggregator
from inferlb.otel.heatmapviews import HeatmapViews, spawn_worker
from inferlb.otel.render import render_html, render_json

from ..conftest import ManualClock, until

PNG = b"\x89PNG\r\n\x1a\n"
NOW = 1_700_000_000.0


class Workers:
    """The worker factory a `HeatmapViews` is given: real spawned workers, each kept to be looked at and stopped."""

    def __init__(self) -> None:
        self.started: list[Executor] = []

    def __call__(self) -> Executor:
        self.started.append(spawn_worker())
        return self.started[-1]

    def pid(self, index: int = -1) -> int:
        """The pid of a worker's process (its only one: it rendered whatever that worker rendered)."""
        return int(self.started[index].submit(os.getpid).result(timeout=60))


@pytest.fixture
def workers() -> Iterator[Workers]:
    made = Workers()
    yield made
    for pool in made.started:
        pool.shutdown(wait=True, cancel_futures=True)


def _heatmap(requests: int = 30) -> HeatmapAggregator:
    heatmap = HeatmapAggregator(bucket_s=10.0)
    for i in range(requests):
        heatmap.add(NOW + i, f"10.0.0.{1 + i % 3}:8000", 0.05 * (1 + i % 3), 1.0)
    return heatmap


def _stopped(pool: Executor) -> bool:
    try:
        pool.submit(os.getpid).cancel()
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return True
    return False


async def test_concurrent_requests_share_one_render_made_in_another_process(
    workers: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_here(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the PNG was drawn in the picker's own process")

    monkeypatch.setattr("inferlb.otel.render.render_png", not_here)  # the spawned worker has its own, real one
    views = HeatmapViews(worker=workers)
    heatmap = _heatmap()
    pngs = await asyncio.gather(*(views.png(heatmap) for _ in range(8)))
    assert views.renders == {"png": 1} and len(workers.started) == 1
    assert pngs[0].startswith(PNG) and len(pngs[0]) > 5_000 and all(png == pngs[0] for png in pngs)
    assert workers.pid() != os.getpid()
    views.close()


async def test_the_json_and_the_page_are_what_the_renderers_make_here(workers: Workers) -> None:
    views = HeatmapViews(worker=workers)
    heatmap = _heatmap()
    grid = heatmap.grid()
    assert await views.json(heatmap) == render_json(grid)
    page = await views.page(heatmap, json_url="heatmap.json", refresh_s=5.0)
    assert page == render_html(grid, json_url="heatmap.json", refresh_s=5.0)
    assert views.renders == {"json": 1, "page": 1} and len(workers.started) == 1
    views.close()


async def test_a_view_is_made_again_once_older_than_max_age_from_a_new_grid(
    workers: Workers, clock: ManualClock
) -> None:
    views = HeatmapViews(max_age_s=2.0, clock=clock, worker=workers)
    heatmap = _heatmap(30)
    first = await views.json(heatmap)
    heatmap.add(NOW + 100, "10.0.0.9:8000", 0.1, 1.0)
    clock.advance(1.9)
    assert await views.json(heatmap) == first and views.renders["json"] == 1  # kept: the new request is not in it
    clock.advance(0.2)
    again = json.loads(await views.json(heatmap))
    assert views.renders["json"] == 2 and sum(map(sum, again["count"])) == 31
    views.close()


async def test_a_replaced_aggregator_is_never_shown_the_old_view(workers: Workers, clock: ManualClock) -> None:
    views = HeatmapViews(clock=clock, worker=workers)
    old, new = _heatmap(30), _heatmap(6)
    await views.json(old)
    shown = json.loads(await views.json(new))  # at the same instant: the old one's view is fresh, but not its own
    assert views.renders["json"] == 2 and sum(map(sum, shown["count"])) == 6
    views.close()


async def test_the_worker_stops_when_idle_on_close_and_starts_again_on_demand(
    workers: Workers, clock: ManualClock
) -> None:
    views = HeatmapViews(idle_s=0.0, clock=clock, worker=workers)
    heatmap = _heatmap()
    await views.json(heatmap)
    await until(lambda: _stopped(workers.started[0]), "the idle worker stopped")
    await views.json(heatmap)  # kept: no worker needed
    await views.png(heatmap)
    assert len(workers.started) == 2
    views.close()
    views.close()  # a second close is harmless
    assert _stopped(workers.started[1])


async def test_a_worker_that_died_while_idle_is_replaced_by_the_next_request(workers: Workers) -> None:
    # The pool knew its worker was dead (the OOM killer, between renders): the next request failed (503) and only
    # the one after it got a new worker.
    views = HeatmapViews(worker=workers)
    heatmap = _heatmap()
    await views.json(heatmap)
    pool, dead = views._pool, workers.pid(0)
    os.kill(dead, signal.SIGKILL)
    await until(lambda: getattr(pool, "_broken", False), "the pool to see its worker gone")
    assert (await views.png(heatmap)).startswith(PNG)
    assert len(workers.started) == 2 and workers.pid(1) != dead
    views.close()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("max_age_s", -1.0, id="negative-age"),
        pytest.param("idle_s", float("nan"), id="nan-idle"),
    ],
)
def test_bad_intervals_are_refused(name: str, value: float) -> None:
    make: Callable[..., HeatmapViews] = HeatmapViews
    with pytest.raises(ValueError, match=f"{name} must be seconds >= 0"):
        make(**{name: value})
