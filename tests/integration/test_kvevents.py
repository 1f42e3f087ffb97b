"""The servers' KV events through the real gateway: emulated servers publish what their prefix caches hold, the
picker follows every one of them, and its index agrees with what each server says it holds, also after events
were lost from the live stream (replay fills the gap) and while one server's publisher is silent."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.sim.replay import Shot, replay
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll

pytestmark = pytest.mark.envoy

MODEL = "m"
SCALE = 4.0
BACKENDS = 3


def _options(encoding: str = "map") -> StackOptions:
    return StackOptions(backends=BACKENDS, models=(MODEL,), policy="default", time_scale=SCALE, kv_events=encoding)


def _shots(stack: LocalStack, count: int, seed: int, system: str = "system") -> list[Shot]:
    """Prompts over six long shared system prompts (named ``system``): enough reuse for the caches to matter."""
    rng = random.Random(seed)
    systems = [f"{system} {k}: " + "policy text " * 200 for k in range(6)]
    shots, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(20.0)
        prompt = rng.choice(systems) + f" q{i}" * 30
        shots.append(Shot(f"r{seed}-{i}", t, stack.gateway_url, MODEL, prompt, 4))
    return shots


def _rows(stack: LocalStack) -> list[dict[str, Any]]:
    response = httpx.get(f"{stack.picker_admin_url}/endpoints", timeout=5, headers=stack.admin_headers)
    return list(response.json()["endpoints"])


def _server_blocks(address: str) -> int:
    return len(httpx.get(f"http://{address}/admin/kv-blocks", timeout=5).json()["blocks"])


def _agree(stack: LocalStack) -> list[dict[str, Any]] | None:
    """The picker's rows when every endpoint is live and holds as many blocks as its server says, else None."""
    rows = _rows(stack)
    for row in rows:
        kv = row["kv_events"]
        if not kv["live"] or kv["pending_blocks"] or kv["blocks"] != _server_blocks(row["address"]):
            return None
    return rows


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_index_agrees_with_what_each_server_holds(tmp_path: Path, encoding: str) -> None:
    with LocalStack(_options(encoding), tmp_path) as stack:
        records = asyncio.run(replay(_shots(stack, 120, seed=1), time_scale=SCALE, timeout_s=60))
        assert [r.error for r in records] == [None] * len(records)
        rows = poll(lambda: _agree(stack), "the picker's KV index to agree with every server", timeout=30)
        assert all(row["kv_events"]["blocks"] > 0 for row in rows)


def _fault(address: str, **spec: object) -> None:
    httpx.post(f"http://{address}/admin/faults", json=spec, timeout=5).raise_for_status()


def test_events_lost_from_the_live_stream_are_replayed(tmp_path: Path) -> None:
    with LocalStack(_options(), tmp_path) as stack:
        for address in stack.endpoints:
            _fault(address, kv_events_drop=3)
        records = asyncio.run(replay(_shots(stack, 90, seed=2), time_scale=SCALE, timeout_s=60))
        assert [r.error for r in records] == [None] * len(records)
        rows = poll(lambda: _agree(stack), "the picker's KV index to agree after replays", timeout=30)
        assert {row["kv_events"]["state"] for row in rows} == {"live"}
        metrics = httpx.get(f"{stack.picker_admin_url}/metrics", timeout=5).text
        assert "inferlb_kv_events_replayed_total" in metrics


def test_a_server_whose_events_stop_falls_back_to_the_guess_and_returns(tmp_path: Path) -> None:
    with LocalStack(_options(), tmp_path) as stack:
        silent = stack.endpoints[0]
        _fault(silent, kv_events_pause=True)
        records = asyncio.run(replay(_shots(stack, 60, seed=3), time_scale=SCALE, timeout_s=60))
        assert [r.error for r in records] == [None] * len(records)
        row = poll(
            lambda: next((r for r in _rows(stack) if r["address"] == silent and not r["kv_events"]["live"]), None),
            "the silent server to leave the exact view",
            timeout=30,
        )
        assert "no events" in row["kv_events"]["state"]
        _fault(silent, kv_events_pause=False)
        # Prompts under the system prompts it cached while silent would store blocks whose parents the picker never
        # heard of, and keep it unsure (test_kvindex: mostly orphans); new ones chain up.
        asyncio.run(replay(_shots(stack, 30, seed=4, system="other system"), time_scale=SCALE, timeout_s=60))
        poll(
            lambda: next(r for r in _rows(stack) if r["address"] == silent)["kv_events"]["live"] or None,
            "the server to come back",
            timeout=30,
        )
