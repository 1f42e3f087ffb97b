"""Tests for scorer/httpget.py against a raw asyncio server that answers with scripted bytes."""

from __future__ import annotations

import asyncio

import pytest

from inferlb.scorer.httpget import HttpGetError, HttpGetter

from ..conftest import until


class Scripted:
    """Answers each request on a connection with the next scripted response; counts connections and requests.

    After an HTTP/1.0 response it closes the connection, as a real server does (the close ends its body)."""

    def __init__(self, responses: list[bytes]) -> None:
        self.responses = responses
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                response = self.responses.pop(0)
                writer.write(response)
                await writer.drain()
                if response.startswith(b"HTTP/1.0 "):
                    break
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
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\nhello", "negative", id="negative-length"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
            "a chunk does not end where its size says",
            id="chunk-overrun",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n",
            "negative chunk size",
            id="negative-chunk",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "5 bytes into the body", id="cut-short"),
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


EXPOSITION = b"".join(
    b'vllm:request_success_total{model_name="meta-llama/Llama-3.1-8B-Instruct",finished_reason="stop",n="%05d"} 7\n' % i
    for i in range(200)
)  # ~22 KB, about what a vLLM /metrics answers


async def in_pieces(response: bytes, pieces: int, *, requests: int = 1) -> tuple[asyncio.Server, int]:
    """A server answering ``requests`` requests on each connection with ``response`` in ``pieces`` writes, a drain
    after each, then closing it (which ends a close-delimited body)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(requests):
                await reader.readuntil(b"\r\n\r\n")
                step = -(-len(response) // pieces)
                for start in range(0, len(response), step):
                    writer.write(response[start : start + step])
                    await writer.drain()
                    # Let the client's side of this loop take the piece before the next one comes, as a network's
                    # pieces arrive apart (these are turns of the loop, not waits on a clock).
                    for _ in range(4):
                        await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def close_delimited(body: bytes, pieces: int) -> tuple[asyncio.Server, int]:
    """A server answering every connection with HTTP/1.0, no Content-Length: ``body`` in pieces, then the close."""
    return await in_pieces(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\r\n" + body, pieces)


def _chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    "response",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(EXPOSITION), EXPOSITION), id="length"),
        pytest.param(_chunked(EXPOSITION, 1000), id="chunked"),
    ],
)
@pytest.mark.parametrize("pieces", [1, 7, 97])
async def test_a_response_in_pieces_is_read_whole_and_the_connection_kept(response, pieces):
    """However the bytes arrive (the head, a size line or a chunk cut anywhere), the body comes back whole, and the
    next request goes on the same connection."""
    server, port = await in_pieces(response, pieces, requests=2)
    getter = HttpGetter("127.0.0.1", port, "/metrics")
    try:
        assert await getter.get(2.0) == (200, EXPOSITION)
        transport = getter._transport
        assert await getter.get(2.0) == (200, EXPOSITION)
        assert getter._transport is transport
    finally:
        getter.close()
        server.close()


async def test_bytes_past_the_body_close_the_connection():
    """What a server sends past the body's end would be read as the next answer: the connection is not reused."""
    script = Scripted([OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale", OK])
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/m")
    try:
        assert await getter.get(2.0) == (200, b"hello")
        assert await getter.get(2.0) == (200, b"hello")
    finally:
        getter.close()
        server.close()
    assert script.connections == 2


async def test_a_close_delimited_body_is_read_to_its_end():
    assert 20_000 < len(EXPOSITION) < 24_000
    server, port = await close_delimited(EXPOSITION, pieces=6)
    getter = HttpGetter("127.0.0.1", port, "/metrics")
    try:
        assert await getter.get(2.0) == (200, EXPOSITION)
        assert await getter.get(2.0) == (200, EXPOSITION)  # the close ended the connection: a new one, same answer
    finally:
        getter.close()
        server.close()


async def test_a_close_delimited_body_over_max_body_is_refused():
    server, port = await close_delimited(EXPOSITION, pieces=6)
    getter = HttpGetter("127.0.0.1", port, "/metrics", max_body=10_000)
    try:
        with pytest.raises(HttpGetError, match="body exceeds 10000 bytes"):
            await getter.get(2.0)
    finally:
        getter.close()
        server.close()


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", id="204"),
        pytest.param(b"HTTP/1.1 304 Not Modified\r\n\r\n", id="304"),
    ],
)
async def test_a_status_without_a_body_does_not_wait_for_one(head):
    script = Scripted([head, OK])
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/m")
    try:
        assert await getter.get(2.0) == (int(head.split()[1]), b"")
        assert await getter.get(2.0) == (200, b"hello")
    finally:
        getter.close()
        server.close()
    assert script.connections == 1


async def test_a_get_cancelled_mid_response_closes_the_connection():
    """The answer to a cancelled request may still come: the next request must not read it as its own."""
    script = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", OK])
    server, port = await serve(script)
    getter = HttpGetter("127.0.0.1", port, "/m")
    try:
        task = asyncio.create_task(getter.get(5.0))
        await until(lambda: script.requests, "the request reaching the server")  # its answer stops halfway
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert getter._transport is None
    finally:
        getter.close()
        server.close()
