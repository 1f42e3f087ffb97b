"""Tests for scorer/gpuclient.py: one client for the emulator's /gpu, the GPU agent's /gpu and a DCGM exporter."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from inferlb.gpuagent import NvmlReader, create_agent_app
from inferlb.scorer import gpuclient
from inferlb.scorer.gpuclient import MAX_GPU_REPORT_BYTES, PARSE_ON_LOOP_BYTES, GpuReadError, fetch_gpu_report
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
        # Python's parser recurses once per level: once this raised RecursionError through the collector's round.
        pytest.param(
            "agent", respond(200, b"[" * 100_000), "the body is not JSON (nested too deeply to parse)", id="nested"
        ),
        pytest.param("agent", respond(200, b"[" * 1_000 + b"]" * 1_000), "the body is not JSON", id="nested-1000"),
        pytest.param("agent", respond(500, b"[" * 100_000), "HTTP 500: [[[[", id="nested-error-body"),
        pytest.param("agent", respond(500, b"[" * 2_000), "HTTP 500: [[[[", id="nested-short-error-body"),
        pytest.param(
            "agent",
            respond(200, {**GOOD, "host": ["x" * 1000] * 1000}),
            "not a GPU report: report.host must be a string; got a list of 1000",
            id="long-value-named-short",
        ),
        pytest.param(
            "agent",
            respond(503, {"error": {"message": "x\n" * 10_000}}),
            "HTTP 503: x x x",
            id="long-error-message-cut",
        ),
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
    assert "\n" not in str(info.value) and len(info.value.reason) <= 500


async def test_unknown_kind_is_a_value_error() -> None:
    async with mock_client(respond(200, GOOD)) as client:
        with pytest.raises(ValueError, match="kind must be one of agent, dcgm; got 'nvidia-smi'"):
            await fetch_gpu_report(client, URL, kind="nvidia-smi", host="n")


class LoopbackHttp:
    """A tiny HTTP/1.1 server on 127.0.0.1, port 0: answers each path with its scripted response (404 for any
    other) and counts the requests per path in ``hits``, before it answers."""

    def __init__(self, routes: dict[str, bytes]) -> None:
        self.routes = routes
        self.hits: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self.port = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def __aenter__(self) -> LoopbackHttp:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode("ascii")
            self.hits[path] += 1
            writer.write(self.routes.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def http_response(status: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def test_a_redirect_is_an_error_that_names_it_and_is_not_followed() -> None:
    canary = LoopbackHttp({"/canary": http_response("200 OK", json.dumps(GOOD).encode())})
    async with canary, LoopbackHttp({}) as source:
        source.routes["/gpu"] = http_response("302 Found", Location=canary.url("/canary"))
        # a client that would follow: fetch_gpu_report must not, whatever client it is given
        async with httpx.AsyncClient(follow_redirects=True, timeout=5) as client:
            with pytest.raises(GpuReadError) as info:
                await fetch_gpu_report(client, source.url("/gpu"), kind="agent", host="n")
    assert info.value.reason == (
        f"HTTP 302 redirect to {canary.url('/canary')!r} (redirects are not followed: set gpu.url to where the "
        "report is)"
    )
    assert source.hits == {"/gpu": 1}
    assert canary.hits == {}


async def test_a_redirect_without_a_location_is_an_error_too() -> None:
    async with mock_client(respond(301, b"moved")) as client:
        with pytest.raises(GpuReadError, match=r": HTTP 301 redirect \(redirects are not followed"):
            await fetch_gpu_report(client, URL, kind="dcgm", host="n")


CHUNK = 64 * 1024


def endless(
    total: int, pulled: list[int], headers: dict[str, str] | None = None
) -> Callable[[httpx.Request], httpx.Response]:
    """A response of ``total`` bytes made as it is read, 64 KiB at a time; ``pulled`` counts what was made."""

    async def body() -> AsyncIterator[bytes]:
        for _ in range(total // CHUNK):
            pulled.append(CHUNK)
            yield b" " * CHUNK

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers=headers)

    return handler


async def test_a_huge_body_is_refused_without_being_read_whole() -> None:
    pulled: list[int] = []
    async with mock_client(endless(50 << 20, pulled)) as client:
        with pytest.raises(GpuReadError) as info:
            await fetch_gpu_report(client, URL, kind="dcgm", host="n")
    assert info.value.reason == f"the body exceeds {MAX_GPU_REPORT_BYTES} bytes"
    assert sum(pulled) <= MAX_GPU_REPORT_BYTES + CHUNK < 50 << 20


async def test_a_smaller_cap_applies_and_a_declared_length_over_it_is_refused_before_reading() -> None:
    pulled: list[int] = []
    async with mock_client(endless(1 << 20, pulled)) as client:
        with pytest.raises(GpuReadError, match=r"the body exceeds 65536 bytes$"):
            await fetch_gpu_report(client, URL, kind="agent", host="n", max_bytes=CHUNK)
    assert sum(pulled) == 2 * CHUNK

    pulled.clear()
    async with mock_client(endless(1 << 20, pulled, {"content-length": "1048576"})) as client:
        with pytest.raises(GpuReadError, match=r"the body of 1048576 bytes exceeds 65536$"):
            await fetch_gpu_report(client, URL, kind="agent", host="n", max_bytes=CHUNK)
    assert pulled == []


async def test_an_encoded_body_is_refused_and_identity_is_asked_for() -> None:
    seen: list[httpx.Request] = []

    def gzipped(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"\x1f\x8b", headers={"content-encoding": "gzip"})

    async with mock_client(gzipped) as client:
        with pytest.raises(GpuReadError, match=r"the body is encoded \(gzip\)"):
            await fetch_gpu_report(client, URL, kind="dcgm", host="n")
    assert seen[0].headers["accept-encoding"] == "identity"


async def test_the_whole_read_is_bounded_by_timeout_s() -> None:
    async def dribble() -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.Event().wait()  # a server that never finishes its body (and never trips a read timeout)
        yield b"}"

    async with mock_client(lambda request: httpx.Response(200, content=dribble())) as client:
        with pytest.raises(GpuReadError) as info:
            await fetch_gpu_report(client, URL, kind="agent", host="n", timeout_s=0.05)
    assert info.value.reason == "timed out after 0.05 s in all"


def dcgm_exposition(gpus: int, devices_per_gpu: int = 1) -> bytes:
    """A DCGM exposition of ``gpus`` GPUs like the fixture's, each family printed for ``devices_per_gpu`` devices of
    every GPU (the GPU and, past the first, its MIG instances, labelled GPU_I_ID)."""
    lines = DCGM_TEXT.decode().splitlines()
    out: list[str] = []
    for line in lines:
        if line.startswith("#"):
            out.append(line)
        elif 'gpu="0"' in line:  # the fixture's GPU 0, once per GPU and device
            for gpu in range(gpus):
                for device in range(devices_per_gpu):
                    mig = f'GPU_I_ID="{device}",GPU_I_PROFILE="1g.10gb",' if device else ""
                    out.append(line.replace('gpu="0",', f'gpu="{gpu}",{mig}'))
    return ("\n".join(out) + "\n").encode()


def test_the_limit_holds_a_real_nodes_exposition_twice_over() -> None:
    # The largest node in reach: 8 GPUs, each split into 7 MIG instances, every default family printed per instance.
    assert 2 * len(dcgm_exposition(8, devices_per_gpu=8)) <= MAX_GPU_REPORT_BYTES


async def test_a_body_of_2_mib_is_refused() -> None:
    # 2 MiB was once the limit: no node sends so much, and a body near it held the event loop for hundreds of ms.
    body = dcgm_exposition(280)
    assert MAX_GPU_REPORT_BYTES < len(body) < 2 << 20
    async with mock_client(respond(200, body)) as client:
        with pytest.raises(GpuReadError, match="exceeds"):
            await fetch_gpu_report(client, URL, kind="dcgm", host="n")


def agent_report(gpus: int) -> bytes:
    gpu = {"uuid": "GPU-0", "name": "NVIDIA H100", "utilization_pct": 5.0, "memory_used_bytes": 1}
    listed = [{"index": i, **gpu, "memory_total_bytes": 85899345920} for i in range(gpus)]
    return json.dumps({**GOOD, "gpus": listed}).encode()


@pytest.mark.parametrize(
    ("kind", "body", "off_loop"),
    [
        pytest.param("dcgm", DCGM_TEXT, False, id="dcgm-small"),
        pytest.param("dcgm", dcgm_exposition(16, devices_per_gpu=2), True, id="dcgm-large"),
        pytest.param("agent", agent_report(8), False, id="agent-small"),
        pytest.param("agent", agent_report(1000), True, id="agent-large"),
        pytest.param("agent", b"[" * 100_000, True, id="agent-large-nested"),
    ],
)
async def test_a_large_body_is_parsed_off_the_event_loop(
    kind: str, body: bytes, off_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (len(body) > PARSE_ON_LOOP_BYTES) == off_loop
    threads: list[int] = []
    module, name = (gpuclient, "read_dcgm") if kind == "dcgm" else (gpuclient.json, "loads")
    parse = getattr(module, name)

    def spy(*args: object) -> object:
        threads.append(threading.get_ident())
        return parse(*args)

    monkeypatch.setattr(module, name, spy)
    async with mock_client(respond(200, body)) as client:
        try:
            await fetch_gpu_report(client, URL, kind=kind, host="n")
        except GpuReadError:
            assert body.startswith(b"[")  # the nested one: refused, wherever it was parsed
    assert len(threads) == 1
    assert (threads[0] != threading.get_ident()) == off_loop
