"""bench/peercheck.py: the trace window it replays, the simulator's half, and the verdict's tolerances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferlb.bench.desrun import load_arrivals
from inferlb.bench.peercheck import PAIRS, Figures, compare, live_figures, live_records, simulated, window
from inferlb.sim.profiles import get_profile


def _trace(tmp_path: Path, rows: int) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"timestamp": 1000 * k, "input_length": 600, "output_length": 5, "hash_ids": [0, k % 3]})
        for k in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_window_keeps_its_rows_and_rebases_their_times(tmp_path: Path) -> None:
    path = window(_trace(tmp_path, 10), start=4, requests=3, folder=tmp_path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r["timestamp"] for r in rows] == [0, 1000, 2000]
    assert [r["hash_ids"] for r in rows] == [[0, 1], [0, 2], [0, 0]]
    assert path.name == "t-rows4-7.jsonl"


@pytest.mark.parametrize(
    ("name", "start", "requests"),
    [
        pytest.param("t.jsonl", 8, 5, id="past-the-end"),
        pytest.param("t.csv", 0, 3, id="not-jsonl"),
    ],
)
def test_a_window_the_trace_cannot_give_is_an_error(tmp_path: Path, name: str, start: int, requests: int) -> None:
    path = _trace(tmp_path, 10).rename(tmp_path / name)
    with pytest.raises(ValueError):
        window(path, start, requests, tmp_path)


def test_the_simulated_half_gives_shares_that_sum_to_one(tmp_path: Path) -> None:
    fleet = (get_profile("h100-llama3.1-8b"),) * 2
    arrivals = load_arrivals(str(_trace(tmp_path, 20)), 20, fleet[0].block_size)
    figures = simulated(PAIRS["sglang-router cache_aware"], arrivals, fleet, rate=2.0, seed=0)
    assert sum(figures.shares) == pytest.approx(1.0) and list(figures.shares) == sorted(figures.shares, reverse=True)
    assert figures.errors == 0 and figures.hit_rate is not None and figures.hit_rate > 0


LIVE = Figures((0.4, 0.3, 0.2, 0.1), 0.10, 300.0, 3000.0, 0)


@pytest.mark.parametrize(
    ("model", "agrees", "says"),
    [
        pytest.param(Figures((0.45, 0.3, 0.15, 0.1), 0.11, 350.0, 2500.0, 0), True, "", id="within-tolerances"),
        pytest.param(Figures((0.4, 0.3, 0.2, 0.1), 0.15, 300.0, 3000.0, 0), False, "hit rate", id="hit-rate"),
        pytest.param(Figures((0.7, 0.1, 0.1, 0.1), 0.10, 300.0, 3000.0, 0), False, "shares", id="shares"),
        pytest.param(Figures((0.4, 0.3, 0.2, 0.1), 0.10, 300.0, 6000.0, 0), False, "TTFT p99", id="p99"),
    ],
)
def test_the_verdict_follows_the_tolerances(model: Figures, agrees: bool, says: str) -> None:
    verdict, reasons = compare(LIVE, [model])
    assert verdict is agrees
    assert all(says in r for r in reasons[:1]) and bool(reasons) is not agrees


@pytest.mark.parametrize(
    "folder",
    [
        pytest.param("vllm-router-cache_aware-0.8-r0", id="repeated-runs"),
        pytest.param("vllm-router cache_aware-0.8", id="one-run-per-load"),
    ],
)
def test_a_live_runs_records_give_its_shares(tmp_path: Path, folder: str) -> None:
    records = tmp_path / folder / "records.jsonl"
    records.parent.mkdir()
    records.write_text("".join(json.dumps({"server": s}) + "\n" for s in "aaab"), encoding="utf-8")
    row = {"policy": "vllm-router cache_aware", "load": 0.8, "repeat": 0}
    row |= {"prefix_hit_rate": 0.1, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "errors": 0}
    figures = live_figures(row, live_records(tmp_path, row), servers=4)
    assert figures.shares == (0.75, 0.25, 0.0, 0.0)


def test_a_router_that_hides_the_server_gets_its_shares_from_the_servers_own_counts(tmp_path: Path) -> None:
    # Dynamo's frontend does not pass the emulator's server header on: the records name no server.
    records = tmp_path / "dynamo-kv-0.8-r0" / "records.jsonl"
    records.parent.mkdir()
    records.write_text("".join(json.dumps({"server": ""}) + "\n" for _ in range(8)), encoding="utf-8")
    row = {"policy": "dynamo kv", "load": 0.8, "repeat": 0, "server_requests": [1, 5, 2, 0]}
    row |= {"prefix_hit_rate": 0.1, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "errors": 0}
    figures = live_figures(row, live_records(tmp_path, row), servers=4)
    assert figures.shares == (0.625, 0.25, 0.125, 0.0)
