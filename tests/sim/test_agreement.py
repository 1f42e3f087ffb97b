"""The live emulator and the discrete-event simulator agree: one small trace, one seed, both clocks.

The same requests go to the same servers (request i to server i % 2) in both; the live fleet runs as a real
``inferlb sim`` process and is driven open-loop over loopback. Medians of time to first token and end-to-end time
must agree within 10%, both as the servers log them (engine time) and as the client saw them (wall time x the time
scale). The live run is at real time: the client's own overhead (a few ms of wall time per request for HTTP and
JSON on a loaded machine) is multiplied by the time scale, and at 2x it already costs ~5 of the 10 points.
`tests/sim/test_server.py` checks that a scaled server reports the same engine times.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import httpx
import pytest

from inferlb.procs import free_port
from inferlb.sim.des import Arrival, simulate
from inferlb.sim.profiles import get_profile
from inferlb.sim.replay import Shot, replay
from inferlb.sim.tokens import count_tokens, text_block_hashes
from inferlb.stack import start_sim

PROFILE = get_profile("h100-llama3.1-8b")
SCALE = 1.0
SERVERS = 2
SEED = 11
MODEL = "agree"


def workload() -> list[tuple[float, str, int]]:
    """30 requests over ~8 s: long prompts from 6 shared system prompts plus a unique question, mixed lengths."""
    rng = random.Random(5)
    systems = [f"system prompt {k}: " + "".join(rng.choice("abcdefgh ") for _ in range(16_000)) for k in range(6)]
    out = []
    t = 0.0
    for i in range(30):
        t += rng.expovariate(4.0)
        question = f" question {i}: " + "".join(rng.choice("xyz ") for _ in range(rng.randrange(4_000, 30_000)))
        out.append((round(t, 3), systems[i % 6] + question, rng.randrange(40, 240)))
    return out


def median(values) -> float:
    return statistics.median(v for v in values if v is not None)


@pytest.fixture
def fleet(tmp_path):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(SERVERS)]
    args = ["--profile", PROFILE.name, "--model", MODEL, "--time-scale", str(SCALE), "--seed", str(SEED)]
    process = start_sim(addresses, tmp_path / "sim.log", *args)
    try:
        yield addresses
    finally:
        process.stop()


def test_live_server_and_des_agree_on_medians(fleet):
    requests = workload()
    arrivals = [
        Arrival(f"r{i}", at, count_tokens(text), out, text_block_hashes(text, PROFILE.block_size))
        for i, (at, text, out) in enumerate(requests)
    ]
    sim = simulate(arrivals, lambda a, v: int(a.id[1:]) % SERVERS, [PROFILE] * SERVERS, seed=SEED)
    assert all(r.error is None for r in sim.records)

    shots = [
        Shot(f"r{i}", at, f"http://{fleet[i % SERVERS]}", MODEL, text, out)
        for i, (at, text, out) in enumerate(requests)
    ]
    client = asyncio.run(replay(shots, time_scale=SCALE, timeout_s=60))
    assert [c.error for c in client] == [None] * len(shots)
    assert [c.tokens for c in client] == [out for _, _, out in requests]
    assert [c.server for c in client] == [fleet[i % SERVERS] for i in range(len(shots))]

    logged = []
    for address in fleet:
        logged += httpx.get(f"http://{address}/admin/requests", timeout=5).json()["requests"]
    assert len(logged) == len(shots)
    assert {e["status"] for e in logged} == {"finished"}

    des_ttft, des_e2e = median(r.ttft_s for r in sim.records), median(r.e2e_s for r in sim.records)
    checks = {
        "server ttft": (median(e["ttft_s"] for e in logged), des_ttft),
        "server e2e": (median(e["e2e_s"] for e in logged), des_e2e),
        "client ttft": (median(c.ttft_s for c in client) * SCALE, des_ttft),
        "client e2e": (median(c.e2e_s for c in client) * SCALE, des_e2e),
    }
    # Both clocks must see the prefix cache the same way, too.
    assert sum(e["cached_tokens"] for e in logged) == sum(r.cached_tokens for r in sim.records) > 0
    for name, (live, des) in checks.items():
        assert live == pytest.approx(des, rel=0.10), f"{name}: live {live:.3f} s vs DES {des:.3f} s"
