"""What many test modules share: a clock the test moves by hand, pollers for conditions that no event
announces, and a recorder of what a discovery source publishes (import them: ``from ..conftest import until``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferlb.procs import find_tool
from inferlb.scorer.config import EndpointConfig

# Tests that drive a real etcd (Debian's etcd-server) skip without it here, never on CI, where .ci/run installs it.
needs_etcd = pytest.mark.skipif(
    shutil.which("etcd") is None and not os.environ.get("CI"), reason="needs Debian's etcd-server (.ci/run installs it)"
)


class ManualClock:
    """A clock (seconds) that moves only when told: ``clock()`` reads it, ``advance`` moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


async def until(check: Callable[[], Any], what: str = "condition", timeout: float = 20.0) -> Any:
    """Poll ``check`` on the event loop (a coroutine function's result is awaited) until it returns something
    true, and return that; AssertionError naming ``what`` after ``timeout`` seconds. For conditions with no event
    to wait on (another process's state, a counter that moves when a stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.005)


class LoopTurns:
    """Counts the turns the event loop gives other tasks while a piece of work runs: ``async with LoopTurns() as
    turns:`` then ``turns.count`` (how often a task that only yields got to run). Work that never awaits gives
    none; work that yields every N items gives about one per N."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker starts here
        self.count = 0
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def poll(check: Callable[[], Any], what: str = "condition", timeout: float = 10.0) -> Any:
    """`until` for code without an event loop: the thread sleeps between looks."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def process_state(pid: int) -> str:
    """A process's state letter from /proc (R running, S sleeping, T stopped by a signal, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    return stat[stat.rindex(")") + 2]


class Published:
    """Stands for the picker beside a discovery source: records each membership the source publishes."""

    def __init__(self) -> None:
        self.lists: list[tuple[EndpointConfig, ...]] = []

    def __call__(self, endpoints: tuple[EndpointConfig, ...]) -> None:
        self.lists.append(endpoints)

    @property
    def addresses(self) -> list[str]:
        """The addresses of the last membership published ([] before the first)."""
        return [e.address for e in self.lists[-1]] if self.lists else []


def envoy_accepts(path: Path) -> None:
    """``envoy --mode validate`` accepts the bootstrap at ``path`` (else the assertion shows Envoy's output)."""
    result = subprocess.run(
        [find_tool("envoy"), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Runs `inferlb serve --config CONFIG` in a fresh interpreter and, once the picker says it is listening, the probe: the
# body of a function ``probe(out)`` that writes what it finds (JSON) to the file ``out``; then stops the picker with
# SIGTERM. serve() logs "listening" just before it installs its signal handlers, so the signal is sent from the event
# loop's next turn, after them.
_PICKER_PROBE = """
import asyncio, json, logging, os, signal, sys, threading
from inferlb.cli import main
out, config = sys.argv[1], sys.argv[2]

def probe(out):
{probe}

class Listening(logging.Handler):
    def emit(self, record):
        if not str(record.msg).startswith("inferlb picker listening"):
            return
        probe(out)
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)

logging.getLogger("inferlb.picker").addHandler(Listening())
sys.exit(main(["serve", "--config", config]))
"""


def probe_running_picker(config: Path, out: Path, probe: str, timeout_s: float = 60.0) -> Any:
    """What ``probe`` (Python statements, indented by four, that write JSON to the file ``out``) found inside a picker
    run with ``config`` (`_PICKER_PROBE`), once it listens; the picker must have exited cleanly after."""
    script = _PICKER_PROBE.format(probe=probe)
    done = subprocess.run(
        [sys.executable, "-c", script, str(out), str(config)], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.exists(), f"the probe wrote nothing; the picker's log:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def self_signed(folder: Path, name: str = "ca") -> Path:
    """A self-signed certificate for 127.0.0.1 (``<name>.crt``, its key ``<name>.key``, made by openssl in
    ``folder``): a cluster's CA, or a server's."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        cwd=folder, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder / f"{name}.crt"
