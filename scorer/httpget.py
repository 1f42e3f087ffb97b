"""A small keep-alive HTTP/1.1 GET client for the metrics scrape: one connection per endpoint, reused.

The scraper fetches one path from every endpoint ten times a second; a general-purpose client spends far more
CPU per request than parsing the answer does. This one writes a fixed request and reads a ``Content-Length``,
chunked or close-delimited (HTTP/1.0) body, at most ``max_body`` bytes, nothing else (no redirects, no TLS, no
compression). Any failure closes the connection; the next call opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["HttpGetError", "HttpGetter"]

_MAX_HEADER = 64 * 1024
_READ_SIZE = 64 * 1024


class HttpGetError(Exception):
    """The GET failed: connection refused or reset, timed out, a malformed or oversized response."""


class HttpGetter:
    """GETs ``path`` from ``host:port`` (an IP literal; IPv6 without brackets). One request at a time.

    Not thread-safe; one event loop. `get` raises `HttpGetError`; call `close` when done.
    """

    def __init__(self, host: str, port: int, path: str, *, max_body: int = 8 << 20) -> None:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.host, self.port, self.max_body = host, port, max_body
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nAccept-Encoding: identity\r\n"
            "User-Agent: inferlb-scraper\r\n\r\n"
        ).encode("ascii")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, timeout: float) -> tuple[int, bytes]:
        """(status, body) of one GET, within ``timeout`` seconds (connecting included)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._get()
        except TimeoutError:
            self.close()
            raise HttpGetError(f"timed out after {timeout:g} s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()
            raise HttpGetError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None

    async def _get(self) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=_MAX_HEADER)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(self._request)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"malformed status line {lines[0][:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = keep = False
        keep = parts[0] == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value.strip())
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection":
                keep = value.strip().lower() == "keep-alive" or (keep and value.strip().lower() != "close")
        if status in (204, 304) or 100 <= status < 200:
            body = b""  # these never have a body (RFC 9112 6.3): reading to the close would wait out the timeout
        elif chunked:
            body = await self._chunked(reader)
        elif length is not None:
            if length > self.max_body:
                raise ValueError(f"body of {length} bytes exceeds {self.max_body}")
            body = await reader.readexactly(length)
        else:
            body = await self._to_close(reader)
            keep = False
        if not keep:
            self.close()
        return status, body

    async def _to_close(self, reader: asyncio.StreamReader) -> bytes:
        """A body without a length ends when the server closes: read to EOF (one ``read`` returns only what has
        arrived so far), at most ``max_body`` bytes; the caller's timeout bounds the wait."""
        parts: list[bytes] = []
        total = 0
        while chunk := await reader.read(_READ_SIZE):
            total += len(chunk)
            if total > self.max_body:
                raise ValueError(f"body exceeds {self.max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the end of the (empty) trailer
                return b"".join(parts)
            total += size
            if total > self.max_body:
                raise ValueError(f"body exceeds {self.max_body} bytes")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        self._reader = self._writer = None
