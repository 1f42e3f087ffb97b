"""Many endpoints that answer ``GET /metrics`` with one fixed exposition: the scrape benchmark's targets.

    python -m inferlb.bench.metricsfarm --body FILE --listen 127.0.0.1:9000 --listen 127.0.0.1:9001 ...

Emulated servers run an engine each and cannot answer 256 scrapes ten times a second on a small machine; these
answer from memory (keep-alive HTTP/1.1, a few microseconds each), so what a benchmark measures is the scraper.
Every path gets the body, whatever its query (as vLLM 0.32's ``/metrics`` ignores one). The process runs until
SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from inferlb.scorer.address import parse_address

__all__ = ["MetricsFarm", "main"]


class _Responder(asyncio.Protocol):
    def __init__(self, response: bytes) -> None:
        self._response = response
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:  # one reply per complete request head
            self._buffer = self._buffer[end + 4 :]
            assert self._transport is not None
            self._transport.write(self._response)


class MetricsFarm:
    """Serves ``body`` on every address in ``addresses`` until `close`. One event loop."""

    def __init__(self, addresses: list[str], body: bytes) -> None:
        self.addresses = addresses
        self._response = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode("ascii")
            + body
        )
        self._servers: list[asyncio.Server] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for address in self.addresses:
            host, port = parse_address(address)
            self._servers.append(await loop.create_server(lambda: _Responder(self._response), host, port))

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
