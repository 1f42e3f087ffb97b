"""Starting, watching and stopping the processes of a local gateway (emulated servers, picker, Envoy).

Used by ``inferlb demo``, the integration tests and the benchmarks. Readiness is always polled against a
deadline, never slept for; a process that dies while we wait fails the wait at once with the end of its log.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVER_HEADER = "x-inferlb-sim-server"
"""The response header in which an emulated server (``inferlb sim``) names itself (``ip:port``). Defined here, on
the side that starts the servers and reads their answers, so that the demo need not import the simulator, and in
this small module, so that an emulated server need not import the local stack (Envoy's configs, the picker's)."""


class ProcessError(RuntimeError):
    """A managed process failed to start, died, or did not become ready in time."""


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now and that no outgoing connection will take before someone listens on it.

    The kernel's choice for port 0 comes from the ephemeral range, which outgoing connections also draw
    from: a client connecting in the seconds between this call and the listener's bind could take the
    port (a real failure seen under load). So ports are drawn at random below the ephemeral range, tested
    by binding, and never handed out twice by this process.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low_ephemeral, high_ephemeral = _ephemeral_range()
    low, high = (20_000, low_ephemeral - 1) if low_ephemeral > 21_000 else (high_ephemeral + 1, 65_535)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(family) as sock:  # a crowded range: the kernel's choice is still better than failing
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that are free now (as `free_port`): for ``inferlb serve
    --workers N``, whose worker ``i`` listens on a port plus ``i``."""
    for _ in range(200):
        first = free_port(host)
        if first + count - 1 > 65535:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        rest = []
        for port in range(first + 1, first + count):
            if port in _handed_out:
                break
            with socket.socket(family) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    break
            rest.append(port)
        if len(rest) == count - 1:
            _handed_out.update(rest)
            return first
    raise ProcessError(f"no {count} consecutive free ports on {host}")


def find_tool(name: str) -> str:
    """The path of a command, preferring the one beside this Python (the venv's ``envoy``, ``inferlb``)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ProcessError(f"{name!r} not found: install the project with `make` (it creates .venv) or put it on PATH")
    return found


class ManagedProcess:
    """One child process with its output in a log file. It runs in a session of its own, so ``stop`` reaches
    everything it started and a Ctrl-C in the terminal does not race our orderly shutdown. Where util-linux's
    ``setpriv`` exists (Linux), the child also gets SIGTERM if we die without stopping it (SIGKILL, a crash),
    so no Envoy or server outlives the demo or test that started it."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        setpriv = shutil.which("setpriv")
        argv = [setpriv, "--pdeathsig", "TERM", "--", *self.argv] if setpriv else self.argv
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ProcessError(f"{self.name} was never started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, check: Callable[[], bool], timeout: float, what: str = "ready") -> None:
        """Poll ``check`` until it returns True; fail if the process exits or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            if not self.running():
                code = self.proc.returncode if self.proc else None
                raise ProcessError(f"{self.name} exited (code {code}) before it was {what}:\n{self.log_tail()}")
            with contextlib.suppress(Exception):
                if check():
                    return
            if time.monotonic() > deadline:
                raise ProcessError(f"{self.name} was not {what} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(delay)  # a poll interval, not a wait for readiness: the deadline bounds it
            delay = min(delay * 2, 0.2)

    def pause(self) -> None:
        """SIGSTOP the process group: it takes no CPU until `resume` (a benchmark measuring one stack stops the
        others, whose idle work would otherwise share the cores and caches with the one measured)."""
        if self.running():
            self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group after `pause`; harmless on a process that runs."""
        if self.running():
            self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``timeout`` seconds. Idempotent; a paused
        process is resumed to take the SIGTERM (a stopped one would only hold it pending)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the process group at once (what a crash looks like to its peers)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness check: GET ``url`` answers 200."""

    def check() -> bool:
        return httpx.get(url, timeout=1.0).status_code == 200

    return check


def grpc_serving(
    address: str, service: str = "readiness", *, root_certificates: bytes | None = None
) -> Callable[[], bool]:
    """A readiness check: the gRPC health service at ``address`` reports ``service`` SERVING (over TLS, trusting
    ``root_certificates``, where they are given)."""

    def check() -> bool:
        if root_certificates is None:
            opened = grpc.insecure_channel(address)
        else:
            opened = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
        with opened as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return check


def stop_all(processes: Sequence[ManagedProcess]) -> None:
    """Stop processes in the given order (front door first), whatever state each is in."""
    for process in processes:
        process.stop()
