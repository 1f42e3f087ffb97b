"""What the engine knows about one request: ``RequestFeatures``, built by the filter from headers and body.

Also the two cheap request-size rules the filter applies to a prompt: the token estimate and the chained prefix
block hashes (``text_block_hashes``, ``token_block_hashes``) that prefix-cache affinity matches on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    token_ids: Sequence[int] | np.ndarray,
    *,
    block_tokens: int = PREFIX_BLOCK_TOKENS,
    max_blocks: int = MAX_PREFIX_BLOCKS,
    seed: int = 0,
) -> tuple[int, ...]:
    """``text_block_hashes`` for a prompt given as token ids: chained hashes of full blocks of ``block_tokens``
    ids. The same contract (per-process hashes, only full blocks, at most ``max_blocks``).

    A block is hashed as the bytes of its ids as int64, so the hashes depend on the values only: a Python list
    from a parsed body and an int64 array read from the raw one (``filter/request.py``) give the same chain. An
    id beyond int64 (JSON allows up to 2**64 - 1; no tokenizer has one) makes its block hashed as a tuple. Only
    the hashed head is converted, so the cost is bounded by ``max_blocks`` whatever the prompt's length.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
    end = min(len(token_ids) // block_tokens, max_blocks) * block_tokens
    if end == 0:
        return ()
    try:
        keys: list[bytes | tuple[int, ...]] = _int64_blocks(token_ids[:end], block_tokens)
    except OverflowError:
        keys = [_block_key(token_ids[start : start + block_tokens]) for start in range(0, end, block_tokens)]
    hashes = []
    prev = seed
    for key in keys:
        prev = hash((prev, key))
        hashes.append(prev)
    return tuple(hashes)


def _int64_blocks(token_ids: Sequence[int] | np.ndarray, block_tokens: int) -> list[bytes | tuple[int, ...]]:
    """The int64 bytes of each ``block_tokens`` ids (``len(token_ids)`` is a multiple of it); raises
    ``OverflowError`` for an id beyond int64."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    step = block_tokens * 8
    return [data[start : start + step] for start in range(0, len(data), step)]


def _block_key(block: Sequence[int] | np.ndarray) -> bytes | tuple[int, ...]:
    try:
        return np.asarray(block, dtype=np.int64).tobytes()
    except OverflowError:
        return tuple(int(i) for i in block)


@dataclass(frozen=True)
class RequestFeatures:
    """The routing-relevant facts of one request, immutable: the filter builds them from headers (`of`) and body
        (`with_body`), and the routing unit adds the request's class (`classified`); each is a new object.

        ``model`` is None for requests whose body was not read (headers-only routes). ``prompt_tokens`` is an
        estimate unless the prompt was given as token ids. ``prefix_hashes`` are the prompt's chained block hashes
        (see ``text_block_hashes``; empty without a body or for prompts shorter than one block); ``cache_keys`` the
    same in the servers' token blocks, where a tokenizer is configured. ``session_key`` is
        the value of the configured session header, None when it is absent or empty; ``objective`` the inference
        objective the gateway names (``x-gateway-inference-objective``), None when it names none.
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
    objective: str | None = None  # the gateway's inference objective: the name of a class
    traceparent: str | None = None
    request_class: str | None = None
    pool_mask: Any = None  # numpy bool array over the pool: the endpoints the request's class may use
    priority: int = 0  # the class's priority: among requests waiting for capacity, higher goes first
    ttft_slo_s: float | None = None  # the class's time-to-first-token objective
    # The headers experiments assign by (name in lower case -> value), read only where an experiment asks.
    headers: Mapping[str, str] | None = None
    arm: Any = None  # the experiment arm admission assigned the request to (`scorer.experiments.Arm`), if any
    # The gateway's subset hint (Endpoint Picker protocol): the only addresses that may serve it; None: any.
    subset: frozenset[str] | None = None
    # The prompt's chained keys in the servers' KV block size, from the model's tokenizer, for the exact cache
    # index (`scorer.kvindex`); empty where no tokenizer is configured for the model.
    cache_keys: tuple[int, ...] = ()
    # Where the model's tokenizer is too slow for the routing loop: the job that computes cache_keys, which the filter
    # runs in a worker thread before the request is routed (None: nothing left to compute).
    keying: Any = None
    # The completions the server generates for the request (``n``, or ``best_of`` where larger): its output is
    # max_tokens (or the assumed output) as many times.
    output_copies: int = 1

    # Every request is built two or three times (from headers, with its body, with its class). A frozen
    # dataclass's __init__ sets its fields one object.__setattr__ call at a time, a fifth of the whole cost of
    # an in-process request here; these builders fill a new instance's dict in a few C calls instead (which is
    # why the class has a __dict__, not slots). They build what the constructor would: tests/scorer/
    # test_features.py holds them to it.

    @classmethod
    def of(cls, fields: dict[str, Any]) -> RequestFeatures:
        """``RequestFeatures(**fields)``, for field names known to be right."""
        new = object.__new__(cls)
        values = new.__dict__
        values.update(_DEFAULTS)
        values.update(fields)
        return new

    def with_body(
        self,
        model: str | None,
        stream: bool,
        max_tokens: int | None,
        prompt_chars: int,
        prompt_tokens: int,
        prefix_hashes: tuple[int, ...],
        cache_keys: tuple[int, ...] = (),
        keying: Any = None,
        output_copies: int = 1,
    ) -> RequestFeatures:
        """These features with what the request's body says."""
        return self._copy(
            {
                "model": model,
                "stream": stream,
                "max_tokens": max_tokens,
                "prompt_chars": prompt_chars,
                "prompt_tokens": prompt_tokens,
                "prefix_hashes": prefix_hashes,
                "cache_keys": cache_keys,
                "keying": keying,
                "output_copies": output_copies,
            }
        )

    def classified(
        self, request_class: str, priority: int, ttft_slo_s: float | None, pool_mask: Any
    ) -> RequestFeatures:
        """These features with the request's class and what it sets."""
        return self._copy(
            {"request_class": request_class, "priority": priority, "ttft_slo_s": ttft_slo_s, "pool_mask": pool_mask}
        )

    def keyed(self, cache_keys: tuple[int, ...]) -> RequestFeatures:
        """These features with the prompt's cache keys (`scorer.tokenizer.cache_keys`)."""
        return self._copy({"cache_keys": cache_keys, "keying": None})

    def hinted(self, subset: frozenset[str]) -> RequestFeatures:
        """These features with the gateway's subset hint: only endpoints at these addresses may serve it."""
        return self._copy({"subset": subset})

    def assigned(self, arm: Any, pool_mask: Any, model: str | None = None) -> RequestFeatures:
        """These features with the experiment arm they were assigned (None: none) and the endpoints it leaves;
        ``model``: the model the arm sends the request as (a release arm's), in place of the client's."""
        changes = {"arm": arm, "pool_mask": pool_mask}
        if model is not None:
            changes["model"] = model
        return self._copy(changes)

    def _copy(self, changes: dict[str, Any]) -> RequestFeatures:
        """A new object with these fields and ``changes`` (what the constructor would build, without its one
        frozen-attribute call per field)."""
        new = object.__new__(RequestFeatures)
        values = new.__dict__
        values.update(self.__dict__)
        values.update(changes)
        return new


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RequestFeatures)}
