"""Turning what Envoy sends (headers, buffered body) into ``RequestFeatures``.

A body is parsed once, here. Only the fields routing needs are read (``model``, ``stream``, ``max_tokens``,
the prompt or messages, or the ``input`` of the embeddings and Responses APIs); the inference server validates
the rest. A field the picker reads must have the right type, or the client gets a 400 that names it.

The prompt's prefix block hashes (``RequestFeatures.prefix_hashes``) are computed from the text the server will
see first: a completions ``prompt`` or an embeddings ``input`` (a string, token ids, or a one-element list of
either; a batch of several prompts gets none), or chat ``messages`` (and a Responses API request's
``instructions`` and ``input`` items) rendered in order as role and text parts (images and other parts are
skipped). The rendering is not the server's chat template; it only has to be the same for equal conversations
and differ for different ones. The chain is seeded with the model name, as servers cache prefixes per model.

A body's cost is linear in its size, up to ``max_body_bytes`` (figures: bench/results/bodycost.md). A prompt of
token ids, where the parse would dominate (a 4 MiB body is a million Python ints), is found, checked and counted
in the raw bytes (``filter/tokenscan.py``); the rest of the body, the ids replaced by a placeholder, is parsed, and any
doubt leaves the body to the full parse, so that what is accepted and refused never changes. While a big body's
document exists the garbage collector is paused: it would rescan the document's many small objects as they are
made. Elements of a prompt, and messages of the common shape, are read by C passes (map, set, join), not by a
Python loop per element; the loop runs only for multi-part messages and for the message an error names.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from typing import Any

import orjson

from inferlb.filter.errors import MalformedRequestError, PayloadTooLargeError, RequestError
from inferlb.filter.replies import METADATA_NAMESPACE
from inferlb.filter.tokenscan import parse_body
from inferlb.scorer.errors import shown
from inferlb.scorer.features import (
    MAX_PREFIX_BLOCKS,
    PREFIX_BLOCK_CHARS,
    RequestFeatures,
    estimate_tokens,
    text_block_hashes,
    token_block_hashes,
)
from inferlb.scorer.tokenizer import CacheKeyer

_BOM = b"\xef\xbb\xbf"
# From this size the document of a body may be many thousand objects: the collector is paused while it exists.
_GC_PAUSE_MIN_BYTES = 64 * 1024
_NONE = type(None)
# The Responses API: its ``input`` is a string or a list of items (messages, tool calls and their outputs).
RESPONSES_PATH = "/v1/responses"
# The embeddings API: its ``input`` has a completions prompt's shapes (a string, strings, token ids, lists of them).
EMBEDDINGS_PATH = "/v1/embeddings"
# Scoring APIs (vLLM's): texts to compare, in these fields (a string or a list of strings each), no prompt to follow.
_SCORING_FIELDS = {"/v1/rerank": ("query", "documents"), "/v1/score": ("text_1", "text_2", "queries", "documents")}
# APIs that generate no output: a request charges its prompt alone.
_NO_OUTPUT_PATHS = frozenset({EMBEDDINGS_PATH, *_SCORING_FIELDS})
# A Responses API input item's own text besides a message's content: a tool call's arguments and its output.
_ITEM_TEXT_FIELDS = ("arguments", "output")
# What a request may generate, by each API's name for it: chat and completions, the Responses API.
_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def features_from_headers(
    headers: Iterable[Any],
    session_header: str | None = None,
    class_header: str | None = None,
    experiment_headers: frozenset[str] = frozenset(),
    objectives: bool = False,
) -> RequestFeatures:
    """Features from Envoy's ``HeaderValue`` list (``key`` and ``raw_value``); no body has been read.

    ``session_header`` names (in lower case, as Envoy sends header names) the header whose value becomes
    ``session_key``; an empty value counts as absent, and a repeated header's last value wins. ``class_header``
    likewise fills ``class_hint``, which request-class rules may match. The ``experiment_headers`` present go into
    ``headers`` (name -> value), which experiments assign by. With ``objectives``, an inference objective header
    (`OBJECTIVE_HEADERS`) fills ``objective``.
    """
    found: dict[str, Any] = {}
    tagged: dict[str, str] | None = None
    for header in headers:
        key = header.key
        if key == ":path":
            found["path"] = header_text(header)
        elif key == ":method":
            found["method"] = header_text(header)
        elif key == "x-request-id":
            found["request_id"] = client_key(header_text(header))
        elif key == "traceparent":
            found["traceparent"] = header_text(header)
        elif objectives and key in OBJECTIVE_HEADERS:
            found["objective"] = header_text(header) or None
        if key == session_header:
            found["session_key"] = header_text(header) or None
        if key == class_header:
            found["class_hint"] = header_text(header) or None
        if experiment_headers and key in experiment_headers:
            if tagged is None:
                tagged = found["headers"] = {}
            tagged[key] = header_text(header)
    return RequestFeatures.of(found)


# The Endpoint Picker protocol's inference objective (llm-d's name for it too): the request's class, by name.
OBJECTIVE_HEADERS = frozenset({"x-gateway-inference-objective", "x-llm-d-inference-objective"})

# The Endpoint Picker protocol's subset hint: Envoy's filter metadata in this namespace, under this key, lists the
# only endpoints (ip:port) the picker may choose (a list of strings, or one comma-separated string).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
MAX_SUBSET = 4096  # more than any pool; a longer list is cut here
SERVED_KEY = "x-gateway-destination-endpoint-served"


def subset_hint(metadata: Any) -> frozenset[str] | None:
    """The addresses of the gateway's subset hint in an ext_proc request's ``metadata_context`` (an Envoy
    ``Metadata``), or None when there is none. A value of another type counts as an empty list (nothing is
    eligible: the request gets a 503, as the protocol says), never as no hint."""
    namespaces = metadata.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values[:MAX_SUBSET] if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",", MAX_SUBSET)[:MAX_SUBSET]
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(metadata: Any) -> str | None:
    """The endpoint the data plane reports served the request (the Endpoint Picker protocol's
    ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` in a response message's ``metadata_context``), or
    None when the message carries none. Only metadata counts: a response header could come from the server."""
    namespaces = metadata.filter_metadata
    if METADATA_NAMESPACE not in namespaces:
        return None
    fields = namespaces[METADATA_NAMESPACE].fields
    if SERVED_KEY not in fields or fields[SERVED_KEY].WhichOneof("kind") != "string_value":
        return None
    return fields[SERVED_KEY].string_value.strip() or None


def header_text(header: Any) -> str:
    # Envoy fills raw_value (bytes); older versions, or send_raw_value off, fill value instead.
    raw = header.raw_value
    return raw.decode("utf-8", "replace") if raw else header.value


MAX_CLIENT_KEY_CHARS = 128
"""A value a client chose (a request id, a tenant name) longer than this is kept as a digest of it (`client_key`)."""


def client_key(value: str) -> str:
    """The key the picker keeps for ``value``, which a client may have chosen (a request id: its lease, its span's
    decision, its experiment outcome; a tenant name: its quota buckets): the value itself, or for one over
    `MAX_CLIENT_KEY_CHARS` a 32-hex-digit digest of it. Envoy's bootstrap makes a fresh UUID for every request's
    id; behind another gateway that passes a client's id on, or with a tenant header no one checked, a 60 KB value
    would otherwise be held for minutes. Every place that reads an id from Envoy goes through this, so that all
    agree. A configured tenant name is at most as long, so a digest never stands for one."""
    if len(value) <= MAX_CLIENT_KEY_CHARS:
        return value
    return "blake2b:" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def apply_body(
    features: RequestFeatures, body: bytes, *, complete: bool, max_bytes: int, keyer: CacheKeyer | None = None
) -> RequestFeatures:
    """``features`` with what the JSON body says added (and, with a ``keyer`` that has the model's tokenizer, the
    prompt's cache keys).

    ``complete`` is False when Envoy sent a partial buffer because the body outgrew its buffer limit.
    Raises ``PayloadTooLargeError`` or ``MalformedRequestError``. For a body of 64 KiB or more it pauses the
    process's garbage collector while it runs, and then restores it as it was.
    """
    if not complete or len(body) > max_bytes:
        size = f"{len(body)} bytes" if complete else f"more than {len(body)} bytes"
        raise PayloadTooLargeError(f"request body is {size}; the limit is {max_bytes} bytes")
    if not body:
        raise MalformedRequestError("request body is empty; expected a JSON object")
    body = _without_bom(body)
    if len(body) < _GC_PAUSE_MIN_BYTES:
        return features.with_body(*_read(body, keyer, _route_path(features.path)))
    # The document must be gone before the collector runs again: an error's traceback holds the frames that hold
    # the document, so it is dropped here.
    refused = None
    with _collector_paused():
        try:
            found = _read(body, keyer, _route_path(features.path))
        except RequestError as exc:
            refused = exc.with_traceback(None)
    if refused is not None:
        raise refused
    return features.with_body(*found)


def _route_path(path: str) -> str:
    """The path Envoy's routes match, ``:path`` without its query string (``/v1/responses?api-version=1``)."""
    return path.partition("?")[0]


def _without_bom(body: bytes) -> bytes:
    """RFC 8259 lets a parser ignore a byte order mark; orjson refuses it."""
    return body[len(_BOM) :] if body.startswith(_BOM) else body


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector off while a big body is parsed, then as it was. orjson runs no Python code and the
    readers make no reference cycles, so nothing collectable appears meanwhile; the collector, triggered by the
    allocations, would only scan the growing document again and again (most of the cost of a body of many small
    lists)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def with_model(body: bytes, model: str) -> bytes:
    """``body`` (a JSON object `apply_body` accepted) naming ``model`` instead: what a release arm that sends its
    requests as another model forwards. The document is parsed whole (not scanned, as a long prompt of token ids is
    on the routing path), so this costs a full parse, paid only by the requests such an arm gets."""
    body = _without_bom(body)
    with _collector_paused() if len(body) >= _GC_PAUSE_MIN_BYTES else contextlib.nullcontext():
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise MalformedRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise MalformedRequestError(f"request body must be a JSON object, not {_json_type(document)}")
    document["model"] = model
    return orjson.dumps(document)


def _read(
    body: bytes, keyer: CacheKeyer | None = None, path: str = ""
) -> tuple[str, bool, int | None, int, int, tuple[int, ...], tuple[int, ...], Any, int]:
    """``apply_body`` on a body within its size limit, sent to ``path``: the features the body gives, in the order
    of `RequestFeatures.with_body` (model, stream, max_tokens, prompt_chars, prompt_tokens, prefix_hashes,
    cache_keys, keying, output_copies)."""
    field = "input" if path == EMBEDDINGS_PATH else "prompt"  # where a prompt of token ids may be
    doc, tokens = parse_body(body, field)
    if not isinstance(doc, dict):
        raise MalformedRequestError(f"request body must be a JSON object, not {_json_type(doc)}")

    model = doc.get("model")
    if model is None:
        raise MalformedRequestError("missing required field 'model'")
    if not isinstance(model, str) or not model:
        raise MalformedRequestError(f"field 'model' must be a non-empty string, not {_json_type(model)}")

    stream = doc.get("stream")
    if stream is None:  # absent, or null (OpenAI's and vLLM's schemas allow it): not streamed
        stream = False
    elif not isinstance(stream, bool):
        raise MalformedRequestError(f"field 'stream' must be a boolean, not {_json_type(stream)}")

    # Both may be given: servers read max_completion_tokens first on chats (vLLM, SGLang, the emulator), max_tokens
    # on completions. The larger is what the request may cost: quotas charge it, so that naming one small and
    # the other large does not buy tokens the quota never saw.
    max_tokens = None
    for name in _MAX_TOKENS_FIELDS:
        value = doc.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MalformedRequestError(f"field {name!r} must be a non-negative integer, not {shown(value)}")
        max_tokens = value if max_tokens is None else max(max_tokens, value)

    if max_tokens is None and path in _NO_OUTPUT_PATHS:
        max_tokens = 0
    # n completions (best_of generated, n returned, where best_of is larger): the output that many times over, which
    # quotas charge and the memory estimate counts.
    copies = 1
    for name in ("n", "best_of"):
        value = doc.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MalformedRequestError(f"field {name!r} must be a positive integer, not {shown(value)}")
        copies = max(copies, value)

    chars, prompt_tokens = 0, 0
    hashes: tuple[int, ...] = ()
    if path == RESPONSES_PATH:  # its input and instructions only ("prompt" names a stored prompt template there)
        if "input" in doc:
            chars, prompt_tokens, hashes = _responses_size(doc, seed=hash(model))
    elif path in _SCORING_FIELDS:
        chars = sum(_string_chars(doc.get(name)) for name in _SCORING_FIELDS[path])
        prompt_tokens = estimate_tokens(chars)
    elif "messages" in doc:
        chars, rendered = _messages_text(doc["messages"])
        chars += _tools_chars(doc.get("tools"), doc["messages"])
        prompt_tokens = estimate_tokens(chars)
        hashes = text_block_hashes(rendered, seed=hash(model))
    elif tokens is not None:  # doc[field] is the placeholder of the ids parse_body counted
        prompt_tokens = tokens.count
        hashes = () if tokens.head is None else token_block_hashes(tokens.head, seed=hash(model))
    elif "prompt" in doc:
        prompt = doc["prompt"]
        chars, token_ids = _prompt_size(prompt)
        prompt_tokens = token_ids if token_ids is not None else estimate_tokens(chars)
        hashes = _prompt_hashes(prompt, seed=hash(model))
    elif "input" in doc:
        chars, token_ids = _prompt_size(doc["input"], "input")
        prompt_tokens = token_ids if token_ids is not None else estimate_tokens(chars)
        hashes = _prompt_hashes(doc["input"], seed=hash(model))
    keys: tuple[int, ...] = ()
    keying = None
    if keyer is not None:
        keys, keying = keyer.plan(model, doc, None if tokens is None else tokens.head)
    return model, stream, max_tokens, chars, prompt_tokens, hashes, keys, keying, copies


def _responses_size(doc: dict[str, Any], *, seed: int) -> tuple[int, int, tuple[int, ...]]:
    """(characters, prompt tokens, prefix block hashes) of a Responses API request: its ``input`` (a string, or a
    list of items: messages, tool calls and their outputs) after its ``instructions``, read as the chat it becomes
    (a tool call's arguments and output count as text too)."""
    value = doc["input"]
    if isinstance(value, str):
        items: list[Any] = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        items = value
    elif value is None:
        items = []
    else:
        raise MalformedRequestError(f"field 'input' must be a string or a list of items, not {_json_type(value)}")
    chars, rendered = _messages_text(items, "input")
    chars += sum(
        len(text) for item in items if type(item) is dict for name in _ITEM_TEXT_FIELDS
        if type(text := item.get(name)) is str
    )  # fmt: skip
    instructions = doc.get("instructions")
    if isinstance(instructions, str):  # rendered as the system message it is to the server
        chars += len(instructions)
        rendered = f"system\n{instructions}\n{rendered}"
    return chars, estimate_tokens(chars), text_block_hashes(rendered, seed=seed)


def _tools_chars(tools: Any, messages: list[Any]) -> int:
    """The characters a chat's tools add to its prompt: the tools' definitions (the chat template writes them into
    the prompt) and the arguments of the assistant's tool calls. Only where present: most chats have none, and the
    messages are looked at in C until one has tool calls."""
    chars = len(orjson.dumps(tools)) if isinstance(tools, list) and tools else 0
    for calls in filter(None, map(dict.get, messages, repeat("tool_calls"))):  # messages are objects: checked
        if not isinstance(calls, list):
            continue
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                chars += len(arguments)
            elif isinstance(arguments, dict):
                chars += len(orjson.dumps(arguments))
    return chars


def _string_chars(value: Any) -> int:
    """The characters of a string, or of the strings of a list (anything else: none, and the server judges it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(map(len, [v for v in value if type(v) is str]))
    return 0


def _prompt_size(prompt: Any, field: str = "prompt") -> tuple[int, int | None]:
    """(characters, exact token count or None) of an OpenAI completions ``prompt`` (or of another ``field`` of the
    same shapes, as the embeddings' ``input``).

    It may be a string, a list of strings, a list of token ids, or a list of lists of token ids.
    """
    if isinstance(prompt, str):
        return len(prompt), None
    if isinstance(prompt, list):
        # Element types are gathered by map and set, in C: a prompt may hold a million elements. ``type(p) is int``
        # leaves booleans out, as orjson makes nothing else that is an int.
        kinds = set(map(type, prompt))
        if kinds <= {str}:
            return sum(map(len, prompt)), None
        if kinds == {int}:
            return 0, len(prompt)
        if kinds == {list} and set(map(type, chain.from_iterable(prompt))) <= {int}:
            return 0, sum(map(len, prompt))
    raise MalformedRequestError(
        f"field {field!r} must be a string, a list of strings, or a list of token ids (or of lists of them)"
    )


def _prompt_hashes(prompt: Any, *, seed: int) -> tuple[int, ...]:
    """Prefix block hashes of a completions ``prompt`` already validated by ``_prompt_size``."""
    if isinstance(prompt, str):
        return text_block_hashes(prompt, seed=seed)
    if not prompt:
        return ()
    if type(prompt[0]) is int:  # validated: then all are token ids
        return token_block_hashes(prompt, seed=seed)
    if len(prompt) == 1:
        only = prompt[0]
        return text_block_hashes(only, seed=seed) if isinstance(only, str) else token_block_hashes(only, seed=seed)
    # A batch of prompts: no one prefix to follow.
    return ()


def _messages_text(messages: Any, field: str = "messages") -> tuple[int, str]:
    """(characters of content text, the conversation rendered for prefix hashing) of chat ``messages`` (or of
    another ``field`` of their shape, as a Responses API request's input items)."""
    if not isinstance(messages, list):
        raise MalformedRequestError(f"field {field!r} must be a list, not {_json_type(messages)}")
    # The common shape, every message an object with a string (or no) content, is read by map, set and join, in C;
    # a conversation may be 100k messages. Anything else (parts, errors) takes the loop below, message by message.
    try:
        contents = list(map(dict.get, messages, repeat("content"), repeat("")))
    except TypeError:  # a message that is not an object: the loop tells which
        contents = None
    if contents is not None:
        kinds = set(map(type, contents))
        if kinds <= {str, _NONE}:
            chars = sum(map(len, filter(None, contents) if _NONE in kinds else contents))
            return chars, _rendered_head(messages, contents, _NONE in kinds)
    return _messages_loop(messages, field)


def _messages_loop(messages: list[Any], field: str = "messages") -> tuple[int, str]:
    """``_messages_text`` message by message, for any shape: what it renders defines the rendering."""
    chars = 0
    pieces: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedRequestError(f"{field}[{i}] must be an object, not {_json_type(message)}")
        role = message.get("role")
        # Role and a separator before the text, so that moving text from one message to the next changes it.
        pieces.append(role if isinstance(role, str) else "")
        pieces.append("\n")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
            pieces.append(content)
        elif isinstance(content, list):
            # Multi-part content: count the text parts; images and audio are not text tokens we can estimate.
            if len(content) > 8:
                texts = _many_part_texts(content)
                chars += sum(map(len, texts))
                pieces += texts
            else:
                for part in content:
                    if type(part) is dict and type(text := part.get("text")) is str:
                        chars += len(text)
                        pieces.append(text)
        elif content is not None:
            raise MalformedRequestError(
                f"{field}[{i}].content must be a string or a list of parts, not {_json_type(content)}"
            )
        pieces.append("\n")
    return chars, "".join(pieces)


def _rendered_head(messages: list[dict[str, Any]], contents: list[Any], nulls: bool) -> str:
    """What ``_messages_loop`` renders ("role\\ncontent\\n" per message) of messages whose ``contents`` are strings
    (or None, if ``nulls``), as far as it is hashed: rendering stops once it covers MAX_PREFIX_BLOCKS blocks."""
    head = MAX_PREFIX_BLOCKS * PREFIX_BLOCK_CHARS
    pieces: list[str] = []
    size, start, step = 0, 0, 64
    while start < len(messages) and size < head:
        texts = contents[start : start + step]
        if nulls:
            texts = ["" if text is None else text for text in texts]
        roles = list(map(dict.get, messages[start : start + step], repeat("role"), repeat("")))
        if set(map(type, roles)) - {str}:
            roles = [role if type(role) is str else "" for role in roles]
        lines = [""] * (2 * len(roles))
        lines[0::2], lines[1::2] = roles, texts  # each role before its text, by slice assignment in C
        pieces.append("\n".join(lines) + "\n")
        size += len(pieces[-1])
        start += step
        step *= 2  # few rounds for a long conversation, little rendered past the head for a short one
    return "".join(pieces)


def _many_part_texts(parts: list[Any]) -> list[str]:
    """The texts of the text parts (objects with a string ``text``) of a long multi-part content, gathered in C
    when every part is an object."""
    texts: list[Any]
    try:
        texts = list(map(dict.get, parts, repeat("text")))
    except TypeError:  # a part that is not an object
        texts = [part.get("text") for part in parts if type(part) is dict]
    return texts if set(map(type, texts)) <= {str} else [text for text in texts if type(text) is str]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
