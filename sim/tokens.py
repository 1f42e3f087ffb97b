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

from inferlb.scorer.features import CHARS_PER_TOKEN
from inferlb.scorer.tokenizer import VOCAB_SIZE, piece_ids
from inferlb.scorer.tokenizer import chat_text as render_chat

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

_MASK63 = (1 << 63) - 1


def count_tokens(text: str) -> int:
    """Tokens in ``text``: ceil(characters / 4)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def token_pieces(text: str) -> list[str]:
    """The tokens of ``text`` as text: its four-character pieces (the last may be shorter)."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def token_ids(text: str) -> list[int]:
    """One id in ``[0, VOCAB_SIZE)`` per piece of `token_pieces`: the picker's `PieceTokenizer` rule
    (`inferlb.scorer.tokenizer.piece_ids`), so that a picker matching the emulator's KV events tokenizes as it does."""
    return piece_ids(text)


def chat_text(messages: Sequence[Mapping[str, object]]) -> str:
    """The prompt a chat request becomes (`inferlb.scorer.tokenizer.chat_text`): each message as
    ``<|role|>\\n{content}\\n``, then ``<|assistant|>\\n``."""
    return render_chat(messages)


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
