"""Tests for filter/request.py: headers and the JSON body into RequestFeatures, and the 400/413 errors."""

from __future__ import annotations

import contextlib
import gc
import json
import re
from dataclasses import replace
from typing import Any
from unittest.mock import patch

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderValue
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.filter import request, tokenscan
from inferlb.filter.errors import MalformedRequestError, PayloadTooLargeError, RequestError
from inferlb.filter.request import apply_body, features_from_headers, with_model
from inferlb.scorer.features import RequestFeatures, text_block_hashes, token_block_hashes

MAX = 1 << 20


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([], RequestFeatures(), id="none"),
        pytest.param(
            [
                HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                HeaderValue(key=":method", raw_value=b"POST"),
                HeaderValue(key="x-request-id", raw_value=b"req-1"),
                HeaderValue(key="content-type", raw_value=b"application/json"),
            ],
            RequestFeatures(path="/v1/chat/completions", method="POST", request_id="req-1"),
            id="raw-value",
        ),
        pytest.param(
            [
                HeaderValue(key=":path", value="/v1/completions"),
                HeaderValue(key=":method", value="GET"),
                HeaderValue(key="x-request-id", value="legacy"),
            ],
            RequestFeatures(path="/v1/completions", method="GET", request_id="legacy"),
            id="legacy-value",
        ),
        pytest.param(
            [HeaderValue(key=":path", raw_value=b"/raw", value="/legacy")],
            RequestFeatures(path="/raw"),
            id="raw-value-wins",
        ),
        pytest.param(
            [HeaderValue(key="x-request-id", raw_value=b"id-\xff")],
            RequestFeatures(request_id="id-\ufffd"),
            id="non-utf8-replaced",
        ),
        pytest.param(
            [HeaderValue(key=":path", raw_value="/caf\u00e9".encode())],
            RequestFeatures(path="/caf\u00e9"),
            id="utf8",
        ),
        pytest.param(
            [HeaderValue(key=":path", raw_value=b"/first"), HeaderValue(key=":path", raw_value=b"/second")],
            RequestFeatures(path="/second"),
            id="repeated-last-wins",
        ),
        pytest.param(
            [HeaderValue(key=":PATH", raw_value=b"/upper"), HeaderValue(key="model", raw_value=b"m")],
            RequestFeatures(),
            id="other-keys-ignored",
        ),
        pytest.param(
            [HeaderValue(key="x-gateway-inference-objective", raw_value=b"critical")],
            RequestFeatures(objective="critical"),
            id="inference-objective",
        ),
        pytest.param(
            [HeaderValue(key="x-llm-d-inference-objective", raw_value=b"batch")],
            RequestFeatures(objective="batch"),
            id="llm-d-objective",
        ),
        pytest.param(
            [HeaderValue(key="x-gateway-inference-objective", raw_value=b"")],
            RequestFeatures(),
            id="empty-objective-is-none",
        ),
    ],
)
def test_features_from_headers(headers: list[HeaderValue], expected: RequestFeatures) -> None:
    features = features_from_headers(headers, objectives=True)
    assert features == expected
    assert features.model is None


def test_the_objective_header_names_nothing_unless_the_operator_turns_it_on() -> None:
    headers = [HeaderValue(key="x-gateway-inference-objective", raw_value=b"critical")]
    assert features_from_headers(headers).objective is None  # inference_objectives: false, the default
    assert features_from_headers(headers, objectives=True).objective == "critical"


def _apply(body: bytes, *, complete: bool = True, max_bytes: int = MAX) -> RequestFeatures:
    features = RequestFeatures(path="/v1/completions", method="POST", request_id="r")
    return apply_body(features, body, complete=complete, max_bytes=max_bytes)


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# (body document, expected fields of RequestFeatures besides path/method/request_id)
BODIES = [
    pytest.param({"model": "m"}, {"model": "m"}, id="model-only"),
    pytest.param(
        {"model": "m", "prompt": "abcdefghi"}, {"model": "m", "prompt_chars": 9, "prompt_tokens": 3}, id="prompt-string"
    ),
    pytest.param(
        {"model": "m", "prompt": "abcd"},
        {"model": "m", "prompt_chars": 4, "prompt_tokens": 1},
        id="prompt-exact-multiple",
    ),
    pytest.param({"model": "m", "prompt": ""}, {"model": "m"}, id="prompt-empty"),
    pytest.param(
        {"model": "m", "prompt": "h\u00e9llo"},
        {"model": "m", "prompt_chars": 5, "prompt_tokens": 2},
        id="prompt-counts-characters-not-bytes",
    ),
    pytest.param(
        {"model": "m", "prompt": ["abc", "defgh"]},
        {"model": "m", "prompt_chars": 8, "prompt_tokens": 2},
        id="prompt-list-of-strings",
    ),
    pytest.param({"model": "m", "prompt": []}, {"model": "m"}, id="prompt-empty-list"),
    pytest.param({"model": "m", "prompt": [1, 2, 3, 4, 5]}, {"model": "m", "prompt_tokens": 5}, id="prompt-token-ids"),
    pytest.param(
        {"model": "m", "prompt": [[1, 2], [3, 4, 5], []]},
        {"model": "m", "prompt_tokens": 5},
        id="prompt-lists-of-token-ids",
    ),
    pytest.param(
        {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
        {"model": "m", "prompt_chars": 5, "prompt_tokens": 2},
        id="chat-string",
    ),
    pytest.param(
        {"model": "m", "messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "defgh"}]},
        {"model": "m", "prompt_chars": 8, "prompt_tokens": 2},
        id="chat-several-messages",
    ),
    pytest.param(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "abcdef"},
                        {"type": "image_url", "image_url": {"url": "data:..."}},
                        {"type": "text", "text": "gh"},
                        "not-a-part",
                        {"type": "text", "text": 3},
                    ],
                }
            ],
        },
        {"model": "m", "prompt_chars": 8, "prompt_tokens": 2},
        id="chat-multi-part-counts-text-parts",
    ),
    pytest.param(
        {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "user"}]},
        {"model": "m"},
        id="chat-null-and-missing-content",
    ),
    pytest.param({"model": "m", "messages": []}, {"model": "m"}, id="chat-empty"),
    pytest.param(
        {"model": "m", "messages": [{"content": "abcde"}], "prompt": "x" * 400},
        {"model": "m", "prompt_chars": 5, "prompt_tokens": 2},
        id="messages-win-over-prompt",
    ),
    pytest.param({"model": "m", "stream": True}, {"model": "m", "stream": True}, id="stream-true"),
    pytest.param({"model": "m", "stream": False}, {"model": "m"}, id="stream-false"),
    pytest.param({"model": "m", "max_tokens": 128}, {"model": "m", "max_tokens": 128}, id="max-tokens"),
    pytest.param({"model": "m", "max_tokens": 0}, {"model": "m", "max_tokens": 0}, id="max-tokens-zero"),
    pytest.param(
        {"model": "m", "max_completion_tokens": 64}, {"model": "m", "max_tokens": 64}, id="max-completion-tokens"
    ),
    # Both given: the larger counts, whichever the server reads (quotas would otherwise charge 1 for 4,000).
    pytest.param(
        {"model": "m", "max_tokens": 1, "max_completion_tokens": 4000},
        {"model": "m", "max_tokens": 4000},
        id="both-the-larger-completion",
    ),
    pytest.param(
        {"model": "m", "max_tokens": 64, "max_completion_tokens": 8},
        {"model": "m", "max_tokens": 64},
        id="both-the-larger-max-tokens",
    ),
    pytest.param(
        {"model": "m", "max_tokens": None, "max_completion_tokens": 64},
        {"model": "m", "max_tokens": 64},
        id="null-max-tokens-falls-through",
    ),
    pytest.param({"model": "m", "max_tokens": None}, {"model": "m"}, id="null-max-tokens"),
    pytest.param(
        {"model": "m", "temperature": "whatever", "logprobs": [1]}, {"model": "m"}, id="other-fields-not-checked"
    ),
    pytest.param({"model": "m", "stream": None}, {"model": "m"}, id="stream-null"),  # OpenAI's and vLLM's schemas
    # n completions (best_of generated where larger): the output that many times, for quotas and memory.
    pytest.param(
        {"model": "m", "max_tokens": 16, "n": 4}, {"model": "m", "max_tokens": 16, "output_copies": 4}, id="n"
    ),
    pytest.param({"model": "m", "n": 2, "best_of": 8}, {"model": "m", "output_copies": 8}, id="best-of-larger-than-n"),
    pytest.param({"model": "m", "n": None}, {"model": "m"}, id="n-null"),
    pytest.param(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "stream": True,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "x" * 4001}],
        },
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "stream": True,
            "max_tokens": 32,
            "prompt_chars": 4001,
            "prompt_tokens": 1001,
        },
        id="full-chat-request",
    ),
]


@pytest.mark.parametrize(("doc", "fields"), BODIES)
def test_apply_body(doc: dict[str, Any], fields: dict[str, Any]) -> None:
    expected = RequestFeatures(path="/v1/completions", method="POST", request_id="r", **fields)
    features = replace(_apply(_json(doc)), prefix_hashes=())  # the hashes are pinned in test_prefix_hashes.py
    assert features == expected


def _apply_to(path: str, doc: Any) -> RequestFeatures:
    return apply_body(RequestFeatures(path=path, method="POST"), _json(doc), complete=True, max_bytes=MAX)


@pytest.mark.parametrize(
    ("doc", "chars", "tokens"),
    [
        pytest.param({"model": "e", "input": "x" * 400}, 400, 100, id="string"),
        pytest.param({"model": "e", "input": ["ab", "cde"]}, 5, 2, id="strings"),
        pytest.param({"model": "e", "input": [1, 2, 3]}, 0, 3, id="token-ids"),
        pytest.param({"model": "e", "input": [[1, 2], [3]]}, 0, 3, id="lists-of-token-ids"),
    ],
)
def test_an_embeddings_input_is_read_as_a_completions_prompt(doc: dict[str, Any], chars: int, tokens: int) -> None:
    features = _apply_to("/v1/embeddings", doc)
    prompt = _apply_to("/v1/completions", {"model": "e", "prompt": doc["input"]})
    assert (features.model, features.prompt_chars, features.prompt_tokens) == ("e", chars, tokens)
    assert features.prefix_hashes == prompt.prefix_hashes


def test_a_responses_request_is_read_as_the_chat_it_becomes() -> None:
    text = "tell me about the weather " * 40
    features = _apply_to(
        "/v1/responses",
        {"model": "r", "instructions": "be brief", "input": text, "stream": True, "max_output_tokens": 300},
    )
    chat = _apply_to(
        "/v1/chat/completions",
        {"model": "r", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]},
    )
    assert (features.model, features.stream, features.max_tokens) == ("r", True, 300)
    assert (features.prompt_chars, features.prefix_hashes) == (chat.prompt_chars, chat.prefix_hashes)
    assert features.prompt_chars == len(text) + len("be brief")
    # Input items: messages with parts, tool calls and their outputs (no role, no content) are all accepted, and a
    # call's arguments and output are text the server reads (3 + 2 + 40,000 characters).
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "abc"}, {"type": "input_image", "image_url": "u"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4" * 40_000},
    ]
    read = _apply_to("/v1/responses", {"model": "r", "input": items})
    assert (read.prompt_chars, read.prompt_tokens) == (40_005, 10_002)
    # "prompt" there names a stored prompt template (an object, or null): not a completions prompt.
    template = {"model": "r", "input": "hi", "prompt": {"id": "pmpt_1", "variables": {"x": "y"}}, "instructions": None}
    assert _apply_to("/v1/responses", template).prompt_chars == 2
    assert _apply_to("/v1/responses", {**template, "prompt": None}).prompt_chars == 2
    # Envoy's routes match the path without its query string, and so does the reading of the body.
    assert _apply_to("/v1/responses?api-version=2025-03-01-preview", template).prompt_chars == 2
    # The largest of the names a request may give its output budget is the one counted (and charged).
    both = {"model": "r", "input": "x", "max_tokens": 5, "max_output_tokens": 900}
    assert _apply_to("/v1/responses", both).max_tokens == 900


@pytest.mark.parametrize(
    ("path", "doc", "chars"),
    [
        pytest.param("/v1/rerank", {"query": "q" * 10, "documents": ["d" * 400_000, "e" * 5]}, 400_015, id="rerank"),
        pytest.param("/v1/score", {"text_1": "a" * 7, "text_2": ["b" * 400_000]}, 400_007, id="score"),
        pytest.param("/v1/rerank", {"query": {"content": []}, "documents": [1, "ab"]}, 2, id="other-shapes"),
        pytest.param("/v1/embeddings", {"input": "x" * 12}, 12, id="embeddings"),
    ],
)
def test_apis_that_generate_nothing_charge_their_texts_and_no_output(
    path: str, doc: dict[str, Any], chars: int
) -> None:
    """Quotas charge a request its prompt's tokens plus its output budget: on the scoring and embeddings APIs the
    texts are the prompt, and no output is generated (not the quotas' assumed output tokens)."""
    for sent in (path, f"{path}?x=1"):
        read = _apply_to(sent, {"model": "s", **doc})
        assert (read.prompt_chars, read.prompt_tokens, read.max_tokens) == (chars, (chars + 3) // 4, 0)


@pytest.mark.parametrize(
    ("path", "doc", "pattern"),
    [
        pytest.param("/v1/embeddings", {"input": "x"}, r"^missing required field 'model'$", id="no-model"),
        pytest.param(
            "/v1/embeddings",
            {"model": "e", "input": {"text": "x"}},
            r"^field 'input' must be a string, a list of strings, or a list of token ids",
            id="embeddings-object",
        ),
        pytest.param(
            "/v1/responses",
            {"model": "r", "input": 7},
            r"^field 'input' must be a string or a list of items, not a number$",
            id="responses-number",
        ),
        pytest.param(
            "/v1/responses",
            {"model": "r", "input": ["hi"]},
            r"^input\[0\] must be an object, not a string$",
            id="responses-item-string",
        ),
        pytest.param(
            "/v1/responses",
            {"model": "r", "instructions": "i", "input": [{"role": "user", "content": 3}]},
            r"^input\[0\]\.content must be a string or a list of parts, not a number$",
            id="responses-content-number",
        ),
        pytest.param(
            "/v1/responses",
            {"model": "r", "input": "x", "max_output_tokens": -1},
            r"^field 'max_output_tokens' must be a non-negative integer",
            id="responses-negative-budget",
        ),
    ],
)
def test_an_input_of_the_wrong_shape_is_refused_by_name(path: str, doc: dict[str, Any], pattern: str) -> None:
    with pytest.raises(MalformedRequestError, match=pattern):
        _apply_to(path, doc)


def test_a_chats_tools_and_tool_call_arguments_count_in_its_prompt() -> None:
    # The chat template writes both into the prompt: they counted for nothing, so 10,000 characters of them were
    # charged 1 token by quotas (and priced as nothing by the prediction and the memory estimate).
    text = "x" * 10_000
    tools = [{"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}]
    with_tools = _apply(_json({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}))
    assert with_tools.prompt_chars == 2 + len(orjson.dumps(tools))
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with_calls = _apply(_json({"model": "m", "messages": messages}))
    assert with_calls.prompt_chars == 2 + 10_000 and with_calls.prompt_tokens >= 2500


def test_apply_body_accepts_a_body_of_exactly_max_bytes() -> None:
    body = _json({"model": "m", "prompt": "x" * 1000})
    assert _apply(body, max_bytes=len(body)).prompt_chars == 1000


def test_apply_body_accepts_utf8_bom_and_whitespace() -> None:
    assert _apply(b'\xef\xbb\xbf  {"model": "m"}\n').model == "m"


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        pytest.param(b"", r"^request body is empty; expected a JSON object$", id="empty"),
        pytest.param(b"{not json", r"^request body is not valid JSON: ", id="not-json"),
        pytest.param(b'{"model": "m"', r"^request body is not valid JSON: ", id="truncated"),
        pytest.param(b"   ", r"^request body is not valid JSON: ", id="whitespace"),
        pytest.param(b'{"model": "caf\xe9"}', r"^request body is not valid JSON: .*not valid UTF-8", id="latin-1"),
        pytest.param(b"\xff\xfe\xfd", r"^request body is not valid JSON: .*not valid UTF-8", id="garbage-bytes"),
        pytest.param(b"[" * 100_000, r"^request body is not valid JSON: depth limit exceeded", id="deep-arrays"),
        pytest.param(b'{"a":' * 100_000, r"^request body is not valid JSON: depth limit exceeded", id="deep-objects"),
        pytest.param(b'{"model": "m", "max_tokens": Infinity}', r"^request body is not valid JSON: ", id="infinity"),
        pytest.param(b'[{"model": "m"}]', r"^request body must be a JSON object, not an array$", id="top-array"),
        pytest.param(b'"model"', r"^request body must be a JSON object, not a string$", id="top-string"),
        pytest.param(b"42", r"^request body must be a JSON object, not a number$", id="top-number"),
        pytest.param(b"4.2", r"^request body must be a JSON object, not a number$", id="top-float"),
        pytest.param(b"true", r"^request body must be a JSON object, not a boolean$", id="top-bool"),
        pytest.param(b"null", r"^request body must be a JSON object, not null$", id="top-null"),
        pytest.param(_json({"prompt": "hi"}), r"^missing required field 'model'$", id="model-missing"),
        pytest.param(_json({"model": None}), r"^missing required field 'model'$", id="model-null"),
        pytest.param(
            _json({"model": 7}), r"^field 'model' must be a non-empty string, not a number$", id="model-number"
        ),
        pytest.param(
            _json({"model": ""}), r"^field 'model' must be a non-empty string, not a string$", id="model-empty"
        ),
        pytest.param(
            _json({"model": ["m"]}), r"^field 'model' must be a non-empty string, not an array$", id="model-array"
        ),
        pytest.param(
            _json({"model": {"id": "m"}}),
            r"^field 'model' must be a non-empty string, not an object$",
            id="model-object",
        ),
        pytest.param(
            _json({"model": True}), r"^field 'model' must be a non-empty string, not a boolean$", id="model-bool"
        ),
        pytest.param(
            _json({"model": "m", "stream": "true"}),
            r"^field 'stream' must be a boolean, not a string$",
            id="stream-string",
        ),
        pytest.param(
            _json({"model": "m", "stream": 1}), r"^field 'stream' must be a boolean, not a number$", id="stream-int"
        ),
        pytest.param(
            _json({"model": "m", "max_tokens": -1}),
            r"^field 'max_tokens' must be a non-negative integer, not -1$",
            id="max-tokens-negative",
        ),
        pytest.param(
            _json({"model": "m", "max_tokens": True}),
            r"^field 'max_tokens' must be a non-negative integer, not True$",
            id="max-tokens-bool",
        ),
        pytest.param(
            _json({"model": "m", "max_tokens": 16.0}),
            r"^field 'max_tokens' must be a non-negative integer, not 16\.0$",
            id="max-tokens-float",
        ),
        pytest.param(
            _json({"model": "m", "max_tokens": "16"}),
            r"^field 'max_tokens' must be a non-negative integer, not '16'$",
            id="max-tokens-string",
        ),
        pytest.param(
            _json({"model": "m", "max_tokens": "9" * 100_000}),
            r"^field 'max_tokens' must be a non-negative integer, not '9{200}'… \(100000 characters\)$",
            id="max-tokens-huge-string-is-not-echoed-whole",
        ),
        pytest.param(
            _json({"model": "m", "max_completion_tokens": [1] * 100_000}),
            r"^field 'max_completion_tokens' must be a non-negative integer, not \[1, 1, .{0,200}$",
            id="max-tokens-huge-list-is-not-echoed-whole",
        ),
        pytest.param(
            b'{"model": "m", "max_tokens": 1e400}',
            r"^request body is not valid JSON: number is infinity",
            id="max-tokens-infinity",
        ),
        pytest.param(
            _json({"model": "m", "max_completion_tokens": -5}),
            r"^field 'max_completion_tokens' must be a non-negative integer, not -5$",
            id="max-completion-tokens-negative",
        ),
        pytest.param(
            _json({"model": "m", "max_completion_tokens": False}),
            r"^field 'max_completion_tokens' must be a non-negative integer",
            id="max-completion-tokens-bool",
        ),
        pytest.param(
            _json({"model": "m", "prompt": 42}),
            r"^field 'prompt' must be a string, a list of strings, or a list of token ids",
            id="prompt-number",
        ),
        pytest.param(_json({"model": "m", "prompt": None}), r"^field 'prompt' must be", id="prompt-null"),
        pytest.param(_json({"model": "m", "prompt": {"text": "hi"}}), r"^field 'prompt' must be", id="prompt-object"),
        pytest.param(_json({"model": "m", "prompt": ["a", 1]}), r"^field 'prompt' must be", id="prompt-mixed-list"),
        pytest.param(_json({"model": "m", "prompt": [1, 2.5]}), r"^field 'prompt' must be", id="prompt-float-token"),
        pytest.param(
            _json({"model": "m", "prompt": [True, False]}), r"^field 'prompt' must be", id="prompt-bool-tokens"
        ),
        pytest.param(
            _json({"model": "m", "prompt": [[1, 2], "a"]}), r"^field 'prompt' must be", id="prompt-mixed-nested"
        ),
        pytest.param(
            _json({"model": "m", "prompt": [[1, "a"]]}), r"^field 'prompt' must be", id="prompt-nested-string-token"
        ),
        pytest.param(_json({"model": "m", "prompt": [[[1]]]}), r"^field 'prompt' must be", id="prompt-too-deep"),
        pytest.param(
            _json({"model": "m", "messages": "hi"}),
            r"^field 'messages' must be a list, not a string$",
            id="messages-string",
        ),
        pytest.param(
            _json({"model": "m", "messages": {"role": "user"}}),
            r"^field 'messages' must be a list, not an object$",
            id="messages-object",
        ),
        pytest.param(
            _json({"model": "m", "messages": None}), r"^field 'messages' must be a list, not null$", id="messages-null"
        ),
        pytest.param(
            _json({"model": "m", "messages": [{"content": "a"}, "hi"]}),
            r"^messages\[1\] must be an object, not a string$",
            id="message-string",
        ),
        pytest.param(
            _json({"model": "m", "messages": [[]]}),
            r"^messages\[0\] must be an object, not an array$",
            id="message-array",
        ),
        pytest.param(
            _json({"model": "m", "messages": [{"content": 5}]}),
            r"^messages\[0\]\.content must be a string or a list of parts, not a number$",
            id="content-number",
        ),
        pytest.param(
            _json({"model": "m", "messages": [{"content": "a"}, {"content": {"text": "b"}}]}),
            r"^messages\[1\]\.content must be a string or a list of parts, not an object$",
            id="content-object",
        ),
        pytest.param(
            _json({"model": "m", "messages": [{"content": False}]}),
            r"^messages\[0\]\.content must be a string or a list of parts, not a boolean$",
            id="content-bool",
        ),
        pytest.param(_json({"model": "m", "n": 0}), r"^field 'n' must be a positive integer, not 0$", id="n-zero"),
        pytest.param(
            _json({"model": "m", "best_of": "8"}), r"^field 'best_of' must be a positive integer", id="best-of-string"
        ),
        pytest.param(_json({"model": "m", "n": True}), r"^field 'n' must be a positive integer", id="n-bool"),
    ],
)
def test_apply_body_malformed(body: bytes, pattern: str) -> None:
    with pytest.raises(MalformedRequestError, match=pattern) as info:
        _apply(body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    assert info.value.message == str(info.value)


@pytest.mark.parametrize(
    ("body", "complete", "max_bytes", "message"),
    [
        pytest.param(b"x" * 2049, True, 2048, "request body is 2049 bytes; the limit is 2048 bytes", id="over-limit"),
        pytest.param(_json({"model": "m", "prompt": "x" * 5000}), True, 1024, None, id="valid-json-over-limit"),
        pytest.param(
            b'{"model": "m", "pro',
            False,
            2048,
            "request body is more than 19 bytes; the limit is 2048 bytes",
            id="incomplete",
        ),
        pytest.param(
            b"", False, 2048, "request body is more than 0 bytes; the limit is 2048 bytes", id="incomplete-empty"
        ),
        pytest.param(
            b"x" * 4096,
            False,
            2048,
            "request body is more than 4096 bytes; the limit is 2048 bytes",
            id="incomplete-over-limit",
        ),
    ],
)
def test_apply_body_too_large(body: bytes, complete: bool, max_bytes: int, message: str | None) -> None:
    features = RequestFeatures()
    with pytest.raises(PayloadTooLargeError) as info:
        apply_body(features, body, complete=complete, max_bytes=max_bytes)
    assert info.value.status == 413
    assert info.value.type == "payload_too_large"
    if message is not None:
        assert info.value.message == message
    assert features == RequestFeatures()


def test_error_statuses() -> None:
    assert RequestError("x").status == MalformedRequestError("x").status == 400
    assert PayloadTooLargeError("x").status == 413
    assert issubclass(MalformedRequestError, RequestError)
    assert issubclass(PayloadTooLargeError, RequestError)


def test_apply_body_huge_integer_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedRequestError):
        _apply(b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}")


def test_apply_body_nested_bool_token_ids_are_malformed() -> None:
    with pytest.raises(MalformedRequestError, match="field 'prompt'"):
        _apply(_json({"model": "m", "prompt": [[True, False]]}))


# ---------------------------------------------------------------- big bodies: what a prompt of token ids costs


class ParseSpy:
    """Wraps ``orjson.loads`` and records every document it is given."""

    def __init__(self) -> None:
        self.documents: list[bytes] = []

    def __call__(self, data: bytes) -> Any:
        self.documents.append(data)
        return _ORJSON_LOADS(data)

    @property
    def sizes(self) -> list[int]:
        return [len(document) for document in self.documents]


_ORJSON_LOADS = orjson.loads
BIG = 8 << 20


def _expected_tokens(prompt: list[Any]) -> tuple[int, tuple[int, ...]]:
    """(exact count, prefix hashes) of a token-id prompt, computed from the ids themselves."""
    if not prompt or not isinstance(prompt[0], list):
        return len(prompt), token_block_hashes(prompt, seed=hash("m"))
    hashes = token_block_hashes(prompt[0], seed=hash("m")) if len(prompt) == 1 else ()
    return sum(map(len, prompt)), hashes


@pytest.mark.parametrize(
    ("prompt", "dump"),
    [
        pytest.param([i % 50_000 for i in range(700_000)], orjson.dumps, id="flat-4-mib"),
        pytest.param([i % 50_000 for i in range(100_000)], json.dumps, id="flat-spaced"),
        pytest.param([i % 50_000 for i in range(20_000)], lambda d: json.dumps(d, indent=2), id="flat-indented"),
        pytest.param(
            [-1, 0, -0, 7, 10**17, -(10**18 - 1), *range(20_000)], orjson.dumps, id="flat-negative-zero-18-digits"
        ),
        pytest.param([[i % 50_000 for i in range(200_000)]], orjson.dumps, id="one-list"),
        pytest.param([[7]] * 300_000, orjson.dumps, id="many-small-lists"),
        pytest.param([[]] * 300_000, orjson.dumps, id="many-empty-lists"),
        pytest.param([list(range(50_000)), [], [1, 2, 3]], json.dumps, id="batch-of-lists"),
    ],
)
def test_apply_body_counts_a_big_token_prompt_without_parsing_it(
    prompt: list[Any], dump: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = dump({"model": "m", "prompt": prompt, "max_tokens": 5, "stream": True})
    body = body if isinstance(body, bytes) else body.encode()
    spy = ParseSpy()
    monkeypatch.setattr(orjson, "loads", spy)
    features = _apply(body, max_bytes=BIG)
    assert max(spy.sizes) < 200  # the ids never became Python objects
    count, hashes = _expected_tokens(prompt)
    assert (features.prompt_tokens, features.prompt_chars, features.prefix_hashes) == (count, 0, hashes)
    assert (features.model, features.max_tokens, features.stream) == ("m", 5, True)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param([i % 50_000 for i in range(700_000)], id="flat-4-mib"),
        pytest.param([[i % 50_000 for i in range(200_000)]], id="one-list"),
        pytest.param([list(range(50_000)), [], [1, 2, 3]], id="batch-of-lists"),
    ],
)
def test_an_embeddings_input_of_token_ids_is_counted_without_parsing_it_as_a_prompt_is(
    ids: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = orjson.dumps({"model": "m", "input": ids, "encoding_format": "float"})
    with patch.object(tokenscan, "SCAN_MIN_BYTES", len(body) + 1):  # the full parse
        expected = apply_body(RequestFeatures(path="/v1/embeddings"), body, complete=True, max_bytes=BIG)
    spy = ParseSpy()
    monkeypatch.setattr(orjson, "loads", spy)
    features = apply_body(RequestFeatures(path="/v1/embeddings"), body, complete=True, max_bytes=BIG)
    assert max(spy.sizes) < 200  # the ids never became Python objects
    count, hashes = _expected_tokens(ids)
    assert (features.prompt_tokens, features.prefix_hashes) == (count, hashes)
    assert features == expected
    # On any other route "input" is not where a prompt of ids is looked for: the body is parsed whole.
    spy.documents.clear()
    apply_body(RequestFeatures(path="/v1/completions"), body, complete=True, max_bytes=BIG)
    assert max(spy.sizes) == len(body)


def _outcome(body: bytes) -> RequestFeatures | tuple[type[RequestError], str]:
    try:
        return apply_body(RequestFeatures(), body, complete=True, max_bytes=BIG)
    except RequestError as exc:
        return type(exc), exc.message


def _both_paths(body: bytes) -> tuple[Any, Any, list[bytes]]:
    """(outcome with the token-id scan tried at any size, outcome with the scan off, what orjson parsed when on)."""
    spy = ParseSpy()
    with (
        patch.object(tokenscan, "SCAN_MIN_BYTES", 1),
        patch.object(orjson, "loads", spy),
    ):
        fast = _outcome(body)
    with patch.object(tokenscan, "SCAN_MIN_BYTES", len(body) + 1):
        slow = _outcome(body)
    return fast, slow, spy.documents


# Element texts: JSON integers, and near misses the scan must leave to the full parse.
VALID_ID = st.one_of(
    st.integers(0, 200_000), st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 10**17, -(10**17)])
).map(str)
INVALID_ID = st.sampled_from(
    [
        *("true", "false", "null", "1.5", "1e3", "1E3", "01", "-01", "00", "-", "--1", "+1", '"7"', "", "1 2"),
        *("- 1", "1-2", "9" * 30, "-" + "9" * 30, "0x10", "[]", "[1]", "{}", "\u0661", "1,", ",1"),
    ]
)
SEPARATOR = st.sampled_from([",", ", ", " ,", " , ", ",\n  ", "\t,\r\n", ",\x0b", ",\x0c"])
SPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n  ", "\x0b"])


@st.composite
def token_array(draw: st.DrawFn, element: st.SearchStrategy[str]) -> str:
    items = draw(st.lists(element, max_size=12))
    sep = draw(SEPARATOR)
    return "[" + draw(SPACE) + sep.join(items) + draw(SPACE) + "]"


@st.composite
def token_prompt_body(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A body with a prompt of token ids (flat, or a list of lists) in varied layout, and whether it may hold a near
    miss (an invalid element)."""
    broken = draw(st.booleans())
    element = st.one_of(VALID_ID, INVALID_ID) if broken else VALID_ID
    if draw(st.booleans()):
        prompt = draw(token_array(element))
    else:
        inner = draw(st.lists(token_array(element), min_size=1, max_size=4))
        prompt = "[" + draw(SPACE) + draw(SEPARATOR).join(inner) + draw(SPACE) + "]"
    key = draw(st.sampled_from(['"prompt":', '"prompt" : ', '"prompt"\n:\t']))
    before = draw(st.sampled_from(['{"model":"m",', '{"model": "m", "stream": true, ', "{", '{"prompt":[1],']))
    after = draw(st.sampled_from(["}", ', "model": "m"}', ' ,"max_tokens":3}', ',"prompt":[2]}', "]}", "}}", ",}"]))
    return (before + key + prompt + after).encode(), broken


@given(token_prompt_body())
@settings(max_examples=400, deadline=None)
def test_token_id_scan_agrees_with_the_full_parse(case: tuple[bytes, bool]) -> None:
    body, broken = case
    fast, slow, parsed = _both_paths(body)
    assert fast == slow
    canonical = body.count(b'"prompt"') == 1 and not re.search(rb"[0-9]{19}", body)  # ids of up to 18 digits
    if isinstance(slow, RequestFeatures) and not broken and canonical:
        assert parsed == [parsed[0]] and b"inferlb" in parsed[0]  # valid ids: counted in the raw body, not parsed


def _big_ids(bad: str, at: int) -> bytes:
    ids = [str(i % 1000) for i in range(10_000)]
    ids[at] = bad
    return ('{"model": "m", "prompt": [' + ",".join(ids) + "]}").encode()


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        pytest.param(_big_ids("true", 0), r"^field 'prompt' must be", id="bool-first"),
        pytest.param(_big_ids("false", 9_999), r"^field 'prompt' must be", id="bool-last"),
        pytest.param(_big_ids("1.5", 5_000), r"^field 'prompt' must be", id="float"),
        pytest.param(_big_ids("1e3", 5_000), r"^field 'prompt' must be", id="exponent"),
        pytest.param(_big_ids("null", 5_000), r"^field 'prompt' must be", id="null"),
        pytest.param(_big_ids('"7"', 5_000), r"^field 'prompt' must be", id="string"),
        pytest.param(_big_ids("[7]", 5_000), r"^field 'prompt' must be", id="nested-mixed"),
        pytest.param(_big_ids("9" * 30, 5_000), r"^field 'prompt' must be", id="beyond-u64-is-a-float"),
        pytest.param(_big_ids("01", 5_000), r"^request body is not valid JSON: number with leading zero", id="zero"),
        pytest.param(_big_ids("-", 5_000), r"^request body is not valid JSON: ", id="lone-minus"),
        pytest.param(_big_ids("1 2", 5_000), r"^request body is not valid JSON: ", id="missing-comma"),
        pytest.param(_big_ids("", 5_000), r"^request body is not valid JSON: ", id="empty-element"),
        pytest.param(_big_ids("", 9_999), r"^request body is not valid JSON: ", id="trailing-comma"),
        pytest.param(_big_ids("1\x0b", 5_000), r"^request body is not valid JSON: ", id="vertical-tab"),
        pytest.param(
            b'{"model": "m", "prompt": "[' + b",".join([b"1"] * 10_000) + b']"}',
            None,
            id="ids-inside-a-string-are-text",
        ),
        pytest.param(
            b'{"model": "m", "x": {"prompt": [' + b",".join([b"1"] * 10_000) + b']}, "prompt": {"inferlb-0": 0}}',
            r"^field 'prompt' must be",
            id="a-forged-placeholder",
        ),
        pytest.param(
            b'{"model": "m", "prompt": [' + b",".join([b"1"] * 10_000) + b'], "prompt": "last wins"}',
            None,
            id="duplicate-key-last-wins",
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"content": "hi"}], "prompt": [' + b",".join([b"1"] * 10_000) + b"]}",
            None,
            id="messages-win",
        ),
        pytest.param(
            b'{"model": "m", "prompt": [' + b",".join([b"1"] * 10_000) + b"]",
            r"^request body is not valid JSON: unexpected end of data",
            id="truncated",
        ),
        pytest.param(
            b'{"model": 7, "prompt": [' + b",".join([b"1"] * 10_000) + b"]}",
            r"^field 'model' must be a non-empty string, not a number$",
            id="other-field-still-checked",
        ),
    ],
)
def test_token_id_scan_refuses_what_the_full_parse_refuses(body: bytes, pattern: str | None) -> None:
    fast, slow, _ = _both_paths(body)
    assert fast == slow
    assert _outcome(body) == slow  # and at the default size threshold
    if pattern is None:
        assert isinstance(slow, RequestFeatures)
    else:
        assert not isinstance(slow, RequestFeatures)
        assert re.search(pattern, slow[1])


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param({"model": "m", "x": [[]] * 300_000}, id="unread-field-of-empty-lists"),
        pytest.param({"model": "m", "prompt": [["a"]] * 100_000}, id="refused-prompt-of-lists"),
        pytest.param({"model": "m", "x": [[]] * 300_000, "messages": [{"content": 5}]}, id="refused-content"),
    ],
)
def test_apply_body_does_not_run_the_garbage_collector_over_a_big_document(doc: dict[str, Any]) -> None:
    body = orjson.dumps(doc)
    collections: list[str] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(phase)

    gc.collect()
    gc.callbacks.append(record)
    try:
        with contextlib.suppress(RequestError):
            _apply(body, max_bytes=BIG)
        during = len(collections)
        gc.collect()
    finally:
        gc.callbacks.remove(record)
    assert during == 0
    assert gc.isenabled()


def test_apply_body_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        _apply(orjson.dumps({"model": "m", "x": [[]] * 100_000}), max_bytes=BIG)
        assert not gc.isenabled()
    finally:
        gc.enable()


# ---------------------------------------------------------------- chat messages: read in C where they allow it

ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", ""]), st.none(), st.integers(), st.text(max_size=5))
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})}),
    st.fixed_dictionaries({"text": st.one_of(st.integers(), st.none())}),
    st.text(max_size=3),
)
CONTENT = st.one_of(st.text(max_size=40), st.none(), st.lists(PART, max_size=12), st.integers(), st.just({"a": 1}))


@st.composite
def chat_messages(draw: st.DrawFn) -> list[Any]:
    messages = []
    for _ in range(draw(st.integers(0, 8))):
        message: dict[str, Any] = {}
        if draw(st.booleans()):
            message["role"] = draw(ROLE)
        if draw(st.integers(0, 5)):
            message["content"] = draw(CONTENT)
        messages.append(message)
    if draw(st.integers(0, 9)) == 0:
        messages.insert(draw(st.integers(0, len(messages))), draw(st.one_of(st.text(max_size=3), st.integers())))
    return messages


def _read_messages(read: Any, messages: list[Any]) -> tuple[int, tuple[int, ...]] | str:
    try:
        chars, rendered = read(messages)
    except MalformedRequestError as exc:
        return exc.message
    return chars, text_block_hashes(rendered, seed=1)


@given(chat_messages())
@settings(max_examples=300, deadline=None)
def test_messages_read_in_c_as_message_by_message(messages: list[Any]) -> None:
    assert _read_messages(request._messages_text, messages) == _read_messages(request._messages_loop, messages)


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([{"role": "user", "content": "x" * 300}] * 3_000, id="rendering-past-the-head"),
        pytest.param([{"role": "user", "content": "x" * 10_000_000}], id="one-huge-message"),
        pytest.param([{}] * 400_000, id="many-empty-messages"),
        pytest.param([{"role": None, "content": None}, {"role": 7, "content": "a" * 600_000}], id="odd-roles-nulls"),
    ],
)
def test_messages_read_in_c_hash_the_same_head(messages: list[Any]) -> None:
    assert _read_messages(request._messages_text, messages) == _read_messages(request._messages_loop, messages)


def test_with_model_renames_the_model_and_keeps_the_rest_of_the_body() -> None:
    body = '{"model": "m", "messages": [{"role": "user", "content": "héllo"}], "temperature": 0.5, "n": 1}'
    rewritten = with_model(body.encode(), "m-next")
    assert json.loads(rewritten) == {**json.loads(body), "model": "m-next"}
    assert list(json.loads(rewritten)) == ["model", "messages", "temperature", "n"]  # the client's order
    assert json.loads(with_model(b"\xef\xbb\xbf" + body.encode(), "m-next"))["model"] == "m-next"  # a BOM
    with pytest.raises(MalformedRequestError, match="JSON object"):
        with_model(b"[1, 2]", "m-next")
    with pytest.raises(MalformedRequestError, match="not valid JSON"):
        with_model(b'{"model": ', "m-next")
