"""Tests for scorer/gpuclient.py: one client for the emulator's /gpu, the GPU agent's /gpu and a DCGM exporter."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from inferlb.scorer.gpuagent import NvmlReader, create_agent_app
from inferlb.scorer.gpuclient import GpuReadError, fetch_gpu_report
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from .fakenvml import NVML_ERROR_GPU_IS_LOST, FakeNvml

DCGM_TEXT = (Path(__file__).parent.parent / "fixtures" / "dcgm" / "dcgm-exporter-h100x2-k8s.txt").read_bytes()
URL = "http://node-7:9400/gpu"


def mock_client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), timeout=1)


async def test_reads_the_emulators_gpu_view() -> None:
    profile = get_profile("h100-llama3.1-8b")
    server = EmulatedServer("127.0.0.1:8001", ServerOptions(profile=profile, jitter=0.0))
    try:
        transport = httpx.ASGITransport(app=server)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=5) as client:
            report = await fetch_gpu_report(client, "http://sim/gpu", kind="agent", host="ignored")
    finally:
        await server.aclose()
    assert (report.source, report.host) == ("emulated", "127.0.0.1:8001")
    assert [gpu.name for gpu in report.gpus] == [profile.gpu] * profile.gpu_count


async def test_reads_the_agent_and_reports_its_503(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    reader = NvmlReader("node-7")
    app = create_agent_app(reader, interval_s=0.01)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as client,
        ):
            report = await fetch_gpu_report(client, "http://agent/gpu", kind="agent", host="node-7")
            assert (report.source, report.host, len(report.gpus)) == ("nvml", "node-7", 2)

            fake.failures["nvmlDeviceGetUtilizationRates"] = NVML_ERROR_GPU_IS_LOST
            # poll: the agent notices at its next sample, a few milliseconds away
            deadline = time.monotonic() + 3
            while True:
                try:
                    await fetch_gpu_report(client, "http://agent/gpu", kind="agent", host="node-7")
                except GpuReadError as exc:
                    error = exc
                    break
                assert time.monotonic() < deadline, "the agent never reported the failure"
                await asyncio.sleep(0.005)
    finally:
        reader.close()
    assert error.url == "http://agent/gpu"
    assert error.reason.startswith("HTTP 503: GPU sampling failed: GPU 0 (GPU-")
    assert error.reason.endswith("nvmlDeviceGetUtilizationRates failed: GPU is lost")


async def test_reads_a_dcgm_exporter() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=DCGM_TEXT, headers={"content-type": "text/plain; version=0.0.4"})

    async with mock_client(handler) as client:
        report = await fetch_gpu_report(client, "http://10.0.0.7:9400/metrics", kind="dcgm", host="gpu-node-7")
    assert (report.source, report.host) == ("dcgm", "gpu-node-7")
    assert [(gpu.index, gpu.utilization_pct) for gpu in report.gpus] == [(0, 87.0), (1, 0.0)]
    assert str(seen[0].url) == "http://10.0.0.7:9400/metrics"


def respond(status: int, body: bytes | str | object) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes | str):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return handler


def fail_with(exc: type[httpx.TransportError]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc("boom", request=request)

    return handler


GOOD = {"source": "nvml", "host": "n", "sampled_at": 1.0, "gpus": []}


@pytest.mark.parametrize(
    ("kind", "handler", "reason"),
    [
        pytest.param("agent", fail_with(httpx.ReadTimeout), "timed out (ReadTimeout)", id="timeout"),
        pytest.param("dcgm", fail_with(httpx.ConnectError), "ConnectError: boom", id="connect-refused"),
        pytest.param("agent", respond(404, "Not Found\nmore"), "HTTP 404: Not Found", id="404-text"),
        pytest.param("agent", respond(500, b""), "HTTP 500", id="500-empty"),
        pytest.param(
            "agent",
            respond(503, {"status": "error", "error": {"message": "GPU sampling failed: x", "code": 503}}),
            "HTTP 503: GPU sampling failed: x",
            id="503-agent-error-body",
        ),
        pytest.param("agent", respond(200, "<html>"), "the body is not JSON", id="not-json"),
        pytest.param("agent", respond(200, b"\xff\xfe"), "the body is not JSON", id="not-utf8"),
        pytest.param(
            "agent",
            respond(200, {**GOOD, "source": "smi"}),
            "not a GPU report: report.source must be one of nvml, dcgm, emulated; got 'smi'",
            id="schema-source",
        ),
        pytest.param(
            "agent",
            respond(200, {**GOOD, "gpus": [{"index": 0}]}),
            "not a GPU report: gpus[0].utilization_pct must be a finite number; got None",
            id="schema-gpu",
        ),
        pytest.param("agent", respond(200, [1, 2]), "not a GPU report: a GPU report must be a JSON object", id="list"),
        pytest.param(
            "dcgm",
            respond(200, DCGM_TEXT.replace(b"DCGM_FI_DEV_FB_FREE{", b"DCGM_FI_DEV_FB_FREEX{")),
            "not a usable DCGM exposition: GPU 0 (GPU-7c1e54b2-93af-4d08-b6e1-2a9f0c3d5e71): metric "
            "DCGM_FI_DEV_FB_FREE is missing",
            id="dcgm-missing-metric",
        ),
        pytest.param("dcgm", respond(200, json.dumps(GOOD)), "not a usable DCGM exposition: no GPU found", id="json"),
    ],
)
async def test_failures_raise_gpu_read_error(
    kind: str, handler: Callable[[httpx.Request], httpx.Response], reason: str
) -> None:
    async with mock_client(handler) as client:
        with pytest.raises(GpuReadError) as info:
            await fetch_gpu_report(client, URL, kind=kind, host="n")
    assert info.value.url == URL
    assert info.value.reason.startswith(reason), info.value.reason
    assert str(info.value).startswith(f"cannot read GPU state from {URL}: {reason}")
    assert "\n" not in str(info.value)


async def test_unknown_kind_is_a_value_error() -> None:
    async with mock_client(respond(200, GOOD)) as client:
        with pytest.raises(ValueError, match="kind must be one of agent, dcgm; got 'nvidia-smi'"):
            await fetch_gpu_report(client, URL, kind="nvidia-smi", host="n")
