"""Tests for scorer/httpget.py against a raw asyncio server that answers with scripted bytes."""

from __future__ import annotations

import asyncio

import pytest

from inferlb.scorer.httpget import HttpGetError, HttpGetter


class Scripted:
    """Answers each request on a connection with the next scripted response; counts connections and requests."""

    def __init__(self, responses: list[bytes]) -> None:
        self.responses = responses
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(self.responses.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(script: Scripted) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    ("responses", "expected"),
    [
        pytest.param([OK, OK], [(200, b"hello"), (200, b"hello")], id="content-length"),
        pytest.param([CHUNKED, OK], [(200, b"abcdefg"), (200, b"hello")], id="chunked"),
        pytest.param(
            [b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\nno", OK],
            [(503, b"no"), (200, b"hello")],
            id="status",
        ),
    ],
)
async def test_reads_bodies_and_keeps_the_connection(responses, expected):
    script = Scripted(list(responses))
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/metrics")
    try:
        got = [await getter.get(2.0) for _ in expected]
    finally:
        getter.close()
        server.close()
    assert got == expected
    assert script.connections == 1
    assert script.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_connection_close_and_read_to_end_reconnect():
    script = Scripted([b"HTTP/1.0 200 OK\r\n\r\nall of it", OK])
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/m")
    try:
        assert await getter.get(2.0) == (200, b"all of it")
        assert await getter.get(2.0) == (200, b"hello")
    finally:
        getter.close()
        server.close()
    assert script.connections == 2


@pytest.mark.parametrize(
    ("response", "words"),
    [
        pytest.param(b"SPDY/9 200 OK\r\n\r\n", "malformed status line", id="status-line"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "exceeds", id="too-big"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "IncompleteReadError", id="cut-short"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "ValueError", id="bad-chunk"),
    ],
)
async def test_bad_responses_raise_and_close(response, words):
    script = Scripted([response])
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/m")
    try:
        with pytest.raises(HttpGetError, match=words):
            await getter.get(2.0)
    finally:
        getter.close()
        server.close()


async def test_timeout_and_refused():
    async def silent(reader, writer):
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(HttpGetError, match=r"timed out after 0\.1 s"):
            await HttpGetter("127.0.0.1", port, "/m").get(0.1)
    finally:
        server.close()
    closed = HttpGetter("127.0.0.1", port, "/m")
    await server.wait_closed()
    with pytest.raises(HttpGetError, match="ConnectionRefusedError"):
        await closed.get(1.0)
