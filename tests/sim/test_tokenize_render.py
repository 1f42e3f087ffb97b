"""Tests for the emulator's ``POST /tokenize`` and ``POST /v1/completions/render`` (sim/server.py, sim/openai.py,
sim/tokens.py): vLLM 0.32's shapes, counts that agree with ``/v1/completions``, deterministic ids, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions
from inferlb.sim.tokens import VOCAB_SIZE, count_tokens, token_ids, token_pieces

H100 = get_profile("h100-llama3.1-8b")
OPTIONS = ServerOptions(profile=H100, models=("m",), time_scale=50.0, jitter=0.0, default_max_tokens=3)
SCALE_OUT = dataclasses.replace(OPTIONS, enable_scale_out=True)
PROMPT = "A shared system prompt that many requests start with. " * 3 + "Then a question of its own?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
TOKENIZE_KEYS = {"count", "max_model_len", "tokens", "token_strs"}
GENERATE_REQUEST_KEYS = {
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
}


@pytest.fixture
async def server():
    server = EmulatedServer("127.0.0.1:8001", SCALE_OUT)
    yield server
    await server.aclose()


@pytest.fixture
async def client(server):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://sim", timeout=10) as c:
        yield c


async def test_tokenize_answers_vllms_fields(client):
    response = await client.post("/tokenize", json={"model": "m", "prompt": PROMPT})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == TOKENIZE_KEYS
    assert body["count"] == len(body["tokens"]) == count_tokens(PROMPT)
    assert body["max_model_len"] == H100.max_model_len
    assert body["token_strs"] is None
    assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in body["tokens"])


async def test_tokenize_returns_the_pieces_when_asked(client):
    response = await client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    body = response.json()
    assert body["token_strs"] == ["hell", "o wo", "rld"]
    assert "".join(body["token_strs"]) == "hello world"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("abc", id="short-piece"),
        pytest.param("naïve café ☕ 😀 and \ud800 a lone surrogate", id="non-ascii"),
        pytest.param(PROMPT, id="prompt"),
    ],
)
def test_token_ids_are_one_per_piece_and_depend_only_on_the_piece(text):
    ids = token_ids(text)
    assert len(ids) == len(token_pieces(text)) == count_tokens(text)
    assert ids == [token_ids(piece)[0] for piece in token_pieces(text)]


def test_token_ids_are_the_same_in_another_process():
    # Prefix-cache affinity across servers and runs depends on it: no salted hash anywhere.
    code = f"from inferlb.sim.tokens import token_ids; print(token_ids({PROMPT!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == token_ids(PROMPT)


async def test_equal_text_gives_equal_tokens_and_a_shared_prefix_shares_ids(client):
    first = (await client.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    again = (await client.post("/tokenize", json={"model": "m", "prompt": PROMPT})).json()["tokens"]
    other = (await client.post("/tokenize", json={"prompt": PROMPT[:120] + "something else entirely"})).json()
    assert first == again
    assert other["tokens"][:30] == first[:30]
    assert other["tokens"][30:] != first[30:]


async def test_tokenize_count_equals_completion_usage(client):
    tokenized = (await client.post("/tokenize", json={"model": "m", "prompt": PROMPT})).json()
    completion = (await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})).json()
    assert tokenized["count"] == completion["usage"]["prompt_tokens"]


async def test_tokenize_messages_count_equals_chat_usage(client):
    tokenized = (await client.post("/tokenize", json={"model": "m", "messages": MESSAGES})).json()
    chat = (await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"]
    bare = (await client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})).json()
    assert bare["count"] < tokenized["count"]
    assert tokenized["tokens"][: bare["count"] - 1] == bare["tokens"][:-1]


async def test_render_answers_a_generate_request_with_the_tokenize_ids(client):
    tokenized = (await client.post("/tokenize", json={"prompt": PROMPT})).json()
    response = await client.post("/v1/completions/render", json={"model": "m", "prompt": PROMPT, "max_tokens": 5})
    assert response.status_code == 200
    (rendered,) = response.json()
    assert set(rendered) == GENERATE_REQUEST_KEYS
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["request_id"].startswith("cmpl-")
    assert rendered["model"] == "m"
    assert rendered["stream"] is False and rendered["stream_options"] is None
    assert rendered["output_mode"] == "tokens"
    params = rendered["sampling_params"]
    assert params["max_tokens"] == 5
    assert params["temperature"] == 1.0 and params["top_p"] == 1.0
    assert params["output_kind"] == 2  # FINAL_ONLY


async def test_render_of_a_streamed_request_with_token_ids(client):
    body = {
        "prompt": [[5, 6, 7]],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
    }
    (rendered,) = (await client.post("/v1/completions/render", json=body)).json()
    assert rendered["token_ids"] == [5, 6, 7]
    assert rendered["model"] is None  # vLLM echoes the request's model, absent here
    assert rendered["stream"] is True
    assert rendered["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert rendered["sampling_params"]["temperature"] == 0.5
    assert rendered["sampling_params"]["output_kind"] == 1  # DELTA
    assert rendered["sampling_params"]["max_tokens"] == 3  # the emulator's default output length


async def test_render_is_403_without_scale_out_as_in_vllm():
    server = EmulatedServer("127.0.0.1:8002", OPTIONS)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://sim") as client:
            response = await client.post("/v1/completions/render", json={"prompt": "hi"})
            tokenized = await client.post("/tokenize", json={"prompt": "hi"})
    finally:
        await server.aclose()
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "PermissionDeniedError" and error["code"] == 403
    assert "--enable-scale-out" in error["message"]
    assert tokenized.status_code == 200  # /tokenize is always on in vLLM


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "words"),
    [
        pytest.param("/tokenize", b"{not json", 400, "BadRequestError", "not valid JSON", id="tokenize-bad-json"),
        pytest.param(
            "/tokenize", {"model": "x", "prompt": "hi"}, 404, "NotFoundError", "`x` does not exist", id="tokenize-model"
        ),
        pytest.param("/tokenize", {"model": "m"}, 400, "BadRequestError", "'prompt' must be", id="tokenize-no-prompt"),
        pytest.param("/tokenize", {"prompt": 7}, 400, "BadRequestError", "'prompt' must be", id="tokenize-prompt-type"),
        pytest.param("/tokenize", [1, 2], 400, "BadRequestError", "JSON object", id="tokenize-not-object"),
        pytest.param(
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "BadRequestError",
            "Cannot set both",
            id="tokenize-continue-and-generation-prompt",
        ),
        pytest.param(
            "/tokenize",
            {"prompt": "hi", "return_token_strs": "yes"},
            400,
            "BadRequestError",
            "'return_token_strs' must be a boolean",
            id="tokenize-flag-type",
        ),
        pytest.param(
            "/v1/completions/render", b"{not json", 400, "BadRequestError", "not valid JSON", id="render-bad-json"
        ),
        pytest.param(
            "/v1/completions/render",
            {"model": "x", "prompt": "hi"},
            404,
            "NotFoundError",
            "`x` does not exist",
            id="render-model",
        ),
        pytest.param(
            "/v1/completions/render",
            {"prompt": "hi", "max_tokens": H100.max_model_len},
            400,
            "BadRequestError",
            "maximum context length",
            id="render-too-long",
        ),
    ],
)
async def test_errors_are_answered_as_on_completions(client, path, body, status, kind, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind and error["code"] == status
    assert words in error["message"]
    if path == "/v1/completions/render" and not isinstance(body, bytes):
        # The same body on /v1/completions gets the same answer, word for word.
        same = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert (same.status_code, same.json()) == (response.status_code, response.json())


async def test_wrong_method_is_405(client):
    response = await client.get("/tokenize")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


# Run by vLLM's own Python: validates every captured answer with vLLM 0.32's pydantic models and checks that dumping
# the validated model gives back exactly the JSON the emulator sent (no field missing, extra or mis-typed).
_VALIDATE = textwrap.dedent(
    """
    import json, sys
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse

    captured = json.load(open(sys.argv[1]))
    models = {"tokenize": TokenizeResponse, "error": ErrorResponse}
    for kind, payload in captured:
        if kind == "render":
            assert isinstance(payload, list) and len(payload) == 1, payload
            for item in payload:
                again = json.loads(GenerateRequest.model_validate(item).model_dump_json())
                assert again == item, (again, item)
        else:
            again = json.loads(models[kind].model_validate(payload).model_dump_json())
            assert again == payload, (again, payload)
    print("validated", len(captured))
    """
)


@pytest.mark.vllm
async def test_answers_validate_with_vllms_own_models(client, tmp_path: Path):
    python = os.environ.get("INFERLB_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.fail("INFERLB_VLLM_PYTHON is not set to the vLLM venv's Python: run `make test-vllm`")
    requests: list[tuple[str, str, Any]] = [
        ("tokenize", "/tokenize", {"model": "m", "prompt": PROMPT}),
        ("tokenize", "/tokenize", {"prompt": PROMPT, "return_token_strs": True}),
        ("tokenize", "/tokenize", {"messages": MESSAGES}),
        ("render", "/v1/completions/render", {"model": "m", "prompt": PROMPT, "max_tokens": 5}),
        ("render", "/v1/completions/render", {"prompt": [1, 2, 3], "stream": True, "top_p": 0.5}),
        (
            "render",
            "/v1/completions/render",
            {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "priority": 3},
        ),
        ("error", "/tokenize", {"model": "x", "prompt": "hi"}),
        ("error", "/v1/completions/render", {"prompt": 5}),
    ]
    captured = []
    for kind, path, body in requests:
        response = await client.post(path, json=body)
        captured.append((kind, response.json()))
    (tmp_path / "captured.json").write_text(json.dumps(captured), encoding="utf-8")
    done = subprocess.run(
        [python, "-c", _VALIDATE, str(tmp_path / "captured.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"validated {len(requests)}" in done.stdout


async def test_admin_routes_counts_answers_by_route_and_status(client):
    await client.post("/tokenize", json={"prompt": "hi"})
    await client.post("/tokenize", json={"prompt": "hi"})
    await client.post("/v1/completions/render", json={"model": "x", "prompt": "hi"})
    await client.get("/no/such/path")
    routes = (await client.get("/admin/routes")).json()["routes"]
    assert routes == {"POST /tokenize 200": 2, "POST /v1/completions/render 404": 1, "GET (other) 404": 1}
