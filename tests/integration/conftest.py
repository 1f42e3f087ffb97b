"""Fixtures for tests that run the real Envoy binary with the picker and emulated servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from inferlb.stack import LocalStack


class Canary:
    """A loopback listener outside the pool that counts every TCP connection it accepts.

    If anything ever connects, traffic was steered outside the pool. It answers like an HTTP server so that
    such a leak would also be visible in the response, not only in the count.
    """

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\ncanary")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture(scope="session")
def canary() -> Iterator[Canary]:
    listener = Canary()
    yield listener
    listener.close()


def log_entry(stack: LocalStack, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The access-log entry of one request; Envoy flushes the log every 100 ms, so poll for it."""
    deadline = time.monotonic() + timeout
    while True:
        for entry in stack.access_log():
            if entry.get("request_id") == request_id:
                return entry
        if time.monotonic() > deadline:
            raise AssertionError(f"request {request_id} not in Envoy's access log after {timeout} s")
        time.sleep(0.05)
