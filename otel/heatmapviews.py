"""The heatmap as the admin API serves it (``/heatmap.json``, ``/heatmap``, ``/heatmap.png``): made in a worker
process, one render at a time, and each kept for a moment.

matplotlib holds the GIL through most of a PNG (tens to hundreds of milliseconds), and encoding the grid of a few
hundred endpoints as JSON or as the page is C code that never lets go of it either. On the picker's event loop, or on
a thread beside it, that time is taken from the ext_proc streams the loop answers. So the loop only reads the grid
(`HeatmapAggregator.grid`, at most once per ``max_age_s``) and hands it, pickled (a small fraction of what JSON
costs), to one worker process that encodes and draws it (otel/render.py).
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferlb.otel.render import render_html, render_json, render_png_bytes

if TYPE_CHECKING:
    from inferlb.otel.heatmap import HeatmapAggregator

__all__ = ["HeatmapViews", "RenderError", "spawn_worker"]

MAX_AGE_S = 2.0
"""How long a view is shown again before it is made anew (the page polls every 5 s)."""
IDLE_S = 60.0
"""The worker process stops after this long without a request."""
NICE = 10  # below the picker (0), as the span receiver's process: under load the kernel gives routing the CPU first
PARENT_CHECK_S = 1.0


class RenderError(Exception):
    """The worker process died while making a view (a later request starts a new one)."""


def spawn_worker() -> Executor:
    """One worker process, spawned (a fresh interpreter: none of the picker's state, threads or sockets), at a
    lower CPU priority than the picker. It ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the
    picker owns shutdown) and exits within `PARENT_CHECK_S` of the picker's process, however that ends. Spawning
    runs the parent's main script again in the worker (as ``__mp_main__``): a script of one's own that serves the
    admin app needs the ``if __name__ == "__main__":`` guard (``inferlb`` and ``python -m inferlb`` are safe)."""
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_start_worker)


def _start_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="parent watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    # A spawned worker holds both ends of the pool's call queue, so no EOF tells it that the picker was killed: it
    # looks instead. Once its parent has gone it is another process's child.
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


@dataclass(slots=True)
class _View:
    value: Any = None
    heatmap: HeatmapAggregator | None = None
    made_at: float = -math.inf
    making: asyncio.Task[Any] | None = None


class HeatmapViews:
    """The JSON, the page and the PNG of a `HeatmapAggregator`, made in one worker process and each kept for
    ``max_age_s`` seconds (of ``clock``) after it was made.

    A request for a view that is being made waits for that render (a client that goes away does not cancel it for
    the others), so any number of clients cost at most one render of each view per ``max_age_s``; the single worker
    makes one at a time. The views of one interval share one grid, read on the caller's loop. A view made from
    another aggregator (a reload replaced it) is never shown. `renders` counts the renders handed to the worker, by
    view ("json", "page", "png").

    The worker (``worker()``, by default `spawn_worker`) starts at the first request and stops after ``idle_s``
    without one, on `close`, or when the picker's process ends. If it dies while making a view, the requests waiting
    for it get `RenderError` and the next request starts a new one. Use from one event loop (the admin API's); not
    thread-safe.
    """

    def __init__(
        self,
        *,
        max_age_s: float = MAX_AGE_S,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        worker: Callable[[], Executor] = spawn_worker,
    ) -> None:
        for name, value in (("max_age_s", max_age_s), ("idle_s", idle_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be seconds >= 0; got {value!r}")
        self.max_age_s, self.idle_s, self.clock, self._start = float(max_age_s), float(idle_s), clock, worker
        self.renders: Counter[str] = Counter()
        self._views: dict[tuple[Hashable, ...], _View] = {}
        self._pool: Executor | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._grid: tuple[HeatmapAggregator, float, dict[str, Any]] | None = None

    async def json(self, heatmap: HeatmapAggregator) -> bytes:
        """`render_json` of the grid: compact UTF-8 JSON."""
        made: bytes = await self._view(heatmap, "json", (), render_json)
        return made

    async def page(self, heatmap: HeatmapAggregator, *, json_url: str | None, refresh_s: float | None) -> str:
        """`render_html` of the grid: the self-contained page, fetching ``json_url`` every ``refresh_s``."""
        render = functools.partial(render_html, json_url=json_url, refresh_s=refresh_s)
        made: str = await self._view(heatmap, "page", (json_url, refresh_s), render)
        return made

    async def png(self, heatmap: HeatmapAggregator) -> bytes:
        """`render_png_bytes` of the grid."""
        made: bytes = await self._view(heatmap, "png", (), render_png_bytes)
        return made

    def close(self) -> None:
        """Stop the worker process: a render under way finishes first, renders queued behind it are cancelled (so
        are the requests waiting for them). Safe to call again; a later request starts a new worker."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _view(
        self, heatmap: HeatmapAggregator, name: str, options: tuple[Hashable, ...], render: Callable[[Any], Any]
    ) -> Any:
        view = self._views.setdefault((name, *options), _View())
        fresh = view.heatmap is heatmap and self.clock() - view.made_at < self.max_age_s
        if view.making is None and not fresh:
            view.making = asyncio.ensure_future(self._make(view, heatmap, name, render))
            view.making.add_done_callback(_retrieve)
        if view.making is not None:
            return await asyncio.shield(view.making)
        return view.value

    async def _make(self, view: _View, heatmap: HeatmapAggregator, name: str, render: Callable[[Any], Any]) -> Any:
        try:
            grid = self._grid_of(heatmap)
            if self._pool is None:
                self._pool = self._start()
            self.renders[name] += 1
            try:
                submitted = self._pool.submit(render, grid)
            except BrokenProcessPool:
                # The worker died while idle (the OOM killer, say): this request starts another.
                self.close()
                self._pool = self._start()
                submitted = self._pool.submit(render, grid)
            value = await asyncio.wrap_future(submitted)
        except BrokenProcessPool as exc:
            self.close()
            raise RenderError(f"the heatmap's render process stopped ({exc}); the next request starts another") from exc
        finally:
            view.making = None
            self._idle_later()
        view.value, view.heatmap, view.made_at = value, heatmap, self.clock()
        return value

    def _grid_of(self, heatmap: HeatmapAggregator) -> dict[str, Any]:
        """The grid, read at most once per ``max_age_s``: the views of one interval show the same data."""
        now = self.clock()
        if self._grid is None or self._grid[0] is not heatmap or now - self._grid[1] >= self.max_age_s:
            self._grid = (heatmap, now, heatmap.grid())
        return self._grid[2]

    def _idle_later(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(self.idle_s, self._idle_check)

    def _idle_check(self) -> None:
        self._idle = None
        if all(view.making is None for view in self._views.values()):  # else the render under way re-arms it
            self.close()


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Every waiter may have gone (clients that hung up): the failure was theirs to see, not the loop's to log.
    if not task.cancelled():
        task.exception()
