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

from inferlb.scorer.promtext import parse_exposition
from inferlb.sim.replay import Shot, replay
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m"
SCALE = 2.0


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
            rows = httpx.get(f"{stack.picker_admin_url}/endpoints", timeout=5).json()["endpoints"]
            counted = sum((row.get("spans") or {}).get("count") or 0 for row in rows)
            if counted >= expected:
                break
            assert time.monotonic() < deadline, f"only {counted} of {expected} spans arrived"
            time.sleep(0.2)
        metrics = parse_exposition(httpx.get(f"{stack.picker_admin_url}/metrics", timeout=5).text)

    outcomes = {dict(s.labels)["outcome"]: s.value for s in metrics.get("inferlb_spans_received").samples}
    # Every span joined through the trace id the picker injected, none through the fallback.
    assert outcomes["joined_by_trace"] == expected and outcomes["unjoined"] == 0
    for row in rows:
        log = logs[row["address"]]
        ttfts = np.array([e["ttft_s"] for e in log])
        assert row["spans"]["count"] == len(log)
        # The receiver's P99 sits in a 5% log bucket: within 2.5% of the exact nearest-rank P99.
        exact = float(np.quantile(ttfts, 0.99, method="inverted_cdf"))
        assert math.isclose(row["spans"]["ttft_p99"], exact, rel_tol=0.026), (row["address"], exact, row["spans"])
        assert row["ttft_s"] is not None  # the EWMA reached the scorers' snapshot
