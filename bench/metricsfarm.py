"""Many endpoints that answer ``GET /metrics`` with one fixed exposition: the scrape benchmark's targets.

    python -m inferlb.bench.metricsfarm --body FILE --listen 127.0.0.1:9000 --listen 127.0.0.1:9001 ...

Emulated servers run an engine each and cannot answer 256 scrapes ten times a second on a small machine; these
answer from memory (keep-alive HTTP/1.1, a few microseconds each), so what a benchmark measures is the scraper.
Every path gets the body, cut down to the ``name[]`` query parameters when there are some, as vLLM's
prometheus_client endpoint does. The process runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl

from inferlb.scorer.address import parse_address
from inferlb.sim.metrics import restrict

__all__ = ["MetricsFarm", "main"]


class _Responder(asyncio.Protocol):
    def __init__(self, respond: Callable[[bytes], bytes]) -> None:
        self._respond = respond
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:  # one reply per complete request head
            head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            target = head.split(b"\r\n", 1)[0].split(b" ")[1:2]
            assert self._transport is not None
            self._transport.write(self._respond(target[0] if target else b"/"))


class MetricsFarm:
    """Serves ``body`` on every address in ``addresses`` until `close`. One event loop."""

    def __init__(self, addresses: list[str], body: bytes) -> None:
        self.addresses = addresses
        self._body = body
        self._responses: dict[bytes, bytes] = {}  # by request target
        self._servers: list[asyncio.Server] = []

    def respond(self, target: bytes) -> bytes:
        """The whole HTTP response to a GET of ``target``."""
        response = self._responses.get(target)
        if response is None:
            query = target.partition(b"?")[2].decode("latin-1")
            names = frozenset(value for key, value in parse_qsl(query) if key == "name[]")
            body = restrict(self._body, names) if names else self._body
            response = (
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode("ascii")
                + body
            )
            if len(self._responses) < 64:
                self._responses[target] = response
        return response

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for address in self.addresses:
            host, port = parse_address(address)
            self._servers.append(await loop.create_server(lambda: _Responder(self.respond), host, port))

    def close(self) -> None:
        for server in self._servers:
            server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--body", type=Path, required=True, help="the exposition text every endpoint returns")
    parser.add_argument("--listen", action="append", required=True, metavar="HOST:PORT")
    args = parser.parse_args(argv)

    async def serve() -> None:
        farm = MetricsFarm(args.listen, args.body.read_bytes())
        await farm.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"serving {len(args.listen)} endpoints", flush=True)
        await stop.wait()
        farm.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
