"""Tests for scorer/gpucollect.py: GPU state from the emulator's GPU view into the signals snapshot."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import httpx
import pytest

from inferlb.procs import free_port
from inferlb.scorer import gpucollect
from inferlb.scorer.config import GpuSource
from inferlb.scorer.gpuclient import MAX_GPU_REPORT_BYTES
from inferlb.scorer.gpucollect import GpuCollector
from inferlb.scorer.signals import Signals
from inferlb.sim.fleet import serving
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from .test_gpuclient import LoopbackHttp, http_response

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


async def test_a_source_that_redirects_is_an_error_and_the_target_is_never_asked(caplog):
    canary = LoopbackHttp({"/gpu": http_response("200 OK", b'{"source": "nvml", "host": "n", "gpus": []}')})
    async with canary, LoopbackHttp({}) as source:
        source.routes["/gpu"] = http_response("302 Found", Location=canary.url("/gpu"))
        signals = Signals(1)
        collector = GpuCollector([GpuSource(source.url("/gpu"))], signals, timeout_s=5.0)
        try:
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.gpucollect"):
                await collector.read_once()
        finally:
            await collector.aclose()
    assert source.hits == {"/gpu": 1}
    assert canary.hits == {}
    assert collector.errors == {source.url("/gpu"): 1}
    assert f"HTTP 302 redirect to {canary.url('/gpu')!r}" in caplog.text
    assert math.isnan(signals.snapshot.gpu_util[0])


async def test_a_huge_body_is_refused_without_being_read_whole():
    """A source that answers 200 MiB (close-delimited, so no length to refuse up front): the collector stops at its
    cap and closes; the server gets to write no more than the cap and what the sockets' buffers hold (Linux lets
    them grow to tens of MiB; about 5 MiB here)."""
    huge, piece = 200 << 20, b"#" * (64 << 10)
    written: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            while sum(written) < huge:
                writer.write(piece)
                await writer.drain()
                written.append(len(piece))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    collector = GpuCollector([GpuSource(url, kind="dcgm")], Signals(1), timeout_s=5.0)
    try:
        await collector.read_once()
    finally:
        await collector.aclose()
        server.close()
        await server.wait_closed()
    assert collector.errors == {url: 1}
    assert MAX_GPU_REPORT_BYTES <= sum(written) < 64 << 20


@pytest.mark.parametrize(
    "field", [pytest.param('"sampled_at": 1{zeros}', id="sampled-at"), pytest.param("", id="memory-total")]
)
@pytest.mark.parametrize("digits", [pytest.param(400, id="overflows-float64"), pytest.param(5000, id="past-int-limit")])
async def test_a_report_with_a_huge_integer_is_an_error_of_its_source_and_reading_goes_on(field, digits, caplog):
    # Once, 10**400 raised OverflowError through the report's validation: the collector's task ended, GPU state froze
    # for every endpoint, and nothing was logged.
    huge = "1" + "0" * digits
    total = huge if not field else "80000000000"
    sampled = field.format(zeros="0" * digits) if field else '"sampled_at": 1.0'
    gpu = '{"index": 0, "uuid": "u", "name": "n", "utilization_pct": 5, "memory_used_bytes": 1, '
    gpu += f'"memory_total_bytes": {total}}}'
    bad = f'{{"source": "nvml", "host": "n", {sampled}, "gpus": [{gpu}]}}'.encode()
    good = b'{"source": "nvml", "host": "m", "sampled_at": 1.0, "gpus": []}'
    async with (
        LoopbackHttp({"/gpu": http_response("200 OK", bad)}) as liar,
        LoopbackHttp({"/gpu": http_response("200 OK", good)}) as honest,
    ):
        signals = Signals(2)
        collector = GpuCollector(
            [GpuSource(liar.url("/gpu")), GpuSource(honest.url("/gpu"))], signals, interval_s=0.02, timeout_s=5.0
        )
        task = asyncio.create_task(collector.run())
        deadline = asyncio.get_running_loop().time() + 10
        try:
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.gpucollect"):
                while collector.rounds < 3:
                    assert not task.done(), task
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await collector.aclose()
    assert collector.errors[liar.url("/gpu")] >= 3
    # Refused as JSON (over Python's 4,300 digits) or as a report (over 2**63), with a short word for the number.
    assert f"GPU source {liar.url('/gpu')}" in caplog.text and len(caplog.text) < 2000
    assert math.isnan(signals.snapshot.gpu_util[0])


def report(*utils: float, host: str = "n") -> bytes:
    """An agent's report of GPUs 0, 1, ... at these utilisations, 10 of 100 bytes used on each."""
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "name": "H100", "utilization_pct": u, "memory_used_bytes": 10}
        | {"memory_total_bytes": 100}
        for i, u in enumerate(utils)
    ]
    return json.dumps({"source": "nvml", "host": host, "sampled_at": 1.0, "gpus": gpus}).encode()


async def test_a_source_nested_too_deeply_costs_only_its_own_endpoints(caplog):
    # Once such a body raised RecursionError through the round: nothing was published, every endpoint's GPU state
    # froze at its last values, and a traceback was logged every round.
    async with (
        LoopbackHttp({"/gpu": http_response("200 OK", report(95.0))}) as good,
        LoopbackHttp({"/gpu": http_response("200 OK", b"[" * 100_000)}) as bad,
    ):
        signals = Signals(3)
        sources = [GpuSource(good.url("/gpu")), GpuSource(bad.url("/gpu")), GpuSource(bad.url("/gpu"), indices=(0,))]
        collector = GpuCollector(sources, signals, timeout_s=5.0)
        try:
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.gpucollect"):
                await collector.read_once()
        finally:
            await collector.aclose()
    assert signals.snapshot.gpu_util[0] == pytest.approx(0.95)
    assert math.isnan(signals.snapshot.gpu_util[1]) and math.isnan(signals.snapshot.gpu_util[2])
    nested = "the body is not JSON (nested too deeply to parse)"
    assert collector.last_error == [None, nested, nested]
    assert collector.errors == {bad.url("/gpu"): 1} and collector.rounds == 1
    assert caplog.text.count("GPU source") == 1 and "Traceback" not in caplog.text


async def test_a_bug_met_on_one_sources_report_costs_only_that_sources_endpoints(monkeypatch, caplog):
    real = gpucollect.fetch_gpu_report

    async def fetch(client, url, **kwargs):
        if url.endswith("/bad"):
            raise RuntimeError("a bug")
        return await real(client, url, **kwargs)

    monkeypatch.setattr(gpucollect, "fetch_gpu_report", fetch)
    async with LoopbackHttp({"/gpu": http_response("200 OK", report(40.0))}) as node:
        signals = Signals(2)
        collector = GpuCollector([GpuSource(node.url("/gpu")), GpuSource(node.url("/bad"))], signals, timeout_s=5.0)
        try:
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.gpucollect"):
                for _ in range(3):
                    await collector.read_once()
        finally:
            await collector.aclose()
    assert signals.snapshot.gpu_util[0] == pytest.approx(0.4) and math.isnan(signals.snapshot.gpu_util[1])
    assert collector.last_error == [None, "reading it raised RuntimeError: a bug"]
    assert collector.errors == {node.url("/bad"): 3} and collector.rounds == 3
    assert caplog.text.count("Traceback") == 1  # the bug's traceback, once while it goes on


async def test_each_change_of_a_sources_state_is_logged_once(caplog):
    lost = json.dumps({"status": "error", "error": {"message": "GPU 0: GPU is lost"}}).encode()
    phases = [
        ("ok", http_response("200 OK", report(30.0))),
        ("lost", http_response("503 Service Unavailable", lost)),
        ("lost", http_response("503 Service Unavailable", lost)),
        ("ok", http_response("200 OK", report(30.0))),
        ("absurd", http_response("200 OK", report(130.0))),
        ("ok", http_response("200 OK", report(30.0))),
    ]
    async with LoopbackHttp({}) as node:
        url = node.url("/gpu")
        collector = GpuCollector([GpuSource(url)], Signals(1), timeout_s=5.0)
        seen = []
        try:
            with caplog.at_level(logging.INFO, logger="inferlb.scorer.gpucollect"):
                for _, response in phases:
                    node.routes["/gpu"] = response
                    await collector.read_once()
                    seen.append(collector.last_error[0])
        finally:
            await collector.aclose()
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "inferlb.scorer.gpucollect"]
    absurd = "not a GPU report: gpus[0].utilization_pct must be in [0, 100]; got 130.0"
    assert [(level, message.split(" (GPU state unknown")[0]) for level, message in logged] == [
        ("WARNING", f"GPU source {url} fails: HTTP 503: GPU 0: GPU is lost"),
        ("INFO", f"GPU source {url} recovered after 2 failed rounds"),
        ("WARNING", f"GPU source {url} fails: {absurd}"),
        ("INFO", f"GPU source {url} recovered after 1 failed round"),
    ]
    assert seen == [None, "HTTP 503: GPU 0: GPU is lost", "HTTP 503: GPU 0: GPU is lost", None, absurd, None]
    assert collector.errors == {url: 3}


async def test_a_gpu_the_report_lacks_is_its_sources_failure(caplog):
    async with LoopbackHttp({"/gpu": http_response("200 OK", report(20.0, 60.0))}) as node:
        url = node.url("/gpu")
        signals = Signals(3)
        sources = [GpuSource(url, indices=(1,)), GpuSource(url, indices=(2,)), GpuSource(url, indices=(0, 2))]
        collector = GpuCollector(sources, signals, timeout_s=5.0)
        try:
            with caplog.at_level(logging.WARNING, logger="inferlb.scorer.gpucollect"):
                await collector.read_once()
                await collector.read_once()
        finally:
            await collector.aclose()
    snap = signals.snapshot
    assert snap.gpu_util[0] == pytest.approx(0.6) and snap.gpu_total_bytes[0] == 100
    # not GPU 0's figures alone for the endpoint of GPUs 0 and 2: half its memory would go uncounted
    assert all(math.isnan(snap.gpu_util[i]) and math.isnan(snap.gpu_total_bytes[i]) for i in (1, 2))
    lacks = "the report has no GPU 2 of those gpu.indices names (it lists 0, 1)"
    assert collector.last_error == [None, lacks, lacks]
    assert collector.errors == {url: 2}
    assert caplog.text.count(f"GPU source {url} fails: {lacks}") == 1
