"""A real etcd server for the membership benchmark and the tests (Debian's etcd-server, which .ci/run installs), on
loopback ports of its own, and the few v3 JSON-gateway writes they make to it."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from inferlb.procs import ManagedProcess, ProcessError, free_port, http_ok

__all__ = ["ETCD", "delete", "etcd_server", "put"]

ETCD = shutil.which("etcd")


@contextmanager
def etcd_server(data_dir: Path, ports: tuple[int, int] | None = None) -> Iterator[str]:
    """Start etcd with its data in ``data_dir`` (on ``ports``, client and peer, or two free ones); yield its client
    URL; stop it."""
    if ETCD is None:
        raise ProcessError("etcd is not installed: apt-get install etcd-server")
    client, peer = ports or (free_port(), free_port())
    url = f"http://127.0.0.1:{client}"
    process = ManagedProcess(
        "etcd",
        [
            ETCD,
            "--name=test",
            f"--data-dir={data_dir / 'etcd'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}",
        ],
        data_dir / "etcd.log",
    ).start()
    try:
        process.wait_ready(http_ok(f"{url}/health"), timeout=30, what="serving its clients")
        yield url
    finally:
        process.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def put(url: str, key: str, value: Any) -> None:
    """Write ``value`` (JSON-encoded unless it is bytes or str) under ``key``."""
    if isinstance(value, bytes):
        raw = value
    elif isinstance(value, str):
        raw = value.encode()
    else:
        raw = json.dumps(value).encode()
    body = {"key": _b64(key), "value": base64.b64encode(raw).decode()}
    httpx.post(f"{url}/v3/kv/put", json=body, timeout=5).raise_for_status()


def delete(url: str, key: str) -> None:
    httpx.post(f"{url}/v3/kv/deleterange", json={"key": _b64(key)}, timeout=5).raise_for_status()
