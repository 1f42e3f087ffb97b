"""Tests for bench/dynamolive.py, the Dynamo workers in front of emulated servers: the tokenizer the frontend loads
makes each Dynamo block one emulator block, and a server's KV events reach Dynamo's publisher as the same tokens the
frontend gives the router for that prompt (so the router's block hashes of a request and of a server's cache
agree). Dynamo itself runs in tests/bench/test_peers.py where it is installed."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from inferlb.bench import dynamolive
from inferlb.bench.dynamolive import BLOCK_CHARS, VOCAB, BlockTexts, prompt_text, relay, write_model
from inferlb.scorer.kvevents import decode_batch
from inferlb.sim.kvevents import encode_batch
from inferlb.sim.tokens import block_hashes
from inferlb.sim.traces import TraceRequest
from inferlb.sim.traces import prompt_text as trace_prompt

SERVER_BLOCK = 16  # tokens of 4 characters: every profile's block
MASK63 = (1 << 63) - 1


class Publisher:
    """What relay calls on Dynamo's KvEventPublisher, recorded."""

    def __init__(self) -> None:
        self.stored: list[tuple[list[int], list[int], list[int], int | None]] = []
        self.removed: list[list[int]] = []

    def publish_stored(self, tokens: list[int], sizes: list[int], hashes: list[int], parent: int | None) -> None:
        self.stored.append((tokens, sizes, hashes, parent))

    def publish_removed(self, hashes: list[int]) -> None:
        self.removed.append(hashes)


def _prompt(index: int, tokens: int) -> str:
    request = TraceRequest(index=index, arrival_s=0.0, prompt_tokens=tokens, output_tokens=1, hash_ids=(1000 + index,))
    return trace_prompt(request, "t")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("model")
    write_model(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_the_model_tokenizes_one_token_per_character_and_back(tokenizer: Tokenizer) -> None:
    text = _prompt(1, 300) + "\n" + "a b  c"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text)
    assert prompt_text(ids) == text
    assert 0 not in ids  # no character of a trace prompt is unknown
    assert BLOCK_CHARS == SERVER_BLOCK * 4


def _stored_batch(text: str, blocks: slice, removed: list[int] = ()) -> Any:  # type: ignore[assignment]
    hashes = block_hashes(text, SERVER_BLOCK)[blocks]
    parent = block_hashes(text, SERVER_BLOCK)[blocks.start - 1] if blocks.start else None
    events: list[tuple[Any, ...]] = [("s", hashes, parent, list(range(len(hashes) * SERVER_BLOCK)))]
    events += [("r", h) for h in removed]
    return decode_batch(encode_batch(1.0, events, SERVER_BLOCK))


def test_a_servers_stored_blocks_reach_dynamo_as_the_tokens_the_frontend_gives_the_router(tokenizer: Tokenizer) -> None:
    text = _prompt(2, 5 * SERVER_BLOCK + 3)  # five full blocks and a partial one (never cached)
    texts, publisher = BlockTexts(), Publisher()
    texts.remember(text)
    relay(_stored_batch(text, slice(0, 3)), texts, publisher)
    relay(_stored_batch(text, slice(3, 5)), texts, publisher)
    request_tokens = tokenizer.encode(text, add_special_tokens=False).ids
    hashes = block_hashes(text, SERVER_BLOCK)
    (t1, s1, h1, p1), (t2, s2, h2, p2) = publisher.stored
    assert t1 + t2 == request_tokens[: 5 * BLOCK_CHARS]
    assert (s1, s2) == ([BLOCK_CHARS] * 3, [BLOCK_CHARS] * 2)
    assert h1 + h2 == [h & MASK63 for h in hashes]
    assert (p1, p2) == (None, hashes[2] & MASK63)
    assert texts.unknown == 0


def test_blocks_never_forwarded_are_skipped_and_counted_and_removals_pass_through() -> None:
    seen, unseen = _prompt(3, 2 * SERVER_BLOCK), _prompt(4, 2 * SERVER_BLOCK)
    texts, publisher = BlockTexts(), Publisher()
    texts.remember(seen)
    relay(_stored_batch(unseen, slice(0, 2), removed=block_hashes(seen, SERVER_BLOCK)), texts, publisher)
    assert publisher.stored == []
    assert texts.unknown == 2
    assert publisher.removed == [[h & MASK63] for h in block_hashes(seen, SERVER_BLOCK)]


def test_block_texts_keep_the_most_recent_blocks_up_to_their_capacity() -> None:
    texts = BlockTexts(capacity=2)
    old, new = _prompt(5, 2 * SERVER_BLOCK), _prompt(6, 2 * SERVER_BLOCK)
    texts.remember(old)
    texts.remember(new)
    assert texts.tokens(block_hashes(new, SERVER_BLOCK)) == [VOCAB[c] for c in new[: 2 * BLOCK_CHARS]]
    assert texts.tokens(block_hashes(old, SERVER_BLOCK)[:1]) is None
    with pytest.raises(ValueError, match="capacity"):
        BlockTexts(capacity=0)


def test_the_launcher_refuses_a_namespace_with_more_than_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(dynamolive, "loopback_only", lambda: ["eth0"])
    argv = ["--server", "127.0.0.1:1", "--kv-events-port", "2", "--model-dir", str(tmp_path), "--store", str(tmp_path)]
    with pytest.raises(SystemExit):
        dynamolive.main(argv)
    assert not (tmp_path / "tokenizer.json").exists()
