"""Tests for inferlb/gpuagent.py: NVML read through a fake pynvml, the agent's HTTP app, and serving it on loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from inferlb.gpuagent import (
    NvmlError,
    NvmlReader,
    NvmlUnavailable,
    create_agent_app,
    read_nvml,
    serve_agent,
)
from inferlb.procs import free_port
from inferlb.scorer.gpustate import GpuInfo, GpuReport, parse_gpu_report

from .conftest import until
from .scorer.fakenvml import (
    H100_TOTAL,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    FakeGpu,
    FakeNvml,
    nvml_missing,
)

FAST_S = 0.01  # sampling interval for the app tests: changes show up within a few milliseconds


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


@asynccontextmanager
async def agent(reader: Any, **options: float) -> AsyncIterator[httpx.AsyncClient]:
    app = create_agent_app(reader, **{"interval_s": FAST_S, **options})
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as client,
    ):
        yield client


# ---- reading NVML ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "as_bytes", "expected"),
    [
        pytest.param(
            [FakeGpu("GPU-0a", "NVIDIA H100 80GB HBM3", 37, 73_014_444_032)],
            False,
            [GpuInfo(0, "GPU-0a", "NVIDIA H100 80GB HBM3", 37.0, 73_014_444_032, H100_TOTAL)],
            id="one-gpu-str",
        ),
        pytest.param(
            [FakeGpu("GPU-0a", "NVIDIA A100-SXM4-40GB", 100, 0, 42_949_672_960)],
            True,
            [GpuInfo(0, "GPU-0a", "NVIDIA A100-SXM4-40GB", 100.0, 0, 42_949_672_960)],
            id="bytes-names-old-pynvml",
        ),
        pytest.param(
            [FakeGpu("GPU-0a", "NVIDIA L4", 0, 1), FakeGpu("GPU-1b", "NVIDIA L4", 99, 23_034_986_496, 23_034_986_496)],
            False,
            [
                GpuInfo(0, "GPU-0a", "NVIDIA L4", 0.0, 1, H100_TOTAL),
                GpuInfo(1, "GPU-1b", "NVIDIA L4", 99.0, 23_034_986_496, 23_034_986_496),
            ],
            id="two-gpus-index-order-full-memory",
        ),
    ],
)
def test_read_nvml_maps_each_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], as_bytes: bool, expected: list[GpuInfo]
) -> None:
    fake = install(monkeypatch, FakeNvml(gpus, as_bytes=as_bytes))
    before = time.time()
    report = read_nvml("node-a")
    assert (report.source, report.host, report.gpus) == ("nvml", "node-a", tuple(expected))
    assert before <= report.sampled_at <= time.time()
    assert parse_gpu_report(report.to_json()) == report
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        *nvml_missing(),
        pytest.param(
            FakeNvml(failures={"nvmlDeviceGetUUID": NVML_ERROR_GPU_IS_LOST}),
            "NVML could not list the GPUs: GPU is lost",
            id="gpu-lost-at-start",
        ),
    ],
)
def test_nvml_init_failures_are_unavailable(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml, reason: str) -> None:
    install(monkeypatch, fake)
    with pytest.raises(NvmlUnavailable) as info:
        NvmlReader("node-a")
    assert str(info.value) == reason
    assert not fake.initialized  # whatever was initialised was shut down again


def test_no_pynvml_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match=r"^cannot import pynvml: ") as info:
        read_nvml("node-a")
    assert "\n" not in str(info.value)


def test_reader_inits_once_and_closes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml())
    reader = NvmlReader("node-a")
    assert reader.gpu_count == 2
    first = reader.read()
    fake.gpus[1].utilization = 64
    second = reader.read()
    assert (first.gpus[1].utilization_pct, second.gpus[1].utilization_pct) == (0.0, 64.0)
    # uuid and name are read once, when the reader starts
    assert fake.calls["nvmlDeviceGetName"] == 2 and fake.calls["nvmlDeviceGetMemoryInfo"] == 4
    reader.close()
    reader.close()
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)
    with pytest.raises(NvmlError, match="closed"):
        reader.read()


def test_close_gives_up_on_a_hung_read(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml(hang=threading.Event()))
    reader = NvmlReader("node-a", close_timeout_s=0.05)
    stuck = threading.Thread(target=reader.read, daemon=True)
    stuck.start()
    deadline = time.monotonic() + 3
    while not fake.calls.get("nvmlDeviceGetMemoryInfo"):
        assert time.monotonic() < deadline, "the read never reached NVML"
        time.sleep(0.001)
    reader.close()  # returns although the read holds NVML
    assert fake.shutdown_calls == 0
    assert fake.hang is not None
    fake.hang.set()
    stuck.join(3)
    reader.close()
    assert fake.shutdown_calls == 1


@pytest.mark.parametrize(
    ("failures", "message"),
    [
        pytest.param(
            {"nvmlDeviceGetMemoryInfo": NVML_ERROR_GPU_IS_LOST},
            "GPU 0 (GPU-5d1f3a2e-8b47-4c1d-9e0a-3f6b7c8d9e01): nvmlDeviceGetMemoryInfo failed: GPU is lost",
            id="fell-off-the-bus",
        ),
        pytest.param(
            {"nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED},
            "GPU 0 (GPU-5d1f3a2e-8b47-4c1d-9e0a-3f6b7c8d9e01): nvmlDeviceGetUtilizationRates failed: Not Supported",
            id="utilization-not-supported-mig",
        ),
    ],
)
def test_a_failing_query_names_the_gpu_and_call(
    monkeypatch: pytest.MonkeyPatch, failures: dict[str, int], message: str
) -> None:
    fake = install(monkeypatch, FakeNvml())
    reader = NvmlReader("node-a")
    fake.failures.update(failures)
    with pytest.raises(NvmlError) as info:
        reader.read()
    assert str(info.value) == message
    reader.close()


def test_values_outside_the_schema_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvml([FakeGpu("GPU-0a", "x", 5, used=2, total=1)]))
    with pytest.raises(NvmlError, match=r"gpus\[0\]\.memory_used_bytes \(2\) exceeds memory_total_bytes \(1\)"):
        read_nvml("node-a")


# ---- the HTTP app ------------------------------------------------------------------------------------------------


async def test_gpu_and_healthz_serve_the_cached_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml())
    reader = NvmlReader("node-a")
    try:
        async with agent(reader) as client:
            gpu = await client.get("/gpu")
            assert gpu.status_code == 200
            report = parse_gpu_report(gpu.json())
            assert (report.source, report.host, [g.uuid for g in report.gpus]) == (
                "nvml",
                "node-a",
                [g.uuid for g in fake.gpus],
            )
            health = (await client.get("/healthz")).json()
            assert health["status"] == "ok" and health["gpus"] == 2 and health["sampled_at"] >= report.sampled_at

            fake.gpus[0].utilization = 91  # the background task picks it up; no request triggers a read

            async def updated() -> bool:
                return bool((await client.get("/gpu")).json()["gpus"][0]["utilization_pct"] == 91.0)

            await until(updated)
    finally:
        reader.close()


async def test_a_device_failing_mid_run_gives_503_until_it_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml())
    reader = NvmlReader("node-a")
    try:
        async with agent(reader) as client:
            assert (await client.get("/gpu")).status_code == 200
            fake.failures["nvmlDeviceGetMemoryInfo"] = NVML_ERROR_GPU_IS_LOST

            async def failing() -> httpx.Response | None:
                response = await client.get("/gpu")
                return response if response.status_code == 503 else None

            response = await until(failing)
            body = response.json()
            assert body["error"]["message"] == (
                "GPU sampling failed: GPU 0 (GPU-5d1f3a2e-8b47-4c1d-9e0a-3f6b7c8d9e01): "
                "nvmlDeviceGetMemoryInfo failed: GPU is lost"
            )
            assert body["status"] == "error" and body["error"]["code"] == 503
            assert body["failing_since"] is not None and body["last_sampled_at"] is not None
            health = await client.get("/healthz")
            assert health.status_code == 503 and "GPU is lost" in health.json()["error"]["message"]

            del fake.failures["nvmlDeviceGetMemoryInfo"]

            async def recovered() -> bool:
                return (await client.get("/healthz")).status_code == 200

            await until(recovered)
    finally:
        reader.close()


class BlockingReader:
    """A reader whose reads from the ``block_from``-th on block until released: an NVML call that hangs."""

    def __init__(self, block_from: int = 2) -> None:
        self.release = threading.Event()
        self.block_from = block_from
        self.reads = 0

    def read(self) -> GpuReport:
        self.reads += 1
        if self.reads >= self.block_from:
            self.release.wait(10)
        return GpuReport("nvml", "node-a", time.time(), (GpuInfo(0, "GPU-0a", "x", 1.0, 1, 2),))

    def close(self) -> None:
        self.release.set()


async def test_a_hung_read_turns_stale_and_requests_never_wait_for_it() -> None:
    reader = BlockingReader()
    try:
        async with agent(reader, stale_after_s=0.1) as client:
            assert (await client.get("/gpu")).status_code == 200

            async def stale() -> httpx.Response | None:
                response = await client.get("/gpu")
                return response if response.status_code == 503 else None

            body = (await until(stale)).json()
            assert "the last read has not returned" in body["error"]["message"]
            assert body["failing_since"] is None and body["last_sampled_at"] is not None
    finally:
        reader.close()


async def test_a_hung_first_read_does_not_hold_up_start_up() -> None:
    reader = BlockingReader(block_from=1)
    try:
        async with agent(reader, stale_after_s=0.05) as client:
            response = await client.get("/healthz")
            assert response.status_code == 503
            assert response.json()["error"]["message"].startswith(
                "no GPU sample yet: the first read has not returned after"
            )
    finally:
        reader.close()


async def test_without_the_lifespan_there_is_no_sample_yet() -> None:
    app = create_agent_app(BlockingReader(), interval_s=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as client:
        response = await client.get("/gpu")
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "no GPU sample yet: the agent is starting"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        pytest.param({"interval_s": 0}, "interval_s must be a number of seconds > 0", id="zero-interval"),
        pytest.param({"interval_s": float("nan")}, "interval_s must be", id="nan-interval"),
        pytest.param({"interval_s": 1, "stale_after_s": -1}, "stale_after_s must be", id="negative-stale"),
    ],
)
def test_bad_options(options: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        create_agent_app(BlockingReader(), **options)


# ---- serving on loopback -----------------------------------------------------------------------------------------


async def test_serve_agent_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvml())
    reader = NvmlReader("node-a")
    address = f"127.0.0.1:{free_port()}"
    ready = asyncio.Event()
    task = asyncio.create_task(serve_agent(create_agent_app(reader, interval_s=FAST_S), address, ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 5)
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client:
            response = await client.get("/gpu")
        assert response.status_code == 200
        assert len(parse_gpu_report(response.json()).gpus) == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reader.close()


async def test_serve_agent_rejects_bad_and_busy_addresses() -> None:
    app = create_agent_app(BlockingReader(), interval_s=1)
    with pytest.raises(ValueError, match="bad listen address 'gpu-node:9400'"):
        await serve_agent(app, "gpu-node:9400")
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            await serve_agent(app, f"127.0.0.1:{port}")
