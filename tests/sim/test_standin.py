"""Tests for sim/standin.py: the app in process over httpx.ASGITransport, and `serve()` for real over loopback."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from inferlb.sim.standin import SEEN_DEST_HEADER, STANDIN_HEADER, StandinOptions, create_app, serve

ADDRESS = "127.0.0.1:8001"
FAST = StandinOptions(models=("model-a", "model-b"), token_delay_s=0.0, default_max_tokens=4, max_output_tokens=8)


def _client(options: StandinOptions = FAST, address: str = ADDRESS) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(address, options))
    return httpx.AsyncClient(transport=transport, base_url="http://standin")


def _tokens(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def _events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order; every event must be one `data:` line."""
    assert body.endswith("\n\n")
    events = body[: -len("\n\n")].split("\n\n")
    assert all(event.startswith("data: ") for event in events), events
    return [event[len("data: ") :] for event in events]


@pytest.mark.parametrize("destination", [pytest.param(None, id="no-dest"), pytest.param("10.0.0.7:8000", id="dest")])
@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        pytest.param("GET", "/health", None, 200, id="health"),
        pytest.param("GET", "/v1/models", None, 200, id="models"),
        pytest.param("POST", "/v1/completions", b'{"prompt": "hi"}', 200, id="completions"),
        pytest.param("POST", "/v1/chat/completions", b'{"messages": [], "stream": true}', 200, id="chat-stream"),
        pytest.param("GET", "/nope", None, 404, id="not-found"),
        pytest.param("GET", "/v1/completions", None, 405, id="wrong-method"),
        pytest.param("POST", "/v1/completions", b"{not json", 400, id="bad-json"),
    ],
)
async def test_every_response_names_the_backend_and_the_seen_destination(
    method: str, path: str, body: bytes | None, status: int, destination: str | None
) -> None:
    headers = {} if destination is None else {"x-gateway-destination-endpoint": destination}
    async with _client() as client:
        response = await client.request(method, path, content=body, headers=headers)
    assert response.status_code == status
    assert response.headers[STANDIN_HEADER] == ADDRESS
    assert response.headers[SEEN_DEST_HEADER] == (destination or "")
    if status >= 400:
        assert response.json()["error"]["code"] == status
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["message"]


async def test_health_and_models() -> None:
    async with _client() as client:
        health = await client.get("/health")
        models = await client.get("/v1/models")
    assert health.json() == {"status": "ok"}
    assert models.json() == {
        "object": "list",
        "data": [
            {"id": "model-a", "object": "model", "owned_by": "inferlb-standin"},
            {"id": "model-b", "object": "model", "owned_by": "inferlb-standin"},
        ],
    }


@pytest.mark.parametrize(
    ("request_fields", "expected_n"),
    [
        pytest.param({}, 4, id="default-length"),
        pytest.param({"max_tokens": 3}, 3, id="max-tokens"),
        pytest.param({"max_tokens": 0}, 0, id="zero"),
        pytest.param({"max_tokens": 100}, 8, id="capped"),
        pytest.param({"max_tokens": -1}, 4, id="negative-ignored"),
        pytest.param({"max_tokens": "5"}, 4, id="string-ignored"),
        pytest.param({"max_tokens": True}, 4, id="bool-ignored"),
    ],
)
async def test_completion_shape_and_length(request_fields: dict[str, Any], expected_n: int) -> None:
    async with _client() as client:
        response = await client.post(
            "/v1/completions", json={"model": "model-b", "prompt": "abcdefghi", **request_fields}
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert abs(body["created"] - time.time()) < 60
    assert body["model"] == "model-b"
    assert body["choices"] == [{"index": 0, "text": _tokens(expected_n), "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": expected_n, "total_tokens": 3 + expected_n}


@pytest.mark.parametrize(
    ("request_fields", "expected_n"),
    [
        pytest.param({}, 4, id="default-length"),
        pytest.param({"max_tokens": 2}, 2, id="max-tokens"),
        pytest.param({"max_completion_tokens": 5}, 5, id="max-completion-tokens"),
        pytest.param({"max_completion_tokens": 1, "max_tokens": 6}, 1, id="max-completion-tokens-wins"),
        pytest.param({"max_completion_tokens": 99}, 8, id="capped"),
    ],
)
async def test_chat_shape_and_length(request_fields: dict[str, Any], expected_n: int) -> None:
    messages = [{"role": "user", "content": "abcd"}]
    async with _client() as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages, **request_fields})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "model-a"  # no model asked: the first served one
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": _tokens(expected_n)},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": expected_n, "total_tokens": 1 + expected_n}


async def test_ids_count_per_app() -> None:
    async with _client() as first, _client() as second:
        ids = [(await first.post("/v1/completions", json={})).json()["id"] for _ in range(2)]
        other = (await second.post("/v1/completions", json={})).json()["id"]
    assert ids == ["cmpl-1", "cmpl-2"]
    assert other == "cmpl-1"


@pytest.mark.parametrize(
    ("path", "request_body", "expected"),
    [
        pytest.param("/v1/completions", {"prompt": "abcde"}, 2, id="string-rounds-up"),
        pytest.param("/v1/completions", {"prompt": ""}, 0, id="empty-string"),
        pytest.param("/v1/completions", {"prompt": ["abcd", "efgh", "i"]}, 3, id="string-list"),
        pytest.param("/v1/completions", {"prompt": [11, 12, 13, 14, 15]}, 5, id="token-ids"),
        pytest.param("/v1/completions", {"prompt": [[1, 2], [3]]}, 3, id="token-id-batch"),
        pytest.param("/v1/completions", {}, 0, id="no-prompt"),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "abcd"},
                    {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "i"},
                ]
            },
            3,
            id="chat-parts",
        ),
    ],
)
async def test_prompt_token_estimate(path: str, request_body: dict[str, Any], expected: int) -> None:
    async with _client() as client:
        response = await client.post(path, json=request_body)
    assert response.json()["usage"]["prompt_tokens"] == expected


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/completions", b"{not json", id="malformed-json"),
        pytest.param("/v1/completions", b"", id="empty-body"),
        pytest.param("/v1/chat/completions", b"[1, 2]", id="array"),
        pytest.param("/v1/chat/completions", b'"text"', id="string"),
        pytest.param("/v1/completions", b"\xff\xfe", id="not-utf8"),
        pytest.param("/v1/completions", b'{"model": 7}', id="model-not-string"),
    ],
)
async def test_bad_body_is_a_400_json_error(path: str, body: bytes) -> None:
    async with _client() as client:
        response = await client.post(path, content=body)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert isinstance(error["message"], str)


@pytest.mark.parametrize(
    ("model", "mismatch", "echoed"),
    [
        pytest.param("model-b", None, "model-b", id="served"),
        pytest.param("elsewhere", "1", "elsewhere", id="unknown-echoed-and-flagged"),
        pytest.param(None, None, "model-a", id="absent"),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="plain"), pytest.param(True, id="stream")])
async def test_model_mismatch_header(model: str | None, mismatch: str | None, echoed: str, stream: bool) -> None:
    request: dict[str, Any] = {"prompt": "x", "stream": stream}
    if model is not None:
        request["model"] = model
    async with _client() as client:
        response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200
    assert response.headers.get("x-inferlb-model-mismatch") == mismatch
    if stream:
        assert json.loads(_events(response.text)[0])["model"] == echoed
    else:
        assert response.json()["model"] == echoed


@pytest.mark.parametrize("include_usage", [pytest.param(False, id="no-usage"), pytest.param(True, id="usage")])
@pytest.mark.parametrize("chat", [pytest.param(False, id="completions"), pytest.param(True, id="chat")])
async def test_stream_event_sequence(chat: bool, include_usage: bool) -> None:
    n = 5
    request: dict[str, Any] = {"model": "model-a", "stream": True, "max_tokens": n}
    request.update({"messages": [{"role": "user", "content": "abcdefgh"}]} if chat else {"prompt": "abcdefgh"})
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    options = StandinOptions(models=("model-a",), token_delay_s=0.001)
    before = time.monotonic()
    async with _client(options) as client:
        response = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=request)
    after = time.monotonic()

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    events = _events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    token_chunks = chunks[:n]
    assert [chunk["seq"] for chunk in token_chunks] == list(range(n))
    sent = [chunk["sent_at"] for chunk in chunks]
    assert sent == sorted(sent)
    assert before <= sent[0] and sent[-1] <= after
    assert len({chunk["id"] for chunk in chunks}) == 1
    for i, chunk in enumerate(token_chunks):
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert chunk["model"] == "model-a"
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert choice["finish_reason"] == ("length" if i == n - 1 else None)
        if chat:
            expected_delta = {"content": f"tok{i} "}
            if i == 0:
                expected_delta["role"] = "assistant"
            assert choice["delta"] == expected_delta
        else:
            assert choice["text"] == f"tok{i} "
    if include_usage:
        (usage_chunk,) = chunks[n:]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n}
    else:
        assert chunks[n:] == []


async def test_stream_of_zero_tokens_still_finishes() -> None:
    async with _client() as client:
        response = await client.post("/v1/completions", json={"stream": True, "max_tokens": 0})
    events = _events(response.text)
    assert events[-1] == "[DONE]"
    (chunk,) = [json.loads(event) for event in events[:-1]]
    assert chunk["choices"][0]["text"] == ""
    assert chunk["choices"][0]["finish_reason"] == "length"


async def test_stream_stops_when_the_client_disconnects() -> None:
    app = create_app(ADDRESS, StandinOptions(token_delay_s=0.001, max_output_tokens=10_000))
    first_chunk = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body = json.dumps({"stream": True, "max_tokens": 10_000}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))
        if message["type"] == "http.response.body":
            first_chunk.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await asyncio.wait_for(app(scope, receive, send), 10)
    bodies = [message for message in sent if message["type"] == "http.response.body"]
    assert 1 <= len(bodies) < 100
    assert all(message.get("more_body") for message in bodies)  # stopped quietly: no [DONE]


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("localhost:8000", id="hostname"),
        pytest.param("127.0.0.1", id="no-port"),
        pytest.param("127.0.0.1:", id="empty-port"),
        pytest.param("127.0.0.1:0", id="port-zero"),
        pytest.param("127.0.0.1:65536", id="port-too-big"),
        pytest.param("127.0.0.1:+80", id="signed-port"),
        pytest.param("::1:8000", id="ipv6-unbracketed"),
        pytest.param("[127.0.0.1]:8000", id="ipv4-bracketed"),
        pytest.param("", id="empty"),
    ],
)
def test_malformed_address_is_rejected_by_name(address: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(address))):
        create_app(address, FAST)


@pytest.mark.parametrize("address", [pytest.param("10.1.2.3:80", id="ipv4"), pytest.param("[::1]:8001", id="ipv6")])
async def test_accepted_address_is_reported_verbatim(address: str) -> None:
    async with _client(address=address) as client:
        response = await client.get("/health")
    assert response.headers[STANDIN_HEADER] == address


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        pytest.param({"models": ()}, "models", id="no-models"),
        pytest.param({"models": "stand-in"}, "models", id="models-string"),
        pytest.param({"models": ("ok", "")}, r"models\[1\]", id="empty-model-name"),
        pytest.param({"token_delay_s": -0.1}, "token_delay_s", id="negative-delay"),
        pytest.param({"token_delay_s": float("nan")}, "token_delay_s", id="nan-delay"),
        pytest.param({"default_max_tokens": -1}, "default_max_tokens", id="negative-default"),
        pytest.param({"max_output_tokens": 1.5}, "max_output_tokens", id="float-cap"),
    ],
)
def test_options_reject_bad_values_naming_the_field(fields: dict[str, Any], bad_field: str) -> None:
    with pytest.raises(ValueError, match=rf"StandinOptions\.{bad_field}"):
        StandinOptions(**fields)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _timed_events(response: httpx.Response) -> AsyncIterator[tuple[float, str]]:
    """Each SSE payload with the monotonic time its last byte arrived."""
    buffer = ""
    async for text in response.aiter_text():
        arrived = time.monotonic()
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            yield arrived, event.removeprefix("data: ")


@pytest.mark.parametrize("shutdown", [pytest.param("sigterm", id="sigterm"), pytest.param("cancel", id="cancel")])
async def test_serve_over_loopback(shutdown: str) -> None:
    addresses = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    options = StandinOptions(token_delay_s=0.02)
    # A fallback so that, should serve() fail to take SIGTERM over, the signal cannot kill the test run.
    fallback_hits: list[int] = []

    def fallback(signum: int, frame: object) -> None:
        fallback_hits.append(signum)

    previous = signal.signal(signal.SIGTERM, fallback)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(addresses, options, ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with httpx.AsyncClient(timeout=10) as client:
            for address in addresses:
                response = await client.get(f"http://{address}/health")
                assert response.status_code == 200
                assert response.headers[STANDIN_HEADER] == address

                request = {"prompt": "hi", "stream": True, "max_tokens": 5}
                async with client.stream("POST", f"http://{address}/v1/completions", json=request) as streamed:
                    assert streamed.headers[STANDIN_HEADER] == address
                    events = [item async for item in _timed_events(streamed)]
            # Shut down with the client's keep-alive connections still open.
            if shutdown == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                task.cancel()
            await asyncio.wait({task}, timeout=10)
        assert task.done(), "serve() did not stop within 10 s"
        if shutdown == "sigterm":
            assert task.result() is None
            assert fallback_hits == []
        else:
            assert task.cancelled()
        assert signal.getsignal(signal.SIGTERM) is fallback  # serve() put back what it found
        async with httpx.AsyncClient(timeout=10) as client:
            for address in addresses:
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"http://{address}/health")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=10)
        signal.signal(signal.SIGTERM, previous)

    # The last stream, read as it arrived: several events, the first received before the last token was sent.
    assert events[-1][1] == "[DONE]"
    chunks = [(arrived, json.loads(payload)) for arrived, payload in events[:-1]]
    assert [chunk["seq"] for _, chunk in chunks] == list(range(5))
    assert all(chunk["sent_at"] <= arrived for arrived, chunk in chunks)
    assert chunks[0][0] < chunks[-1][1]["sent_at"]
