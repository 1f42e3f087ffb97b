"""The whole request path through a real Envoy: client -> Envoy -> ext_proc picker -> ORIGINAL_DST -> server.

The emulated servers name themselves on every response (x-inferlb-sim-server) and echo the destination
header they received (x-inferlb-seen-destination); Envoy's access log records the cluster, the upstream it
connected to and the picker's choice (dynamic metadata). Together they show where each request really went.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import SERVER_HEADER
from inferlb.sim.openai import output_text
from inferlb.sim.server import SEEN_DEST_HEADER
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll
from .conftest import Canary, log_entry

pytestmark = pytest.mark.envoy

MODEL = "m1"
OTHER = "m2"  # served by the last endpoint alone, as far as the picker knows (the emulators all answer to it)
# Emulated H100s in real time: a 500-token stream stays open ~3 s while the test sends other requests.
OPTIONS = StackOptions(backends=3, models=(MODEL, OTHER), endpoint_models=((MODEL,), (MODEL,), (MODEL, OTHER)))
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(OPTIONS, tmp_path_factory.mktemp("gateway")) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as c:
        yield c


def test_each_request_reaches_the_endpoint_the_picker_chose(stack: LocalStack, client: httpx.Client) -> None:
    seen = set()
    for i in range(24):
        if i % 3:
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
        else:
            # A route the picker decides from the headers alone; the emulator has no such API and says 404.
            response = client.get("/v1/audio/transcriptions")
        backend = response.headers[SERVER_HEADER]
        assert response.headers[SEEN_DEST_HEADER] == backend, "the server got a destination other than itself"
        entry = log_entry(stack, response.headers["x-request-id"])
        assert entry["cluster"] == "inferlb_picked"
        assert entry["picked"] == entry["upstream"] == backend
        seen.add(backend)
    assert seen == set(stack.endpoints)


def test_client_cannot_choose_its_upstream(stack: LocalStack, client: httpx.Client, canary: Canary) -> None:
    before = canary.connections
    for path in ("/v1/completions", "/v1/embeddings", "/v1/audio/transcriptions"):
        for _ in range(5):
            response = client.post(path, json=COMPLETION, headers={"x-gateway-destination-endpoint": canary.address})
            assert response.headers[SERVER_HEADER] in stack.endpoints
            assert response.headers[SEEN_DEST_HEADER] != canary.address
    assert canary.connections == before


def test_envoy_makes_every_request_id_whatever_the_client_sends(stack: LocalStack, client: httpx.Client) -> None:
    # The picker keys leases, span joins and experiment outcomes on the request id: a client that chose it could
    # move another request's in-flight count (by reusing one) or have the picker keep 60 KB ids for minutes.
    sent = ["mine", "mine", "x" * 20_000]
    ids = []
    for chosen in sent:
        response = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": chosen})
        assert response.status_code == 200
        ids.append(response.headers["x-request-id"])
    assert len(set(ids)) == len(ids) and not set(ids) & set(sent)
    assert all(len(i) == 36 for i in ids)  # Envoy's UUIDs
    decisions = client.get(
        f"{stack.picker_admin_url}/decisions", params={"limit": 50}, headers=stack.admin_headers
    ).json()["decisions"]
    seen = {d["request_id"] for d in decisions}
    assert set(ids) <= seen and not seen & set(sent)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, id="chat"),
        pytest.param("/v1/embeddings", {"input": ["one", "two"]}, id="embeddings"),
        pytest.param("/v1/responses", {"input": "hi", "instructions": "be brief"}, id="responses"),
        pytest.param("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, id="rerank"),
    ],
)
def test_every_json_api_goes_to_a_server_of_its_model(
    stack: LocalStack, client: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    """On a pool of several models the picker reads the model of every JSON API, not only of the two it scores
    prompts for: a request for a model only one server has goes there (the emulator answers the chat and says
    404 to the APIs it lacks; a real server of that model would answer them)."""
    served_by = stack.endpoints[-1]
    for _ in range(6):
        response = client.post(path, json={"model": OTHER, **body})
        assert response.headers[SERVER_HEADER] == served_by, response.text
        assert log_entry(stack, response.headers["x-request-id"])["picked"] == served_by
    # A model no server has is refused by the picker, naming it, on these routes too.
    response = client.post(path, json={"model": "nope", **body})
    assert response.status_code == 404 and "'nope'" in response.json()["error"]["message"]
    assert SERVER_HEADER not in response.headers


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/v1/chat/%63ompletions", id="percent-encoded"),
        pytest.param("/v1//chat/completions", id="double-slash"),
    ],
)
def test_a_path_spelled_another_way_takes_the_body_route(stack: LocalStack, client: httpx.Client, path: str) -> None:
    """A server reads /v1/chat/%63ompletions as /v1/chat/completions: so does Envoy's routing, so the picker reads
    the body (the model, the tokens quotas charge, the body limit) whatever the spelling."""
    served_by = stack.endpoints[-1]
    body = {"model": OTHER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(4):
        response = client.post(path, json=body)
        assert response.status_code == 200 and response.headers[SERVER_HEADER] == served_by, response.text
        assert log_entry(stack, response.headers["x-request-id"])["picked"] == served_by
    big = b'{"model": "m1", "prompt": "' + b"x" * (5 << 20) + b'"}'
    response = client.post(path.replace("chat/", ""), content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_an_encoded_slash_in_the_path_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/chat%2Fcompletions", json={"model": MODEL, "messages": []})
    assert response.status_code == 400
    assert SERVER_HEADER not in response.headers


@pytest.mark.parametrize(
    ("path", "content", "status", "words"),
    [
        pytest.param("/v1/completions", b'{"model": "m1", "prompt": ', 400, "not valid JSON", id="malformed-json"),
        pytest.param("/v1/chat/completions", b"model=m1", 400, "not valid JSON", id="form-body"),
        pytest.param("/v1/completions", json.dumps({"prompt": "x"}).encode(), 400, "'model'", id="no-model"),
        pytest.param("/v1/completions", json.dumps({"model": "nope"}).encode(), 404, "'nope'", id="unknown-model"),
        pytest.param(
            "/v1/completions", b'{"model": "m1", "prompt": "' + b"x" * (5 << 20) + b'"}', 413, "limit", id="too-large"
        ),
        pytest.param("/other", b"", 404, "/v1/", id="unknown-path"),
    ],
)
def test_errors_are_json_that_says_what_was_wrong(
    client: httpx.Client, path: str, content: bytes, status: int, words: str
) -> None:
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert words in error["message"]
    assert int(error["code"]) == status
    # The picker survived: the next request is routed as usual.
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_opt_out_route_never_calls_the_picker(stack: LocalStack, client: httpx.Client) -> None:
    streams = "http.inferlb.ext_proc.streams_started"
    before = stack.envoy_counters(streams)[streams]
    for _ in range(5):
        response = client.get("/v1/models")
        assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL
        assert log_entry(stack, response.headers["x-request-id"])["cluster"] == "inferlb_fallback"
    assert stack.envoy_counters(streams)[streams] == before
    client.post("/v1/completions", json=COMPLETION)  # while a picked route does call it
    assert stack.envoy_counters(streams)[streams] == before + 1


def test_streaming_arrives_intact_chunk_by_chunk(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 40, "stream": True}
    events: list[tuple[float, str]] = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))
    assert events[-1][1] == "[DONE]"
    chunks = [(at, json.loads(data)) for at, data in events[:-1]]
    assert len(chunks) == 40
    assert "".join(c["choices"][0]["text"] for _, c in chunks) == output_text(0, 40)
    # Not buffered by the gateway: 39 decode steps take ~0.25 s, and the chunks arrived spread over that time.
    assert chunks[-1][0] - chunks[0][0] > 0.1


def test_in_flight_counts_rise_on_decision_and_fall_when_the_request_ends(stack: LocalStack) -> None:
    long_stream = {"model": MODEL, "prompt": "long", "max_tokens": 500, "stream": True}
    count = 2 * len(stack.endpoints)
    held: dict[str, list[Any]] = {address: [] for address in stack.endpoints}
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as streams, contextlib.ExitStack() as exits:
        for _ in range(count):
            response = exits.enter_context(streams.stream("POST", "/v1/completions", json=long_stream))
            lines = response.iter_lines()
            next(lines)  # routed, streaming, and held open: nothing has been released yet
            # Keep the iterator: dropping a half-read one would close the response.
            held[response.headers[SERVER_HEADER]].append((response, lines))
        # Least-request with nothing finishing: each endpoint holds exactly two of the streams.
        assert sorted(len(v) for v in held.values()) == [2] * len(stack.endpoints)
        freed = stack.endpoints[0]
        for response, _ in held[freed]:
            response.close()  # the client goes away mid-stream; Envoy ends the picker's stream
        with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
            # Once the picker has seen both ends, the freed endpoint (0 in flight) beats the others (2 each),
            # and keeps winning: a finished quick request can lag by at most one count.
            poll(
                lambda: client.post("/v1/completions", json=COMPLETION).headers[SERVER_HEADER] == freed,
                what="a request to the endpoint whose streams ended",
            )
            for _ in range(5):
                assert client.post("/v1/completions", json=COMPLETION).headers[SERVER_HEADER] == freed


@pytest.fixture
def own_stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    options = replace(OPTIONS, envoy=replace(EnvoyOptions(), fail_open=request.param))
    with LocalStack(options, tmp_path) as running:
        yield running


@pytest.mark.parametrize("own_stack", [True], ids=["fail-open"], indirect=True)
def test_picker_down_fail_open_uses_the_fallback_cluster(own_stack: LocalStack, canary: Canary) -> None:
    stack = own_stack
    assert stack.picker is not None
    stack.picker.kill()
    before = canary.connections
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for i in range(6):
            headers = {"x-gateway-destination-endpoint": canary.address} if i % 2 else {}
            response = client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert response.status_code == 200
            assert response.headers[SERVER_HEADER] in stack.endpoints
            assert log_entry(stack, response.headers["x-request-id"])["cluster"] == "inferlb_fallback"
        assert canary.connections == before
        # A restarted picker is used again without touching Envoy.
        stack.start_picker()
        response = client.post("/v1/completions", json=COMPLETION)
        assert log_entry(stack, response.headers["x-request-id"])["cluster"] == "inferlb_picked"


@pytest.mark.parametrize("own_stack", [False], ids=["fail-closed"], indirect=True)
def test_picker_down_fail_closed_fails_fast(own_stack: LocalStack, canary: Canary) -> None:
    stack = own_stack
    assert stack.picker is not None
    stack.picker.kill()
    before = canary.connections
    # The client timeout is the "no hang" bound: a hung request would raise instead of answering.
    with httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for headers in ({}, {"x-gateway-destination-endpoint": canary.address}):
            response = client.post("/v1/completions", json=COMPLETION, headers=headers)
            assert 500 <= response.status_code < 600
            assert SERVER_HEADER not in response.headers
            assert response.json()["error"]["message"]
    assert canary.connections == before
