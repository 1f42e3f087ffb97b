"""Tests for sim/server.py: the emulated vLLM server, in process (httpx.ASGITransport) and over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from uvicorn.protocols.http import h11_impl

from inferlb.procs import SERVER_HEADER, free_port
from inferlb.scorer.gpustate import parse_gpu_report
from inferlb.scorer.promtext import read_vllm
from inferlb.sim.engine import EngineModel, EngineOptions, SimRequest
from inferlb.sim.fleet import build_fleet, serving
from inferlb.sim.openai import output_text
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import SEEN_DEST_HEADER, EmulatedServer, ServerOptions
from inferlb.sim.spans import RequestSpans
from inferlb.sim.tokens import count_tokens

from ..conftest import until

H100 = get_profile("h100-llama3.1-8b")
ADDRESS = "127.0.0.1:8001"
# 50x real time, no jitter: a request that takes the engine 1 s takes 20 ms here, and timings are exact.
FAST = ServerOptions(profile=H100, models=("m", "m2"), time_scale=50.0, jitter=0.0, default_max_tokens=7)


def client_for(server: EmulatedServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://sim", timeout=10)


def events(body: str) -> list[Any]:
    assert body.endswith("\n\n")
    out = []
    for event in body[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        payload = event[6:]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture
async def server():
    server = EmulatedServer(ADDRESS, FAST)
    yield server
    await server.aclose()


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        pytest.param("GET", "/health", None, 200, id="health"),
        pytest.param("GET", "/v1/models", None, 200, id="models"),
        pytest.param("GET", "/metrics", None, 200, id="metrics"),
        pytest.param("GET", "/gpu", None, 200, id="gpu"),
        pytest.param("POST", "/v1/completions", {"model": "m", "prompt": "hi"}, 200, id="completion"),
        pytest.param("GET", "/nope", None, 404, id="not-found"),
        pytest.param("GET", "/v1/completions", None, 405, id="wrong-method"),
    ],
)
async def test_every_response_names_the_server_and_echoes_the_destination(server, method, path, body, status):
    async with client_for(server) as client:
        response = await client.request(
            method, path, json=body, headers={"x-gateway-destination-endpoint": "10.0.0.7:80"}
        )
    assert response.status_code == status
    assert response.headers[SERVER_HEADER] == ADDRESS
    assert response.headers[SEEN_DEST_HEADER] == "10.0.0.7:80"
    if status == 405:
        assert response.headers["allow"] == "POST"


async def test_models_list_like_vllm(server):
    async with client_for(server) as client:
        body = (await client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == ["m", "m2"]
    assert body["data"][0]["max_model_len"] == H100.max_model_len
    assert body["data"][0]["owned_by"] == "vllm"


@pytest.mark.parametrize(
    ("body", "prompt_tokens", "completion_tokens", "reason"),
    [
        pytest.param({"prompt": "x" * 401, "max_tokens": 9}, 101, 9, "length", id="text"),
        pytest.param({"prompt": [1, 2, 3, 4, 5]}, 5, 7, "stop", id="token-ids-default-length"),
        pytest.param({"prompt": ["abcd" * 10], "max_tokens": 1}, 10, 1, "length", id="list-of-one"),
        pytest.param({"prompt": [[7] * 33], "max_tokens": 3}, 33, 3, "length", id="ids-list-of-one"),
    ],
)
async def test_completion_counts_tokens_and_returns_exactly_the_asked_length(
    server, body, prompt_tokens, completion_tokens, reason
):
    async with client_for(server) as client:
        response = await client.post("/v1/completions", json={"model": "m", **body})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "text_completion" and result["model"] == "m"
    assert result["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert result["choices"][0]["text"] == output_text(0, completion_tokens)
    assert count_tokens(result["choices"][0]["text"]) == completion_tokens
    assert result["choices"][0]["finish_reason"] == reason


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("chat", [True, False])
async def test_streams_one_event_per_token_then_usage_then_done(server, chat, include_usage):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m2", "stream": True, "max_tokens": 6}
    if chat:
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello there"
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with client_for(server) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    items = events(response.text)
    assert items[-1] == "[DONE]"
    chunks = items[:-1]
    usage = chunks.pop() if include_usage else None
    assert len(chunks) == 6
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    texts = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == output_text(0, 6)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    if include_usage:
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        pytest.param("/v1/completions", b"{bad", 400, "not valid JSON", id="bad-json"),
        pytest.param("/v1/completions", b"[1]", 400, "JSON object", id="not-object"),
        pytest.param("/v1/completions", {"model": "zz", "prompt": "a"}, 404, "`zz` does not exist", id="model"),
        pytest.param("/v1/completions", {"model": "m", "prompt": ""}, 400, "must not be empty", id="empty"),
        pytest.param("/v1/completions", {"model": "m"}, 400, "'prompt'", id="no-prompt"),
        pytest.param("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, 400, "one prompt", id="batch"),
        pytest.param("/v1/completions", {"model": "m", "prompt": [1, -2]}, 400, ">= 0", id="negative-id"),
        pytest.param("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 0}, 400, "at least 1", id="max0"),
        pytest.param("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": "9"}, 400, "integer", id="max-str"),
        pytest.param(
            "/v1/completions",
            {"model": "m", "prompt": "a", "max_tokens": H100.max_model_len},
            400,
            "maximum context length",
            id="too-long",
        ),
        pytest.param("/v1/completions", {"model": "m", "prompt": "a", "stream": 1}, 400, "boolean", id="stream-int"),
        pytest.param(
            "/v1/completions",
            {"model": "m", "prompt": "a", "stream_options": {"include_usage": True}},
            400,
            "stream=True",
            id="usage-no-stream",
        ),
        pytest.param("/v1/chat/completions", {"model": "m", "messages": []}, 400, "'messages'", id="no-messages"),
        pytest.param("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "'messages'", id="str-messages"),
    ],
)
async def test_bad_requests_get_vllm_style_errors(server, path, body, status, message):
    async with client_for(server) as client:
        if isinstance(body, bytes):
            response = await client.post(path, content=body)
        else:
            response = await client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"]
    assert error["code"] == status
    assert server.engine.waiting == type(server.engine.waiting)()  # nothing was queued


async def test_metrics_in_vllm_names_follow_the_engine(server):
    prompt = "shared prefix " * 400
    async with client_for(server) as client:
        for _ in range(3):
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": prompt})).status_code == 200
        snapshot = read_vllm((await client.get("/metrics")).content)
    assert snapshot.running == 0 and snapshot.waiting == 0
    assert snapshot.block_size == H100.block_size and snapshot.num_gpu_blocks == H100.num_gpu_blocks
    assert snapshot.ttft.count == snapshot.e2e_latency.count == snapshot.queue_time.count == 3
    assert snapshot.prefix_cache_queries == 3 * count_tokens(prompt)
    # The 2nd and 3rd requests hit every full block but the last token's.
    assert snapshot.prefix_cache_hits == server.engine.prefix_hits > count_tokens(prompt)
    assert 0 <= snapshot.kv_cache_usage < 0.01


async def test_metrics_show_running_and_waiting_under_load():
    options = dataclasses.replace(FAST, time_scale=1.0)
    server = EmulatedServer(ADDRESS, dataclasses.replace(options, profile=dataclasses.replace(H100, max_num_seqs=2)))
    try:
        async with client_for(server) as client:
            tasks = [
                asyncio.create_task(
                    client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 500})
                )
                for _ in range(5)
            ]
            # max_num_seqs=2: two run, three wait (the second is admitted one step after the first).
            await until(lambda: (len(server.engine.running), len(server.engine.waiting)) == (2, 3))
            snapshot = read_vllm((await client.get("/metrics")).content)
            assert (snapshot.running, snapshot.waiting) == (2, 3)
            assert snapshot.kv_cache_usage > 0
            for task in tasks:
                task.cancel()
    finally:
        await server.aclose()


async def test_gpu_view_uses_the_agent_schema():
    profile = get_profile("h100x4-llama3.1-70b")
    server = EmulatedServer(ADDRESS, ServerOptions(profile=profile, time_scale=1.0))
    try:
        async with client_for(server) as client:
            idle = parse_gpu_report((await client.get("/gpu")).json())
            task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x" * 4000, "max_tokens": 1000}))
            await until(lambda: server.gpu_report() and server.engine.busy_s > 1.2)
            busy = parse_gpu_report((await client.get("/gpu")).json())
            task.cancel()
    finally:
        await server.aclose()
    assert idle.source == "emulated" and idle.host == ADDRESS
    assert len(busy.gpus) == profile.gpu_count == 4
    assert len({g.uuid for g in busy.gpus}) == 4
    assert all(g.name == profile.gpu and g.memory_total_bytes == profile.gpu_memory_bytes for g in busy.gpus)
    assert all(0 < g.memory_used_bytes < g.memory_total_bytes for g in busy.gpus)
    assert busy.gpus[0].utilization_pct > 80


async def test_latencies_are_the_engines_at_any_time_scale():
    """A request's logged latencies equal the engine model's, and the wall time is that over the time scale."""
    reference = EngineModel(H100, EngineOptions(jitter=0.0))
    request = SimRequest("ref", 1000, 300)
    reference.add(request)
    reference.advance(100.0)
    server = EmulatedServer(ADDRESS, dataclasses.replace(FAST, time_scale=20.0))
    try:
        async with client_for(server) as client:
            start = time.monotonic()
            response = await client.post(
                "/v1/completions", json={"model": "m", "prompt": "y" * 4000, "max_tokens": 300}
            )
            wall = time.monotonic() - start
            logged = (await client.get("/admin/requests")).json()["requests"][-1]
    finally:
        await server.aclose()
    assert response.status_code == 200
    # The engine time also counts reading and hashing the prompt (as vLLM's TTFT counts tokenizing): a few ms.
    assert logged["e2e_s"] == pytest.approx(request.e2e_s, abs=0.05)
    assert logged["ttft_s"] == pytest.approx(request.ttft_s, abs=0.05)
    assert wall == pytest.approx(request.e2e_s / 20, abs=0.05)


async def test_spans_carry_vllm_attributes_and_continue_the_trace():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = EmulatedServer(ADDRESS, FAST, spans=RequestSpans(provider))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        async with client_for(server) as client:
            response = await client.post(
                "/v1/completions",
                json={"model": "m", "prompt": "z" * 800, "max_tokens": 12},
                headers={"traceparent": parent},
            )
            logged = (await client.get("/admin/requests")).json()["requests"][-1]
    finally:
        await server.aclose()
    assert response.status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request"
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    attrs = span.attributes
    assert attrs["gen_ai.request.id"] == logged["id"]
    assert attrs["gen_ai.usage.prompt_tokens"] == 200 and attrs["gen_ai.usage.completion_tokens"] == 12
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(logged["ttft_s"])
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(logged["e2e_s"])
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(logged["queue_s"])


async def test_fault_admin_validates_and_applies(server):
    async with client_for(server) as client:
        bad = await client.post("/admin/faults", json={"slowdown": 0})
        assert bad.status_code == 400 and "slowdown" in bad.json()["error"]["message"]
        unknown = await client.post("/admin/faults", json={"explode": True})
        assert unknown.status_code == 400 and "unknown fault explode" in unknown.json()["error"]["message"]
        assert (await client.post("/admin/faults", json=[1])).status_code == 400
        state = (await client.post("/admin/faults", json={"error_rate": 1.0})).json()
        assert state["error_rate"] == 1.0
        failed = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert failed.status_code == 500 and "injected" in failed.json()["error"]["message"]
        await client.post("/admin/faults", json={"error_rate": 0})
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 200


async def test_slowdown_multiplies_latency(server):
    body = {"model": "m", "prompt": "q" * 8000, "max_tokens": 40}
    async with client_for(server) as client:
        await client.post("/v1/completions", json=body)
        await client.post("/admin/faults", json={"slowdown": 5})
        await client.post("/v1/completions", json=body | {"prompt": "r" * 8000})
        normal, slow = (await client.get("/admin/requests")).json()["requests"][-2:]
    assert slow["e2e_s"] == pytest.approx(5 * normal["e2e_s"], rel=0.05)


async def test_hang_holds_requests_until_released(server):
    async with client_for(server) as client:
        await client.post("/admin/faults", json={"hang": True})
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await until(lambda: server.engine.waiting or server.engine.running)
        await asyncio.sleep(0.1)  # 5 s of engine time: a normal request would have finished long ago
        assert not pending.done()
        await client.post("/admin/faults", json={"hang": False})
        response = await asyncio.wait_for(pending, 5)
    assert response.status_code == 200


async def test_start_cold_is_unavailable_until_the_cold_start_passes():
    server = EmulatedServer(ADDRESS, dataclasses.replace(FAST, start_cold=True, cold_start_s=5.0))  # 0.1 s wall
    try:
        async with client_for(server) as client:
            early = await client.get("/health")
            assert early.status_code == 503 and "cold start" in early.json()["error"]["message"]
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 503
            assert (await client.get("/admin/faults")).json()["ready"] is False
            deadline = time.monotonic() + 5
            while (await client.get("/health")).status_code != 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 200
    finally:
        await server.aclose()


@pytest.fixture
async def live():
    """Two emulated servers over loopback, in this event loop."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [EmulatedServer(a, dataclasses.replace(FAST, time_scale=5.0, cold_start_s=10.0)) for a in addresses]
    async with serving(servers):
        yield servers


async def test_streams_arrive_token_by_token_over_loopback(live):
    server = live[0]
    body = {"model": "m", "prompt": "hello", "max_tokens": 100, "stream": True}
    arrivals = []
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", f"http://{server.address}/v1/completions", json=body) as response,
    ):
        assert response.headers[SERVER_HEADER] == server.address
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 100
    # 100 decode steps take ~0.65 s of engine time, 0.13 s here: the tokens came spread out, not in one burst.
    assert arrivals[-1] - arrivals[0] > 0.05


async def test_connections_are_accepted_with_nagle_off(monkeypatch):
    """A token written a few ms after the response headers must not wait for the client's delayed ACK (~40 ms, a
    fixed wall-clock stall that the time scale multiplies): the server's connections have TCP_NODELAY set."""
    seen: list[int] = []
    protocols = [h11_impl.H11Protocol]
    with contextlib.suppress(ImportError):  # uvicorn takes httptools over h11 where it is installed
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        protocols.append(HttpToolsProtocol)
    for protocol_class in protocols:

        def record(protocol, transport, made=protocol_class.connection_made):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            return made(protocol, transport)

        monkeypatch.setattr(protocol_class, "connection_made", record)
    server = EmulatedServer(f"127.0.0.1:{free_port()}", FAST)
    async with serving([server]), httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"http://{server.address}/health")).status_code == 200
    assert seen and all(seen)


async def test_a_client_that_leaves_frees_its_request(live):
    server = live[0]
    body = {"model": "m", "prompt": "w" * 4000, "max_tokens": 5000, "stream": True}
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", f"http://{server.address}/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                request_id = json.loads(line.removeprefix("data: "))["id"]
                break
    # The request is freed first and logged after, in the server's own task: wait for both. This request's own:
    # the module's servers are shared, and an earlier test's request may still be finishing under load.
    entries = await until(lambda: [e for e in server._log if e["id"] == request_id], "its log entry", 30.0)
    assert [e["status"] for e in entries] == ["aborted"]
    assert all(r.id != request_id for r in server.engine.running)


async def test_crash_drops_streams_and_restarts_cold(live):
    server = live[1]
    url = f"http://{server.address}"
    body = {"model": "m", "prompt": "c" * 400, "max_tokens": 5000, "stream": True}
    async with httpx.AsyncClient(timeout=10) as client:
        crashed = False
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and not crashed:
                        crash = await client.post(f"{url}/admin/faults", json={"crash": True})
                        assert crash.json()["restarts"] == 1 and crash.json()["ready"] is False
                        crashed = True
        assert crashed
        assert (await client.get(f"{url}/health")).status_code == 503
        deadline = time.monotonic() + 10  # 10 s of engine time at 5x: 2 s
        while (await client.get(f"{url}/health")).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert (await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 200
    assert server.engine.cache.used == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"time_scale": 0}, "time_scale", id="scale"),
        pytest.param({"cold_start_s": -1}, "cold_start_s", id="cold"),
        pytest.param({"default_max_tokens": 0}, "default_max_tokens", id="default-len"),
        pytest.param({"flush_interval_s_wall": 0}, "flush_interval_s_wall", id="flush"),
    ],
)
def test_options_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ServerOptions(profile=H100, **fields)


def test_a_mixed_fleet_runs_each_servers_own_profile_and_model() -> None:
    l4 = get_profile("l4-llama3.2-3b")
    default = ServerOptions(profile=H100)
    servers = build_fleet(["127.0.0.1:1", "127.0.0.1:2"], default, profiles=[H100, l4])
    assert [(s.options.profile.name, s.options.models) for s in servers] == [
        (H100.name, (H100.model,)),
        (l4.name, (l4.model,)),
    ]
    named = build_fleet(["127.0.0.1:1", "127.0.0.1:2"], FAST, profiles=[H100, l4])
    assert [s.options.models for s in named] == [("m", "m2")] * 2  # names the operator gave stay
    with pytest.raises(ValueError, match="1 profiles for 2 servers"):
        build_fleet(["127.0.0.1:1", "127.0.0.1:2"], FAST, profiles=[l4])


async def test_an_emulated_server_takes_as_many_connections_as_envoy_opens(live):
    # Envoy opens a connection to a server per request it has in flight there, as vLLM's uvicorn takes them: the
    # admin API's cap (256 connections) must not apply to the servers standing in for vLLM.
    host, port = live[0].address.rsplit(":", 1)
    opened = []
    try:
        for _ in range(300):
            opened.append(await asyncio.open_connection(host, int(port)))
        for _, writer in opened:
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        statuses = [(await reader.readline()).split()[1] for reader, _ in opened]
    finally:
        for _, writer in opened:
            writer.close()
    assert statuses == [b"200"] * 300
