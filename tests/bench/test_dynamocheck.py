"""The Dynamo check: the real router's adapter (its tokens, its missing-runtime error, a short run where the runtime
is installed) and the report's agreement rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from inferlb.bench import dynamoreal
from inferlb.bench.dynamocheck import CONTENDERS, _markdown, summarise
from inferlb.bench.dynamoreal import RealDynamoKv, block_tokens, loopback_only
from inferlb.sim.profiles import fleet_of

HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None


def test_a_block_is_the_same_tokens_wherever_it_appears_and_others_differ() -> None:
    assert block_tokens(12345, 16) == block_tokens(12345, 16)
    assert len(block_tokens(12345, 16)) == 16
    assert block_tokens(12345, 16) != block_tokens(12346, 16)


def test_it_refuses_to_start_where_other_interfaces_could_reach_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dynamoreal, "loopback_only", lambda: ["eth0"])
    with pytest.raises(RuntimeError, match=r"unshare --net.*eth0"):
        RealDynamoKv(fleet_of("h100-llama3.1-8b", 2), seed=0)


@pytest.mark.skipif(HAVE_DYNAMO, reason="the runtime is installed here")
def test_without_the_runtime_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dynamoreal, "loopback_only", lambda: [])
    with pytest.raises(RuntimeError, match="make bench-dynamo"):
        RealDynamoKv(fleet_of("h100-llama3.1-8b", 2), seed=0)


def _row(contender: str, seed: int, hit: float, p99: float) -> dict[str, object]:
    return {"trace": "t.jsonl", "load": 0.6, "seed": seed, "contender": contender, "prefix_hit_rate": hit,
            "ttft_p50_ms": 100.0, "ttft_p99_ms": p99, "errors": 0}  # fmt: skip


def test_the_model_agrees_where_its_mean_is_within_the_real_routers_range_widened_by_five_percent() -> None:
    real, model = CONTENDERS
    rows = [
        _row(real, 0, 0.20, 1000.0),
        _row(real, 1, 0.22, 1100.0),
        _row(model, 0, 0.21, 1200.0),  # p99 mean 1,200 > 1,100 x 1.05
        _row(model, 1, 0.23, 1200.0),  # hit mean 0.22: inside
    ]
    (entry,) = summarise(rows)
    assert entry["agrees"] == {"prefix_hit_rate": True, "ttft_p50_ms": True, "ttft_p99_ms": False}
    text = _markdown(
        {
            "meta": {"date": "d", "command": "c", "machine": "m", "dynamo_runtime": "1", "profile": "p",
                     "servers": 16, "requests": 2000},
            "summary": [entry],
        }
    )  # fmt: skip
    assert "| t.jsonl | 0.6 | 0.210 [0.200-0.220] | 0.220 [0.210-0.230] |" in text
    assert "1,200 [1,200-1,200] * |" in text


@pytest.mark.skipif(
    not HAVE_DYNAMO or bool(loopback_only()),
    reason="needs ai-dynamo-runtime and a loopback-only network namespace: in .venv/dynamo under unshare --net",
)
def test_the_real_router_routes_a_trace_and_follows_the_servers_caches() -> None:
    from inferlb.bench.desrun import capacity_rps, load_arrivals, scaled, sim_figures
    from inferlb.sim.des import simulate

    profiles = fleet_of("h100-llama3.1-8b", 4)
    trace = Path(__file__).parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    arrivals = load_arrivals(str(trace), 200, profiles[0].block_size)
    policy = RealDynamoKv(profiles, seed=0)
    try:
        result = simulate(scaled(arrivals, 0.5 * 4 * capacity_rps(arrivals, profiles[0], 0)), policy, profiles,
                          seed=0, on_finish=policy.finished)  # fmt: skip
    finally:
        policy.close()
    figures = sim_figures(result)
    assert figures["errors"] == 0
    assert len({r.server for r in result.records}) == 4
    assert (figures["prefix_hit_rate"] or 0) > 0
