"""The picker's body routes through a real Envoy in both body modes gateways configure: BUFFERED (Envoy sends
the whole body in one message) and FULL_DUPLEX_STREAMED (the body streams to the picker in chunks, the picker
answers the headers once it is whole and streams it back; llm-d's gateways use it). In each, a body of many
chunks reaches the server intact, at the endpoint the picker chose; bad and oversized bodies get their JSON
errors."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import SERVER_HEADER
from inferlb.stack import LocalStack, StackOptions

from .conftest import log_entry

pytestmark = pytest.mark.envoy

MODEL = "m1"
MAX_BODY = 1 << 20


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    options = StackOptions(
        backends=2,
        models=(MODEL,),
        envoy=EnvoyOptions(body_mode=request.param),
        picker_config={"max_body_bytes": MAX_BODY},
    )
    with LocalStack(options, tmp_path_factory.mktemp(request.param)) as running:
        yield running


def test_a_body_of_many_chunks_reaches_the_chosen_server_intact(stack: LocalStack) -> None:
    # ~300 KB: Envoy reads it from the client in several pieces, and in full-duplex mode the picker gives it
    # back in chunks of at most 64 KiB.
    prompt = " ".join(f"word{i}" for i in range(40_000))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{stack.gateway_url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        served = response.headers[SERVER_HEADER]
        entry = log_entry(stack, response.headers["x-request-id"])
        assert entry["cluster"] == "inferlb_picked" and entry["picked"] == served
        # The same body sent straight to that server: the same prompt, token for token.
        direct = client.post(f"http://{served}/v1/completions", json=body)
    assert direct.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"] > 40_000


def test_a_streamed_chat_answer_arrives_and_a_bad_body_is_a_400(stack: LocalStack) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat) as response:
            assert response.status_code == 200
            assert "data: [DONE]" in "".join(response.iter_text())
        bad = client.post(
            "/v1/completions", content=b'{"model": "m1", "prompt": ', headers={"content-type": "application/json"}
        )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_a_413(stack: LocalStack) -> None:
    body = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{stack.gateway_url}/v1/completions", json=body)
    assert response.status_code == 413 and response.json()["error"]["type"] == "payload_too_large"


def test_with_the_picker_down_a_full_duplex_body_fails_open_once_envoy_has_marked_it_down(tmp_path) -> None:
    """Envoy streams a full-duplex body before the picker's stream is open, so a refused connection found after
    the first chunk cannot fail open; the bootstrap's health check of the picker closes that window: once it
    has marked the picker down, every body request goes to the fallback cluster."""
    options = StackOptions(backends=2, models=(MODEL,), envoy=EnvoyOptions(body_mode="full-duplex", fail_open=True))
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10.0) as client:
        assert stack.picker is not None
        stack.picker.stop()
        stack.wait_picker_marked_down()
        body = {"model": MODEL, "prompt": "after the picker " * 4000, "max_tokens": 2}
        responses = [client.post("/v1/completions", json=body) for _ in range(10)]
        assert [r.status_code for r in responses] == [200] * 10
        for response in responses:
            assert log_entry(stack, response.headers["x-request-id"])["cluster"] == "inferlb_fallback"
