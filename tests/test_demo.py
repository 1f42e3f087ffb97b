"""``inferlb demo --quick`` end to end (the README's first command's short run, on a smaller burst), and Ctrl-C and
SIGTERM in both the short run and the comparison."""

from __future__ import annotations

import io
import os
import signal
import subprocess
from pathlib import Path

import pytest

from inferlb.demo import DemoOptions, run_demo
from inferlb.procs import find_tool

pytestmark = pytest.mark.envoy


def test_demo_routes_every_request_through_the_picker(tmp_path: Path) -> None:
    out = io.StringIO()
    code = run_demo(DemoOptions(backends=3, quick=True, requests=30, concurrency=4), tmp_path, stream=out)
    text = out.getvalue()
    assert code == 0, text
    assert "routed by the picker through Envoy's ORIGINAL_DST cluster: 30/30" in text
    assert "sent to the fallback cluster: 0" in text
    assert "HTTP 400" in text and "HTTP 404" in text
    assert (tmp_path / "envoy.yaml").exists() and (tmp_path / "picker.yaml").exists()


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if text in line and int(line.split()[0]) != os.getpid()]


QUICK = ("--quick", "--requests", "1000000", "--concurrency", "4")
COMPARISON = ("--duration", "600", "--slow-at", "0")


@pytest.mark.parametrize(
    ("sig", "args", "started"),
    [
        pytest.param(signal.SIGINT, QUICK, "gateway ", id="quick-ctrl-c"),
        pytest.param(signal.SIGTERM, QUICK, "gateway ", id="quick-sigterm"),
        # Interrupted in the middle of the round-robin run, with a server slowed.
        pytest.param(signal.SIGINT, COMPARISON, "round robin: through", id="comparison-ctrl-c"),
    ],
)
def test_interrupted_demo_stops_everything_it_started(
    tmp_path: Path, sig: signal.Signals, args: tuple[str, ...], started: str
) -> None:
    out_dir = tmp_path / "demo"
    demo = subprocess.Popen(
        [find_tool("inferlb"), "demo", *args, "--out", str(out_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # bounded: the demo prints this line once the gateway is up (or a run is on)
            if line.startswith(started):
                break
        assert _processes_mentioning(str(out_dir)), "the demo's picker and Envoy should be running"
        demo.send_signal(sig)
        assert demo.wait(30) == 130
    finally:
        demo.kill()
    assert _processes_mentioning(str(out_dir)) == []
