"""Tests for scorer/gpucollect.py: GPU state from the emulator's GPU view into the signals snapshot."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from inferlb.procs import free_port
from inferlb.scorer.config import GpuSource
from inferlb.scorer.gpucollect import GpuCollector
from inferlb.scorer.signals import Signals
from inferlb.sim.fleet import serving
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

TP4 = get_profile("h100x4-llama3.1-70b")


@pytest.fixture
async def servers():
    emulated = [EmulatedServer(f"127.0.0.1:{free_port()}", ServerOptions(profile=TP4, models=("m",))) for _ in range(2)]
    async with serving(emulated):
        yield emulated


async def test_gpu_state_reaches_the_snapshot(servers):
    busy, idle = servers
    sources = [
        GpuSource(f"http://{busy.address}/gpu"),
        GpuSource(f"http://{idle.address}/gpu", indices=(0, 1)),
        None,  # an endpoint without a GPU source
        GpuSource(f"http://127.0.0.1:{free_port()}/gpu"),  # nobody there
    ]
    signals = Signals(4)
    collector = GpuCollector(sources, signals, timeout_s=1.0)
    async with httpx.AsyncClient(timeout=30) as client:
        task = asyncio.create_task(
            client.post(f"http://{busy.address}/v1/completions", json={"prompt": "x" * 8000, "max_tokens": 2000})
        )
        deadline = asyncio.get_running_loop().time() + 10
        while busy.gpu_report().gpus[0].utilization_pct < 50:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        try:
            await collector.read_once()
        finally:
            task.cancel()
            await collector.aclose()
    snap = signals.snapshot
    per_gpu = TP4.gpu_memory_bytes
    free_per_gpu = per_gpu - int(per_gpu * TP4.gpu_memory_utilization)
    assert snap.gpu_util[0] > 0.5 and snap.gpu_util[1] == 0.0
    assert snap.gpu_total_bytes[0] == 4 * per_gpu and snap.gpu_total_bytes[1] == 2 * per_gpu  # indices 0 and 1
    assert snap.gpu_free_bytes[0] == 4 * free_per_gpu
    assert all(math.isnan(snap.gpu_util[i]) for i in (2, 3))
    assert list(collector.errors) == [sources[3].url]
