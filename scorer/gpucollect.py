"""The GPU collector: reads each endpoint's GPU source (a GPU agent, a DCGM exporter, the emulator's view) in the
background and publishes utilisation and free/total memory into the signals snapshot.

Endpoints that name the same URL share one read per round. An endpoint's utilisation is the mean over its GPUs
(``indices``, or all of the node's), its memory the sum. A failed read leaves the endpoint's GPU values NaN
(unknown: neutral in every scorer) rather than keeping numbers that may no longer be true.

Each read goes to the configured URL only (no redirect, no proxy from the environment), takes at most
``timeout_s`` in all and reads at most ``max_body_bytes``, so no source can hold up a round for long or fill memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Sequence

import httpx
import numpy as np

from inferlb.scorer.config import GpuSource
from inferlb.scorer.gpuclient import MAX_GPU_REPORT_BYTES, GpuReadError, fetch_gpu_report
from inferlb.scorer.gpustate import GpuReport
from inferlb.scorer.signals import Signals

__all__ = ["GpuCollector"]

logger = logging.getLogger(__name__)


class GpuCollector:
    """Reads ``sources[i]`` (None: endpoint i has no GPU source) into ``signals`` every ``interval_s``; each read
    within ``timeout_s`` and ``max_body_bytes``. One event loop; call ``aclose`` when done."""

    def __init__(
        self,
        sources: Sequence[GpuSource | None],
        signals: Signals,
        *,
        interval_s: float = 0.5,
        timeout_s: float = 1.0,
        max_body_bytes: int = MAX_GPU_REPORT_BYTES,
    ) -> None:
        self.sources = list(sources)
        self.signals = signals
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        # The URL was checked against pool.allowed_networks: a redirect or an HTTP_PROXY from the environment would
        # send the request somewhere else (fetch_gpu_report refuses redirects on its own as well).
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False)
        self._urls = sorted({(s.url, s.kind) for s in self.sources if s is not None})
        self.errors: Counter[str] = Counter()
        self.rounds = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.read_once()
            except Exception:  # a bug, not a source's fault: the loop must outlive it, or GPU state freezes
                logger.exception("reading the GPU sources raised; reading goes on")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def read_once(self) -> None:
        results = await asyncio.gather(*(self._read(url, kind) for url, kind in self._urls))
        reports = dict(zip(self._urls, results, strict=True))
        n = len(self.sources)
        util, free, total = np.full(n, math.nan), np.full(n, math.nan), np.full(n, math.nan)
        for i, source in enumerate(self.sources):
            report = reports.get((source.url, source.kind)) if source is not None else None
            if report is None or source is None:
                continue
            gpus = [g for g in report.gpus if source.indices is None or g.index in source.indices]
            if not gpus:
                continue
            util[i] = sum(g.utilization_pct for g in gpus) / len(gpus) / 100.0
            free[i] = float(sum(g.memory_free_bytes for g in gpus))
            total[i] = float(sum(g.memory_total_bytes for g in gpus))
        old = self.signals.snapshot
        self.signals.publish(old.with_values(gpu_util=util, gpu_free_bytes=free, gpu_total_bytes=total))
        self.rounds += 1

    async def _read(self, url: str, kind: str) -> GpuReport | None:
        try:
            return await fetch_gpu_report(
                self._client, url, kind=kind, host=url, max_bytes=self.max_body_bytes, timeout_s=self.timeout_s
            )
        except GpuReadError as exc:
            if not self.errors[url]:
                logger.warning("GPU source %s: %s", url, exc)
            self.errors[url] += 1
            return None
