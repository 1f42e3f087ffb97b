"""What the engine knows about one request: ``RequestFeatures``, built by the filter from headers and body.

Also the two cheap request-size rules the filter applies to a prompt: the token estimate and the chained prefix
block hashes (``text_block_hashes``, ``token_block_hashes``) that prefix-cache affinity matches on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# A rough English-text rule (OpenAI's own rule of thumb): one token per four characters. It only has to rank
# requests by size and estimate load; no tokenizer is loaded on the request path.
CHARS_PER_TOKEN = 4

# Prefix blocks: 256 characters is about 64 tokens, a few of vLLM's 16-token KV blocks. Smaller blocks match
# more finely but cost more to hash and to index; the index only has to say roughly how much of a prompt an
# endpoint has recently seen.
PREFIX_BLOCK_CHARS = 256
PREFIX_BLOCK_TOKENS = PREFIX_BLOCK_CHARS // CHARS_PER_TOKEN
# 2048 blocks of 256 characters: the first ~512 KB (~128k tokens) of a prompt; the rest is not hashed.
MAX_PREFIX_BLOCKS = 2048


def estimate_tokens(chars: int) -> int:
    """Estimated token count of ``chars`` characters of prompt text (ceiling division)."""
    return -(-chars // CHARS_PER_TOKEN)


def text_block_hashes(
    text: str, *, block_chars: int = PREFIX_BLOCK_CHARS, max_blocks: int = MAX_PREFIX_BLOCKS, seed: int = 0
) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text`` (a trailing partial block is left
    out), at most ``max_blocks`` of them.

    Each hash covers its block and, through the previous hash, everything before it: two prompts share the
    first k hashes exactly when they share the first k blocks (up to hash collisions), and one differing
    character breaks the chain from its block on. ``seed`` starts the chain (the filter passes the model name's
    hash, because servers cache prefixes per model). Hashes use Python's ``hash``, which is salted per process:
    they agree within one process only and must never be stored or sent elsewhere. Cost: about 1.4 µs per KB.
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, not {block_chars}")
    end = min(len(text) // block_chars, max_blocks) * block_chars
    hashes = []
    prev = seed
    for start in range(0, end, block_chars):
        prev = hash((prev, text[start : start + block_chars]))
        hashes.append(prev)
    return tuple(hashes)


def token_block_hashes(
    token_ids: Sequence[int],
    *,
    block_tokens: int = PREFIX_BLOCK_TOKENS,
    max_blocks: int = MAX_PREFIX_BLOCKS,
    seed: int = 0,
) -> tuple[int, ...]:
    """``text_block_hashes`` for a prompt given as token ids: chained hashes of full blocks of ``block_tokens``
    ids. The same contract (per-process hashes, only full blocks, at most ``max_blocks``)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
    end = min(len(token_ids) // block_tokens, max_blocks) * block_tokens
    hashes = []
    prev = seed
    for start in range(0, end, block_tokens):
        prev = hash((prev, tuple(token_ids[start : start + block_tokens])))
        hashes.append(prev)
    return tuple(hashes)


@dataclass(slots=True)
class RequestFeatures:
    """The routing-relevant facts of one request. Built once per request; treat as read-only.

    ``model`` is None for requests whose body was not read (headers-only routes). ``prompt_tokens`` is an
    estimate unless the prompt was given as token ids. ``prefix_hashes`` are the prompt's chained block hashes
    (see ``text_block_hashes``; empty without a body or for prompts shorter than one block). ``session_key`` is
    the value of the configured session header, None when it is absent or empty.
    """

    path: str = ""
    method: str = ""
    request_id: str = ""
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    prompt_chars: int = 0
    prompt_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()
    session_key: str | None = None
    class_hint: str | None = None
    traceparent: str | None = None
    request_class: str | None = None
    pool_mask: Any = None  # numpy bool array over the pool: the endpoints the request's class may use
    priority: int = 0  # the class's priority: among requests waiting for capacity, higher goes first
    ttft_slo_s: float | None = None  # the class's time-to-first-token objective
    admission: str | None = None  # "waited" (capacity came) or "waited-out" (routed though saturated)
