"""Tests for otel/spanwire.py: records and settings survive the socket pair; a broken frame is refused."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from inferlb.otel.spanwire import (
    BATCH_RECORDS,
    MAX_FRAME_BYTES,
    Kind,
    ReceiverSettings,
    SpanBounds,
    SpanRecord,
    WireError,
    decode_records,
    encode_frame,
    encode_json,
    encode_records,
    read_frame,
)

RECORDS = [
    SpanRecord(b"\x07" * 16, "10.0.0.1:8000", 0.25, 2.0, 1_700_000_000.5),
    SpanRecord(None, None, None, 1.5, 1_700_000_001.0),
    SpanRecord(b"\x01" * 16, "[fd00::1]:8000", 0.1, None, 1_700_000_002.0),
    SpanRecord(b"\x02" * 16, "10.0.0.2:8000", 0.1, 2.1, 1_700_000_003.0, output_tokens=201),
    SpanRecord(None, None, 0.1, 0.2, 1_700_000_004.0, output_tokens=0),
    SpanRecord(b"\x03" * 16, None, 0.1, 0.2, 1_700_000_005.0, parent_id=b"\x09" * 8),
]


def test_records_round_trip() -> None:
    sender, records = decode_records(encode_records("10.0.0.9", RECORDS))
    assert sender == "10.0.0.9" and list(records) == RECORDS


def test_a_server_name_too_long_for_the_wire_is_sent_as_none() -> None:
    _, records = decode_records(encode_records("::1", [RECORDS[0]._replace(server="x" * 300)]))
    assert [r.server for r in records] == [None]


def test_a_batch_is_bounded() -> None:
    with pytest.raises(WireError):
        encode_records("::1", [RECORDS[0]] * (BATCH_RECORDS + 1))
    longest = encode_records("::1", [RECORDS[0]._replace(server="9" * 255)] * BATCH_RECORDS)
    assert len(encode_frame(Kind.RECORDS, longest)) <= MAX_FRAME_BYTES


def test_a_truncated_record_is_refused_after_the_whole_ones() -> None:
    _, records = decode_records(encode_records("10.0.0.9", RECORDS)[:-3])
    with pytest.raises(WireError):
        list(records)


def test_settings_round_trip_and_never_show_the_token() -> None:
    settings = ReceiverSettings("127.0.0.1:0", ("10.0.0.0/8",), token="t" * 32, bounds=SpanBounds(max_age_s=5))
    assert ReceiverSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    assert "t" * 32 not in repr(settings)
    with pytest.raises(WireError):
        ReceiverSettings.from_json({"bind": "127.0.0.1:0"})


@pytest.mark.parametrize(
    ("data", "error"),
    [
        pytest.param(struct.pack("<IB", MAX_FRAME_BYTES + 1, Kind.RECORDS), WireError, id="too-large"),
        pytest.param(struct.pack("<IB", 0, 99), WireError, id="unknown-kind"),
        pytest.param(struct.pack("<IB", 10, Kind.STATS) + b"{}", asyncio.IncompleteReadError, id="truncated"),
    ],
)
async def test_a_broken_frame_is_refused(data: bytes, error: type[Exception]) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    with pytest.raises(error):
        await read_frame(reader)


async def test_frames_are_read_in_order() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(encode_json(Kind.READY, {"port": 4317}) + encode_frame(Kind.RECORDS, b"\x00"))
    assert await read_frame(reader) == (Kind.READY, b'{"port":4317}')
    assert await read_frame(reader) == (Kind.RECORDS, b"\x00")
