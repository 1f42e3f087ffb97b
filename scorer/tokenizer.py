"""Prompts as the servers tokenize them, for matching a request against the blocks a server reports it holds.

A server's KV events (`scorer.kvevents`) name its cached blocks by the token ids they hold. To ask how much of a
new request a server has cached, the picker needs the request's prompt as the same token ids: the model's own
tokenizer (Hugging Face ``tokenizer.json``, through the ``tokenizers`` library; chats rendered by the model's chat
template from ``tokenizer_config.json`` first), or the emulator's stand-in (`PieceTokenizer`: four characters make
one token, the rule the picker's size estimate also uses). `cache_keys` then chains the ids block by block, the
way `scorer.kvindex.KVBlockIndex` keys what servers report.

Cost: the piece tokenizer takes a few microseconds per KB (numpy) and runs on the routing loop; a Hugging Face
tokenizer is Rust but still the largest per-request cost where it is configured (see bench/results/kvevents.md), and
the filter runs it in worker threads, under a deadline. Only the first `MAX_CACHE_BLOCKS` blocks are keyed, so only
the head of a prompt that holds them is tokenized (`HuggingFaceTokenizer`: a head guessed at `HEAD_CHARS_PER_TOKEN`
characters a token, grown until it holds `CUT_SLACK_TOKENS` more tokens than needed). Tokenizers are loaded once,
at start-up, from local files only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inferlb.scorer.chattemplate import ChatTemplate, MediaContent, TemplateRefused
from inferlb.scorer.features import CHARS_PER_TOKEN, token_block_hashes

__all__ = [
    "CUT_SLACK_TOKENS",
    "HEAD_CHARS_PER_TOKEN",
    "MAX_CACHE_BLOCKS",
    "VOCAB_SIZE",
    "HuggingFaceTokenizer",
    "MediaContent",
    "PieceTokenizer",
    "PromptTokenizer",
    "TokenizerError",
    "cache_keys",
    "chat_text",
    "piece_ids",
]

# Blocks of a prompt that are keyed for the cache match: 8192 blocks of vLLM's 16 tokens is 128k tokens.
MAX_CACHE_BLOCKS = 8192
# A head of a long prompt is tokenized first, guessed at this many characters a token (most text and code has 3 to 5)
# and grown while it gives too few tokens. The cut changes only the tokens of the word it splits (a tokenizer encodes
# each pre-tokenized word on its own): the head must give this many tokens more than are keyed, so that word lies past
# them. Only one word longer than this (no spaces or punctuation for some 4,000 characters) can still straddle the
# last keyed block, which then misses on the server's; the blocks before it match.
HEAD_CHARS_PER_TOKEN = 6
CUT_SLACK_TOKENS = 1024
# Llama 3's vocabulary size: the stand-in's ids look like a real tokenizer's and fit the u32 that Rust routers use.
VOCAB_SIZE = 128_256
# Odd 64-bit constants (splitmix64's) that mix a piece's four code points into one id.
_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93], dtype=np.uint64)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a chat its template refuses; the message says which and why."""


class PromptTokenizer(Protocol):
    """Turns a request's prompt into the token ids its server computes. Synchronous and CPU-only; may raise
    `TokenizerError` for a chat its template refuses. ``inline``: cheap enough to run on the routing loop (else the
    filter runs it in a worker thread, and it must be thread-safe)."""

    inline: bool

    def text_ids(self, text: str, max_tokens: int | None = None) -> Sequence[int] | np.ndarray:
        """A completions prompt's ids (with the special tokens the server adds); with ``max_tokens``, at least its
        first ``max_tokens`` ids (all there are where it has fewer), exactly as the whole prompt's would begin."""
        ...

    def chat_ids(self, messages: list[Any], max_tokens: int | None = None) -> Sequence[int] | np.ndarray:
        """A chat's ids: the messages rendered as the server renders them, with the generation prompt (``max_tokens``
        as for `text_ids`). May raise `MediaContent` for a chat with content other than text."""
        ...


def cache_keys(token_ids: Sequence[int] | np.ndarray, block_size: int) -> tuple[int, ...]:
    """Chained keys of the full ``block_size``-token blocks of a prompt (at most `MAX_CACHE_BLOCKS`): two prompts
    share their first k keys exactly when they share their first k blocks. Per-process hashes, like the prefix
    index's; a server's reported blocks are keyed the same way (`scorer.kvindex`)."""
    return token_block_hashes(token_ids, block_tokens=block_size, max_blocks=MAX_CACHE_BLOCKS, seed=0)


def piece_ids(text: str) -> list[int]:
    """The emulator's token ids of ``text``: one id in ``[0, VOCAB_SIZE)`` per four-character piece, a hash of the
    piece's code points alone (the same in every process). Unlike a real tokenizer's, two pieces may share an id;
    no id is special (there is no BOS). Vectorised."""
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
    """The prompt a chat becomes on the emulator: each message as ``<|role|>\\n{content}\\n``, then
    ``<|assistant|>\\n``. Content may be a string or a list of OpenAI content parts, of which the ``{"type":
    "text"}`` ones count. The same leading messages always render to the same leading text."""
    parts: list[str] = []
    for message in messages:
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
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


class PieceTokenizer:
    """The emulator's tokenizer (`sim`): four-character pieces, chats rendered by `chat_text`. Stateless, and cheap
    enough for the routing loop."""

    inline = True

    def text_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        return piece_ids(text if max_tokens is None else text[: max_tokens * CHARS_PER_TOKEN])

    def chat_ids(self, messages: list[Any], max_tokens: int | None = None) -> list[int]:
        return self.text_ids(chat_text(messages), max_tokens)


class HuggingFaceTokenizer:
    """A model's tokenizer from its folder (``tokenizer.json``, and ``tokenizer_config.json`` for the chat template
    and the special tokens it names). Raises `TokenizerError` at construction when the files cannot be used.

    Completions are encoded with the tokenizer's special tokens (the BOS a server adds); chats are rendered as vLLM
    renders them (`scorer.chattemplate`: its normalised messages, transformers' sandbox and globals, today's date),
    with the generation prompt, and encoded without adding any (a template writes its own). A chat the template
    refuses raises `TokenizerError`, one with images or other media `MediaContent`. With ``max_tokens``, only a head
    of the text is encoded (module docstring). Too slow for the routing loop (a millisecond or more for a few KB,
    bench/results/kvevents.md): the filter runs it in worker threads, and it encodes through the library's batch
    call, which lets other threads run meanwhile."""

    inline = False

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        try:
            self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the library raises its own Exception subclass for every problem
            raise TokenizerError(f"cannot load {folder / 'tokenizer.json'}: {exc}") from exc
        self._template: ChatTemplate | None = None
        specials: dict[str, str] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"cannot read {config_path}: {exc}") from exc
            for name in _SPECIAL_TOKENS:
                value = config.get(name)
                if isinstance(value, dict):  # an AddedToken written out
                    value = value.get("content")
                if isinstance(value, str):
                    specials[name] = value
            source = config.get("chat_template")
            if isinstance(source, str):
                try:
                    self._template = ChatTemplate(source, config_path, specials)
                except TemplateRefused as exc:
                    raise TokenizerError(str(exc)) from exc

    def text_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        return self._encode(text, True, max_tokens)

    def chat_ids(self, messages: list[Any], max_tokens: int | None = None) -> list[int]:
        if self._template is None:
            raise TokenizerError("the model's tokenizer_config.json has no chat_template")
        try:
            rendered = self._template.render(messages)
        except TemplateRefused as exc:
            raise TokenizerError(str(exc)) from None
        return self._encode(rendered, False, max_tokens)

    def _encode(self, text: str, special: bool, max_tokens: int | None) -> list[int]:
        """The ids of ``text``, or of a head of it that gives ``max_tokens`` and `CUT_SLACK_TOKENS` more."""
        if max_tokens is None:
            return list(self._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)
        want = max_tokens + CUT_SLACK_TOKENS
        size = min(len(text), want * HEAD_CHARS_PER_TOKEN)
        while True:
            ids = self._tokenizer.encode_batch([text[:size]], add_special_tokens=special)[0].ids
            if size >= len(text):
                return list(ids)
            if len(ids) >= want:
                return list(ids[:max_tokens])
            # Too few tokens (long tokens: runs of spaces or symbols): a head as long as this one's rate needs, and
            # at least twice as long.
            size = min(len(text), max(2 * size, size * want // max(len(ids), 1) * 5 // 4))


# The named special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class CacheKeyer:
    """The cache keys of a request's prompt, for the models that have a tokenizer (``tokenizers``: model name →
    tokenizer); keys in blocks of ``block_size`` tokens (`cache_keys`). What it cannot tokenize (a model without a
    tokenizer, a batch of prompts, a chat the template refuses or one with images) gets no keys, and routing falls
    back to the approximate index; refusals are counted in ``failed``, chats with media in ``media``. Only the
    prompt's first `MAX_CACHE_BLOCKS` blocks are tokenized."""

    def __init__(self, tokenizers: Mapping[str, PromptTokenizer], block_size: int) -> None:
        self.tokenizers = dict(tokenizers)
        self.block_size = block_size
        self.failed = 0
        self.media = 0

    def keys(self, model: str, document: Mapping[str, Any], token_head: Any = None) -> tuple[int, ...]:
        """Keys of a validated completions or chat ``document`` for ``model``; ``token_head``: the prompt's leading
        token ids where the filter read them from the raw body instead of the document."""
        keys, later = self.plan(model, document, token_head)
        return keys if later is None else later()

    def plan(
        self, model: str, document: Mapping[str, Any], token_head: Any = None
    ) -> tuple[tuple[int, ...], Callable[[], tuple[int, ...]] | None]:
        """(the keys, or () and a job that computes them): the job where the model's tokenizer is not `inline`
        and there is text to tokenize. Cheap; the job holds only the prompt (or the messages)."""
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None:
            return (), None
        if token_head is not None:
            return self._ids(token_head), None
        if "messages" in document:
            job = partial(self._tokenized, tokenizer.chat_ids, document["messages"])
        else:
            prompt = document.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
                return self._ids(prompt), None
            if not isinstance(prompt, str):
                return (), None  # a batch of prompts: no one prefix to follow
            job = partial(self._tokenized, tokenizer.text_ids, prompt)
        return ((), job) if not tokenizer.inline else (job(), None)

    def _ids(self, ids: Any) -> tuple[int, ...]:
        try:
            return cache_keys(ids, self.block_size)
        except (TypeError, ValueError, OverflowError):
            self.failed += 1
            return ()

    def _tokenized(self, tokenize: Callable[[Any, int], Sequence[int] | np.ndarray], prompt: Any) -> tuple[int, ...]:
        try:
            return cache_keys(tokenize(prompt, MAX_CACHE_BLOCKS * self.block_size), self.block_size)
        except MediaContent:
            self.media += 1  # as `failed`
            return ()
        except (TokenizerError, TypeError, ValueError, OverflowError):
            self.failed += 1  # an int += from a worker thread: the count may miss one under a race, never more
            return ()
