"""Loaders for recorded LLM request traces (Mooncake JSONL, Azure LLM inference CSV) and their synthetic prompts.

`load_trace` reads a file, detects its format from the content (a first non-blank line starting with ``{`` is
Mooncake JSONL, anything else a CSV with a header), checks every row and returns an immutable `Trace` of
`TraceRequest` rows sorted by arrival. Bad input raises `TraceError` naming the file, the line and the problem;
repairs that keep a row usable (a 0 token count read as 1, extra keys ignored, rows sorted) are counted in
`Trace.notes`.

The time pipeline, in order: seconds from the file's earliest row; optionally ``spread_ticks``; the window
``[start_s, end_s)`` on that timeline, rebased so the window start is 0; ``limit`` keeps the first N; arrivals are
divided by ``rate_scale``.

Prompts are synthetic but keep the trace's prefix sharing: Mooncake ``hash_ids`` name 512-token blocks, and
`block_text` turns an id into the same 2,048 characters in every process, so equal ids give equal prefixes in a
simulator and against a live server alike. Positions no id covers get text unique to (trace name, request index,
position). `block_keys` gives the simulator cheap integer keys, chained over the ids as
`inferlb.sim.tokens.text_block_hashes` of `prompt_text` are over the text, so a block is shared exactly where the
live server would share it, for any file, without hashing megabytes of text.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import itertools
import json
import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Literal

from inferlb.sim.tokens import CHARS_PER_TOKEN

__all__ = [
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

MOONCAKE_BLOCK_TOKENS = 512
TraceFormat = Literal["mooncake", "azure"]

_BLOCK_CHARS = MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN
# 64 printable characters, so each digest byte maps to one uniformly (256 = 4 x 64).
_ALPHABET = (string.ascii_lowercase + string.ascii_uppercase + string.digits + " .").encode("ascii")
_TRANSLATE = bytes(_ALPHABET[b % len(_ALPHABET)] for b in range(256))
# Token counts above this are refused: they bound the filler keys' fields (see `block_keys`) and no real prompt
# comes near them.
_MAX_TOKENS = (1 << 40) - 1
# Chained block keys keep 54 bits, so a key times up to 512 sub-blocks stays below 2**63.
_CHAIN_MASK = (1 << 54) - 1
_DATETIME = re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_NON_BLANK = re.compile(r"\S")
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")


class TraceError(ValueError):
    """A trace file cannot be read; the message names the file, the line (where there is one) and the problem."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Immutable.

    ``index`` is the row's position in `Trace.requests` (0-based). ``arrival_s`` is seconds from the window start
    (the file's first row when there is no window), after rate scaling. ``prompt_tokens`` and ``output_tokens`` are
    >= 1. ``hash_ids`` are Mooncake's prefix block ids, one per 512 prompt tokens (the last may cover a partial
    block), at most ``ceil(prompt_tokens / 512)`` of them; empty for Azure rows.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace. Immutable.

    ``name`` is the file's stem, ``format`` the detected format. ``requests`` are sorted by arrival (ties keep file
    order) and each one's ``index`` is its position here. ``duration_s`` is the last request's arrival. ``notes``
    say, with counts, what was repaired or ignored while reading the file (empty for a clean file).
    """

    name: str
    format: TraceFormat
    requests: tuple[TraceRequest, ...]
    duration_s: float
    notes: tuple[str, ...] = ()


class _Notes:
    """What a load repaired or ignored: per-row notes are counted, file-level ones kept once, in first-seen order."""

    __slots__ = ("_rows", "_seen")

    def __init__(self) -> None:
        self._rows: Counter[str] = Counter()
        self._seen: dict[str, None] = {}

    def row(self, note: str) -> None:
        self._rows[note] += 1
        self._seen.setdefault(note)

    def file(self, note: str) -> None:
        self._seen.setdefault(note)

    def render(self) -> tuple[str, ...]:
        return tuple(f"{self._rows[note]} row(s): {note}" if note in self._rows else note for note in self._seen)


# A parsed row: (time in the file's unit, prompt tokens, output tokens, hash ids).
_Row = tuple[int | float, int, int, tuple[int, ...]]


def load_trace(
    path: str | Path,
    *,
    rate_scale: float = 1.0,
    start_s: float | None = None,
    end_s: float | None = None,
    limit: int | None = None,
    spread_ticks: bool = False,
) -> Trace:
    """Read the trace at ``path``.

    ``start_s``/``end_s`` select the window ``[start_s, end_s)`` in seconds from the file's earliest row; arrivals
    are rebased so the window start is 0. ``limit`` keeps the first N requests of the window. ``rate_scale`` > 0
    multiplies the request rate (arrivals are divided by it). ``spread_ticks`` spreads the requests that share a
    timestamp evenly, in file order, over the gap to the next distinct timestamp (the last timestamp uses the gap
    before it); it applies to the whole file, before windowing.

    Raises `TraceError` for bad content or a window without requests, ``ValueError`` for bad arguments, and
    ``OSError`` when the file cannot be read.
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale!r}")
    start = 0.0 if start_s is None else float(start_s)
    end = math.inf if end_s is None else float(end_s)
    if math.isnan(start) or math.isnan(end) or start >= end:
        raise ValueError(f"the window [start_s, end_s) must be non-empty, got [{start_s!r}, {end_s!r})")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit!r}")

    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text ({exc.reason})") from exc
    first = _NON_BLANK.search(text)
    if first is None:
        raise TraceError(f"{path}:1: empty file, no requests")

    notes = _Notes()
    fmt: TraceFormat
    if first.group() == "{":
        fmt, (rows, unit) = "mooncake", _parse_mooncake(path, text, notes)
    else:
        fmt, (rows, unit) = "azure", _parse_azure(path, text, notes)

    if any(a[0] > b[0] for a, b in itertools.pairwise(rows)):
        rows.sort(key=lambda row: row[0])
        notes.file("rows were not in time order and were sorted by time (ties keep file order)")
    origin = rows[0][0]
    times = [(row[0] - origin) / unit for row in rows]
    if spread_ticks:
        times = _spread(times, notes)

    kept = [i for i, t in enumerate(times) if start <= t < end]
    if not kept:
        raise TraceError(
            f"{path}: no requests in the window [{start:g}, {end:g}) s; the file's rows span 0 to {times[-1]:g} s"
        )
    if limit is not None:
        kept = kept[:limit]
    if len(kept) < len(rows):
        limited = "" if limit is None else f", limit {limit}"
        notes.file(f"kept {len(kept)} of {len(rows)} rows (window [{start:g}, {end:g}) s{limited})")

    requests = tuple(
        TraceRequest(
            index=n,
            arrival_s=(times[i] - start) / rate_scale,
            prompt_tokens=rows[i][1],
            output_tokens=rows[i][2],
            hash_ids=rows[i][3],
        )
        for n, i in enumerate(kept)
    )
    return Trace(
        name=path.stem,
        format=fmt,
        requests=requests,
        duration_s=requests[-1].arrival_s,
        notes=notes.render(),
    )


def _parse_mooncake(path: Path, text: str, notes: _Notes) -> tuple[list[_Row], int]:
    rows: list[_Row] = []
    blank = 0
    extra: set[str] = set()
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the file's final newline ends a line; it does not start a blank one
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            blank += 1
            continue
        where = f"{path}:{lineno}"
        try:
            # The standard library, not orjson: orjson reads integers beyond 64 bits as floats.
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: malformed JSON at column {exc.colno}: {exc.msg}") from exc
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in obj:
                raise TraceError(f"{where}: missing field {field!r}")
        if len(obj) > 3 and not obj.keys() <= _MOONCAKE_KEYS:
            extra.update(obj.keys() - _MOONCAKE_KEYS)
        timestamp = obj["timestamp"]
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
            raise TraceError(f"{where}: timestamp must be a number of milliseconds, got {timestamp!r:.40}")
        prompt = _token_count(obj["input_length"], "input_length", where, notes)
        output = _token_count(obj["output_length"], "output_length", where, notes)
        rows.append((timestamp, prompt, output, _hash_ids(obj.get("hash_ids"), prompt, where, notes)))
    if blank:
        notes.file(f"skipped {blank} blank line(s)")
    if extra:
        notes.file(f"ignored extra key(s): {', '.join(sorted(extra))}")
    return rows, 1000


def _hash_ids(value: object, prompt: int, where: str, notes: _Notes) -> tuple[int, ...]:
    if value is None:
        notes.row("no hash_ids; the prompt is unique text")
        return ()
    if not isinstance(value, list):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {type(value).__name__}")
    # The fast path checks in C; the loop only runs to name the bad item.
    if value and not (set(map(type, value)) == {int} and min(value) >= 0):
        bad = next(item for item in value if type(item) is not int or item < 0)
        raise TraceError(f"{where}: hash_ids must be non-negative integers, got {bad!r:.40}")
    slots = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    if len(value) > slots:
        notes.row("more hash_ids than 512-token blocks of input_length; the extra ids were ignored")
        del value[slots:]
    elif len(value) < slots:
        notes.row("fewer hash_ids than 512-token blocks of input_length; the rest of the prompt is unique text")
    return tuple(value)


def _csv_count(cell: str, field: str, where: str, notes: _Notes) -> int:
    """`_token_count` of a CSV cell holding an integer (``12``, or ``12.0`` from a float column)."""
    text = cell.strip()
    value: object = cell
    if (text.isascii() and text.isdigit()) or _INTEGER.fullmatch(text):
        value = int(text)
    elif _NUMBER.fullmatch(text):
        value = float(text)
    return _token_count(value, field, where, notes)


def _token_count(value: object, field: str, where: str, notes: _Notes) -> int:
    """A non-negative integral count (an int, or a float with no fraction); 0 is read as 1 and counted."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: {field} must be an integer token count, got {value!r:.40}")
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError(f"{where}: {field} must be an integer token count, got {value!r}")
        value = int(value)
    if value < 0:
        raise TraceError(f"{where}: {field} is negative ({value})")
    if value > _MAX_TOKENS:
        raise TraceError(f"{where}: {field} is implausibly large ({value}); at most {_MAX_TOKENS} is accepted")
    if value == 0:
        notes.row(f"{field} 0 was read as 1")
        return 1
    return value


def _parse_azure(path: Path, text: str, notes: _Notes) -> tuple[list[_Row], int]:
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    columns: list[int] = []
    rows: list[_Row] = []
    blank = 0
    numeric: bool | None = None  # whether TIMESTAMP holds seconds (True) or date-times (False); fixed by row 1
    try:
        for row in reader:
            lineno = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                blank += 1
                continue
            where = f"{path}:{lineno}"
            if header is None:
                header = [cell.strip().lower() for cell in row]
                for name in _AZURE_COLUMNS:
                    if name not in header:
                        found = ", ".join(cell.strip() for cell in row)
                        raise TraceError(f"{where}: the CSV header has no {name!r} column (columns: {found:.200})")
                    columns.append(header.index(name))
                if len(header) > len(_AZURE_COLUMNS):
                    ignored = [cell.strip() for i, cell in enumerate(row) if i not in columns]
                    notes.file(f"ignored extra column(s): {', '.join(ignored)}")
                continue
            if len(row) <= max(columns):
                raise TraceError(f"{where}: expected {len(header)} fields, got {len(row)}")
            stamp = row[columns[0]].strip()
            time, is_numeric = _azure_time(stamp, where)
            if numeric is None:
                numeric = is_numeric
            elif numeric != is_numeric:
                kinds = "seconds" if numeric else "date-times"
                raise TraceError(f"{where}: TIMESTAMP {stamp!r:.40} breaks with earlier rows, which hold {kinds}")
            prompt = _csv_count(row[columns[1]], "ContextTokens", where, notes)
            output = _csv_count(row[columns[2]], "GeneratedTokens", where, notes)
            rows.append((time, prompt, output, ()))
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: malformed CSV: {exc}") from exc
    if not rows:
        raise TraceError(f"{path}:{reader.line_num}: empty file, no data rows after the header")
    if blank:
        notes.file(f"skipped {blank} blank line(s)")
    return rows, 10**9


def _azure_time(stamp: str, where: str) -> tuple[int, bool]:
    """Integer nanoseconds and whether ``stamp`` was plain seconds (True) or a date-time (since 0001-01-01)."""
    match = _DATETIME.fullmatch(stamp)
    if match is not None:
        year, month, day, hour, minute, second, fraction_digits = match.groups()
        try:
            days = _day_number(year, month, day)
        except ValueError as exc:
            raise TraceError(f"{where}: unparseable TIMESTAMP {stamp!r}: {exc}") from exc
        hour, minute, second = int(hour), int(minute), int(second)
        if hour > 23 or minute > 59 or second > 59:
            raise TraceError(f"{where}: unparseable TIMESTAMP {stamp!r}: time of day out of range")
        fraction = int(fraction_digits.ljust(9, "0")) if fraction_digits else 0
        return (((days * 24 + hour) * 60 + minute) * 60 + second) * 10**9 + fraction, False
    if _NUMBER.fullmatch(stamp):
        # Decimal, not float: epoch seconds as floats are only good to about 0.2 us.
        return int(Decimal(stamp).scaleb(9).to_integral_value()), True
    raise TraceError(
        f"{where}: unparseable TIMESTAMP {stamp!r:.40}; expected 'YYYY-MM-DD HH:MM:SS[.fraction]' or seconds"
    )


@functools.lru_cache(maxsize=256)
def _day_number(year: str, month: str, day: str) -> int:
    return date(int(year), int(month), int(day)).toordinal()


def _spread(times: list[float], notes: _Notes) -> list[float]:
    """Spread each run of equal (sorted) times evenly over the gap to the next distinct time."""
    distinct: list[float] = []
    counts: list[int] = []
    for t in times:
        if distinct and distinct[-1] == t:
            counts[-1] += 1
        else:
            distinct.append(t)
            counts.append(1)
    spread: list[float] = []
    for g, (t, count) in enumerate(zip(distinct, counts, strict=True)):
        if g + 1 < len(distinct):
            gap = distinct[g + 1] - t
        elif g > 0:
            gap = t - distinct[g - 1]
        else:
            gap = 0.0
        spread.extend(t + k * gap / count for k in range(count))
    shared = sum(count > 1 for count in counts)
    if shared:
        notes.file(f"spread_ticks: spread the requests of {shared} shared timestamp(s) over the gap to the next one")
    return spread


@functools.lru_cache(maxsize=4096)
def block_text(block_id: int) -> str:
    """The 2,048 characters (512 tokens) of Mooncake block ``block_id``: printable ASCII, a function of the id only,
    the same in every process. Distinct ids give distinct texts (barring a SHAKE-256 collision)."""
    digest = hashlib.shake_256(b"inferlb-mooncake-block:%d" % block_id).digest(_BLOCK_CHARS)
    return digest.translate(_TRANSLATE).decode("ascii")


def _filler_text(trace_name: str, index: int, slot: int) -> str:
    # A different prefix than block_text's, so filler never equals a block's text.
    seed = f"inferlb-filler:{trace_name}:{index}:{slot}".encode("utf-8", "surrogatepass")
    return hashlib.shake_256(seed).digest(_BLOCK_CHARS).translate(_TRANSLATE).decode("ascii")


def prompt_text(request: TraceRequest, trace_name: str = "") -> str:
    """The synthetic prompt of ``request``: exactly ``prompt_tokens * 4`` characters, so `count_tokens` gives
    ``prompt_tokens``.

    512-token slot ``i`` is ``block_text(hash_ids[i])`` where there is an id (the last slot truncated); the other
    slots are text unique to (``trace_name``, ``request.index``, slot), so unrelated requests share no prefix.
    """
    slots = -(-request.prompt_tokens // MOONCAKE_BLOCK_TOKENS)
    ids = request.hash_ids
    parts = [
        block_text(ids[slot]) if slot < len(ids) else _filler_text(trace_name, request.index, slot)
        for slot in range(slots)
    ]
    return "".join(parts)[: request.prompt_tokens * CHARS_PER_TOKEN]


@functools.lru_cache(maxsize=64)
def _name_tag(trace_name: str) -> int:
    digest = hashlib.blake2b(trace_name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _chain_ids(ids: tuple[int, ...]) -> list[int]:
    """One key per id, each a function of the ids up to and including it (``ids[:i + 1]``), below 2**54."""
    keys: list[int] = []
    previous = b"inferlb:"  # 8 bytes, as every digest after it, so (previous, id) is read back unambiguously
    for h in ids:
        previous = hashlib.blake2b(previous + b"%d" % h, digest_size=8).digest()
        keys.append(int.from_bytes(previous, "little") & _CHAIN_MASK)
    return keys


def block_keys(request: TraceRequest, block_size: int, trace_name: str = "") -> list[int]:
    """Integer keys for the ``prompt_tokens // block_size`` full blocks of ``prompt_text(request, trace_name)``.

    Keys are chained as `inferlb.sim.tokens.text_block_hashes` are: block ``b`` inside slot ``i`` gets
    ``c * (512 // block_size) + sub-block``, where ``c`` is a hash of ``hash_ids[:i + 1]`` (not of ``hash_ids[i]``
    alone), so two blocks get equal keys exactly when their text and all the text before them are equal, whether
    or not the file's ids are themselves prefix-chained (request A = [1, 2] and request B = [2] share nothing,
    as on a live server). Equal id sequences give equal keys in every process. A block of filler text gets a
    negative key unique to (``trace_name``, ``request.index``, block). ``block_size`` must divide 512;
    ``ValueError`` otherwise, or when a hash id is negative.
    """
    if not 1 <= block_size <= MOONCAKE_BLOCK_TOKENS or MOONCAKE_BLOCK_TOKENS % block_size:
        raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS}, got {block_size!r}")
    ids = request.hash_ids
    if ids and min(ids) < 0:
        raise ValueError(f"hash ids must be >= 0, got {min(ids)} in request {request.index}")
    per = MOONCAKE_BLOCK_TOKENS // block_size
    blocks = request.prompt_tokens // block_size
    covered = min(blocks, len(ids) * per)
    whole, rest = divmod(covered, per)
    chained = _chain_ids(ids[: whole + (1 if rest else 0)])
    keys: list[int] = []
    for c in chained[:whole]:
        keys.extend(range(c * per, c * per + per))
    if rest:
        c = chained[whole]
        keys.extend(range(c * per, c * per + rest))
    if covered < blocks:
        # Fields of 40 bits each: blocks and indexes stay below 2**40 (token counts are capped at that).
        base = -1 - (request.index << 40) - (_name_tag(trace_name) << 80)
        keys.extend(range(base - covered, base - blocks, -1))
    return keys
