"""The replicas benchmark (bench/replicas.py): its workload shares long prefixes, and a short live run through
real Envoy and Redis restarts Redis under load without a client error and reports the resynchronisation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from inferlb.bench import replicas
from inferlb.bench.redisserver import REDIS
from inferlb.sim.traces import load_trace


def test_the_workload_is_chats_that_share_long_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    replicas.shared_prefix_trace(path, 200, groups=8, seed=3)
    trace = load_trace(path)
    assert len(trace.requests) == 200
    prefixes = {tuple(r.hash_ids[: replicas.PREFIX_BLOCKS]) for r in trace.requests}
    assert len(prefixes) == 8  # every request opens with one of the shared prompts
    tails = [r.hash_ids[-1] for r in trace.requests]
    assert len(set(tails)) == 200  # and ends with a block of its own


@pytest.mark.envoy
@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_a_short_run_restarts_redis_under_load_without_a_client_error(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    replicas.add_arguments(parser)
    args = parser.parse_args(["--requests", "60", "--runs", "2 pickers, shared, Redis restarted", "--out", str(tmp_path)])
    args.command = "inferlb bench replicas (test)"
    assert replicas.run(args) == 0
    [row] = json.loads((tmp_path / "replicas.json").read_text())["runs"]
    for key in ("replicas", "shared", "sync_delay_ms", "prefix_hit_rate", "ttft_p99_ms", "throughput_rps", "errors"):
        assert key in row
    assert row["errors"] == 0 and row["replicas"] == 2 and row["shared"] is True
    fault = row["redis_restart"]
    assert fault["error"] is None and fault["resync_s"] is not None and fault["down_s"] > 0
    assert "Redis killed" in (tmp_path / "replicas.md").read_text()
