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
from typing import Any

import httpx
import numpy as np
import pytest

from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.pool import Pool
from inferlb.scorer.promtext import read_families, read_vllm, read_vllm_signals
from inferlb.scorer.signals import Signals
from inferlb.stack import LocalStack

from ..integration.conftest import log_entry
from .conftest import KV_CACHE_BYTES, MODEL, VllmServer

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
