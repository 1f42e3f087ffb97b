"""Turning what Envoy sends (headers, buffered body) into ``RequestFeatures``.

A body is parsed once, here. Only the fields routing needs are read (``model``, ``stream``, ``max_tokens``,
the prompt or messages); the inference server validates the rest. A field the picker reads must have the
right type, or the client gets a 400 that names it.

The prompt's prefix block hashes (``RequestFeatures.prefix_hashes``) are computed from the text the server will
see first: a completions ``prompt`` (a string, token ids, or a one-element list of either; a batch of several
prompts gets none), or chat ``messages`` rendered in order as role and text parts (images and other parts are
skipped). The rendering is not the server's chat template; it only has to be the same for equal conversations
and differ for different ones. The chain is seeded with the model name, as servers cache prefixes per model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from inferlb.filter.errors import MalformedRequestError, PayloadTooLargeError
from inferlb.scorer.features import RequestFeatures, estimate_tokens, text_block_hashes, token_block_hashes

_BOM = b"\xef\xbb\xbf"


def features_from_headers(
    headers: Iterable[Any], session_header: str | None = None, class_header: str | None = None
) -> RequestFeatures:
    """Features from Envoy's ``HeaderValue`` list (``key`` and ``raw_value``); no body has been read.

    ``session_header`` names (in lower case, as Envoy sends header names) the header whose value becomes
    ``session_key``; an empty value counts as absent, and a repeated header's last value wins. ``class_header``
    likewise fills ``class_hint``, which request-class rules may match.
    """
    features = RequestFeatures()
    for header in headers:
        key = header.key
        if key == ":path":
            features.path = header_text(header)
        elif key == ":method":
            features.method = header_text(header)
        elif key == "x-request-id":
            features.request_id = header_text(header)
        elif key == "traceparent":
            features.traceparent = header_text(header)
        if key == session_header:
            features.session_key = header_text(header) or None
        if key == class_header:
            features.class_hint = header_text(header) or None
    return features


def header_text(header: Any) -> str:
    # Envoy fills raw_value (bytes); older versions, or send_raw_value off, fill value instead.
    raw = header.raw_value
    return raw.decode("utf-8", "replace") if raw else header.value


def apply_body(features: RequestFeatures, body: bytes, *, complete: bool, max_bytes: int) -> None:
    """Read the JSON body into ``features``.

    ``complete`` is False when Envoy sent a partial buffer because the body outgrew its buffer limit.
    Raises ``PayloadTooLargeError`` or ``MalformedRequestError``.
    """
    if not complete or len(body) > max_bytes:
        size = f"{len(body)} bytes" if complete else f"more than {len(body)} bytes"
        raise PayloadTooLargeError(f"request body is {size}; the limit is {max_bytes} bytes")
    if not body:
        raise MalformedRequestError("request body is empty; expected a JSON object")
    if body.startswith(_BOM):
        body = body[len(_BOM) :]  # RFC 8259 lets a parser ignore a byte order mark; orjson refuses it
    try:
        # orjson: several times faster than the json module on prompts, strict UTF-8, nesting capped at 1024.
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MalformedRequestError(f"request body must be a JSON object, not {_json_type(doc)}")

    model = doc.get("model")
    if model is None:
        raise MalformedRequestError("missing required field 'model'")
    if not isinstance(model, str) or not model:
        raise MalformedRequestError(f"field 'model' must be a non-empty string, not {_json_type(model)}")
    features.model = model

    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise MalformedRequestError(f"field 'stream' must be a boolean, not {_json_type(stream)}")
    features.stream = stream

    for name in ("max_tokens", "max_completion_tokens"):
        value = doc.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MalformedRequestError(f"field {name!r} must be a non-negative integer, not {value!r}")
        features.max_tokens = value
        break

    if "messages" in doc:
        chars, rendered = _messages_text(doc["messages"])
        features.prompt_chars = chars
        features.prompt_tokens = estimate_tokens(chars)
        features.prefix_hashes = text_block_hashes(rendered, seed=hash(model))
    elif "prompt" in doc:
        prompt = doc["prompt"]
        chars, token_ids = _prompt_size(prompt)
        features.prompt_chars = chars
        features.prompt_tokens = token_ids if token_ids is not None else estimate_tokens(chars)
        features.prefix_hashes = _prompt_hashes(prompt, seed=hash(model))


def _prompt_size(prompt: Any) -> tuple[int, int | None]:
    """(characters, exact token count or None) of an OpenAI completions ``prompt``.

    It may be a string, a list of strings, a list of token ids, or a list of lists of token ids.
    """
    if isinstance(prompt, str):
        return len(prompt), None
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt), None
        if all(_is_token_id(p) for p in prompt):
            return 0, len(prompt)
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return 0, sum(len(p) for p in prompt)
    raise MalformedRequestError(
        "field 'prompt' must be a string, a list of strings, or a list of token ids (or of lists of them)"
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_hashes(prompt: Any, *, seed: int) -> tuple[int, ...]:
    """Prefix block hashes of a completions ``prompt`` already validated by ``_prompt_size``."""
    if isinstance(prompt, str):
        return text_block_hashes(prompt, seed=seed)
    if not prompt:
        return ()
    if _is_token_id(prompt[0]):  # validated: then all are token ids
        return token_block_hashes(prompt, seed=seed)
    if len(prompt) == 1:
        only = prompt[0]
        return text_block_hashes(only, seed=seed) if isinstance(only, str) else token_block_hashes(only, seed=seed)
    # A batch of prompts: no one prefix to follow.
    return ()


def _messages_text(messages: Any) -> tuple[int, str]:
    """(characters of content text, the conversation rendered for prefix hashing) of chat ``messages``."""
    if not isinstance(messages, list):
        raise MalformedRequestError(f"field 'messages' must be a list, not {_json_type(messages)}")
    chars = 0
    pieces: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedRequestError(f"messages[{i}] must be an object, not {_json_type(message)}")
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
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    text = part["text"]
                    chars += len(text)
                    pieces.append(text)
        elif content is not None:
            raise MalformedRequestError(
                f"messages[{i}].content must be a string or a list of parts, not {_json_type(content)}"
            )
        pieces.append("\n")
    return chars, "".join(pieces)


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
