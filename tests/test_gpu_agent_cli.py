"""``inferlb gpu-agent``: exit status 3 with one line when NVML is missing, and a served agent that stops on
SIGTERM (with the fake pynvml of tests/scorer/fakenvml.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inferlb.cli import main
from inferlb.procs import free_port

from .scorer.fakenvml import (
    FakeNvml,
    nvml_missing,
)

FAKE_DIR = Path(__file__).parent / "scorer"
ARGS = ["gpu-agent", "--listen", "127.0.0.1:9400", "--interval-s", "0.5"]


def no_nvml_line(reason: str) -> str:
    return (
        f"inferlb: error: NVML is not available ({reason}); the GPU agent needs an NVIDIA driver and GPU on this node\n"
    )


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        *nvml_missing(),
    ],
)
def test_no_nvml_exits_3_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake: FakeNvml, reason: str
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    assert main(ARGS) == 3
    captured = capsys.readouterr()
    assert captured.err == no_nvml_line(reason)
    assert captured.out == ""


def test_no_pynvml_exits_3_with_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(ARGS) == 3
    assert capsys.readouterr().err == no_nvml_line("cannot import pynvml: import of pynvml halted; None in sys.modules")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        pytest.param(
            ["--listen", "gpu-node:9400"], "--listen: 'gpu-node:9400': 'gpu-node' is not a literal IP", id="host"
        ),
        pytest.param(["--interval-s", "0"], "--interval-s must be a number of seconds > 0; got 0.0", id="interval"),
        pytest.param(["--interval-s", "nan"], "--interval-s must be", id="nan"),
    ],
)
def test_bad_arguments_exit_2_before_touching_nvml(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    assert main(["gpu-agent", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"inferlb: error: {words}")
    assert fake.init_calls == 0


def test_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["gpu-agent", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "3 when NVML is not available" in out and "--interval-s" in out and "default 127.0.0.1:9400" in out


# The agent as an operator runs it: its own process, stopped by SIGTERM. The fake replaces pynvml before the CLI runs.
_RUN_WITH_FAKE = """
import sys
sys.path.insert(0, sys.argv[1])
import fakenvml
sys.modules["pynvml"] = fakenvml.FakeNvml().module()
from inferlb.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_serves_until_sigterm() -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["gpu-agent", "--listen", address, "--interval-s", "0.05", "--host", "node-x"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_WITH_FAKE, str(FAKE_DIR), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=f"http://{address}", timeout=2) as client:
            while True:
                assert proc.poll() is None, proc.communicate()
                try:
                    health = client.get("/healthz")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the agent did not start listening in time"
                    time.sleep(0.02)
            report = client.get("/gpu").json()
        assert health.status_code == 200 and health.json()["gpus"] == 2
        assert (report["source"], report["host"], len(report["gpus"])) == ("nvml", "node-x", 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert f"GPU agent listening on {address}" in err and "got SIGTERM, shutting down" in err
