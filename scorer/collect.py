"""The vLLM metrics collector: scrapes every endpoint's ``/metrics`` in the background and publishes snapshots.

One round scrapes all endpoints concurrently, each bounded by ``timeout_s``; then one new `Snapshot` is
published with what the round learned. Rounds start every ``interval_s`` (a slow round delays the next; rounds
never overlap). A failed scrape (refused, timed out, an HTTP error, a body without the metrics) marks the
endpoint down and keeps its last values with their old scrape time, so the staleness filter can tell; it never
stops the collector. Picks never wait for a scrape: they read the latest snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from inferlb.scorer.address import parse_address
from inferlb.scorer.httpget import HttpGetError, HttpGetter
from inferlb.scorer.pool import Pool
from inferlb.scorer.promtext import VllmSnapshot, read_vllm_signals
from inferlb.scorer.signals import Signals

__all__ = ["CollectorOptions", "MetricsCollector", "ScrapeStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CollectorOptions:
    """``interval_s``: time between round starts; ``timeout_s``: per scrape; ``path``: the metrics path."""

    interval_s: float = 0.1
    timeout_s: float = 0.5
    path: str = "/metrics"

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0; got {value!r}")


@dataclass(slots=True)
class ScrapeStats:
    """Counters of the collector (event-loop owned). ``errors`` is keyed by endpoint address."""

    rounds: int = 0
    scrapes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    last_round_s: float = 0.0
    parse_s: float = 0.0


class MetricsCollector:
    """Scrapes ``pool``'s endpoints into ``signals``, over one kept-alive connection per endpoint.

    Use ``await collector.run()`` as a task (cancel it to stop) or ``await collector.scrape_once()`` for one round.
    """

    def __init__(
        self,
        pool: Pool,
        signals: Signals,
        options: CollectorOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.signals = signals
        self.options = options or CollectorOptions()
        self._clock = clock
        self._getters = [HttpGetter(*parse_address(e.address), self.options.path) for e in pool]
        self.stats = ScrapeStats()
        self.last_error: list[str | None] = [None] * len(pool)

    async def aclose(self) -> None:
        for getter in self._getters:
            getter.close()

    async def run(self) -> None:
        """Scrape forever, a round every ``interval_s``; returns only by cancellation."""
        interval = self.options.interval_s
        while True:
            started = self._clock()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))

    async def scrape_once(self) -> None:
        started = self._clock()
        results = await asyncio.gather(*(self._scrape(i) for i in range(len(self._getters))))
        now = self._clock()
        parse_started = time.perf_counter()
        old = self.signals.snapshot
        running, waiting = old.running.copy(), old.waiting.copy()
        kv_usage, kv_tokens = old.kv_usage.copy(), old.kv_tokens.copy()
        scraped_at, up = old.scraped_at.copy(), old.up.copy()
        lora = list(old.lora)
        for i, body in enumerate(results):
            if body is None:
                up[i] = False
                continue
            reading: VllmSnapshot = read_vllm_signals(body)
            if reading.running is None and reading.waiting is None and reading.kv_cache_usage is None:
                self._failed(i, "no vLLM metrics in the response")
                up[i] = False
                continue
            running[i] = _value(reading.running)
            waiting[i] = _value(reading.waiting)
            kv_usage[i] = _value(reading.kv_cache_usage)
            if reading.num_gpu_blocks is not None and reading.block_size is not None:
                kv_tokens[i] = reading.num_gpu_blocks * reading.block_size
            lora[i] = reading.lora
            scraped_at[i] = now
            up[i] = True
            self.last_error[i] = None
        self.signals.publish(
            old.with_values(
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                kv_tokens=kv_tokens,
                scraped_at=scraped_at,
                up=up,
                lora=lora,
            )
        )
        stats = self.stats
        stats.rounds += 1
        stats.scrapes += len(results)
        stats.parse_s += time.perf_counter() - parse_started
        stats.last_round_s = self._clock() - started

    async def _scrape(self, i: int) -> bytes | None:
        try:
            status, body = await self._getters[i].get(self.options.timeout_s)
        except HttpGetError as exc:
            self._failed(i, str(exc))
            return None
        if status != 200:
            self._failed(i, f"HTTP {status}")
            return None
        return body

    def _failed(self, i: int, reason: str) -> None:
        address = self.pool.endpoints[i].address
        if self.last_error[i] is None:
            logger.warning(
                "metrics scrape of %s failed: %s (logged again once it recovers and fails anew)", address, reason
            )
        self.stats.errors[address] += 1
        self.last_error[i] = reason


def _value(value: float | None) -> float:
    return math.nan if value is None else float(value)
