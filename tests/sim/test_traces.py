"""Tests for sim/traces.py: format variants, errors, the time pipeline, synthetic prompts and the shipped traces."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from inferlb.sim import traces
from inferlb.sim.des import simulate, trace_arrivals
from inferlb.sim.profiles import get_profile
from inferlb.sim.tokens import count_tokens, text_block_hashes
from inferlb.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    Trace,
    TraceError,
    TraceRequest,
    block_keys,
    block_text,
    load_trace,
    prompt_text,
)


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def _jsonl(*rows: dict[str, Any]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _row(ts: Any, prompt: Any = 600, output: Any = 10, ids: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"timestamp": ts, "input_length": prompt, "output_length": output}
    if ids is not None:
        row["hash_ids"] = ids
    row.update(extra)
    return row


def _shape(trace: Trace) -> list[tuple[float, int, int, tuple[int, ...]]]:
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in trace.requests]


def test_public_names_are_pinned() -> None:
    assert sorted(traces.__all__) == [
        "MOONCAKE_BLOCK_TOKENS",
        "Trace",
        "TraceError",
        "TraceFormat",
        "TraceRequest",
        "block_keys",
        "block_text",
        "load_trace",
        "prompt_text",
    ]
    assert issubclass(TraceError, ValueError)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TraceRequest(0, 0.0, 1, 1).prompt_tokens = 2


# --- Mooncake JSONL -----------------------------------------------------------------------------------------------

_MOONCAKE_PLAIN = _jsonl(_row(0, 600, 10, [0, 1]), _row(1500, 512, 20, [0]))
_MOONCAKE_EXPECTED = [(0.0, 600, 10, (0, 1)), (1.5, 512, 20, (0,))]


@pytest.mark.parametrize(
    ("name", "content", "notes"),
    [
        pytest.param("t.jsonl", _MOONCAKE_PLAIN, (), id="plain"),
        pytest.param("t.jsonl", _MOONCAKE_PLAIN.rstrip("\n"), (), id="no-final-newline"),
        pytest.param("t.jsonl", "\ufeff" + _MOONCAKE_PLAIN, (), id="bom"),
        pytest.param("t.jsonl", _MOONCAKE_PLAIN.replace("\n", "\r\n"), (), id="crlf"),
        pytest.param("t.csv", _MOONCAKE_PLAIN, (), id="csv-extension"),
        pytest.param(
            "t.jsonl",
            "\n  \n" + _MOONCAKE_PLAIN.replace("\n", "\n\n", 1),
            ("skipped 3 blank line(s)",),
            id="blank-lines",
        ),
        pytest.param(
            "t.jsonl",
            _jsonl(_row(0, 600, 10, [0, 1], session="a", extra=None), _row(1500, 512, 20, [0])),
            ("ignored extra key(s): extra, session",),
            id="extra-keys",
        ),
        pytest.param(
            "t.jsonl",
            _jsonl(_row(1500, 512, 20, [0]), _row(0, 600, 10, [0, 1])),
            ("rows were not in time order and were sorted by time (ties keep file order)",),
            id="unsorted",
        ),
        pytest.param(
            "t.jsonl",
            _jsonl(_row(0.0, 600.0, 10, [0, 1]), _row(1500.0, 512, 20.0, [0])),
            (),
            id="integral-floats",
        ),
        pytest.param(
            "t.jsonl",
            _jsonl(_row(10_000, 600, 10, [0, 1]), _row(11_500, 512, 20, [0])),
            (),
            id="offset-origin",
        ),
        pytest.param(
            "t.jsonl",
            _MOONCAKE_PLAIN.replace("[0]}", '[0], "f": 1e400, "i": 123456789012345678901234, "n": NaN}'),
            ("ignored extra key(s): f, i, n",),
            id="beyond-64-bit-values",
        ),
    ],
)
def test_mooncake_variants_load_alike(tmp_path: Path, name: str, content: str, notes: tuple[str, ...]) -> None:
    trace = load_trace(_write(tmp_path, name, content))
    assert trace.name == "t"
    assert trace.format == "mooncake"
    assert _shape(trace) == _MOONCAKE_EXPECTED
    assert [r.index for r in trace.requests] == [0, 1]
    assert trace.duration_s == 1.5
    assert trace.notes == notes


def test_mooncake_repairs_are_counted(tmp_path: Path) -> None:
    content = _jsonl(
        _row(0, 600, 0, [0, 1]),
        _row(0, 0, 0, []),
        _row(1000, 100, 5, [0, 1, 2]),
        _row(2000, 1100, 5, [0]),
        _row(3000, 700, 5),
        _row(4000, 700, 5, None, hash_ids=None),
    )
    trace = load_trace(_write(tmp_path, "r.jsonl", content))
    assert _shape(trace) == [
        (0.0, 600, 1, (0, 1)),
        (0.0, 1, 1, ()),
        (1.0, 100, 5, (0,)),
        (2.0, 1100, 5, (0,)),
        (3.0, 700, 5, ()),
        (4.0, 700, 5, ()),
    ]
    assert trace.notes == (
        "2 row(s): output_length 0 was read as 1",
        "1 row(s): input_length 0 was read as 1",
        "2 row(s): fewer hash_ids than 512-token blocks of input_length; the rest of the prompt is unique text",
        "1 row(s): more hash_ids than 512-token blocks of input_length; the extra ids were ignored",
        "2 row(s): no hash_ids; the prompt is unique text",
    )


# --- Azure CSV ----------------------------------------------------------------------------------------------------

_AZURE_PLAIN = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:17:03.9799600,4808,10\n"
    "2023-11-16 18:17:04.0319600,3180,8\n"
    "2023-11-16 18:17:05.9799600,100,0"
)
_AZURE_EXPECTED = [(0.0, 4808, 10, ()), (0.052, 3180, 8, ()), (2.0, 100, 1, ())]


@pytest.mark.parametrize(
    ("name", "content"),
    [
        pytest.param("a.csv", _AZURE_PLAIN, id="plain-no-final-newline"),
        pytest.param("a.csv", _AZURE_PLAIN + "\n\n", id="final-newlines"),
        pytest.param("a.csv", "\ufeff" + _AZURE_PLAIN.replace("\n", "\r\n") + "\r\n", id="bom-crlf"),
        pytest.param("a.jsonl", _AZURE_PLAIN, id="jsonl-extension"),
        pytest.param(
            "a.csv",
            "generatedtokens,Model,timestamp,contextTOKENS\n"
            "10,gpt,2023-11-16 18:17:03.97996,4808\n"
            '8,gpt,"2023-11-16 18:17:04.03196","3180"\n'
            "0,gpt,2023-11-16T18:17:05.97996,100\n",
            id="reordered-extra-column-quoted-iso-t",
        ),
        pytest.param(
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1700000000.5,4808,10\n1700000000.552,3180,8\n1700000002.5,100,0\n",
            id="numeric-seconds",
        ),
    ],
)
def test_azure_variants_load_alike(tmp_path: Path, name: str, content: str) -> None:
    trace = load_trace(_write(tmp_path, name, content))
    assert trace.name == "a"
    assert trace.format == "azure"
    assert [r.arrival_s for r in trace.requests] == pytest.approx([e[0] for e in _AZURE_EXPECTED], abs=1e-9)
    assert [s[1:] for s in _shape(trace)] == [e[1:] for e in _AZURE_EXPECTED]
    assert "1 row(s): GeneratedTokens 0 was read as 1" in trace.notes


@pytest.mark.parametrize(
    ("stamps", "expected"),
    [
        pytest.param(["2023-11-16 18:17:03", "2023-11-16 18:17:04.5"], [0.0, 1.5], id="fewer-digits-or-none"),
        pytest.param(["2023-11-16 23:59:59.9", "2023-11-17 00:00:00.1"], [0.0, 0.2], id="across-midnight"),
        pytest.param(["2023-12-31 23:59:59.9999999", "2024-01-01 00:00:00"], [0.0, 1e-7], id="100ns-new-year"),
        pytest.param(["2023-11-16 18:00:02", "2023-11-16 18:00:00.25"], [0.0, 1.75], id="unsorted"),
    ],
)
def test_azure_timestamps(tmp_path: Path, stamps: list[str], expected: list[float]) -> None:
    content = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},10,10\n" for s in stamps)
    trace = load_trace(_write(tmp_path, "a.csv", content))
    assert [r.arrival_s for r in trace.requests] == pytest.approx(expected, abs=1e-12)


# --- Errors -------------------------------------------------------------------------------------------------------

_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
_GOOD_AZURE_ROW = "2023-11-16 18:17:03.9799600,4808,10\n"
_GOOD_MOONCAKE_ROW = json.dumps(_row(0, 600, 10, [0, 1])) + "\n"


@pytest.mark.parametrize(
    ("content", "line", "message"),
    [
        pytest.param(b"", 1, "empty file", id="empty"),
        pytest.param(b"\n \r\n\n", 1, "empty file", id="blank-only"),
        pytest.param("\ufeff".encode(), 1, "empty file", id="bom-only"),
        pytest.param(_GOOD_MOONCAKE_ROW + '{"timestamp": 1,\n', 2, "malformed JSON at column", id="json-malformed"),
        pytest.param(_GOOD_MOONCAKE_ROW + "\n[1, 2, 3]\n", 3, "expected a JSON object", id="json-array"),
        pytest.param(
            _GOOD_MOONCAKE_ROW + '{"timestamp": 1, "output_length": 3}\n',
            2,
            "missing field 'input_length'",
            id="json-missing-input",
        ),
        pytest.param(
            '{"input_length": 3, "output_length": 3}\n', 1, "missing field 'timestamp'", id="json-missing-time"
        ),
        pytest.param(_jsonl(_row(0, -5)), 1, "input_length is negative (-5)", id="json-negative"),
        pytest.param(_jsonl(_row(0, 5, 2.5)), 1, "output_length must be an integer", id="json-fraction"),
        pytest.param(_jsonl(_row(0, "5")), 1, "input_length must be an integer", id="json-string-count"),
        pytest.param(_jsonl(_row(0, True)), 1, "input_length must be an integer", id="json-bool-count"),
        pytest.param(_jsonl(_row(0, 2**41)), 1, "implausibly large", id="json-huge-count"),
        pytest.param(_jsonl(_row("0")), 1, "timestamp must be a number", id="json-string-time"),
        pytest.param(_jsonl(_row(0, ids=[0, -1])), 1, "non-negative integers, got -1", id="json-negative-id"),
        pytest.param(_jsonl(_row(0, ids=[0, 1.5])), 1, "non-negative integers, got 1.5", id="json-float-id"),
        pytest.param(_jsonl(_row(0, hash_ids="0,1")), 1, "hash_ids must be a list", id="json-ids-not-list"),
        pytest.param(b'{"timestamp": 0}\n\xff\xfe\n', 2, "not UTF-8", id="not-utf8"),
        pytest.param("TIME,ContextTokens,GeneratedTokens\n" + _GOOD_AZURE_ROW, 1, "no 'timestamp' column", id="no-ts"),
        pytest.param("TIMESTAMP,ContextTokens\n" + _GOOD_AZURE_ROW, 1, "no 'generatedtokens'", id="no-output-col"),
        pytest.param(_HEADER, 1, "no data rows", id="header-only"),
        pytest.param(_HEADER + "\n\n", 3, "no data rows", id="header-and-blanks"),
        pytest.param(_HEADER + _GOOD_AZURE_ROW + "yesterday,1,1\n", 3, "unparseable TIMESTAMP", id="csv-bad-time"),
        pytest.param(_HEADER + "2023-13-16 18:17:03,1,1\n", 2, "month must be in 1..12", id="csv-bad-month"),
        pytest.param(_HEADER + "2023-11-16 24:17:03,1,1\n", 2, "time of day out of range", id="csv-bad-hour"),
        pytest.param(_HEADER + "nan,1,1\n", 2, "unparseable TIMESTAMP", id="csv-nan-time"),
        pytest.param(_HEADER + _GOOD_AZURE_ROW + "1700000000,1,1\n", 3, "breaks with earlier rows", id="csv-mixed"),
        pytest.param(_HEADER + _GOOD_AZURE_ROW + "2023-11-16 18:17:04,1\n", 3, "expected 3 fields", id="csv-short"),
        pytest.param(_HEADER + "2023-11-16 18:17:04,12.5,1\n", 2, "ContextTokens must be an integer", id="csv-frac"),
        pytest.param(_HEADER + "2023-11-16 18:17:04,abc,1\n", 2, "ContextTokens must be an integer", id="csv-text"),
        pytest.param(_HEADER + "2023-11-16 18:17:04,1,-1\n", 2, "GeneratedTokens is negative", id="csv-negative"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path: Path, content: str | bytes, line: int, message: str) -> None:
    path = _write(tmp_path, "bad.txt", content)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert f"{path}:{line}: " in str(caught.value)
    assert message in str(caught.value)


def test_empty_window_is_a_trace_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "w.jsonl", _jsonl(_row(0), _row(3000)))
    with pytest.raises(TraceError, match=r"w\.jsonl: no requests in the window \[5, 10\) s.*span 0 to 3 s"):
        load_trace(path, start_s=5, end_s=10)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"rate_scale": 0}, id="rate-zero"),
        pytest.param({"rate_scale": -1.0}, id="rate-negative"),
        pytest.param({"rate_scale": float("inf")}, id="rate-inf"),
        pytest.param({"rate_scale": float("nan")}, id="rate-nan"),
        pytest.param({"start_s": 5, "end_s": 5}, id="window-empty"),
        pytest.param({"start_s": float("nan")}, id="window-nan"),
        pytest.param({"limit": 0}, id="limit-zero"),
    ],
)
def test_bad_arguments_are_value_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    path = _write(tmp_path, "w.jsonl", _jsonl(_row(0)))
    with pytest.raises(ValueError) as caught:
        load_trace(path, **kwargs)
    assert not isinstance(caught.value, TraceError)


# --- Time pipeline ------------------------------------------------------------------------------------------------

_TICKS_MS = [0, 0, 0, 3000, 3000, 6000, 9000]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({}, [0, 0, 0, 3, 3, 6, 9], id="as-is"),
        pytest.param({"start_s": 3}, [0, 0, 3, 6], id="start"),
        pytest.param({"start_s": 2}, [1, 1, 4, 7], id="start-between-ticks"),
        pytest.param({"start_s": 3, "end_s": 9}, [0, 0, 3], id="window-end-exclusive"),
        pytest.param({"end_s": 3.5}, [0, 0, 0, 3, 3], id="end"),
        pytest.param({"rate_scale": 2.0}, [0, 0, 0, 1.5, 1.5, 3, 4.5], id="twice-the-rate"),
        pytest.param({"rate_scale": 0.5}, [0, 0, 0, 6, 6, 12, 18], id="half-the-rate"),
        pytest.param({"start_s": 3, "rate_scale": 2.0}, [0, 0, 1.5, 3], id="window-then-rate"),
        pytest.param({"limit": 4}, [0, 0, 0, 3], id="limit"),
        pytest.param({"limit": 100}, [0, 0, 0, 3, 3, 6, 9], id="limit-above-rows"),
        pytest.param({"start_s": 3, "limit": 2}, [0, 0], id="window-then-limit"),
        pytest.param({"spread_ticks": True}, [0, 1, 2, 3, 4.5, 6, 9], id="spread"),
        pytest.param({"spread_ticks": True, "start_s": 1.5, "end_s": 6}, [0.5, 1.5, 3], id="spread-then-window"),
        pytest.param({"spread_ticks": True, "rate_scale": 2.0}, [0, 0.5, 1, 1.5, 2.25, 3, 4.5], id="spread-rate"),
    ],
)
def test_time_pipeline(tmp_path: Path, kwargs: dict[str, Any], expected: list[float]) -> None:
    rows = [_row(ts, prompt=100 + i) for i, ts in enumerate(_TICKS_MS)]
    trace = load_trace(_write(tmp_path, "ticks.jsonl", _jsonl(*rows)), **kwargs)
    assert [r.arrival_s for r in trace.requests] == pytest.approx(expected, abs=1e-12)
    assert [r.index for r in trace.requests] == list(range(len(expected)))
    assert trace.duration_s == trace.requests[-1].arrival_s
    kept = len(expected) < len(rows)
    assert any(note.startswith(f"kept {len(expected)} of 7 rows") for note in trace.notes) == kept
    # Requests keep file order within a tick, so prompts (100 + file row) rise with arrival order.
    prompts = [r.prompt_tokens for r in trace.requests]
    assert prompts == sorted(prompts)


@pytest.mark.parametrize(
    ("stamps_ms", "expected"),
    [
        pytest.param([0, 2000, 2000], [0, 2, 3], id="last-tick-uses-previous-gap"),
        pytest.param([5000, 5000], [0, 0], id="single-tick-cannot-spread"),
        pytest.param([0, 1000, 1000, 1000, 1000, 5000], [0, 1, 2, 3, 4, 5], id="four-over-four-seconds"),
        pytest.param([3000, 0, 3000, 0], [0, 1.5, 3, 4.5], id="unsorted-file"),
    ],
)
def test_spread_ticks(tmp_path: Path, stamps_ms: list[int], expected: list[float]) -> None:
    path = _write(tmp_path, "s.jsonl", _jsonl(*(_row(ts) for ts in stamps_ms)))
    trace = load_trace(path, spread_ticks=True)
    assert [r.arrival_s for r in trace.requests] == pytest.approx(expected, abs=1e-12)
    assert load_trace(path, spread_ticks=True) == trace


# --- Synthetic prompts and block keys -----------------------------------------------------------------------------


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _prefix_trace(tmp_path: Path) -> Trace:
    """Hand-written rows sharing prefixes in every awkward way, then seeded random multi-turn conversations."""
    rows = [
        _row(0, 1536, ids=[0, 1, 2]),
        _row(0, 1300, ids=[0, 1, 3]),  # partial last block
        _row(0, 700, ids=[0, 1]),  # id 1 covers only 188 tokens here, a full block elsewhere
        _row(0, 512, ids=[0]),
        _row(0, 2600, ids=[0, 1]),  # too few ids: filler after token 1024
        _row(0, 2600, ids=[0, 1]),  # same ids, yet its own filler
        _row(0, 600),  # no ids at all
        _row(0, 100, ids=[0, 1, 2]),  # extra ids, dropped
        _row(0, 1536, ids=[9, 1, 2]),  # same later ids behind another first block
        _row(0, 31, ids=[0]),  # shorter than one block of any size above 31
    ]
    rng = random.Random(7)
    chats: list[list[int]] = []
    next_id = 100
    for turn in range(30):
        if chats and rng.random() < 0.7:
            ids = list(rng.choice(chats))
            ids = ids[: rng.randint(1, len(ids))]
        else:
            ids = [0]
        for _ in range(rng.randint(0, 2)):
            ids.append(next_id)
            next_id += 1
        chats.append(ids)
        partial = rng.choice([0, 1, 255, 511])
        prompt = max(1, (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + (partial or MOONCAKE_BLOCK_TOKENS))
        rows.append(_row(1000 + turn, prompt, ids=ids))
    return load_trace(_write(tmp_path, "prefix.jsonl", _jsonl(*rows)))


def _cached_runs(blocks: list[list[int]]) -> list[int]:
    """For each request in turn, how many of its leading blocks an unbounded prefix cache already holds (every
    block of the requests before it), as `inferlb.sim.kvcache.KVCache.match` counts them."""
    seen: set[int] = set()
    runs = []
    for keys in blocks:
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        runs.append(n)
        seen.update(keys)
    return runs


@pytest.mark.parametrize("block_size", [1, 16, 64, 512])
def test_block_keys_share_leading_runs_exactly_where_text_hashes_do(tmp_path: Path, block_size: int) -> None:
    trace = _prefix_trace(tmp_path)
    keys = [block_keys(r, block_size, trace.name) for r in trace.requests]
    hashes = [text_block_hashes(prompt_text(r, trace.name), block_size) for r in trace.requests]
    for r, k, h in zip(trace.requests, keys, hashes, strict=True):
        assert len(k) == len(h) == r.prompt_tokens // block_size
    shared = 0
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            expected = _leading_equal(hashes[i], hashes[j])
            assert _leading_equal(keys[i], keys[j]) == expected, (i, j)
            shared += expected > 0
    assert shared > 50  # the trace does share prefixes, so the check above is not vacuous
    assert _cached_runs(keys) == _cached_runs(hashes)


_NOT_CHAINED = _jsonl(
    _row(0, 1024, ids=[1, 2]),
    _row(1, 512, ids=[2]),  # id 2 follows id 1 above: different text before it, so nothing to share
    _row(2, 1536, ids=[2, 1, 3]),  # starts as the row above does: shares its one block
    _row(3, 1024, ids=[3, 3]),  # an id repeated inside one request
    _row(4, 1536, ids=[1, 2, 3]),  # shares 2 blocks with the first row, not its third with row 2
    _row(5, 1100, ids=[7, 1, 2]),
    _row(6, 1024, ids=[1, 2]),  # the first row again: shares everything
)


@pytest.mark.parametrize("block_size", [1, 16, 512])
def test_block_keys_of_a_file_whose_ids_are_not_chained_share_what_the_live_server_would(
    tmp_path: Path, block_size: int
) -> None:
    trace = load_trace(_write(tmp_path, "loose.jsonl", _NOT_CHAINED))
    keys = [block_keys(r, block_size, trace.name) for r in trace.requests]
    hashes = [text_block_hashes(prompt_text(r, trace.name), block_size) for r in trace.requests]
    per = MOONCAKE_BLOCK_TOKENS // block_size
    runs = _cached_runs(hashes)
    assert runs == [0, 0, per, 0, 2 * per, 0, 2 * per]
    assert _cached_runs(keys) == runs
    # Equal blocks of text give equal keys, and only they do, across the whole file.
    pairs = {(k, h) for ks, hs in zip(keys, hashes, strict=True) for k, h in zip(ks, hs, strict=True)}
    assert len({k for k, _ in pairs}) == len({h for _, h in pairs}) == len(pairs)


def test_a_block_id_seen_later_in_another_request_is_not_cached_in_the_simulator(tmp_path: Path) -> None:
    """Request A = [1, 2], then B = [2]: B's first block follows different text on A, so a live server's chained
    hashes share nothing, and neither may the simulator (it once gave B 496 cached tokens). C = [1] does share."""
    rows = [_row(0, 1024, 1, [1, 2]), _row(10_000, 512, 1, [2]), _row(20_000, 512, 1, [1])]
    trace = load_trace(_write(tmp_path, "ab.jsonl", _jsonl(*rows)))
    profile = get_profile("h100-llama3.1-8b")
    result = simulate(trace_arrivals(trace, profile.block_size), lambda arrival, view: 0, [profile], jitter=0.0)
    a, b, c = result.records
    assert (a.error, b.error, c.error) == (None, None, None)
    assert b.cached_tokens == 0
    assert c.cached_tokens == 512 - profile.block_size  # all but the block holding the last token


def test_prompt_text_lengths_and_prefixes(tmp_path: Path) -> None:
    trace = _prefix_trace(tmp_path)
    texts = [prompt_text(r, trace.name) for r in trace.requests]
    for r, text in zip(trace.requests, texts, strict=True):
        assert len(text) == r.prompt_tokens * 4
        assert count_tokens(text) == r.prompt_tokens
        assert text.isascii()
        assert text.strip()
    first, second, third, _, short_a, short_b, no_ids = texts[:7]
    assert first[: 2 * 2048] == second[: 2 * 2048] != second[: 3 * 2048]
    assert third == first[:2800]  # a partial last block is the start of the same block elsewhere
    assert short_a[:4096] == short_b[:4096] and short_a[4096:] != short_b[4096:]
    assert no_ids[:2048] != block_text(0)
    # Filler depends on the trace's name, so two traces' unrelated rows share nothing either.
    assert prompt_text(trace.requests[6], "other") != no_ids
    assert prompt_text(trace.requests[6], trace.name) == no_ids


def test_block_text_is_fixed_by_the_id() -> None:
    assert len(block_text(0)) == MOONCAKE_BLOCK_TOKENS * 4
    # Pinned, so that a change to the derivation (which would break shared prefixes across runs) is noticed.
    assert block_text(0)[:24] == "UwP6uTeKWl4PlI1iVz5Ux6ux"
    assert block_text(182789)[:24] == "oP5k298LdlZhToDbfwBijbsc"
    assert block_text(1) != block_text(0)


@pytest.mark.parametrize("block_size", [0, -16, 3, 24, 1024])
def test_block_keys_rejects_block_sizes_that_do_not_divide_512(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must divide 512"):
        block_keys(TraceRequest(0, 0.0, 2048, 1, (0, 1, 2, 3)), block_size)


@pytest.mark.parametrize(
    "file",
    [
        pytest.param("mooncake_conversation_trace.jsonl", id="mooncake-conversation"),
        pytest.param("mooncake_synthetic_trace.jsonl", id="mooncake-synthetic"),
    ],
)
def test_block_keys_of_the_shipped_traces_share_as_the_ids_do(file: str) -> None:
    """The shipped traces' ids are prefix-chained (an id always follows the same ids), so keying blocks by their
    chain of ids gives exactly the sharing that keying them by the id alone did: a one-to-one map between the two."""
    path = _traces_dir() / file
    if not path.is_file():
        pytest.skip(f"{path} is absent (set INFERLB_TRACES_DIR to the folder holding the shared traces)")
    trace = load_trace(path)
    by_id: dict[int, int] = {}
    by_key: dict[int, int] = {}
    for r in trace.requests:
        covered = r.hash_ids[: r.prompt_tokens // MOONCAKE_BLOCK_TOKENS]
        for h, key in zip(covered, block_keys(r, MOONCAKE_BLOCK_TOKENS, trace.name), strict=False):
            assert by_id.setdefault(h, key) == key
            assert by_key.setdefault(key, h) == h
    assert len(by_id) > 10_000


def test_block_keys_rejects_negative_hash_ids() -> None:
    with pytest.raises(ValueError, match="hash ids must be >= 0"):
        block_keys(TraceRequest(0, 0.0, 1024, 1, (0, -1)), 16)


def test_block_keys_for_azure_rows_are_unique_per_request_and_trace() -> None:
    a, b = TraceRequest(0, 0.0, 64, 1), TraceRequest(1, 0.0, 64, 1)
    keys = block_keys(a, 16, "t")
    assert len(set(keys)) == 4 and all(k < 0 for k in keys)
    assert not set(keys) & set(block_keys(b, 16, "t"))
    assert not set(keys) & set(block_keys(a, 16, "u"))
    assert keys == block_keys(a, 16, "t")


# --- Shipped traces -----------------------------------------------------------------------------------------------


def _traces_dir() -> Path:
    configured = os.environ.get("INFERLB_TRACES_DIR")
    return Path(configured) if configured else Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.mark.parametrize(
    ("file", "fmt", "rows", "duration_s"),
    [
        pytest.param("mooncake_conversation_trace.jsonl", "mooncake", 12_031, 3536.999, id="mooncake-conversation"),
        pytest.param("mooncake_synthetic_trace.jsonl", "mooncake", 3_993, 1022.025, id="mooncake-synthetic"),
        pytest.param("AzureLLMInferenceTrace_code.csv", "azure", 8_819, 3435.948056, id="azure-code"),
        pytest.param("AzureLLMInferenceTrace_conv.csv", "azure", 19_366, 3501.721937, id="azure-conv"),
    ],
)
def test_shipped_traces_load(file: str, fmt: str, rows: int, duration_s: float) -> None:
    path = _traces_dir() / file
    if not path.is_file():
        pytest.skip(f"{path} is absent (set INFERLB_TRACES_DIR to the folder holding the shared traces)")
    trace = load_trace(path)
    assert trace.format == fmt
    assert len(trace.requests) == rows
    assert trace.duration_s == pytest.approx(duration_s, abs=1e-9)
    assert trace.notes == ()
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in trace.requests)
    if fmt == "mooncake":
        # The README: one id per 512 started tokens on every row; distinct first blocks 1 and 2,211.
        assert all(len(r.hash_ids) == -(-r.prompt_tokens // 512) for r in trace.requests)
        assert len({r.hash_ids[0] for r in trace.requests}) == (1 if "conversation" in file else 2_211)
