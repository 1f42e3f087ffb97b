"""Local stacks' processes: free ports that outgoing connections cannot steal before the bind, and pausing a
process (the hop benchmark pauses the stacks it is not measuring)."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

from inferlb.procs import ManagedProcess, _ephemeral_range, free_port

from .conftest import poll, process_state


def test_ports_are_outside_the_range_outgoing_connections_draw_from() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not low <= port <= high for port in ports)


def test_a_port_is_never_handed_out_twice_and_can_be_bound() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
        sock.listen()


def test_a_paused_process_is_stopped_until_resumed(tmp_path: Path) -> None:
    process = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    process.start()
    try:
        process.pause()
        poll(lambda: process_state(process.pid) == "T", "stopped")
        process.resume()
        poll(lambda: process_state(process.pid) != "T", "running again")
        assert process.running()
    finally:
        process.stop(timeout=5)


def test_stop_ends_a_paused_process_with_sigterm_not_a_kill_after_the_timeout(tmp_path: Path) -> None:
    # A stopped process only holds a SIGTERM pending: without a SIGCONT, stop would wait out its timeout and kill.
    process = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    process.start()
    process.pause()
    poll(lambda: process_state(process.pid) == "T", "stopped")
    process.stop(timeout=30)
    assert process.proc is not None and process.proc.returncode == -signal.SIGTERM
