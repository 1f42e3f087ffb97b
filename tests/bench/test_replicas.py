"""The replicas benchmark (bench/replicas.py): its workload shares long prefixes, a short live run through real
Envoy and Redis restarts Redis under load without a client error and reports the resynchronisation, and the
throughput runs load 1 and 2 workers and count every worker's CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferlb.bench import replicas
from inferlb.bench.desrun import DesJob, capacity_rps, load_arrivals, replicated_name, run_job
from inferlb.bench.exchangecost import exchange_rows
from inferlb.bench.policies import Replicated
from inferlb.bench.redisserver import REDIS
from inferlb.bench.workersload import picker_pids, worker_ratios
from inferlb.sim.des import Arrival, FleetView
from inferlb.sim.profiles import get_profile
from inferlb.sim.traces import load_trace


def _run(argv: list[str]) -> int:
    """``inferlb bench replicas`` with ``argv``, as the CLI runs it."""
    parser = argparse.ArgumentParser()
    replicas.add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = "inferlb bench replicas (test)"
    return replicas.run(args)


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
    assert (
        _run(
            [
                "--requests",
                "60",
                "--runs",
                "2 pickers, shared, Redis restarted",
                "--modes",
                "live",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    [row] = json.loads((tmp_path / "replicas.json").read_text())["runs"]
    for key in ("replicas", "shared", "sync_delay_ms", "prefix_hit_rate", "ttft_p99_ms", "throughput_rps", "errors"):
        assert key in row
    assert row["errors"] == 0 and row["replicas"] == 2 and row["shared"] is True
    fault = row["redis_restart"]
    assert fault["error"] is None and fault["resync_s"] is not None and fault["down_s"] > 0
    assert "Redis killed" in (tmp_path / "replicas.md").read_text()


def _view(now: float, n: int) -> FleetView:
    return FleetView(now, tuple(f"server-{i}" for i in range(n)), [None] * n, [0] * n, [0] * n, ())


def test_the_replica_model_shows_each_replica_the_others_as_they_were_the_delay_earlier() -> None:
    profiles = [get_profile("h100-llama3.1-8b")] * 3
    model = Replicated("least-request", profiles, seed=1, replicas=2, sync_delay_s=0.05)
    first = model(Arrival("a", 0.0, 100, 10), _view(0.0, 3))  # replica 0 routes it
    assert isinstance(first, int)
    peer = model.replicas[1]
    model(Arrival("b", 0.01, 100, 10), _view(0.01, 3))  # replica 1, 10 ms later: it has not heard yet
    assert peer.inflight.peer_requests.sum() == 0
    model(Arrival("c", 0.02, 100, 10), _view(0.02, 3))  # replica 0 again
    model(Arrival("d", 0.065, 100, 10), _view(0.065, 3))  # replica 1, 65 ms: it counts a, not c (20 ms)
    assert peer.inflight.peer_requests.tolist() == [int(i == first) for i in range(3)]
    unsynced = Replicated("least-request", profiles, seed=1, replicas=2, sync_delay_s=None)
    for i, at in enumerate((0.0, 1.0, 2.0, 3.0)):
        unsynced(Arrival(f"u{i}", at, 100, 10), _view(at, 3))
    assert all(r.inflight.peer_requests.sum() == 0 for r in unsynced.replicas)


def test_replicas_that_share_nothing_find_fewer_prefixes_in_the_simulator(tmp_path: Path) -> None:
    trace = tmp_path / "chats.jsonl"
    replicas.shared_prefix_trace(trace, 400, groups=24, seed=0)
    profile = get_profile("h100-llama3.1-8b")
    arrivals = load_arrivals(str(trace), 400, profile.block_size)
    rate = 0.6 * capacity_rps(arrivals, profile, 0) * 4
    hit = {}
    for delay in (0.0, None):
        name = replicated_name("default", 4, delay)
        hit[delay] = run_job(DesJob(str(trace), 400, 4, profile.name, name, 0.6, rate, 0), arrivals)["prefix_hit_rate"]
    assert hit[0.0] > hit[None] + 0.05, hit


@pytest.mark.envoy
@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_the_throughput_runs_load_one_and_two_workers_and_count_every_workers_cpu(tmp_path: Path) -> None:
    assert (
        _run(
            ["--modes", "throughput", "--throughput-rounds", "1", "--throughput-duration", "1", "--out", str(tmp_path)]
        )
        == 0
    )
    document = json.loads((tmp_path / "replicas.json").read_text())
    rows = {r["policy"]: r for r in document["runs"]}
    assert set(rows) == {"1 worker", "1 worker, Redis", "2 workers"}
    assert [rows[name]["workers"] for name in ("1 worker", "2 workers")] == [1, 2]
    for row in rows.values():
        assert row["mode"] == "throughput" and row["errors"] == 0 and row["throughput_rps"] > 0
        assert row["picker_cpu_us"] > 0
    assert set(document["workers_2_over_1"]) == {"throughput", "cpu_per_request"}
    assert "Throughput: 1 and 2 workers" in (tmp_path / "replicas.md").read_text()


def test_a_supervisors_cpu_includes_its_workers(tmp_path: Path) -> None:
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(pids := picker_pids(parent.pid)) < 2:
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.01)
        assert pids[0] == parent.pid and len(pids) == 2
    finally:
        for pid in picker_pids(parent.pid)[::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(10)


def test_two_workers_over_one_is_taken_within_each_round() -> None:
    rows = [
        {"policy": "1 worker", "round": 1, "throughput_rps": 1000.0, "picker_cpu_us": 500.0},
        {"policy": "2 workers", "round": 1, "throughput_rps": 1500.0, "picker_cpu_us": 600.0},
        {"policy": "1 worker", "round": 2, "throughput_rps": 500.0, "picker_cpu_us": 1000.0},
        {"policy": "2 workers", "round": 2, "throughput_rps": 1000.0, "picker_cpu_us": 1000.0},
        {"policy": "2 workers", "round": 3, "throughput_rps": 9000.0, "picker_cpu_us": 1.0},  # no pair: left out
    ]
    assert worker_ratios(rows) == {"throughput": 1.75, "cpu_per_request": 1.1}
    assert worker_ratios(rows[4:]) is None


@pytest.mark.envoy
@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_the_quota_run_refuses_the_tenant_over_its_quota_only_and_measures_the_limits_error(tmp_path: Path) -> None:
    assert _run(["--modes", "quota", "--quota-phase", "3", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "replicas.json").read_text())
    rows = {(r["phase"], r["tenant"]): r for r in document["runs"]}
    assert set(rows) == {("b alone", "b"), ("a within its quota", "b"), ("a within its quota", "a"),
                         ("a over its quota", "b"), ("a over its quota", "a")}  # fmt: skip
    assert all(r["errors"] == 0 for r in rows.values())
    assert rows[("a within its quota", "a")]["refused_429"] == 0
    assert rows[("a over its quota", "a")]["refused_429"] > 0
    assert all(
        rows[(phase, "b")]["refused_429"] == 0 for phase in ("b alone", "a within its quota", "a over its quota")
    )
    summary = document["quota"]
    assert summary["b_refused"] == 0 and abs(summary["limit_error"]) < 0.25
    assert "Tenant quotas across two replicas" in (tmp_path / "replicas.md").read_text()


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_the_exchange_cost_is_measured_against_the_feed_alone(tmp_path: Path) -> None:
    rows, medians = exchange_rows(tmp_path, rounds=1, seconds=0.5)
    assert [r["sync_delay_ms"] for r in rows] == [5.0, 20.0]
    assert all(r["mode"] == "exchange" and r["feed_cpu_us"] > 0 for r in rows)
    assert set(medians) == {"5ms", "20ms"}
