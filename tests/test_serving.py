"""Tests for inferlb/serving.py: what a client that sends nothing, or too little, costs a server (the picker's
admin API takes connections before any token check)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferlb.procs import free_port
from inferlb.serving import serve

from .conftest import until

HEAD = b"GET /slow HTTP/1.1\r\nhost: x\r\n"  # a request head, all but its closing empty line
EOF_WAIT_S = 20.0  # a deadline for the server's close, not a measurement


class App:
    """Answers "ok"; ``/slow`` only once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def serving(app: App, **limits: Any) -> AsyncIterator[int]:
    port = free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(serve([(f"127.0.0.1:{port}", app)], ready=ready, handle_signals=False, **limits))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def connect(port: int, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def response(reader: asyncio.StreamReader) -> bytes:
    """One response to a GET: its head and its 2-byte body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), EOF_WAIT_S)
    return head + await asyncio.wait_for(reader.readexactly(2), EOF_WAIT_S)


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (AssertionError if it keeps it open)."""
    try:
        return await asyncio.wait_for(reader.read(), EOF_WAIT_S)
    except TimeoutError:
        raise AssertionError(f"the connection is still open after {EOF_WAIT_S} s") from None


@pytest.mark.parametrize(
    ("requests", "sent"),
    [
        pytest.param(0, b"", id="nothing"),
        pytest.param(0, HEAD, id="half-a-head"),
        # uvicorn's keep-alive timer stops at the first byte of the next request: it never closed this one.
        pytest.param(1, HEAD, id="half-a-head-after-a-response"),
    ],
)
async def test_a_connection_without_a_whole_request_head_is_closed(requests: int, sent: bytes) -> None:
    async with serving(App(), header_timeout_s=0.2) as port:
        reader, writer = await connect(port)
        for _ in range(requests):
            writer.write(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await response(reader)).startswith(b"HTTP/1.1 200")
        writer.write(sent)
        assert await closed(reader) == b""
        writer.close()


async def test_a_request_whose_head_arrived_is_never_cut() -> None:
    app = App()
    async with serving(app, header_timeout_s=0.2) as port:
        slow_reader, slow_writer = await connect(port, HEAD + b"\r\n")
        # Another connection's head times out: more than header_timeout_s has passed for the slow request too.
        idle_reader, idle_writer = await connect(port, HEAD)
        await closed(idle_reader)
        app.release.set()
        assert (await response(slow_reader)).endswith(b"\r\n\r\nok")
        for writer in (slow_writer, idle_writer):
            writer.close()


async def test_connections_past_the_cap_are_answered_503_and_closed() -> None:
    async with serving(App(), max_connections=2, header_timeout_s=3600.0) as port:
        held = [await connect(port, b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n") for _ in range(2)]
        for reader, _ in held:
            assert (await response(reader)).startswith(b"HTTP/1.1 200")  # both are in: the server holds two
        reader, writer = await connect(port)
        assert (await closed(reader)).startswith(b"HTTP/1.1 503")
        writer.close()
        first_reader, first_writer = held[0]
        first_writer.write(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")  # a connection already in is still served
        assert (await response(first_reader)).startswith(b"HTTP/1.1 200")
        first_writer.close()

        async def a_new_connection_is_served() -> bool:
            reader, writer = await connect(port, b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
            try:
                return (await asyncio.wait_for(reader.read(12), EOF_WAIT_S)) == b"HTTP/1.1 200"
            finally:
                writer.close()

        await until(a_new_connection_is_served, "a free place taken again")
        held[1][1].close()


@pytest.mark.parametrize(
    "limits",
    [pytest.param({"max_connections": 0}, id="no-connections"), pytest.param({"header_timeout_s": 0}, id="no-time")],
)
async def test_limits_that_would_serve_nothing_are_refused(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="max_connections must be >= 1 and header_timeout_s > 0"):
        # Checked before anything is bound.
        await serve([("127.0.0.1:1", App())], handle_signals=False, **limits)  # type: ignore[arg-type]
