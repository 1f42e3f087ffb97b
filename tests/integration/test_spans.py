"""The span loop through the real gateway: the emulated servers' llm_request spans reach the picker's OTLP
receiver, are joined to the endpoint each decision chose, and give per-endpoint TTFT statistics that match the
servers' own request logs."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferlb.envoyconf import EnvoyOptions
from inferlb.sim.replay import Shot, replay
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m"
SCALE = 2.0


def _metrics(stack: LocalStack) -> dict[str, Metric]:
    """The picker's /metrics by family name, as prometheus_client parses it (counters without ``_total``)."""
    text = httpx.get(f"{stack.picker_admin_url}/metrics", timeout=5).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_server_spans_are_joined_and_their_p99_matches_the_servers_logs(tmp_path: Path) -> None:
    options = StackOptions(backends=3, models=(MODEL,), policy="default", time_scale=SCALE, spans=True)
    rng = random.Random(3)
    shots = []
    t = 0.0
    with LocalStack(options, tmp_path) as stack:
        for i in range(150):
            t += rng.expovariate(10.0)
            prompt = f"q{i} " + "z" * rng.randrange(400, 16_000)
            shots.append(Shot(f"r{i}", t, stack.gateway_url, MODEL, prompt, rng.randrange(5, 80)))
        records = asyncio.run(replay(shots, time_scale=SCALE, timeout_s=60))
        assert [r.error for r in records] == [None] * len(records)

        logs = {a: httpx.get(f"http://{a}/admin/requests", timeout=5).json()["requests"] for a in stack.endpoints}
        expected = sum(len(v) for v in logs.values())
        assert expected == len(shots)
        deadline = time.monotonic() + 20  # the servers export spans in batches every 0.5 s
        while True:
            rows = httpx.get(f"{stack.picker_admin_url}/endpoints", timeout=5, headers=stack.admin_headers).json()[
                "endpoints"
            ]
            counted = sum((row.get("latency") or {}).get("count") or 0 for row in rows)
            if counted >= expected:
                break
            assert time.monotonic() < deadline, f"only {counted} of {expected} spans arrived"
            time.sleep(0.2)
        metrics = _metrics(stack)

    outcomes = {dict(s.labels)["outcome"]: s.value for s in metrics["inferlb_spans_received"].samples}
    ttft = metrics["inferlb_endpoint_ttft_seconds"]
    assert ttft.type == "histogram"
    assert sum(s.value for s in ttft.samples if s.name.endswith("_count")) == expected
    # Every span joined through the trace id the picker injected, none through the fallback.
    assert outcomes["joined_by_trace"] == expected and outcomes["unjoined"] == 0
    for row in rows:
        log = logs[row["address"]]
        ttfts = np.array([e["ttft_s"] for e in log])
        assert row["latency"]["count"] == len(log)
        # The receiver's P99 sits in a 5% log bucket: within 2.5% of the exact nearest-rank P99.
        exact = float(np.quantile(ttfts, 0.99, method="inverted_cdf"))
        assert math.isclose(row["latency"]["ttft_p99"], exact, rel_tol=0.026), (row["address"], exact, row["latency"])
        assert row["ttft_s"] is not None  # the EWMA reached the scorers' snapshot


def test_a_slowed_server_is_the_hot_row_of_the_heatmap(tmp_path: Path) -> None:
    options = StackOptions(
        backends=3,
        models=(MODEL,),
        policy="round-robin",  # the slow server keeps getting its third, so its row fills in
        time_scale=SCALE,
        spans=True,
        sim_args=("--fault", "0:slowdown=5"),
    )
    rng = random.Random(4)
    with LocalStack(options, tmp_path) as stack:
        shots, t = [], 0.0
        for i in range(90):
            t += rng.expovariate(8.0)
            shots.append(Shot(f"r{i}", t, stack.gateway_url, MODEL, "w" * rng.randrange(2_000, 8_000), 20))
        records = asyncio.run(replay(shots, time_scale=SCALE, timeout_s=60))
        assert [r.error for r in records] == [None] * len(records)
        deadline = time.monotonic() + 20
        while True:
            grid = httpx.get(f"{stack.picker_admin_url}/heatmap.json", timeout=5).json()
            if sum(sum(row) for row in grid["count"]) >= len(shots):
                break
            assert time.monotonic() < deadline, "spans did not all reach the heatmap"
            time.sleep(0.2)
        png = httpx.get(f"{stack.picker_admin_url}/heatmap.png", timeout=30).content
        page = httpx.get(f"{stack.picker_admin_url}/heatmap", timeout=5).text
        slow = stack.endpoints[0]
    (tmp_path / "heatmap.png").write_bytes(png)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "<html" in page.lower() and "heatmap.json" in page
    rows = dict(zip(grid["endpoints"], grid["p95_ttft_s"], strict=True))
    assert set(rows) == set(stack.endpoints)
    hottest = max(rows, key=lambda e: max(v for v in rows[e] if v is not None))
    assert hottest == slow
    others = [v for e, row in rows.items() if e != slow for v in row if v is not None]
    assert min(v for v in rows[slow] if v is not None) > max(others)  # every cell of its row is hotter


def test_envoy_spans_reach_the_receiver_and_server_spans_still_join(tmp_path: Path) -> None:
    options = StackOptions(backends=2, models=(MODEL,), policy="default", spans=True, envoy=EnvoyOptions(tracing=True))
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for i in range(10):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4})
            assert response.status_code == 200
        deadline = time.monotonic() + 20
        while True:
            metrics = _metrics(stack)
            outcomes = {dict(s.labels)["outcome"]: s.value for s in metrics["inferlb_spans_received"].samples}
            joined = outcomes["joined_by_trace"] + outcomes["joined_by_resource"]
            if joined >= 10 and outcomes["envoy"] >= 10:
                break
            assert time.monotonic() < deadline, outcomes
            time.sleep(0.2)
    assert outcomes["unjoined"] == 0
    assert outcomes["joined_by_trace"] == 10, outcomes  # Envoy's tracer did not replace the picker's traceparent


def test_without_spans_the_filter_times_responses_from_the_stream(tmp_path: Path) -> None:
    # otel.latency_source: stream, no receiver, servers that send no spans; one server slowed 5x.
    options = StackOptions(
        backends=3,
        models=(MODEL,),
        policy="round-robin",  # every server keeps its third, so each has enough samples
        latency_source="stream",
        sim_args=("--fault", "0:slowdown=5"),
    )
    rng = random.Random(5)
    with LocalStack(options, tmp_path) as stack:
        shots, t = [], 0.0
        for i in range(120):
            t += rng.expovariate(8.0)
            shots.append(Shot(f"r{i}", t, stack.gateway_url, MODEL, "w" * rng.randrange(2_000, 8_000), 20))
        records = asyncio.run(replay(shots, timeout_s=60))
        assert [(r.error, r.tokens) for r in records] == [(None, 20)] * len(records)  # responses arrive whole
        logs = {a: httpx.get(f"http://{a}/admin/requests", timeout=5).json()["requests"] for a in stack.endpoints}
        deadline = time.monotonic() + 10
        while True:
            rows = httpx.get(f"{stack.picker_admin_url}/endpoints", timeout=5, headers=stack.admin_headers).json()[
                "endpoints"
            ]
            if sum((row.get("latency") or {}).get("count") or 0 for row in rows) >= len(shots):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
        grid = httpx.get(f"{stack.picker_admin_url}/heatmap.json", timeout=5).json()
        metrics = _metrics(stack)
        envoy = stack.envoy_counters("http.inferlb.ext_proc.")
    outcomes = {dict(s.labels)["outcome"]: s.value for s in metrics["inferlb_responses_timed"].samples}
    assert outcomes["ttft"] == len(shots) and outcomes["unknown_endpoint"] == outcomes["not_ok"] == 0
    assert envoy["http.inferlb.ext_proc.streams_failed"] == 0
    clients: dict[str, list[float]] = {}
    for record in records:
        clients.setdefault(record.server, []).append(record.ttft_s or 0.0)
    medians = {}
    for row in rows:
        server = np.median([e["ttft_s"] for e in logs[row["address"]]])
        client = np.median(clients[row["address"]])
        measured = row["latency"]["ttft_p50"]
        assert row["latency"]["count"] == len(logs[row["address"]])
        # The filter's clock runs from just after the routing reply to the first chunk passing Envoy: more than
        # the server's own TTFT, less than the client's (which adds the client's hop and the decision). The
        # median sits in a 5% log bucket, and the picker reads its messages a little late under load.
        assert server * 0.974 - 0.003 <= measured <= client * 1.026 + 0.003, (row["address"], server, measured, client)
        medians[row["address"]] = measured
    slow = stack.endpoints[0]
    assert max(medians, key=medians.__getitem__) == slow
    rows_p95 = dict(zip(grid["endpoints"], grid["p95_ttft_s"], strict=True))
    assert max(rows_p95, key=lambda e: max(v for v in rows_p95[e] if v is not None)) == slow
