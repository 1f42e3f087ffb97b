"""Real vLLM behind Envoy and the picker: the picker reads the servers' own ``/metrics`` and routes real requests.

Two vLLM CPU servers (see conftest.py) serve a tiny random-weights model. What the emulator can only imitate is
checked against the real thing here: the metric names and labels the scraper reads, vLLM's OpenAI responses
(plain and streamed) passing through Envoy, and the picker's error replies in front of a real server.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.kvsubscriber import KVEventCollector, KVEventOptions
from inferlb.scorer.pool import Pool
from inferlb.scorer.promtext import read_families, read_vllm, read_vllm_signals
from inferlb.scorer.signals import Signals
from inferlb.scorer.tokenizer import HuggingFaceTokenizer, cache_keys
from inferlb.stack import LocalStack

from ..conftest import poll, until
from ..integration.conftest import log_entry
from .conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MODEL, VllmServer

# Starting two vLLM servers is part of the first test's time.
pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(400)]

# vLLM's start-up line: "GPU KV cache size: 32,768 tokens" (the CPU backend says GPU too).
_KV_TOKENS_LOGGED = re.compile(r"KV cache size: ([\d,]+) tokens")


def _cache_config(server: VllmServer) -> dict[str, str]:
    samples = read_families(server.metrics(), ["vllm:cache_config_info"]).samples("vllm:cache_config_info")
    assert samples, f"{server.address} prints no vllm:cache_config_info"
    (sample,) = samples
    return dict(sample.labels)


def test_signals_are_read_from_the_servers_metrics(vllm_servers: list[VllmServer], stack: LocalStack) -> None:
    capacity = []  # KV-cache tokens per server
    for server in vllm_servers:
        body = server.metrics()
        full, fast = read_vllm(body, model=MODEL), read_vllm_signals(body)
        config = _cache_config(server)
        assert config["kv_cache_memory_bytes"] == str(KV_CACHE_BYTES)
        assert config["enable_prefix_caching"] == "True"
        assert full.block_size == fast.block_size == int(config["block_size"])
        assert full.num_gpu_blocks == fast.num_gpu_blocks == int(config["num_gpu_blocks"])
        assert full.block_size and full.num_gpu_blocks, "no KV-cache geometry in the scrape"
        logged = _KV_TOKENS_LOGGED.findall(server.log())
        assert logged, "vLLM did not log its KV cache size"
        assert int(logged[-1].replace(",", "")) == full.num_gpu_blocks * full.block_size
        capacity.append(full.num_gpu_blocks * full.block_size)
        assert full.running == fast.running is not None
        assert full.waiting == fast.waiting is not None
        assert full.kv_cache_usage == fast.kv_cache_usage is not None

    # The picker's own collector, configured as the running picker is, reads the same servers.
    pool = Pool(stack.config.endpoints)
    signals = Signals(len(pool), stale_after_s=stack.config.signals.stale_after_s)
    options = CollectorOptions(stack.config.signals.scrape_interval_s, stack.config.signals.scrape_timeout_s)
    collector = MetricsCollector(pool, signals, options)

    async def scrape() -> None:
        try:
            await collector.scrape_once()
        finally:
            await collector.aclose()

    asyncio.run(scrape())
    snapshot = signals.snapshot
    assert snapshot.up.all() and not np.isnan(snapshot.scraped_at).any(), collector.last_error
    assert snapshot.kv_tokens.tolist() == capacity
    assert not np.isnan(snapshot.kv_usage).any() and not np.isnan(snapshot.running).any()
    # ... and so does the running picker: its admin API shows every endpoint up and fresh.
    url = f"http://{stack.picker_admin_address}/endpoints"
    rows = httpx.get(url, timeout=10, headers=stack.admin_headers).json()["endpoints"]
    assert [r["address"] for r in rows] == [s.address for s in vllm_servers]
    assert all(r["up"] and not r["stale"] and r["kv_cache_tokens"] in capacity for r in rows), rows
    picker_log = stack.workdir.joinpath("picker.log").read_text(encoding="utf-8")
    assert "metrics scrape of" not in picker_log, picker_log


def _request(i: int) -> tuple[str, dict[str, Any]]:
    """The i-th request of the burst: completions and chats, every third streamed."""
    prompt = f"The load balancer picks a server for request {i}."
    # ignore_eos: random weights may emit the end token at once, which would make an empty answer.
    common = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "stream": i % 3 == 0}
    if common["stream"]:
        common["stream_options"] = {"include_usage": True}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


def _send(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, str, str, dict[str, Any] | None]:
    """POST one request; returns the status, Envoy's request id, the generated text (or the error body) and the
    usage (from the last chunk when streamed)."""
    chat = path.endswith("chat/completions")
    with client.stream("POST", path, json=body) as response:
        request_id = response.headers["x-request-id"]
        if response.status_code != 200:
            return response.status_code, request_id, response.read().decode(), None
        if not body["stream"]:
            reply = json.loads(response.read())
            choice = reply["choices"][0]
            return 200, request_id, choice["message"]["content"] if chat else choice["text"], reply["usage"]
        assert response.headers["content-type"].startswith("text/event-stream")
        text, usage = [], None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return 200, request_id, "".join(text), usage


def _successes(server: VllmServer) -> float:
    found = read_families(server.metrics(), ["vllm:request_success_total"])
    return float(sum(s.value for s in found.samples("vllm:request_success_total")))


def test_a_burst_through_the_gateway_is_answered_by_both_servers(
    vllm_servers: list[VllmServer], stack: LocalStack
) -> None:
    before = [_successes(s) for s in vllm_servers]
    requests = [_request(i) for i in range(16)]
    with httpx.Client(base_url=stack.gateway_url, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: _send(client, *r), requests))

    served: dict[str, int] = {}
    for (path, body), (status, request_id, text, usage) in zip(requests, results, strict=True):
        assert status == 200, f"{path} (stream={body['stream']}) answered {status}: {text}"
        assert text, f"{path} (stream={body['stream']}) answered no text"
        assert usage is not None and usage["completion_tokens"] == body["max_tokens"] and usage["prompt_tokens"] > 0
        entry = log_entry(stack, request_id)
        assert entry["cluster"] == "inferlb_picked"
        assert entry["picked"] == entry["upstream"] in stack.endpoints
        served[entry["upstream"]] = served.get(entry["upstream"], 0) + 1
    assert set(served) == set(stack.endpoints), f"one server got every request: {served}"
    # vLLM's own counters agree with Envoy on who served what. A server counts a request just after answering
    # it, so poll.
    expected = [before[i] + served[s.address] for i, s in enumerate(vllm_servers)]
    deadline = time.monotonic() + 10
    while (counted := [_successes(s) for s in vllm_servers]) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted == expected, f"vLLM counted {counted} successes; Envoy's log says {expected}"


@pytest.mark.parametrize(
    ("path", "content", "status", "words"),
    [
        pytest.param("/v1/completions", json.dumps({"model": "nope"}), 404, "'nope'", id="unknown-model"),
        pytest.param("/v1/completions", '{"model": "tiny", "prompt": ', 400, "not valid JSON", id="malformed-json"),
        pytest.param("/v1/chat/completions", json.dumps({"messages": []}), 400, "'model'", id="no-model"),
    ],
)
def test_bad_requests_are_refused_and_lose_nothing(
    stack: LocalStack, path: str, content: str, status: int, words: str
) -> None:
    with httpx.Client(base_url=stack.gateway_url, timeout=60) as client:
        response = client.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert words in error["message"] and int(error["code"]) == status
        # Refused by the picker, before any server: Envoy logged no upstream for it.
        assert log_entry(stack, response.headers["x-request-id"])["upstream"] not in stack.endpoints
        ok = _send(client, *_request(1))
        assert ok[0] == 200 and ok[2], ok


# ---------------------------------------------------------------- KV events


def _raw_events(server: VllmServer, timeout_s: float = 10.0) -> list[Any]:
    """Every event batch ``server`` still buffers, asked of its replay socket from sequence 0, as plain msgpack."""
    import msgpack
    import zmq

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{server.kv_replay_port}")
    batches: list[Any] = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append(msgpack.unpackb(frames[3], raw=False, strict_map_key=False))
    finally:
        dealer.close()
        context.term()


def test_the_index_built_from_real_vllm_events_matches_the_prompts_the_picker_tokenizes(
    vllm_servers: list[VllmServer], tiny_model: Path, stack: LocalStack
) -> None:
    """A prompt sent to one server is found there, block for block, by the keys the picker computes from the
    model's own tokenizer; the picker's own index (behind Envoy) holds what each server's events say it holds."""
    block_size = read_vllm(vllm_servers[0].metrics()).block_size
    assert block_size
    prompt = "The picker routes each request to the server that holds its prefix. " * 24
    ids = HuggingFaceTokenizer(tiny_model).text_ids(prompt)
    full_blocks = min(len(ids), MAX_MODEL_LEN - 8) // block_size
    assert full_blocks >= 2
    target = vllm_servers[1]
    response = httpx.post(
        f"{target.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60
    )
    response.raise_for_status()
    assert response.json()["usage"]["prompt_tokens"] == len(ids)  # the picker tokenizes as the server does

    # The encoding this vLLM publishes: events as maps tagged by "type".
    raw = poll(lambda: [b for b in _raw_events(target) if b[1]] or None, "the server's KV events", timeout=30)
    assert {type(e) for batch in raw for e in batch[1]} == {dict}
    assert any(e["type"] == "BlockStored" for batch in raw for e in batch[1])

    async def follow() -> list[int]:
        clock = time.monotonic
        index = KVBlockIndex(2, clock=clock, block_size=block_size)
        pool = Pool([EndpointConfig(s.address, frozenset({MODEL})) for s in vllm_servers])
        options = KVEventOptions(
            vllm_servers[0].kv_port,
            ports={s.address: s.kv_port for s in vllm_servers},
            replay_ports={s.address: s.kv_replay_port for s in vllm_servers},
        )
        collector = KVEventCollector(pool, index, options)
        task = asyncio.create_task(collector.run())
        try:
            await until(lambda: index.live.all() or None, "both servers' event streams", timeout=30)
            # A new event (another prompt) makes the collector replay what came before it from sequence 0.
            async with httpx.AsyncClient(timeout=60) as client:
                other = {"model": MODEL, "prompt": "Another prompt entirely, long enough for a block. " * 8}
                for server in vllm_servers:
                    (
                        await client.post(f"{server.url}/v1/completions", json={**other, "max_tokens": 2})
                    ).raise_for_status()
            keys = cache_keys(ids, block_size)
            return await until(
                lambda: (c := index.match_depth(keys)[0]).any() and c.tolist(), "the prompt's blocks", timeout=30
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await collector.aclose()

    assert asyncio.run(follow()) == [0, full_blocks]

    def picker_agrees() -> list[dict[str, Any]] | None:
        rows = httpx.get(f"{stack.picker_admin_url}/endpoints", timeout=5, headers=stack.admin_headers).json()
        rows = rows["endpoints"]
        return rows if all(r["kv_events"]["live"] and r["kv_events"]["blocks"] > 0 for r in rows) else None

    rows = poll(picker_agrees, "the picker to follow both servers' events", timeout=30)
    by_address = {r["address"]: r["kv_events"]["blocks"] for r in rows}
    for server in vllm_servers:
        stored: set[Any] = set()
        for _, events, *_ in _raw_events(server):
            for event in events:
                if event["type"] == "BlockStored":
                    stored.update(map(_hashable, event["block_hashes"]))
                elif event["type"] == "BlockRemoved":
                    stored.difference_update(map(_hashable, event["block_hashes"]))
                else:
                    stored.clear()
        assert by_address[server.address] == len(stored)


def _hashable(value: Any) -> Any:
    return bytes(value) if isinstance(value, bytearray | list) else value
