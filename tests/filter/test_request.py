"""Tests for filter/request.py: headers and the JSON body into RequestFeatures, and the 400/413 errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderValue

from inferlb.filter.errors import MalformedRequestError, PayloadTooLargeError, RequestError
from inferlb.filter.request import apply_body, features_from_headers
from inferlb.scorer.features import RequestFeatures

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
    ],
)
def test_features_from_headers(headers: list[HeaderValue], expected: RequestFeatures) -> None:
    features = features_from_headers(headers)
    assert features == expected
    assert features.model is None


def _apply(body: bytes, *, complete: bool = True, max_bytes: int = MAX) -> RequestFeatures:
    features = RequestFeatures(path="/v1/completions", method="POST", request_id="r")
    apply_body(features, body, complete=complete, max_bytes=max_bytes)
    return features


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
    pytest.param(
        {"model": "m", "max_tokens": 8, "max_completion_tokens": 64},
        {"model": "m", "max_tokens": 8},
        id="max-tokens-wins",
    ),
    pytest.param(
        {"model": "m", "max_tokens": None, "max_completion_tokens": 64},
        {"model": "m", "max_tokens": 64},
        id="null-max-tokens-falls-through",
    ),
    pytest.param({"model": "m", "max_tokens": None}, {"model": "m"}, id="null-max-tokens"),
    pytest.param({"model": "m", "temperature": "whatever", "n": [1]}, {"model": "m"}, id="other-fields-not-checked"),
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
    features = _apply(_json(doc))
    features.prefix_hashes = ()  # pinned in test_prefix_hashes.py
    assert features == expected


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
            _json({"model": "m", "stream": None}), r"^field 'stream' must be a boolean, not null$", id="stream-null"
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
