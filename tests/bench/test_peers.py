"""Tests for bench/peers.py: each peer router starts on loopback, routes streamed and plain completions to both
emulated servers with full outputs, (vllm-router cache_aware) gets its per-request render calls answered, and
(vllm-router consistent_hash) keeps a prompt on one server."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.bench.peers import PEERS, Peer, available, start_peer
from inferlb.procs import ManagedProcess, ProcessError, free_port, stop_all
from inferlb.sim.fleet import serving
from inferlb.sim.openai import output_text
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from ..conftest import until

pytestmark = pytest.mark.peers

MODEL = "m"
MAX_TOKENS = 6
REQUESTS = 10
HASHED_REQUESTS = 40
# 50x real time: a request takes the emulated engine tens of ms, a few ms here. Render answered, as after
# `vllm serve --enable-scale-out`, so that vllm-router's cache_aware mode gets what it asks for.
H100 = get_profile("h100-llama3.1-8b")
OPTIONS = ServerOptions(profile=H100, models=(MODEL,), time_scale=50.0, enable_scale_out=True)


async def _complete(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    # Prompts differ from their first character, so no prefix ties them to one server.
    body = {"model": MODEL, "prompt": f"{i} request {i}: " + "words " * 40, "max_tokens": MAX_TOKENS}
    if i % 2:
        text, done = [], False
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return response.status_code, "".join(text) if done else "(stream ended without [DONE])"
    response = await client.post("/v1/completions", json=body)
    return response.status_code, response.json()["choices"][0]["text"] if response.status_code == 200 else response.text


async def _get(url: str) -> Any:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(url)
    response.raise_for_status()
    return response.json()


@asynccontextmanager
async def _peer_before_two_servers(
    peer: Peer, tmp_path: Path
) -> AsyncIterator[tuple[list[EmulatedServer], ManagedProcess, httpx.AsyncClient]]:
    """``peer`` started in front of two emulated servers: the servers, its process and a client to it."""
    reason = available(peer)
    if reason is not None:
        pytest.fail(reason)  # not a skip: a benchmark without its peers must say so
    # power_of_two weighs the requests it has in flight per server (vLLM has no /get_load): at 50x real time a
    # request could end before the next arrived, every choice a tie, and all ten went to one server now and then.
    # At 5x they overlap.
    options = dataclasses.replace(OPTIONS, time_scale=5.0) if peer.policy == "power_of_two" else OPTIONS
    servers = [EmulatedServer(f"127.0.0.1:{free_port()}", options) for _ in range(2)]
    async with serving(servers):
        listen = f"127.0.0.1:{free_port()}"
        # start_peer polls with blocking sleeps; the servers it waits for answer from this event loop.
        process = await asyncio.to_thread(start_peer, peer, [s.address for s in servers], listen, tmp_path)
        try:
            async with httpx.AsyncClient(base_url=f"http://{listen}", timeout=20) as client:
                yield servers, process, client
        finally:
            await asyncio.to_thread(process.stop)


# Dynamo runs in its own venv and network namespace (make bench-dynamo-live); its test is below.
ROUTERS = [p for p in PEERS if p.kind != "dynamo"]
DYNAMO = next(p for p in PEERS if p.kind == "dynamo")


@pytest.mark.parametrize("peer", [pytest.param(p, id=p.name.replace(" ", "-")) for p in ROUTERS])
async def test_peer_routes_completions_to_both_servers(peer: Peer, tmp_path: Path):
    # A hashing peer puts each distinct prompt on a server of its ring: with 40 prompts, all on one of two servers
    # is a chance below 1e-7 even for a ring split 2:1.
    requests = HASHED_REQUESTS if peer.policy == "consistent_hash" else REQUESTS
    async with _peer_before_two_servers(peer, tmp_path) as (servers, process, client):
        results = await asyncio.gather(*(_complete(client, i) for i in range(requests)))
        logs = [await _get(f"http://{s.address}/admin/requests") for s in servers]
        routes = [(await _get(f"http://{s.address}/admin/routes"))["routes"] for s in servers]
    assert results == [(200, output_text(0, MAX_TOKENS))] * requests, process.log_tail()
    served = [len(log["requests"]) for log in logs]
    assert sum(served) == requests
    assert all(served), f"{peer.name} sent every request to one server: {served}; routes seen: {routes}"
    side_calls: Counter[str] = Counter()
    for counts in routes:
        side_calls.update({k: n for k, n in counts.items() if "/tokenize" in k or "/render" in k})
    assert all(k.endswith(" 200") for k in side_calls), f"side calls answered with errors: {side_calls}"
    if peer.name == "vllm-router cache_aware":
        # It renders every completion on every worker; had those failed it would be measured crippled.
        assert side_calls["POST /v1/completions/render 200"] == requests * len(servers), routes
    if peer.policy == "consistent_hash":
        assert not side_calls, f"consistent_hash asked the servers {side_calls}"


async def test_consistent_hash_sends_a_repeated_prompt_where_it_went_first(tmp_path: Path):
    """What the simulator's model of it assumes: the key is the request's text, so a prompt sent again goes to the
    same server however loaded, and distinct prompts spread."""
    peer = next(p for p in PEERS if p.policy == "consistent_hash")
    chosen = []
    async with _peer_before_two_servers(peer, tmp_path) as (servers, _, client):
        for i in (0, 1, 2, 3):
            # At once: were it balancing load, the second and later copies would go to the idle server.
            await asyncio.gather(*(_complete(client, i) for _ in range(4)))
            logs = [await _get(f"http://{s.address}/admin/requests") for s in servers]
            chosen.append([len(log["requests"]) for log in logs])
    # After each prompt's four copies, exactly one server's count grew, by four.
    before = [0, 0]
    for counts in chosen:
        grew = sorted(after - was for after, was in zip(counts, before, strict=True))
        assert grew == [0, 4], f"a prompt's copies were split between servers: {chosen}"
        before = counts


def test_a_missing_peer_is_named_with_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    peer = next(p for p in PEERS if p.name == "sglang-router cache_aware")
    reason = available(peer)
    assert reason is not None
    assert reason.startswith("sglang-router cache_aware: sglang-router is not installed")
    assert "pip install 'sglang-router==0.3.2'" in reason
    with pytest.raises(ProcessError, match="is not installed"):
        start_peer(peer, ["127.0.0.1:1"], "127.0.0.1:2", tmp_path)


@pytest.mark.parametrize(
    ("workers", "listen", "words"),
    [
        pytest.param(["127.0.0.1:1"], "0.0.0.0:8000", "must be a loopback address", id="all-interfaces"),
        pytest.param(["127.0.0.1:1"], "localhost:8000", "not a literal IP", id="hostname"),
        pytest.param([], "127.0.0.1:8000", "at least one worker", id="no-workers"),
        pytest.param(["worker:1"], "127.0.0.1:8000", "not a literal IP", id="bad-worker"),
    ],
)
def test_bad_addresses_are_refused_before_anything_starts(workers, listen, words, tmp_path: Path):
    with pytest.raises(ValueError, match=words):
        start_peer(PEERS[0], workers, listen, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(available(DYNAMO) is None, reason="ai-dynamo is installed here")
def test_dynamo_says_where_it_runs(tmp_path: Path):
    reason = available(DYNAMO)
    assert reason is not None
    assert "make bench-dynamo-live" in reason
    with pytest.raises(ProcessError, match="bench-dynamo-live"):
        start_peer(DYNAMO, ["127.0.0.1:1"], "127.0.0.1:2", tmp_path, kv_events_ports=[3])


@pytest.mark.skipif(
    available(DYNAMO) is not None,
    reason="needs ai-dynamo and a loopback-only network namespace: .venv/dynamo under unshare --net (make test-dynamo)",
)
async def test_dynamo_routes_to_both_servers_and_sends_a_cached_prompt_where_its_blocks_are(tmp_path: Path):
    """Dynamo's frontend and KV router before two servers that publish KV events: distinct prompts spread, and a
    long prompt sent again, one at a time, goes where the relayed events say its blocks are cached."""
    servers = [
        EmulatedServer(f"127.0.0.1:{free_port()}", dataclasses.replace(OPTIONS, kv_events_port=free_port()))
        for _ in range(2)
    ]
    long_prompt = "a long shared document " * 200  # 72 blocks of 64 characters
    async with serving(servers):
        listen = f"127.0.0.1:{free_port()}"
        helpers: list[ManagedProcess] = []
        ports = [s.options.kv_events_port for s in servers]
        process = await asyncio.to_thread(
            start_peer, DYNAMO, [s.address for s in servers], listen, tmp_path, kv_events_ports=ports, helpers=helpers
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://{listen}", timeout=20) as client:
                results = await asyncio.gather(*(_complete(client, i) for i in range(REQUESTS)))
                spread = [len((await _get(f"http://{s.address}/admin/requests"))["requests"]) for s in servers]
                body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 2}
                # The distinct prompts' blocks first (their events follow their answers), then the long prompt's.
                applied = await until(lambda: _events_applied(client), "the first prompts' KV events applied", 10.0)
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                first = [len((await _get(f"http://{s.address}/admin/requests"))["requests"]) for s in servers]
                holder = max((0, 1), key=lambda i: first[i] - spread[i])

                async def relayed() -> bool:  # the blocks' events reach the router after the answer
                    return await _events_applied(client) > applied

                await until(relayed, "the long prompt's KV events applied by Dynamo's router", 10.0)
                for _ in range(4):
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                after = [len((await _get(f"http://{s.address}/admin/requests"))["requests"]) for s in servers]
        finally:
            await asyncio.to_thread(stop_all, [process, *helpers])
    # Dynamo's answer is its own detokenizer's text of the worker's tokens: one character per server token here.
    assert [(status, len(text)) for status, text in results] == [(200, MAX_TOKENS)] * REQUESTS, process.log_tail()
    assert all(spread), f"Dynamo sent every distinct prompt to one server: {spread}"
    assert after[holder] - first[holder] == 4, f"the repeated prompt left its cached blocks: {first} -> {after}"


async def _events_applied(client: httpx.AsyncClient) -> float:
    """The KV events Dynamo's router has applied to its index (its frontend's metric, summed over labels)."""
    text = (await client.get("/metrics")).text
    name = "dynamo_component_kv_cache_events_applied"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
