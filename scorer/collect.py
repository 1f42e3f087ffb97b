"""The vLLM metrics collector: scrapes every endpoint's ``/metrics`` in the background and publishes snapshots.

Every endpoint has its own scrape loop: a scrape every ``interval_s``, bounded by ``timeout_s``. The loops start
in groups of `SCRAPE_GROUP` endpoints, the groups spread evenly over the interval: a large pool is scraped as a
steady trickle instead of a burst, and the endpoints of a group share their wake-ups (one timer, responses that
arrive together, one snapshot), which on 4 endpoints halves the scraping's CPU against one wake-up each (767 ->
328-358 µs a scrape, measured on 2 cores). A body is parsed as soon as it arrives, so the event loop that answers
Envoy never waits behind a whole pool's worth of parsing; and a hung endpoint delays only its own readings. Each
endpoint's `SignalReader` remembers where the families it reads stood in that server's last exposition, so a
parse searches a few KB instead of the whole body (tens of microseconds for vLLM's 57 KB). Readings land in
staging arrays; a new `Snapshot` is published at most ``publish_delay_s`` after a reading arrives, so many scrapes
make one snapshot (scorers that compute once per snapshot stay cheap).

Each scrape also notes how many requests the picker had in flight on the endpoint when it began (``inflight``, if
given), so that the saturation rule can add their growth since to the scraped queue (`Snapshot.inflight_at_scrape`).

A failed scrape (refused, timed out, an HTTP error, a body without the metrics) marks the endpoint down and keeps
its last values with their old scrape time, so the staleness filter can tell; it never stops the collector.
Picks never wait for a scrape: they read the latest snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from inferlb.scorer.address import parse_address
from inferlb.scorer.httpget import HttpGetError, HttpGetter
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.pool import Pool
from inferlb.scorer.promtext import SignalReader, VllmSnapshot
from inferlb.scorer.signals import Signals

__all__ = ["SCRAPE_GROUP", "CollectorOptions", "MetricsCollector", "ScrapeStats", "scrape_phases"]

logger = logging.getLogger(__name__)

# Endpoints whose scrapes start together: enough to share the wake-ups of a small pool's round, few enough that
# the bodies that arrive together are parsed in well under a millisecond.
SCRAPE_GROUP = 8


def scrape_phases(count: int, interval_s: float, group: int = SCRAPE_GROUP) -> list[float]:
    """When, within the interval, each of ``count`` endpoints' scrapes start: endpoint i in group ``i // group``,
    the groups evenly spread."""
    groups = max(1, math.ceil(count / group))
    return [interval_s * (i // group) / groups for i in range(count)]


@dataclass(frozen=True, slots=True)
class CollectorOptions:
    """``interval_s``: time between one endpoint's scrape starts; ``timeout_s``: per scrape; ``path``: the metrics
    path; ``publish_delay_s``: how long a reading may wait to be published with the readings after it."""

    interval_s: float = 0.1
    timeout_s: float = 0.5
    path: str = "/metrics"
    publish_delay_s: float = 0.005

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "publish_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0; got {value!r}")


@dataclass(slots=True)
class ScrapeStats:
    """Counters of the collector (event-loop owned). ``errors`` is keyed by endpoint address."""

    scrapes: int = 0
    bytes: int = 0
    published: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    parse_s: float = 0.0


class MetricsCollector:
    """Scrapes ``pool``'s endpoints into ``signals``, over one kept-alive connection per endpoint.

    Use ``await collector.run()`` as a task (cancel it to stop) or ``await collector.scrape_once()`` for one
    scrape of every endpoint, published at once; the two must not run at the same time.
    """

    def __init__(
        self,
        pool: Pool,
        signals: Signals,
        options: CollectorOptions | None = None,
        *,
        inflight: InFlight | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.inflight = inflight
        self.signals = signals
        self.options = options or CollectorOptions()
        self._clock = clock
        self._getters = [HttpGetter(*parse_address(e.address), self.options.path) for e in pool]
        self._readers = [SignalReader() for _ in pool]
        self.stats = ScrapeStats()
        self.last_error: list[str | None] = [None] * len(pool)
        self._untried = set(range(len(pool)))  # endpoints not scraped yet, successfully or not
        # Staging: the latest reading of each endpoint, copied into a snapshot when published.
        old = signals.snapshot
        self._running, self._waiting = old.running.copy(), old.waiting.copy()
        self._kv_usage, self._kv_tokens = old.kv_usage.copy(), old.kv_tokens.copy()
        self._scraped_at, self._up = old.scraped_at.copy(), old.up.copy()
        self._inflight_at_scrape = old.inflight_at_scrape.copy()
        # InFlight.requests when each endpoint's current scrape began
        self._inflight_at_start = np.full(len(pool), np.nan)
        self._lora = list(old.lora)
        self._publish_pending: asyncio.TimerHandle | None = None
        self._round_published = False

    @property
    def first_round_done(self) -> bool:
        """Whether every endpoint has been scraped (successfully or not) at least once, and that published."""
        return self._round_published

    async def aclose(self) -> None:
        if self._publish_pending is not None:
            self._publish_pending.cancel()
            self._publish_pending = None
        for getter in self._getters:
            getter.close()

    async def run(self) -> None:
        """Scrape forever, each endpoint every ``interval_s``; returns only by cancellation."""
        start = asyncio.get_running_loop().time()  # the timers' clock: the grid is about waking up
        phases = scrape_phases(len(self._getters), self.options.interval_s)
        loops = [
            asyncio.create_task(self._endpoint_loop(i, start + phases[i]), name=f"scrape {endpoint.address}")
            for i, endpoint in enumerate(self.pool.endpoints)
        ]
        try:
            await asyncio.gather(*loops)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def scrape_once(self) -> None:
        """Scrape every endpoint once, concurrently, and publish the result."""
        await asyncio.gather(*(self._scrape(i) for i in range(len(self._getters))))
        self._publish()

    async def _endpoint_loop(self, i: int, due: float) -> None:
        """Scrape endpoint ``i`` at ``due`` and every interval after, on that grid: the endpoints of a group keep
        waking together. A scrape that overruns its slot (a slow server) makes this one skip to the next slot."""
        interval = self.options.interval_s
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if due > now:
                await asyncio.sleep(due - now)
            try:
                await self._scrape(i)
            except (
                Exception
            ):  # a bug, not a server's fault: this loop must outlive it, or the endpoint's signals freeze
                logger.exception("metrics scrape of %s raised; scraping goes on", self.pool.endpoints[i].address)
                self._failed(i, "the picker failed to read the scrape (its log has the traceback)")
            self._schedule_publish()
            due += interval
            now = loop.time()
            if due <= now:
                due += math.ceil((now - due) / interval) * interval

    async def _scrape(self, i: int) -> None:
        if self.inflight is not None:
            self._inflight_at_start[i] = self.inflight.requests[i]
        try:
            status, body = await self._getters[i].get(self.options.timeout_s)
        except HttpGetError as exc:
            self._failed(i, str(exc))
        else:
            if status != 200:
                self._failed(i, f"HTTP {status}")
            else:
                try:
                    self._read(i, body)
                except (ValueError, OverflowError) as exc:  # the reader bounds what it takes; this is the backstop
                    self._failed(i, f"unreadable metrics: {str(exc)[:200]}")
        self.stats.scrapes += 1
        self._untried.discard(i)

    def _read(self, i: int, body: bytes) -> None:
        self.stats.bytes += len(body)
        started = time.perf_counter()
        reading: VllmSnapshot = self._readers[i].read(body)
        self.stats.parse_s += time.perf_counter() - started
        if reading.running is None and reading.waiting is None and reading.kv_cache_usage is None:
            self._failed(i, "no vLLM metrics in the response")
            return
        self._running[i] = _value(reading.running)
        self._waiting[i] = _value(reading.waiting)
        self._kv_usage[i] = _value(reading.kv_cache_usage)
        if reading.num_gpu_blocks is not None and reading.block_size is not None:
            self._kv_tokens[i] = reading.num_gpu_blocks * reading.block_size
        self._lora[i] = reading.lora
        self._scraped_at[i] = self._clock()
        self._inflight_at_scrape[i] = self._inflight_at_start[i]
        self._up[i] = True
        self.last_error[i] = None

    def _schedule_publish(self) -> None:
        if self._publish_pending is None:
            loop = asyncio.get_running_loop()
            self._publish_pending = loop.call_later(self.options.publish_delay_s, self._publish)

    def _publish(self) -> None:
        if self._publish_pending is not None:
            self._publish_pending.cancel()
            self._publish_pending = None
        # Onto the latest snapshot: other collectors (GPU state, spans) publish their own fields into it.
        self.signals.publish(
            self.signals.snapshot.with_values(
                running=self._running,
                waiting=self._waiting,
                kv_usage=self._kv_usage,
                kv_tokens=self._kv_tokens,
                scraped_at=self._scraped_at,
                inflight_at_scrape=self._inflight_at_scrape,
                up=self._up,
                lora=self._lora,
            )
        )
        self.stats.published += 1
        self._round_published = not self._untried

    def _failed(self, i: int, reason: str) -> None:
        self._up[i] = False
        address = self.pool.endpoints[i].address
        if self.last_error[i] is None:
            logger.warning(
                "metrics scrape of %s failed: %s (logged again once it recovers and fails anew)", address, reason
            )
        self.stats.errors[address] += 1
        self.last_error[i] = reason


def _value(value: float | None) -> float:
    return math.nan if value is None else float(value)
