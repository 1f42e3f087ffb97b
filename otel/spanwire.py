"""What crosses the socket pair between the picker and its OTLP receiver process (otel/receiverproc.py).

A frame is a 5-byte header, the payload's length (little-endian uint32) and its kind, then the payload; no
frame is larger than `MAX_FRAME_BYTES`, and a reader refuses a larger one (`WireError`) rather than buffering it.

- picker -> receiver: ``SETTINGS`` (JSON, `ReceiverSettings`): the first frame, and again whenever the
  allowlist, the token or the bounds change.
- receiver -> picker: ``READY`` (JSON ``{"port": N}``) once it listens, or ``FAILED`` (JSON ``{"error": text}``)
  and exit; then ``RECORDS`` (binary, below) and ``STATS`` (JSON: counter increments since the last STATS).

A ``RECORDS`` payload holds at most `BATCH_RECORDS` records of one export request: the sender's IP (one byte
of length, ASCII), then per record a fixed part (trace id, 16 bytes, zero for none; TTFT, E2E and end time as
float64 seconds, NaN for an unknown latency) and the server address the span names (one byte of length, then
ASCII; empty for none). The records were validated by the receiver (otel/spancheck.py); the picker still
decodes them defensively, since a broken child must not break routing.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

__all__ = [
    "BATCH_RECORDS",
    "MAX_FRAME_BYTES",
    "MAX_OUTPUT_TOKENS",
    "Kind",
    "ReceiverSettings",
    "SpanBounds",
    "SpanRecord",
    "WireError",
    "decode_records",
    "encode_frame",
    "encode_json",
    "encode_records",
    "read_frame",
]

MAX_FRAME_BYTES = 1 << 20
"""No frame is larger; a SETTINGS or STATS frame is a few hundred bytes, a RECORDS frame at most ~300 KB."""
BATCH_RECORDS = 1024
"""Records per RECORDS frame, at most."""

_HEADER = struct.Struct("<IB")
_RECORD = struct.Struct("<16sdddI8s")
_NO_TRACE = bytes(16)
_NO_PARENT = bytes(8)
_NO_TOKENS = 0xFFFFFFFF  # output_tokens unknown


class WireError(Exception):
    """A frame that breaks the protocol (too large, unknown kind, truncated records): the peer is broken."""


class Kind(IntEnum):
    SETTINGS = 1
    READY = 2
    FAILED = 3
    RECORDS = 4
    STATS = 5


class SpanRecord(NamedTuple):
    """One validated latency span, as the picker needs it: ``trace_id`` (16 bytes, or None), ``server`` (the
    ``ip:port`` the span names, or None), ``ttft_s``/``e2e_s`` (positive seconds, or None when the span has no
    such attribute; at least one is set), ``end_s`` (Unix seconds, within the bounds the receiver applied),
    ``output_tokens`` (the tokens the server generated, `MAX_OUTPUT_TOKENS` at most; None: not reported),
    ``parent_id`` (the span id, 8 bytes, of the span's parent: the one the picker put in the request's ``traceparent``
    when the server continued it; None: a root span)."""

    trace_id: bytes | None
    server: str | None
    ttft_s: float | None
    e2e_s: float | None
    end_s: float
    output_tokens: int | None = None
    parent_id: bytes | None = None


MAX_OUTPUT_TOKENS = 10_000_000
"""A span reporting more output tokens than this is taken as reporting none (no model generates that many)."""


@dataclass(frozen=True, slots=True)
class SpanBounds:
    """What a sane latency span looks like (checked in the receiver process, see otel/spancheck.py).

    ``max_age_s``/``max_ahead_s``: its end time is at most this long before / after the receiver's clock;
    ``max_latency_s``: its duration, TTFT and E2E are at most this; TTFT may exceed E2E by no more than
    ``ttft_slack_s`` plus 0.1% (the two are measured on different clocks and rounded)."""

    max_age_s: float = 600.0
    max_ahead_s: float = 60.0
    max_latency_s: float = 3600.0
    ttft_slack_s: float = 0.001


@dataclass(frozen=True, slots=True)
class ReceiverSettings:
    """Everything the receiver process needs; immutable (`dataclasses.replace` to change).

    ``bind``: ``ip:port`` to listen on (port 0: any, reported in READY); ``allowed``: CIDR strings of the senders
    it serves; ``token``: the bearer token exports must carry (None: none needed; never shown in the repr);
    ``max_message_bytes``: gRPC's receive limit; ``max_spans_per_request``; ``max_spans_per_s``: the span budget
    (a burst of one second's budget, or one full export if larger); ``bounds``: `SpanBounds`; ``max_pending_bytes``:
    records written to the picker and not yet read, past which whole exports are refused (the picker is behind);
    ``stats_interval_s``: how often counters go to the picker; ``max_concurrent_rpcs``: exports in progress at
    once (more are refused with RESOURCE_EXHAUSTED by the receiver's handler, counted), which bounds the buffered
    messages' memory.

    ``bind``, ``max_message_bytes`` and ``max_concurrent_rpcs`` are fixed for a process's life (`restart_needed`);
    the rest may change with a SETTINGS frame."""

    bind: str
    allowed: tuple[str, ...]
    token: str | None = field(default=None, repr=False)
    max_message_bytes: int = 4 << 20
    max_spans_per_request: int = 16384
    max_spans_per_s: float = 10000.0
    bounds: SpanBounds = field(default_factory=SpanBounds)
    max_pending_bytes: int = 8 << 20
    stats_interval_s: float = 0.1
    max_concurrent_rpcs: int = 8

    def restart_needed(self, other: ReceiverSettings) -> bool:
        """True when going from these settings to ``other`` needs a new process (a gRPC server option changed)."""
        fixed = ("bind", "max_message_bytes", "max_concurrent_rpcs")
        return any(getattr(self, name) != getattr(other, name) for name in fixed)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {name: getattr(self, name) for name in self.__dataclass_fields__}
        document["allowed"] = list(self.allowed)
        document["bounds"] = {name: getattr(self.bounds, name) for name in SpanBounds.__dataclass_fields__}
        return document

    @classmethod
    def from_json(cls, document: Any) -> ReceiverSettings:
        """The settings a SETTINGS frame carries; WireError if it is not such a document."""
        try:
            values = dict(document)
            values["allowed"] = tuple(str(c) for c in values["allowed"])
            values["bounds"] = SpanBounds(**values["bounds"])
            return cls(**values)
        except (TypeError, KeyError, ValueError) as exc:
            raise WireError(f"not receiver settings: {exc}") from None


def encode_frame(kind: Kind, payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"a {kind.name} frame of {len(payload)} bytes is over {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload), kind) + payload


def encode_json(kind: Kind, document: Any) -> bytes:
    return encode_frame(kind, json.dumps(document, separators=(",", ":")).encode())


async def read_frame(reader: asyncio.StreamReader) -> tuple[Kind, bytes]:
    """The next frame; ``asyncio.IncompleteReadError`` at the end of the stream, WireError for a broken one."""
    header = await reader.readexactly(_HEADER.size)
    size, kind = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {size} bytes is over {MAX_FRAME_BYTES}")
    try:
        known = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    return known, await reader.readexactly(size)


def encode_records(sender: str, records: Sequence[SpanRecord]) -> bytes:
    """A RECORDS payload (at most `BATCH_RECORDS` records; a server name over 255 bytes is sent as none)."""
    if len(records) > BATCH_RECORDS:
        raise WireError(f"{len(records)} records in one frame; at most {BATCH_RECORDS}")
    ip = sender.encode("ascii")
    parts = [bytes((len(ip),)), ip]
    nan = math.nan
    for record in records:
        server = record.server.encode("ascii", "replace") if record.server else b""
        if len(server) > 255:
            server = b""
        parts.append(
            _RECORD.pack(
                record.trace_id or _NO_TRACE,
                nan if record.ttft_s is None else record.ttft_s,
                nan if record.e2e_s is None else record.e2e_s,
                record.end_s,
                _NO_TOKENS if record.output_tokens is None else record.output_tokens,
                record.parent_id or _NO_PARENT,
            )
        )
        parts.append(bytes((len(server),)))
        parts.append(server)
    return b"".join(parts)


def decode_records(payload: bytes) -> tuple[str, Iterator[SpanRecord]]:
    """The sender and a lazy iterator over the records of a RECORDS payload (WireError where it is broken:
    the records before the break have been yielded)."""
    if not payload or len(payload) < 1 + payload[0]:
        raise WireError("a RECORDS frame without its sender")
    end = 1 + payload[0]
    sender = payload[1:end].decode("ascii", "replace")
    return sender, _records(payload, end)


def _records(payload: bytes, offset: int) -> Iterator[SpanRecord]:
    size, unpack, total = _RECORD.size, _RECORD.unpack_from, len(payload)
    while offset < total:
        if offset + size + 1 > total:
            raise WireError("a truncated record")
        trace_id, ttft, e2e, end_s, tokens, parent = unpack(payload, offset)
        offset += size
        length = payload[offset]
        server = payload[offset + 1 : offset + 1 + length].decode("ascii", "replace") if length else None
        offset += 1 + length
        if offset > total:
            raise WireError("a truncated record")
        yield SpanRecord(
            trace_id if trace_id != _NO_TRACE else None,
            server,
            None if ttft != ttft else ttft,  # NaN: unknown
            None if e2e != e2e else e2e,
            end_s,
            None if tokens == _NO_TOKENS else tokens,
            parent if parent != _NO_PARENT else None,
        )
