"""A deterministic stand-in for a tokenizer: token counts and prefix-cache block hashes without any model files.

The rule is the picker's own estimate (`inferlb.scorer.features.CHARS_PER_TOKEN` characters make one token), so a
text prompt's token count here equals the count the picker estimates. Token ``i`` of a text is the slice
``text[4*i : 4*i+4]``; block ``j`` is tokens ``[j*block_size, (j+1)*block_size)``. Block hashes are chained, as in
vLLM's automatic prefix caching: a block's hash covers its own tokens and the hash of the block before it, so two
prompts share a block hash exactly when they share the whole prefix up to the end of that block. Only full blocks
are hashed; a trailing partial block is never cached.

Hashes are 63-bit non-negative ints from BLAKE2b, the same in every process (Python's own ``hash`` is salted).
`token_ids` gives each four-character piece an id below `VOCAB_SIZE`, also the same in every process (what
``/tokenize`` answers), so equal text always has equal ids and a shared prefix has a shared id prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence

import numpy as np

from inferlb.scorer.features import CHARS_PER_TOKEN

__all__ = [
    "CHARS_PER_TOKEN",
    "VOCAB_SIZE",
    "block_hashes",
    "chat_text",
    "count_tokens",
    "id_block_hashes",
    "text_block_hashes",
    "token_ids",
    "token_pieces",
]

# Llama 3's vocabulary size: ids look like a real tokenizer's, and fit the u32 that Rust routers parse them into.
VOCAB_SIZE = 128_256
_MASK63 = (1 << 63) - 1
# Odd 64-bit constants (splitmix64's) that mix a piece's four code points into one id.
_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93], dtype=np.uint64)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)


def count_tokens(text: str) -> int:
    """Tokens in ``text``: ceil(characters / 4)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def token_pieces(text: str) -> list[str]:
    """The tokens of ``text`` as text: its four-character pieces (the last may be shorter)."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def token_ids(text: str) -> list[int]:
    """One id in ``[0, VOCAB_SIZE)`` per piece of `token_pieces`, a hash of the piece's code points alone (the same
    in every process). Vectorised: a router may ask every server to tokenize every prompt.

    Unlike a real tokenizer's, two different pieces may share an id; no id is special (there is no BOS)."""
    if not text:
        return []
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.uint64)
    pad = -len(points) % CHARS_PER_TOKEN
    if pad:
        points = np.concatenate([points, np.zeros(pad, dtype=np.uint64)])
    pieces = points.reshape(-1, CHARS_PER_TOKEN)
    mixed = pieces @ _MIX  # wraps modulo 2**64, as a hash should
    mixed ^= mixed >> np.uint64(31)
    mixed *= _FINAL
    mixed ^= mixed >> np.uint64(29)
    return (mixed % np.uint64(VOCAB_SIZE)).tolist()


def chat_text(messages: Sequence[Mapping[str, object]]) -> str:
    """The prompt a chat request becomes: each message as ``<|role|>\\n{content}\\n``, then ``<|assistant|>\\n``.

    Content may be a string or a list of OpenAI content parts, of which the ``{"type": "text"}`` ones count. The
    same leading messages always render to the same leading text, so a shared system prompt is a shared prefix.
    """
    parts: list[str] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p["text"]
                for p in content
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            )
        parts.append(
            f"<|{role if isinstance(role, str) else 'user'}|>\n{content if isinstance(content, str) else ''}\n"
        )
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _chain(previous: int, payload: bytes) -> int:
    digest = hashlib.blake2b(payload, digest_size=8, key=previous.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") & _MASK63


def text_block_hashes(text: str, block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``text`` (``block_size`` tokens each)."""
    width = block_size * CHARS_PER_TOKEN
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text) - width + 1, width):
        previous = _chain(previous, text[start : start + width].encode("utf-8", "surrogatepass"))
        hashes.append(previous)
    return hashes


def id_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of a prompt given as token ids."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = array("q", (t & _MASK63 for t in token_ids[start : start + block_size]))
        previous = _chain(previous, b"ids" + chunk.tobytes())
        hashes.append(previous)
    return hashes


def block_hashes(prompt: str | Sequence[int], block_size: int) -> list[int]:
    """`text_block_hashes` for text, `id_block_hashes` for a token-id list."""
    if isinstance(prompt, str):
        return text_block_hashes(prompt, block_size)
    return id_block_hashes(prompt, block_size)
