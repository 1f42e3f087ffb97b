"""Tests for the prompt's prefix block hashes (scorer/features.py, filter/request.py) and the session header."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpHeaders, ProcessingRequest

from inferlb.filter.request import apply_body, features_from_headers
from inferlb.filter.server import ExtProcService
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine, Profile, State, WeightedScorer
from inferlb.scorer.features import (
    MAX_PREFIX_BLOCKS,
    PREFIX_BLOCK_CHARS,
    PREFIX_BLOCK_TOKENS,
    RequestFeatures,
    text_block_hashes,
    token_block_hashes,
)
from inferlb.scorer.plugins import MaxScorePicker
from inferlb.scorer.pool import Pool

B = PREFIX_BLOCK_CHARS
T = PREFIX_BLOCK_TOKENS


def _text(*blocks: str, tail: str = "") -> str:
    """Full blocks, one letter repeated each, plus an optional partial tail."""
    return "".join(letter * B for letter in blocks) + tail


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading hashes two chains share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- the hash functions


@pytest.mark.parametrize(
    ("a", "b", "blocks_a", "blocks_b", "shared"),
    [
        pytest.param(_text("a", "b", "c"), _text("a", "b", "c"), 3, 3, 3, id="equal"),
        pytest.param(_text("a", "b", "c"), _text("a", "b", "x"), 3, 3, 2, id="last-block-differs"),
        pytest.param(_text("a", "x", "c", "d"), _text("a", "b", "c", "d"), 4, 4, 1, id="middle-block-breaks-chain"),
        pytest.param(_text("x", "b"), _text("a", "b"), 2, 2, 0, id="first-block-differs"),
        pytest.param(_text("a", "b"), _text("a", "b", "c", "d"), 2, 4, 2, id="prefix-of-longer"),
        pytest.param(_text("a", tail="xyz"), _text("a", tail="q"), 1, 1, 1, id="partial-tail-ignored"),
        pytest.param("a" * (B - 1), "a" * (B - 1), 0, 0, 0, id="shorter-than-a-block"),
        pytest.param("", "", 0, 0, 0, id="empty"),
        pytest.param(
            "a" * B + "b" * (B - 1) + "c", "a" * B + "b" * (B - 1) + "d", 2, 2, 1, id="last-character-of-a-block"
        ),
    ],
)
def test_text_block_hashes_share_exactly_the_common_leading_blocks(
    a: str, b: str, blocks_a: int, blocks_b: int, shared: int
) -> None:
    ha, hb = text_block_hashes(a), text_block_hashes(b)
    assert (len(ha), len(hb)) == (blocks_a, blocks_b)
    assert _common(ha, hb) == shared
    # Chained: after the first difference nothing matches again, even where the blocks are equal.
    assert not set(ha[shared:]) & set(hb[shared:])


@pytest.mark.parametrize(
    ("kwargs", "length"),
    [
        pytest.param({}, 10, id="default"),
        pytest.param({"block_chars": 64}, 40, id="smaller-blocks"),
        pytest.param({"block_chars": 1000}, 2, id="larger-blocks"),
        pytest.param({"max_blocks": 3}, 3, id="capped"),
        pytest.param({"max_blocks": 0}, 0, id="cap-zero"),
    ],
)
def test_text_block_hashes_block_size_and_cap(kwargs: dict[str, int], length: int) -> None:
    text = "".join(chr(ord("a") + i % 26) * 64 for i in range(40))  # 2560 characters
    hashes = text_block_hashes(text, **kwargs)
    assert len(hashes) == length
    assert len(set(hashes)) == length


def test_text_block_hashes_default_cap() -> None:
    assert len(text_block_hashes("x" * B * (MAX_PREFIX_BLOCKS + 5))) == MAX_PREFIX_BLOCKS


def test_block_hashes_are_seeded_and_refuse_a_bad_block_size() -> None:
    text = _text("a", "b")
    assert not set(text_block_hashes(text, seed=1)) & set(text_block_hashes(text, seed=2))
    assert text_block_hashes(text, seed=1) == text_block_hashes(text, seed=1)
    with pytest.raises(ValueError, match="block_chars"):
        text_block_hashes(text, block_chars=0)
    with pytest.raises(ValueError, match="block_tokens"):
        token_block_hashes([1, 2], block_tokens=0)


@pytest.mark.parametrize(
    ("a", "b", "blocks_a", "shared"),
    [
        pytest.param(list(range(3 * T)), list(range(3 * T)), 3, 3, id="equal"),
        pytest.param(list(range(3 * T)), [*range(2 * T), *range(T)], 3, 2, id="last-block-differs"),
        pytest.param(list(range(2 * T + 5)), list(range(2 * T)), 2, 2, id="partial-tail-ignored"),
        pytest.param([7] * (T - 1), [7] * (T - 1), 0, 0, id="shorter-than-a-block"),
        pytest.param([1, *range(1, 2 * T)], list(range(2 * T)), 2, 0, id="first-id-differs"),
    ],
)
def test_token_block_hashes(a: list[int], b: list[int], blocks_a: int, shared: int) -> None:
    ha, hb = token_block_hashes(a), token_block_hashes(b)
    assert len(ha) == blocks_a
    assert _common(ha, hb) == shared


IDS = [(i * 7919) % 150_000 - 3 for i in range(3 * T + 5)]


def test_token_block_hashes_hash_each_block_as_int64_bytes() -> None:
    # The contract both body paths meet: the raw-body scan hashes int64 arrays, the parsed body Python lists.
    prev, expected = 42, []
    for start in range(0, 3 * T, T):
        prev = hash((prev, np.asarray(IDS[start : start + T], dtype=np.int64).tobytes()))
        expected.append(prev)
    assert token_block_hashes(IDS, seed=42) == tuple(expected)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(np.asarray(IDS, dtype=np.int64), id="int64-array"),
        pytest.param(np.asarray(IDS, dtype=np.int32), id="int32-array"),
        pytest.param(tuple(IDS), id="tuple"),
    ],
)
def test_token_block_hashes_depend_on_the_values_only(ids: Any) -> None:
    assert token_block_hashes(ids, seed=7) == token_block_hashes(IDS, seed=7)
    assert token_block_hashes(ids[: 2 * T], seed=7, max_blocks=1) == token_block_hashes(IDS, seed=7)[:1]


def test_token_block_hashes_of_ids_beyond_int64() -> None:
    # JSON allows integers up to 2**64 - 1 and no tokenizer has such ids; they still hash, per block, consistently.
    ids = [*range(T), 2**63, *range(T - 1), -(2**63) - 1, *range(T)]
    hashes = token_block_hashes(ids, seed=1)
    assert len(hashes) == 3
    assert hashes[0] == token_block_hashes(list(range(T)), seed=1)[0]  # a block that fits keeps its int64 hash
    assert hashes == token_block_hashes(list(ids), seed=1)
    assert len(set(hashes)) == 3


# ---------------------------------------------------------------- from the request body

MODEL = "m"
LONG = _text("a", "b", "c", tail="zz")  # 3 full blocks


def _hashes(doc: dict[str, Any]) -> tuple[int, ...]:
    body = json.dumps({"model": MODEL, **doc}).encode()
    return apply_body(RequestFeatures(), body, complete=True, max_bytes=1 << 22).prefix_hashes


def _chat(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param({"prompt": LONG}, text_block_hashes(LONG, seed=hash(MODEL)), id="prompt-string"),
        pytest.param({"prompt": [LONG]}, text_block_hashes(LONG, seed=hash(MODEL)), id="prompt-one-string"),
        pytest.param(
            {"prompt": list(range(2 * T))}, token_block_hashes(list(range(2 * T)), seed=hash(MODEL)), id="token-ids"
        ),
        pytest.param(
            {"prompt": [list(range(2 * T))]},
            token_block_hashes(list(range(2 * T)), seed=hash(MODEL)),
            id="one-list-of-token-ids",
        ),
        pytest.param({"prompt": [LONG, LONG]}, (), id="batch-of-strings-has-none"),
        pytest.param({"prompt": [list(range(2 * T))] * 2}, (), id="batch-of-token-lists-has-none"),
        pytest.param({"prompt": []}, (), id="empty-list"),
        pytest.param({"prompt": "short"}, (), id="short-prompt"),
        pytest.param({}, (), id="no-prompt"),
        pytest.param(
            _chat(("system", "a" * B), ("user", "b" * B)),
            text_block_hashes(f"system\n{'a' * B}\nuser\n{'b' * B}\n", seed=hash(MODEL)),
            id="chat-rendering",
        ),
    ],
)
def test_apply_body_prefix_hashes(doc: dict[str, Any], expected: tuple[int, ...]) -> None:
    assert _hashes(doc) == expected


SYSTEM = "s" * (2 * B)
QUESTION = "q" * B


@pytest.mark.parametrize(
    ("a", "b", "relation"),
    [
        pytest.param(
            _chat(("system", SYSTEM), ("user", QUESTION)),
            _chat(("system", SYSTEM), ("user", QUESTION)),
            "equal",
            id="same-conversation",
        ),
        pytest.param(
            _chat(("system", SYSTEM), ("user", QUESTION)),
            _chat(("system", SYSTEM), ("user", "other question " * 40)),
            "share-head",
            id="shared-system-prompt",
        ),
        pytest.param(
            _chat(("system", SYSTEM), ("user", QUESTION)),
            _chat(("system", SYSTEM), ("user", QUESTION), ("assistant", "a" * B), ("user", QUESTION)),
            "prefix",
            id="conversation-grows",
        ),
        pytest.param(
            _chat(("user", [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": "x"}}])),
            _chat(("user", SYSTEM)),
            "equal",
            id="only-text-parts",
        ),
        pytest.param(_chat(("system", SYSTEM)), _chat(("user", SYSTEM)), "disjoint", id="role-matters"),
        pytest.param(_chat(("user", SYSTEM)), {"prompt": SYSTEM}, "disjoint", id="chat-vs-completion"),
        pytest.param({"prompt": SYSTEM, "model": "other"}, {"prompt": SYSTEM}, "disjoint", id="model-seeds-the-chain"),
    ],
)
def test_apply_body_prefix_relations(a: dict[str, Any], b: dict[str, Any], relation: str) -> None:
    ha, hb = _hashes(a), _hashes(b)
    assert ha and hb
    shared = _common(ha, hb)
    if relation == "equal":
        assert ha == hb
    elif relation == "prefix":
        assert hb[: len(ha)] == ha and len(hb) > len(ha)
    elif relation == "share-head":
        assert 0 < shared < min(len(ha), len(hb))
    else:
        assert shared == 0


# ---------------------------------------------------------------- the session header


def _headers(*pairs: tuple[str, bytes]) -> list[HeaderValue]:
    return [HeaderValue(key=k, raw_value=v) for k, v in [(":path", b"/v1/chat/completions"), *pairs]]


@pytest.mark.parametrize(
    ("headers", "session_header", "expected"),
    [
        pytest.param(_headers(("x-session-id", b"abc")), "x-session-id", "abc", id="present"),
        pytest.param(_headers(("x-session-id", b"abc")), None, None, id="not-configured"),
        pytest.param(_headers(("x-user", b"abc")), "x-session-id", None, id="absent"),
        pytest.param(_headers(("x-session-id", b"")), "x-session-id", None, id="empty-is-absent"),
        pytest.param(
            _headers(("x-session-id", b"one"), ("x-session-id", b"two")), "x-session-id", "two", id="last-wins"
        ),
        pytest.param(_headers(("x-request-id", b"r1")), "x-request-id", "r1", id="may-share-a-known-header"),
        pytest.param([HeaderValue(key="x-session-id", value="legacy")], "x-session-id", "legacy", id="legacy-value"),
    ],
)
def test_features_from_headers_session_key(
    headers: list[HeaderValue], session_header: str | None, expected: str | None
) -> None:
    features = features_from_headers(headers, session_header)
    assert features.session_key == expected
    assert features.path == ("/v1/chat/completions" if headers[0].key == ":path" else "")


class RecordingScorer:
    name = "recording"

    def __init__(self) -> None:
        self.seen: list[RequestFeatures] = []

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        self.seen.append(request)
        return np.full(len(candidates), 0.5)


async def _messages(items: Iterable[ProcessingRequest]) -> AsyncIterator[ProcessingRequest]:
    for item in items:
        yield item


@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        pytest.param("x-session-id", "s-42", id="lower-case"),
        pytest.param("X-Session-ID", "s-42", id="mixed-case-is-lowered"),
        pytest.param(None, None, id="off"),
    ],
)
async def test_ext_proc_service_threads_the_session_header(configured: str | None, expected: str | None) -> None:
    recorder = RecordingScorer()
    engine = Engine(
        Pool([EndpointConfig("10.0.0.1:8000", None)]),
        Profile("p", (), (WeightedScorer(recorder, 1.0),), MaxScorePicker()),
    )
    service = ExtProcService(engine, max_body_bytes=4096, session_header=configured)
    headers = HeaderMap(
        headers=[
            HeaderValue(key=":path", raw_value=b"/v1/completions"),
            HeaderValue(key="x-session-id", raw_value=b"s-42"),
        ]
    )
    request = ProcessingRequest(request_headers=HttpHeaders(headers=headers, end_of_stream=True))
    replies = [reply async for reply in service.Process(_messages([request]), None)]
    assert len(replies) == 1
    assert [r.session_key for r in recorder.seen] == [expected]


@pytest.mark.parametrize("bad", [pytest.param("", id="empty"), pytest.param(" x-session ", id="spaces")])
def test_ext_proc_service_refuses_a_bad_session_header(bad: str) -> None:
    engine = Engine(Pool([EndpointConfig("10.0.0.1:8000", None)]), Profile("p", (), (), MaxScorePicker()))
    with pytest.raises(ValueError, match="session_header"):
        ExtProcService(engine, max_body_bytes=4096, session_header=bad)
