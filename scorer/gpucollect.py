"""The GPU collector: reads each endpoint's GPU source (a GPU agent, a DCGM exporter, the emulator's view) in the
background and publishes utilisation and free/total memory into the signals snapshot.

Endpoints that name the same URL share one read per round. An endpoint's utilisation is the mean over its GPUs
(``indices``, or all of the node's), its memory the sum. A failed read leaves the endpoint's GPU values NaN
(unknown: neutral in every scorer) rather than keeping numbers that may no longer be true; so does a report that
lacks a GPU the endpoint's ``indices`` name (a sum over fewer GPUs would understate the memory), or that lists no
GPU. Each of these is its source's failure: one source's failure, whatever it is, costs only the endpoints that read
it, never the round. Each source's changes of state are logged, once each: failing (with the reason) and recovered.

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
    within ``timeout_s`` and ``max_body_bytes``. One event loop; call ``aclose`` when done.

    ``last_error[i]`` says why endpoint i's GPU values are unknown (None when they are known, or it has no source);
    ``errors`` counts, per source URL, the rounds in which the source failed (a read that failed, or a report
    without a GPU that an endpoint names)."""

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
        self.last_error: list[str | None] = [None] * len(self.sources)
        self._failing: Counter[str] = Counter()  # url -> rounds failed in a row, while it fails (for the logs)
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
        failing: dict[str, str] = {}  # url -> why, this round
        for i, source in enumerate(self.sources):
            self.last_error[i] = None
            if source is None:
                continue
            report = reports[(source.url, source.kind)]
            reading = _reading(report, source.indices) if isinstance(report, GpuReport) else report
            if isinstance(reading, str):
                self.last_error[i] = reading
                failing.setdefault(source.url, reading)
            else:
                util[i], free[i], total[i] = reading
        old = self.signals.snapshot
        self.signals.publish(old.with_values(gpu_util=util, gpu_free_bytes=free, gpu_total_bytes=total))
        self._note(failing)
        self.rounds += 1

    async def _read(self, url: str, kind: str) -> GpuReport | str:
        """The source's report, or why there is none."""
        try:
            return await fetch_gpu_report(
                self._client, url, kind=kind, host=url, max_bytes=self.max_body_bytes, timeout_s=self.timeout_s
            )
        except GpuReadError as exc:
            return exc.reason
        except Exception as exc:  # a bug met on one source's report: that source's failure, not the round's
            if url not in self._failing:
                logger.exception("reading GPU source %s raised", url)
            return GpuReadError(url, f"reading it raised {type(exc).__name__}: {exc}").reason  # one line, bounded

    def _note(self, failing: dict[str, str]) -> None:
        """Count this round's failures and log each source's change of state."""
        for url, reason in failing.items():
            self.errors[url] += 1
            if url not in self._failing:
                logger.warning(
                    "GPU source %s fails: %s (GPU state unknown where it fails; logged again once it recovers)",
                    url,
                    reason,
                )
            self._failing[url] += 1
        for url in [url for url in self._failing if url not in failing]:
            rounds = self._failing.pop(url)
            logger.info("GPU source %s recovered after %d failed round%s", url, rounds, "" if rounds == 1 else "s")


def _reading(report: GpuReport, indices: tuple[int, ...] | None) -> tuple[float, float, float] | str:
    """(utilisation in [0, 1], free bytes, total bytes) of the GPUs ``indices`` (None: all) of ``report``, or why
    it has none: a report that lacks one of them, or lists no GPU."""
    if not report.gpus:
        return "the report lists no GPU"
    have = {g.index for g in report.gpus}
    missing = [i for i in indices or () if i not in have]
    if missing:
        listed = ", ".join(map(str, sorted(have)[:16])) + (", ..." if len(have) > 16 else "")
        return f"the report has no GPU {', '.join(map(str, missing))} of those gpu.indices names (it lists {listed})"
    gpus = [g for g in report.gpus if indices is None or g.index in indices]
    util = sum(g.utilization_pct for g in gpus) / len(gpus) / 100.0
    return util, float(sum(g.memory_free_bytes for g in gpus)), float(sum(g.memory_total_bytes for g in gpus))
