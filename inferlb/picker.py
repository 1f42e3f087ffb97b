"""Assembling and running the picker process: config -> pool -> engine -> ext_proc gRPC server."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import numpy as np

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.config import Config
from inferlb.scorer.engine import Engine
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


def create_picker(config: Config, *, rng: np.random.Generator | None = None) -> PickerServer:
    """Everything a picker needs, built from ``config`` and nothing global: two pickers can live side by side."""
    pool = Pool(config.endpoints)
    engine = Engine(pool, build_profile(config.policy, rng))
    service = ExtProcService(engine, max_body_bytes=config.max_body_bytes)
    return PickerServer(service, config.listen)


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
        "inferlb picker listening on %s (policy %s, %d endpoints)", config.listen, config.policy, len(config.endpoints)
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
