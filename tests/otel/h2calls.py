"""Export calls that gRPC's own clients cannot make, for the receiver tests: a raw HTTP/2 connection that sends a
call's headers and part of its message, and never the rest."""

from __future__ import annotations

import asyncio
import struct

EXPORT_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS = 0, 1, 4  # frame types
_ACK, _END_HEADERS = 0x1, 0x4  # flags


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    # HPACK: a literal header field without indexing, new name; both strings short enough for a one-byte length.
    return b"\x00" + bytes((len(name),)) + name.encode() + bytes((len(value),)) + value.encode()


class HalfSentExport:
    """One connection to ``127.0.0.1:port`` from ``source`` carrying one Export call: its headers and the first 10
    of the 100 bytes its message announces, and nothing more until `close`. While the connection is open the call
    is in progress as far as gRPC can tell (its keepalive pings are hours apart by default)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, source: str = "127.0.0.1") -> HalfSentExport:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(_PREFACE + _frame(_SETTINGS, 0, 0))
        while True:  # the server's SETTINGS, acknowledged as a real client would
            header = await reader.readexactly(9)
            await reader.readexactly(int.from_bytes(header[:3], "big"))
            if header[3] == _SETTINGS and not header[4] & _ACK:
                break
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", EXPORT_PATH),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        writer.write(
            _frame(_SETTINGS, _ACK, 0)
            + _frame(_HEADERS, _END_HEADERS, 1, b"".join(_literal(k, v) for k, v in headers))  # no END_STREAM
            + _frame(_DATA, 0, 1, b"\x00" + struct.pack(">I", 100) + b"x" * 10)
        )
        await writer.drain()
        return cls(reader, writer)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()
