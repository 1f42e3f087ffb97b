"""A real Redis server for the replicas' tests and benchmarks (Debian's redis-server, which .ci/run installs), on
a loopback port of its own, with a password and no persistence."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from inferlb.procs import ManagedProcess, ProcessError, free_port

__all__ = ["REDIS", "RedisServer", "redis_server"]

REDIS = shutil.which("redis-server")


@dataclass(slots=True)
class RedisServer:
    """A running redis-server: its URL (no credentials in it), its password, and `stop` / `start` to kill it and
    bring it back on the same port (with nothing in it: it keeps no data)."""

    port: int
    password: str
    workdir: Path
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if REDIS is None:
            raise ProcessError("redis-server is not installed: apt-get install redis-server")
        argv = [
            REDIS,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--requirepass",
            self.password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]
        self.process = ManagedProcess("redis", argv, self.workdir / "redis.log").start()
        self.process.wait_ready(self._answers, timeout=30, what="answering PING")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
            conn.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = conn.recv(256)
                if not chunk:
                    return False
                reply += chunk
            return reply == b"+OK\r\n+PONG\r\n"


@contextmanager
def redis_server(workdir: Path, password: str = "replicas-test-password-0123456789") -> Iterator[RedisServer]:
    """Start redis-server (password ``password``) in ``workdir``; yield it; stop it."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(free_port(), password, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
