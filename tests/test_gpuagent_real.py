"""The GPU agent on a real NVIDIA GPU: what it serves at ``/gpu`` is what the driver says (``nvidia-smi``), and it
follows memory that a process takes and gives back. Marked ``gpu``: excluded from ``make test`` (no GPU on the
development machines or CI); run with ``pytest -m gpu tests/test_gpuagent_real.py`` on a machine with one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferlb.procs import free_port

from .conftest import poll

pytestmark = pytest.mark.gpu

MIB = 1 << 20
# Memory taken on GPU 0 to see the agent follow it; far below any data-centre GPU's memory.
TAKEN_BYTES = 8 << 30


def _smi() -> list[dict[str, str]]:
    fields = ["index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu"]
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [dict(zip(fields, (v.strip() for v in line.split(",")), strict=True)) for line in out.splitlines()]


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi: this machine has no NVIDIA driver")
    address = f"127.0.0.1:{free_port()}"
    # What `inferlb gpu-agent` runs, without the rest of the CLI's imports (a GPU node needs only the agent's).
    agent_main = "import sys; from inferlb.gpuagent import run_agent; sys.exit(run_agent(sys.argv[1], 0.2))"
    process = subprocess.Popen(
        [sys.executable, "-c", agent_main, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        poll(lambda: _exited(process) or _get(address, "/healthz"), "the GPU agent to answer", timeout=60)
        yield address
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
        print(output)
    assert process.returncode == 0, output


def _exited(process: subprocess.Popen[str]) -> None:
    if process.poll() is not None:
        raise AssertionError(f"the GPU agent exited with {process.returncode}: {process.communicate()[0]}")


def _get(address: str, path: str) -> Any:
    try:
        response = httpx.get(f"http://{address}{path}", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def test_the_agent_serves_what_the_driver_says(agent: str) -> None:
    report = _get(agent, "/gpu")
    print(report)
    assert report["source"] == "nvml"
    smi = _smi()
    assert [g["uuid"] for g in report["gpus"]] == [g["uuid"] for g in smi]
    assert [g["name"] for g in report["gpus"]] == [g["name"] for g in smi]
    for served, said in zip(report["gpus"], smi, strict=True):
        assert abs(served["memory_total_bytes"] / MIB - float(said["memory.total"])) <= 1
        assert 0 <= served["utilization_pct"] <= 100
        assert 0 <= served["memory_used_bytes"] <= served["memory_total_bytes"]


def _free(address: str) -> int:
    gpu = _get(address, "/gpu")["gpus"][0]
    return int(gpu["memory_total_bytes"] - gpu["memory_used_bytes"])


def test_the_agent_follows_memory_taken_and_given_back(agent: str) -> None:
    torch = pytest.importorskip("torch")
    before = _free(agent)
    block = torch.empty(TAKEN_BYTES, dtype=torch.uint8, device="cuda:0")
    block.fill_(1)
    torch.cuda.synchronize()
    taken = poll(
        lambda: (free := _free(agent)) <= before - TAKEN_BYTES and free,
        "the agent to see the memory taken",
        timeout=10,
    )
    print(f"free before {before / MIB:.0f} MiB, with {TAKEN_BYTES / MIB:.0f} MiB taken {taken / MIB:.0f} MiB")
    del block
    torch.cuda.empty_cache()
    # The CUDA context this process made stays; the block's memory comes back.
    back = poll(
        lambda: (free := _free(agent)) >= taken + TAKEN_BYTES - 64 * MIB and free,
        "the agent to see the memory given back",
        timeout=10,
    )
    print(f"given back: free {back / MIB:.0f} MiB")
