"""Assembling and running the picker process: config -> pool -> signals, engine -> ext_proc gRPC server, plus the
background collectors that keep the signals fresh."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from dataclasses import dataclass, field

import numpy as np

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.config import Config
from inferlb.scorer.engine import Engine
from inferlb.scorer.gpucollect import GpuCollector
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.signals import Signals

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


@dataclass(slots=True)
class Picker:
    """One picker: its gRPC server, engine and collector. `start` and `stop` run the whole of it."""

    config: Config
    engine: Engine
    server: PickerServer
    collector: MetricsCollector | None
    gpu_collector: GpuCollector | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        await self.server.start()
        loop = asyncio.get_running_loop()
        if self.collector is not None:
            self._tasks.append(loop.create_task(self.collector.run(), name="metrics"))
        if self.gpu_collector is not None:
            self._tasks.append(loop.create_task(self.gpu_collector.run(), name="gpu"))

    async def stop(self, grace: float | None = SHUTDOWN_GRACE_S) -> None:
        try:
            await self.server.stop(grace)
        finally:
            for task in self._tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
            if self.collector is not None:
                await self.collector.aclose()
            if self.gpu_collector is not None:
                await self.gpu_collector.aclose()


def create_picker(config: Config, *, rng: np.random.Generator | None = None) -> Picker:
    """Everything a picker needs, built from ``config`` and nothing global: two pickers can live side by side."""
    pool = Pool(config.endpoints)
    signals = Signals(len(pool), stale_after_s=config.signals.stale_after_s)
    profile = build_profile(config.profile_spec(), rng, size=len(pool))
    engine = Engine(pool, profile, signals=signals)
    service = ExtProcService(engine, max_body_bytes=config.max_body_bytes, session_header=config.session_header)
    collector = None
    if config.signals.scrape_metrics:
        options = CollectorOptions(
            interval_s=config.signals.scrape_interval_s, timeout_s=config.signals.scrape_timeout_s
        )
        collector = MetricsCollector(pool, signals, options)
    sources = [e.gpu for e in config.endpoints]
    gpu = GpuCollector(sources, signals, interval_s=config.signals.gpu_interval_s) if any(sources) else None
    return Picker(config, engine, PickerServer(service, config.listen), collector, gpu)


async def serve(config: Config) -> None:
    """Run a picker until SIGTERM or SIGINT, then drain: readiness goes NOT_SERVING and open streams get
    ``SHUTDOWN_GRACE_S`` seconds to finish."""
    picker = create_picker(config)
    await picker.start()
    # Everything built so far lives as long as the process: move it out of the collector's way, so that
    # the collections that per-request garbage triggers stay cheap.
    gc.collect()
    gc.freeze()
    logger.info(
        "inferlb picker listening on %s (policy %s, %d endpoints, metrics scrape %s)",
        config.listen,
        config.policy,
        len(config.endpoints),
        f"every {config.signals.scrape_interval_s:g} s" if config.signals.scrape_metrics else "off",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("inferlb picker stopping: draining open streams for up to %.0f s", SHUTDOWN_GRACE_S)
        await picker.stop(SHUTDOWN_GRACE_S)
