"""The OpenAI request and response shapes the emulator speaks, as vLLM's OpenAI-compatible server does.

`parse_completion` and `parse_chat` turn a decoded JSON body into a `Prompt` (what the engine needs) or raise
`BadRequest` with vLLM-style wording; the chunk and body builders produce the JSON vLLM returns. `parse_tokenize`,
`tokenize_body` and `render_body` do the same for ``/tokenize`` and ``/v1/completions/render``. Output text is
deterministic: token i is the i-th four-character piece of a fixed sentence, so that a conversation that sends an
answer back as the next prompt sends the same text every time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

from inferlb.sim.tokens import block_hashes, chat_text, count_tokens, token_ids, token_pieces

__all__ = [
    "BadRequest",
    "Prompt",
    "Tokenize",
    "chunk_event",
    "completion_body",
    "output_text",
    "parse_chat",
    "parse_completion",
    "parse_tokenize",
    "render_body",
    "tokenize_body",
]

_SENTENCE = "The emulated model answers with this sentence, four characters per token, again and again. "
_PIECES = tuple(_SENTENCE[i : i + 4] for i in range(0, len(_SENTENCE), 4))
_GENERATION_PROMPT = chat_text([])  # what chat_text appends after the messages


class BadRequest(ValueError):
    """A request vLLM would refuse with ``status`` (400 or 404); the message is the client-facing text."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True)
class Prompt:
    """A parsed generation request: model name, prompt size and block hashes, output length and stream flags.

    ``default_length`` is True when the client gave no max_tokens (the emulated model then "stops" by itself).
    """

    model: str
    prompt_tokens: int
    hashes: list[int]
    max_tokens: int
    default_length: bool
    stream: bool
    include_usage: bool
    chat: bool
    temperature: float | None
    top_p: float | None
    source: str | list[int] = ""  # the prompt as text (chat: rendered) or token ids: its tokens when needed


def _model(body: Mapping[str, object], models: Sequence[str]) -> str:
    model = body.get("model", models[0])
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string; got {type(model).__name__}", param="model")
    if model not in models:
        raise BadRequest(f"The model `{model}` does not exist.", status=404, param="model")
    return model


def _int_field(body: Mapping[str, object], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer; got {value!r}", param=key)
    if value < 1:
        raise BadRequest(f"'{key}' must be at least 1, got {value}.", param=key)
    return value


def _float_field(body: Mapping[str, object], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number; got {value!r}", param=key)
    return float(value)


def _finish(
    body: Mapping[str, object],
    *,
    model: str,
    prompt_tokens: int,
    hashes: list[int],
    chat: bool,
    max_model_len: int,
    default_max_tokens: int,
    source: str | list[int],
) -> Prompt:
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    asked = next((v for v in (_int_field(body, k) for k in keys) if v is not None), None)
    if prompt_tokens >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages" if chat else "prompt",
        )
    if asked is not None and prompt_tokens + asked > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the messages, {asked} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean; got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    if include_usage and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    length = asked if asked is not None else min(default_max_tokens, max_model_len - prompt_tokens)
    return Prompt(
        model=model,
        prompt_tokens=prompt_tokens,
        hashes=hashes,
        max_tokens=length,
        default_length=asked is None,
        stream=stream,
        include_usage=include_usage,
        chat=chat,
        temperature=_float_field(body, "temperature"),
        top_p=_float_field(body, "top_p"),
        source=source,
    )


def _completion_prompt(body: Mapping[str, object]) -> object:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def parse_completion(
    body: object, *, models: Sequence[str], block_size: int, max_model_len: int, default_max_tokens: int
) -> Prompt:
    """A ``/v1/completions`` body: ``prompt`` as text, a list of token ids, or a one-element list of either."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body, models)
    prompt = _completion_prompt(body)
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        tokens = count_tokens(prompt)
        hashes = block_hashes(prompt, block_size)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise BadRequest("token ids in 'prompt' must be >= 0", param="prompt")
        tokens = len(prompt)
        hashes = block_hashes(prompt, block_size)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(
            "the emulator serves one prompt per request; send a batch as separate requests", param="prompt"
        )
    else:
        raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")
    return _finish(
        body,
        model=model,
        prompt_tokens=tokens,
        hashes=hashes,
        chat=False,
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        source=prompt,
    )


def parse_chat(
    body: object, *, models: Sequence[str], block_size: int, max_model_len: int, default_max_tokens: int
) -> Prompt:
    """A ``/v1/chat/completions`` body; the messages are rendered by `chat_text` and counted as text."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    model = _model(body, models)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    text = chat_text(messages)
    return _finish(
        body,
        model=model,
        prompt_tokens=count_tokens(text),
        hashes=block_hashes(text, block_size),
        chat=True,
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        source=text,
    )


@dataclass(frozen=True, slots=True)
class Tokenize:
    """A parsed ``/tokenize`` body: the text to tokenize and whether to return the token strings."""

    text: str
    return_token_strs: bool


def _bool_field(body: Mapping[str, object], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean; got {value!r}", param=key)
    return value


def parse_tokenize(body: object, *, models: Sequence[str]) -> Tokenize:
    """A ``/tokenize`` body, as vLLM's ``TokenizeRequest``: ``{model?, prompt}`` (text), or ``{model?, messages}``
    rendered by `chat_text` (without the generation prompt when ``add_generation_prompt`` is false).

    ``add_special_tokens`` is accepted and changes nothing: the emulated tokenizer has no special tokens, so the
    count equals ``usage.prompt_tokens`` of the same prompt on ``/v1/completions`` or ``/v1/chat/completions``."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    if body.get("model") is not None:  # vLLM's TokenizeRequest takes model: null as "the served model"
        _model(body, models)
    with_strs = _bool_field(body, "return_token_strs", False)
    _bool_field(body, "add_special_tokens", True)
    if "messages" in body and "prompt" not in body:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise BadRequest("'messages' must be a list of message objects", param="messages")
        generation_prompt = _bool_field(body, "add_generation_prompt", True)
        if generation_prompt and _bool_field(body, "continue_final_message", False):
            raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        text = chat_text(messages)
        return Tokenize(text if generation_prompt else text[: -len(_GENERATION_PROMPT)], with_strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string (or send 'messages' to tokenize a chat)", param="prompt")
    return Tokenize(prompt, with_strs)


def tokenize_body(request: Tokenize, max_model_len: int) -> dict[str, object]:
    """vLLM's ``TokenizeResponse``: ``{count, max_model_len, tokens, token_strs}`` (``token_strs`` null unless
    asked for)."""
    ids = token_ids(request.text)
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": token_pieces(request.text) if request.return_token_strs else None,
    }


def render_body(body: Mapping[str, object], prompt: Prompt) -> list[dict[str, object]]:
    """What vLLM's ``POST /v1/completions/render`` answers for a completion request that `parse_completion`
    accepted (one prompt): a one-element list of ``GenerateRequest``, the token ids the engine would run and
    the sampling parameters. ``sampling_params`` holds the fields vLLM sends for a plain request (it leaves out
    those at their defaults); ``max_tokens`` is the output length this emulator will give."""
    raw = _completion_prompt(body)
    ids = token_ids(raw) if isinstance(raw, str) else list(raw) if isinstance(raw, list) else []
    options = body.get("stream_options")
    stream_options = None
    if prompt.stream and isinstance(options, Mapping):
        continuous = options.get("continuous_usage_stats") is True
        stream_options = {"include_usage": prompt.include_usage, "continuous_usage_stats": continuous}
    salt, priority = body.get("cache_salt"), body.get("priority")
    sampling_params = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0 if prompt.temperature is None else prompt.temperature,
        "top_p": 1.0 if prompt.top_p is None else prompt.top_p,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": prompt.max_tokens,
        "output_kind": 1 if prompt.stream else 2,  # vLLM's RequestOutputKind: DELTA when streamed, FINAL_ONLY
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    return [
        {
            "request_id": f"cmpl-{uuid.uuid4().hex}",
            "token_ids": ids,
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": sampling_params,
            "model": body.get("model"),
            "reasoning_ended": None,
            "reasoning_parser_kwargs": None,
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": prompt.stream,
            "stream_options": stream_options,
            "cache_salt": salt if isinstance(salt, str) else None,
            "priority": priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }
    ]


def output_text(start: int, stop: int) -> str:
    """The text of output tokens ``start .. stop-1``."""
    n = len(_PIECES)
    return "".join(_PIECES[i % n] for i in range(start, stop))


def _usage(prompt: Prompt, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt.prompt_tokens + completion_tokens,
    }


def finish_reason(prompt: Prompt) -> str:
    return "stop" if prompt.default_length else "length"


def completion_body(request_id: str, prompt: Prompt, completion_tokens: int) -> bytes:
    """The non-streaming response of a finished request."""
    text = output_text(0, completion_tokens)
    choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish_reason(prompt)}
    if prompt.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return orjson.dumps(
        {
            "id": request_id,
            "object": "chat.completion" if prompt.chat else "text_completion",
            "created": int(time.time()),
            "model": prompt.model,
            "choices": [choice],
            "usage": _usage(prompt, completion_tokens),
        }
    )


def chunk_event(
    request_id: str, prompt: Prompt, created: int, start: int, stop: int, *, final: bool, with_usage: bool = False
) -> bytes:
    """SSE events for output tokens ``start .. stop-1`` (one event per token, as vLLM streams), the last one
    carrying the finish reason when ``final``, then the usage chunk if asked for, then ``[DONE]``."""
    events = []
    obj = "chat.completion.chunk" if prompt.chat else "text_completion"
    for i in range(start, stop):
        piece = output_text(i, i + 1)
        done = final and i == stop - 1
        choice: dict[str, object] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish_reason(prompt) if done else None,
        }
        if prompt.chat:
            choice["delta"] = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
        else:
            choice["text"] = piece
        chunk = {"id": request_id, "object": obj, "created": created, "model": prompt.model, "choices": [choice]}
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if final:
        if with_usage:
            chunk = {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": prompt.model,
                "choices": [],
                "usage": _usage(prompt, stop),
            }
            events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)
