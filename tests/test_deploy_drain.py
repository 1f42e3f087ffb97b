"""The standalone Envoy's preStop hook (deploy/kubernetes/standalone/envoy-deployment.yaml) lets the responses in
flight end before the kubelet's SIGTERM, on which Envoy exits at once: the hook's own command, run against a real
Envoy on loopback (the listener's stat_prefix and admin API those of the rendered bootstrap) while a response
streams for longer than the old `sleep 5`, then the kubelet's SIGTERM. The previous hook (`sleep 5`) fails here:
SIGTERM cut the stream at 10 of its 16 chunks."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferlb.procs import ManagedProcess, find_tool, free_port, http_ok

pytestmark = pytest.mark.envoy

STANDALONE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "standalone"
CHUNKS, CHUNK_INTERVAL_S = 16, 0.5  # the streamed response: 8 s, longer than the old hook's 5 s


def envoy_pod() -> dict[str, Any]:
    docs = yaml.safe_load_all((STANDALONE / "envoy-deployment.yaml").read_text(encoding="utf-8"))
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def pre_stop() -> list[str]:
    (container,) = envoy_pod()["containers"]
    command: list[str] = container["lifecycle"]["preStop"]["exec"]["command"]
    return command


def bootstrap() -> tuple[str, str]:
    """The rendered bootstrap's admin address and its listener's stat_prefix."""
    config = yaml.safe_load((STANDALONE / "envoy.yaml").read_text(encoding="utf-8"))
    address = config["admin"]["address"]["socket_address"]
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = [f for f in chain["filters"] if f["name"] == "envoy.filters.network.http_connection_manager"]
    return f"{address['address']}:{address['port_value']}", manager["typed_config"]["stat_prefix"]


def test_the_hook_asks_the_bootstraps_admin_api_and_waits_less_than_the_grace_period() -> None:
    admin, stat_prefix = bootstrap()
    command = pre_stop()
    assert command[:2] == ["python3", "-c"]  # the image's Python (python:3.11-slim has no curl)
    assert command[3:5] == [admin, stat_prefix]
    longest_s = float(command[5])
    assert 60 <= longest_s <= envoy_pod()["terminationGracePeriodSeconds"] - 10


class Upstream:
    """A server that streams each response (server-sent events, chunked) as ``chunks`` chunks, one every
    ``CHUNK_INTERVAL_S``."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()
        self.stopping = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for i in range(self.chunks):
                    if self.stopping:
                        writer.close()
                        return
                    data = f"data: token {i}\n\n".encode()
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(CHUNK_INTERVAL_S)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        """Stops serving, and ends the responses still streaming (a cut stream's is) within a chunk's interval."""
        if self.server is not None:
            self.server.close()
        self.stopping = True
        await asyncio.wait_for(asyncio.gather(*self.handlers, return_exceptions=True), 5)


def envoy_config(listen: int, admin: int, upstream: int, stat_prefix: str) -> str:
    router = {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}
    manager = {
        "@type": MANAGER,
        "stat_prefix": stat_prefix,
        "route_config": {
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": ROUTE}]}]
        },
        "http_filters": [router],
    }
    endpoint = {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": upstream}}}}
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [{"name": MANAGER_NAME, "typed_config": manager}]}],
                }
            ],
            "clusters": [
                {
                    "name": "upstream",
                    "connect_timeout": "1s",
                    "load_assignment": {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": [endpoint]}]},
                }
            ],
        },
    }
    return yaml.safe_dump(config)


MANAGER_NAME = "envoy.filters.network.http_connection_manager"
MANAGER = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
ROUTE = {"cluster": "upstream", "timeout": "0s"}  # like the bootstrap's: a streamed response is not bounded


async def read_response(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What arrives until the chunked response's end or the connection's."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while not got.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(reader.read(4096), max(deadline - time.monotonic(), 0.01))
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got


async def run_hook_on_real_envoy(tmp_path: Path, chunks: int, longest_s: str | None = None) -> dict[str, Any]:
    """Envoy (a listener with the bootstrap's stat_prefix) proxies a response streamed over ``chunks`` intervals;
    once it is in flight the manifest's preStop command runs (the admin address, and the longest wait if given,
    swapped for this test's), then Envoy gets SIGTERM, as from the kubelet. What the client and the hook saw."""
    admin, stat_prefix = bootstrap()
    upstream = Upstream(chunks)
    local_admin = f"127.0.0.1:{free_port()}"
    listen = free_port()
    path = tmp_path / "envoy.yaml"
    path.write_text(envoy_config(listen, int(local_admin.rsplit(":", 1)[1]), await upstream.start(), stat_prefix))
    envoy = ManagedProcess(
        "envoy",
        [find_tool("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"],
        tmp_path / "envoy.log",
    ).start()
    command = pre_stop()
    argv = [sys.executable if a == "python3" else local_admin if a == admin else a for a in command]
    if longest_s is not None:
        argv[-1] = longest_s
    try:
        await asyncio.to_thread(envoy.wait_ready, http_ok(f"http://{local_admin}/ready"), 30.0, "live")
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        writer.write(b"GET /v1/completions HTTP/1.1\r\nhost: inferlb\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"data: token 0"), 5)
        response = asyncio.create_task(read_response(reader, chunks * CHUNK_INTERVAL_S + 10))
        started = time.monotonic()
        hook = await asyncio.create_subprocess_exec(*argv)
        # A client that still reaches this Envoy while the hook waits (its Service endpoints lag): served, and
        # told to close its connection.
        late = b""
        if chunks > 4:
            await asyncio.sleep(1.0)  # the hook has begun the drain (a second is ages for two admin calls)
            late_reader, late_writer = await asyncio.open_connection("127.0.0.1", listen)
            late_writer.write(b"GET /v1/completions HTTP/1.1\r\nhost: inferlb\r\n\r\n")
            await late_writer.drain()
            late = await asyncio.wait_for(late_reader.readuntil(b"data: token 0"), 5)
            late_writer.close()
        hook_code = await asyncio.wait_for(hook.wait(), float(command[-1]) + 10)
        hook_s = time.monotonic() - started
        assert envoy.proc is not None
        envoy.proc.send_signal(signal.SIGTERM)
        body = first + await response
        exit_code = await asyncio.to_thread(envoy.proc.wait, 10)
        writer.close()
        return {"body": body, "late": late, "hook_code": hook_code, "hook_s": hook_s, "envoy_code": exit_code}
    finally:
        envoy.stop()
        await upstream.close()


async def test_the_hook_lets_a_streamed_response_end_before_envoy_gets_sigterm(tmp_path: Path) -> None:
    seen = await run_hook_on_real_envoy(tmp_path, CHUNKS)
    body = seen["body"]
    assert seen["hook_code"] == 0 and seen["envoy_code"] == 0
    assert body.count(b"data: token") == CHUNKS and body.endswith(b"0\r\n\r\n"), (
        f"the stream was cut: {body.count(b'data: token')}/{CHUNKS} chunks"
    )
    # The hook waited for the stream (8 s), not much longer: it polls once a second.
    assert CHUNKS * CHUNK_INTERVAL_S - 1 <= seen["hook_s"] <= CHUNKS * CHUNK_INTERVAL_S + 5
    # Draining, Envoy still served a new connection, and asked its client to close it after the response.
    head = seen["late"].split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"\r\nconnection: close" in head


async def test_the_hook_gives_up_after_its_longest_wait(tmp_path: Path) -> None:
    # A response that outlasts the wait (here 6 s instead of the manifest's): the hook returns, and the kubelet's
    # SIGTERM then cuts it.
    seen = await run_hook_on_real_envoy(tmp_path, 40, longest_s="6")
    assert seen["hook_code"] == 0
    assert 6 <= seen["hook_s"] <= 10
    assert not seen["body"].endswith(b"0\r\n\r\n")
