"""A completions prompt (or an embeddings input) of token ids, read from the raw body: found, checked and counted
without making a Python int per id, because a 4 MiB body of ids is a million of them and the full JSON parse would
dominate its cost.

A JSON array of integers (or of arrays of them) is checked and counted by bytes methods and numpy operations,
each a pass over its bytes in C; only the ids that are hashed (MAX_PREFIX_BLOCKS blocks) are converted, to
int64. `parse_body` puts a placeholder where the ids were, parses the now-small rest, and checks the placeholder
came back as the top-level prompt; any doubt leaves the body to the full parse, so that what is accepted and
refused never changes (tests/filter/test_request.py pins the two paths equal).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from inferlb.filter.errors import MalformedRequestError
from inferlb.scorer.features import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_TOKENS

__all__ = ["SCAN_MIN_BYTES", "TokenIds", "find_prompt_array", "parse_body", "scan_tokens"]

_WS = b" \t\n\r"  # JSON's whitespace (not \v or \f)


def parse_body(body: bytes, field: str = "prompt") -> tuple[Any, TokenIds | None]:
    """The body's document, and the ids of its prompt (the top-level ``field``: ``prompt``, or an embeddings
    request's ``input``) when ``scan_tokens`` counted them in the raw bytes; then ``doc[field]`` is a placeholder,
    and the rest of the document is what the full parse would give."""
    found = find_prompt_array(body, SCAN_MIN_BYTES, field)
    if found is not None:
        start, value, nested = found
        tokens = scan_tokens(value, nested)
        if tokens is not None:
            # A key no client can guess (64 random bits), so that no object in the body can pass for the placeholder.
            key = "inferlb-" + os.urandom(8).hex()
            placeholder = b'{"%s":0}' % key.encode()
            try:
                doc = orjson.loads(body[:start] + placeholder + body[start + len(value) :])
            except orjson.JSONDecodeError:
                doc = None  # the full parse below tells the error, with its position in the body as sent
            # Anything but the top-level prompt (a nested "prompt", ids inside a string, a repeated key) leaves the
            # placeholder elsewhere, or breaks the document.
            if isinstance(doc, dict) and doc.get(field) == {key: 0}:
                return doc, tokens
    try:
        # orjson: several times faster than the json module on prompts, strict UTF-8, nesting capped at 1024.
        return orjson.loads(body), None
    except orjson.JSONDecodeError as exc:
        raise MalformedRequestError(f"request body is not valid JSON: {exc}") from None


# Up to 18 digits an integer fits int64; a longer one is left to the full parse (orjson reads up to 2**64 - 1).
_MAX_DIGITS = 18
_ZERO, _COMMA, _MINUS, _OPEN, _CLOSE = b"0,-[]"
# Every byte that cannot be in an array of integers becomes "#" (whitespace is deleted besides).
_ARRAY_BYTES = bytes(c if chr(c) in "0123456789,-[]" else ord("#") for c in range(256))
_FIELD_KEYS = {name: re.compile(rb'"%s"[ \t\n\r]*:[ \t\n\r]*' % name.encode()) for name in ("prompt", "input")}
_NESTED = re.compile(rb"\[[ \t\n\r]*+\[")
_SPACE = re.compile(rb"[ \t\n\r]*+")
_ARRAY_RUN = re.compile(rb"[0-9,\[\] \t\n\r-]*+")
# "prompt" strings looked at for the key (it may be a value too): a body where the first few are not the key, or
# the key holds no big array, is left to the full parse.
_PROMPT_STRINGS_TRIED = 4


# The raw-body scan is tried for an array of this size or more (below it the full parse costs as little).
SCAN_MIN_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A prompt of token ids read from the raw body: ``count`` ids in all, and ``head``, the int64 ids whose prefix
    blocks are hashed (the one prompt's first MAX_PREFIX_BLOCKS blocks; None for a batch of several)."""

    count: int
    head: np.ndarray | None


def find_prompt_array(body: bytes, min_bytes: int, field: str = "prompt") -> tuple[int, bytes, bool] | None:
    """(offset, bytes, whether it is an array of arrays) of the array the first ``"<field>":`` key holds
    (``prompt`` or ``input``), as far as it may be one, when it has at least ``min_bytes``; None otherwise."""
    if len(body) < min_bytes or b"[" not in body:
        return None
    pattern, quoted = _FIELD_KEYS[field], b'"%s"' % field.encode()
    at = body.find(quoted)
    for _ in range(_PROMPT_STRINGS_TRIED):
        if at < 0:
            return None
        key = pattern.match(body, at)
        if key is not None:
            break
        at = body.find(quoted, at + 1)
    else:
        return None
    start = key.end()
    if body[start : start + 1] != b"[":
        return None
    nested = _NESTED.match(body, start) is not None
    end = body.find(b"]", start)  # a flat array ends at its first "]"; an array of arrays, its first list
    if end < 0:
        return None
    if nested:
        space = _SPACE.match(body, end + 1)
        after = space.end() if space is not None else end + 1
        if body[after : after + 1] == b"]":
            end = after  # an array of one array
        else:
            run = _ARRAY_RUN.match(body, start)
            end = start + len(_array_value(run.group() if run is not None else b"")) - 1
    value = body[start : end + 1]
    return (start, value, nested) if len(value) >= min_bytes else None


def _array_value(run: bytes) -> bytes:
    """The value a run of array characters starts with: in a valid body only whitespace and a comma follow it
    before the next key or the object's end."""
    value = run.rstrip(_WS)
    return value[:-1].rstrip(_WS) if value.endswith(b",") else value


def scan_tokens(value: bytes, nested: bool) -> TokenIds | None:
    """``value`` read as a completions prompt of token ids, when it is exactly a JSON array of integers of up to
    18 digits, or (``nested``) an array of such arrays; None otherwise, and the full parse decides."""
    compact = value.translate(_ARRAY_BYTES, _WS)
    if len(compact) < 2 or b"#" in compact or compact[-1] != _CLOSE:
        return None
    if nested and compact.find(b"[", 2) < 0:
        # "[[…]]": the one list is read as a flat array (which checks its "]" is its last character), and hashed.
        compact, nested = compact[1:-1], False
    chars = np.frombuffer(compact, dtype=np.uint8)
    lists = _lists(chars) if nested else 0
    if lists is None:
        return None
    if not nested:
        if compact.find(b"[", 1) >= 0 or compact.find(b"]") != len(compact) - 1:
            return None  # a flat array has its brackets at its ends only
        if len(compact) == 2:
            return TokenIds(0, np.empty(0, dtype=np.int64))  # "[]", with whitespace inside
    nondigit = (chars - np.uint8(_ZERO)) > 9
    negative = b"-" in compact
    if not _integers_only(chars, nondigit, nested, negative):
        return None
    seps = int(np.count_nonzero(nondigit)) - (compact.count(b"-") if negative else 0)  # brackets and commas
    # Flat: ids are commas + 1. Nested, per list: its commas + 1, or none when empty; "],[" hold k - 1 commas more.
    count = (seps - 2 * lists - 2) - (lists - 1) + lists - compact.count(b"[]") if nested else seps - 2 + 1
    # Whitespace may part two numbers that the compact form joins ("1 2"): then one id is two runs of number
    # characters in the value as sent.
    if len(compact) != len(value) and _number_runs(value, negative) != count:
        return None
    return TokenIds(count, None) if nested else _token_ids(count, compact[1:-1])  # a batch has no one prefix


def _lists(chars: np.ndarray) -> int | None:
    """The number of lists k in an array of arrays, when its brackets are exactly ``[[…],[…],…]``: besides the
    outer two, k "[" and k "]", and k - 1 "],[". Each "],[" holds a "]" and a "[" that are neither the first "["
    nor the last "]", so these counts leave no bracket anywhere else."""
    opening, closing = chars == _OPEN, chars == _CLOSE
    lists = int(np.count_nonzero(opening)) - 1
    if lists < 1 or chars[0] != _OPEN or chars[-2] != _CLOSE or int(np.count_nonzero(closing)) != lists + 1:
        return None
    between = np.count_nonzero(closing[:-2] & (chars[1:-1] == _COMMA) & opening[2:])
    return lists if between == lists - 1 else None


def _integers_only(chars: np.ndarray, nondigit: np.ndarray, nested: bool, negative: bool) -> bool:
    """Whether each element of compact ``chars`` (no whitespace, brackets checked; ``nondigit`` marks what is not
    a digit, ``negative`` says whether there is a minus) is ``-?(0|[1-9][0-9]*)`` of at most ``_MAX_DIGITS``
    digits. An element starts after "[" or "," and ends before "," or "]"."""
    if negative:  # each minus starts an element and comes before a digit
        minus = chars == _MINUS
        sep = nondigit & ~minus
        if np.any(minus[1:] & ~sep[:-1]) or np.any(minus[:-1] & nondigit[1:]):
            return False
    else:
        sep = nondigit
    if nested:  # an empty element: ",,", "[,", ",]" (an empty list "[]" and "],[" are fine)
        comma = chars == _COMMA
        if np.any((comma | (chars == _OPEN))[:-1] & comma[1:]) or np.any(comma[:-1] & (chars[1:] == _CLOSE)):
            return False
    elif np.any(sep[:-1] & sep[1:]):  # an empty element: two separators in a row
        return False
    leading = nondigit[:-1] & (chars[1:] == _ZERO)  # a 0 that starts an element (or follows its minus)
    if leading.any() and np.any(leading[:-1] & ~nondigit[2:]):
        return False  # ... and a digit after it
    # A run of 19 digits holds an aligned 8-byte word of digits: look for one first, on an eighth of the words.
    words = nondigit[: len(nondigit) // 8 * 8].view(np.uint64)
    if np.any(words == 0):
        # After each step run[i] says the ``width`` characters from i are digits: width 1, 2, 4, 8, 16, then 19.
        run = ~nondigit
        for step in (1, 2, 4, 8, _MAX_DIGITS + 1 - 16):
            run = run[:-step] & run[step:]
        if run.any():
            return False
    return True


def _number_runs(value: bytes, negative: bool) -> int:
    """How many runs of digits (and minus signs, if ``negative``) ``value`` holds; it starts with "["."""
    chars = np.frombuffer(value, dtype=np.uint8)
    number = (chars - np.uint8(_ZERO)) < 10
    if negative:
        number |= chars == _MINUS
    return int(np.count_nonzero(number[1:] & ~number[:-1]))


def _token_ids(count: int, ids: bytes) -> TokenIds | None:
    """``TokenIds`` of one prompt: ``count`` checked ids, comma-separated in compact ``ids``, of which the head
    is converted."""
    need = min(count // PREFIX_BLOCK_TOKENS, MAX_PREFIX_BLOCKS) * PREFIX_BLOCK_TOKENS
    if need == 0:
        return TokenIds(count, np.empty(0, dtype=np.int64))
    if need < count:
        # The first ``need`` ids: try twice their average share of the bytes, then enough for the longest ids
        # (19 characters and a comma).
        for size in (2 * need * len(ids) // count + 64, 20 * need):
            commas = np.flatnonzero(np.frombuffer(ids, dtype=np.uint8, count=min(len(ids), size)) == _COMMA)
            if len(commas) >= need:
                ids = ids[: int(commas[need - 1])]
                break
    head = np.fromstring(ids, dtype=np.int64, sep=",")
    return TokenIds(count, head) if len(head) == need else None
