"""A real Redis server for the replicas' tests and benchmarks (Debian's redis-server, which .ci/run installs), on
a loopback port of its own, with a password and no persistence; with ``tls``, TLS only, its certificate signed
by a CA made for it with the openssl command (``ca_file``)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
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
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        """The CA that signed the server's certificate (with ``tls``)."""
        return self.workdir / "ca.crt"

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
        if self.tls:
            _certificates(self.workdir)
            argv[argv.index("--port") + 1] = "0"  # no plain port
            argv += ["--tls-port", str(self.port), "--tls-auth-clients", "no"]
            argv += [
                "--tls-cert-file",
                str(self.workdir / "server.crt"),
                "--tls-key-file",
                str(self.workdir / "server.key"),
            ]
        self.process = ManagedProcess("redis", argv, self.workdir / "redis.log").start()
        self.process.wait_ready(self._answers, timeout=30, what="answering PING")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as plain:
            context = ssl.create_default_context(cafile=self.ca_file) if self.tls else None
            conn = context.wrap_socket(plain, server_hostname="127.0.0.1") if context is not None else plain
            conn.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = conn.recv(256)
                if not chunk:
                    return False
                reply += chunk
            return reply == b"+OK\r\n+PONG\r\n"


def _certificates(folder: Path) -> None:
    """A CA and a certificate for 127.0.0.1 signed by it, in ``folder`` (the openssl command; once)."""
    if (folder / "server.crt").exists():
        return
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ProcessError("openssl is not installed: apt-get install openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=inferlb test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=redis")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n", encoding="ascii")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")  # fmt: skip


@contextmanager
def redis_server(
    workdir: Path, password: str = "replicas-test-password-0123456789", *, tls: bool = False
) -> Iterator[RedisServer]:
    """Start redis-server (password ``password``; TLS only with ``tls``) in ``workdir``; yield it; stop it."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(free_port(), password, workdir, tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()
