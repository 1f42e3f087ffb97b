"""The routing-quality benchmark: its figures, its simulator policies and `inferlb bench` end to end on a small
trace (the simulator in full; the live gateway with two contenders)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.desrun import DES_CONTENDERS, DesJob, capacity_rps, load_arrivals, make_policy, run_job, scaled
from inferlb.bench.metrics import Outcome, goodput, summarise
from inferlb.bench.quality import AGGREGATED, aggregate, markdown
from inferlb.cli import main
from inferlb.sim.des import Arrival
from inferlb.sim.profiles import get_profile

H100 = get_profile("h100-llama3.1-8b")
RESULT_KEYS = {
    "trace",
    "mode",
    "policy",
    "load",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "e2e_p99_ms",
    "throughput_rps",
    "output_tokens_per_s",
    "prefix_hit_rate",
    "imbalance_cv",
    "errors",
    "shed",
}


def write_trace(path: Path, requests: int = 80, seed: int = 1) -> Path:
    """A small Mooncake-format trace: 8 conversations whose turns share growing prefixes."""
    rng = random.Random(seed)
    lines, t = [], 0.0
    prefixes: dict[int, list[int]] = {}
    next_block = 1
    for _ in range(requests):
        t += rng.expovariate(2.0)
        family = rng.randrange(8)
        blocks = prefixes.setdefault(family, [0])
        for _ in range(rng.randrange(1, 4)):
            blocks.append(next_block)
            next_block += 1
        lines.append(
            json.dumps(
                {
                    "timestamp": int(t * 1000),
                    "input_length": 512 * len(blocks),
                    "output_length": rng.randrange(8, 64),
                    "hash_ids": list(blocks),
                }
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- figures ---------------------------------------------------------------------------------------------------


def test_summary_figures() -> None:
    outcomes = [Outcome("a", float(i), 0.1 * (i + 1), 1.0 + i, 10) for i in range(10)]
    outcomes += [Outcome("b", 3.0, None, None, 0, error="status 500"), Outcome("b", 4.0, None, None, 0, shed=True)]
    figures = summarise(outcomes, busy_s=[2.0, 2.0, 2.0, 6.0], prefix_hits=30, prefix_queries=120)
    assert figures["requests"] == 12 and figures["errors"] == 1 and figures["shed"] == 1
    assert figures["ttft_p50_ms"] == pytest.approx(550.0)
    assert figures["ttft_p99_ms"] == pytest.approx(991.0)
    # 10 successes between the first arrival (0 s) and the last completion (9 + 10 = 19 s)
    assert figures["throughput_rps"] == pytest.approx(10 / 19, rel=1e-3)
    assert figures["output_tokens_per_s"] == pytest.approx(100 / 19, rel=1e-2)
    assert figures["prefix_hit_rate"] == 0.25
    busy = np.array([2.0, 2.0, 2.0, 6.0])
    assert figures["imbalance_cv"] == pytest.approx(busy.std() / busy.mean(), rel=1e-3)


def test_goodput_is_the_last_rate_within_the_slo_interpolated_to_the_crossing() -> None:
    assert goodput([(1.0, 100.0), (2.0, 200.0), (3.0, 600.0)], slo_ms=400.0) == pytest.approx(2.5)
    assert goodput([(3.0, 100.0), (1.0, 50.0)], slo_ms=400.0) == 3.0  # every load met it: the highest run
    assert goodput([(1.0, 500.0), (2.0, 900.0)], slo_ms=400.0) is None  # none did


# ---- simulator policies -----------------------------------------------------------------------------------------


def test_scaling_keeps_order_and_rhythm_and_sets_the_mean_rate() -> None:
    arrivals = [Arrival(str(i), t, 100, 10) for i, t in enumerate([10.0, 11.0, 15.0, 20.0])]
    out = scaled(arrivals, rate_rps=3.0)
    assert [a.id for a in out] == ["0", "1", "2", "3"]
    assert out[0].at == 0.0 and out[-1].at == pytest.approx(1.0)  # 3 gaps at 3 req/s
    assert out[1].at == pytest.approx(0.1) and out[2].at == pytest.approx(0.5)


def test_every_contender_has_a_policy_and_unknown_names_are_refused() -> None:
    for name in DES_CONTENDERS:
        assert callable(make_policy(name, [H100] * 2, seed=0))
    with pytest.raises(ValueError, match="unknown DES contender 'nginx'"):
        make_policy("nginx", [H100], seed=0)


def test_a_job_row_has_the_results_keys(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", requests=40)
    arrivals = load_arrivals(str(trace), 40, H100.block_size)
    capacity = capacity_rps(arrivals, H100, seed=0)
    assert capacity > 0
    row = run_job(DesJob(str(trace), 40, 4, H100.name, "inferlb:default", 0.5, 0.5 * capacity * 4, 0))
    assert set(row) >= RESULT_KEYS and row["mode"] == "des" and row["requests"] == 40 and row["errors"] == 0
    assert len(row["_ttft_s"]) == 40


# ---- end to end --------------------------------------------------------------------------------------------------


def test_inferlb_bench_des_writes_results_tables_and_plots(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--mode",
            "des",
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--servers",
            "4",
            "--loads",
            "0.3",
            "0.9",
            "--jobs",
            "1",
            "--requests",
            "80",
        ]
    )
    assert code == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 2 * len(DES_CONTENDERS)
    assert all(set(row) >= RESULT_KEYS and row["errors"] == 0 for row in rows)
    by = {(r["policy"], r["load"]): r for r in rows}
    # Prefix-aware routing finds the shared conversation prefixes that round robin scatters.
    assert by[("inferlb:prefix-aware", 0.9)]["prefix_hit_rate"] > by[("envoy:ROUND_ROBIN", 0.9)]["prefix_hit_rate"]
    summary = json.loads((out / "summary.json").read_text())
    info = summary["traces"]["conv.jsonl"]
    assert info["capacity_rps"] > 0 and info["slo_ttft_p99_ms"] > 0 and set(info["goodput_rps"]) == set(DES_CONTENDERS)
    table = (out / "results.md").read_text()
    assert "| inferlb:default |" in table and "SLO TTFT p99" in table
    for name in ("conv-ttft-cdf.png", "conv-p99-vs-load.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_a_missing_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--mode", "des", "--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])
    assert code == 2 and "trace file not found" in capsys.readouterr().err


@pytest.mark.envoy
def test_inferlb_bench_live_through_envoy(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "conv.jsonl", requests=30)
    out = tmp_path / "out"
    argv = ["bench", "--mode", "live", "--trace", str(trace), "--out", str(out), "--servers", "2", "--loads", "0.5"]
    argv += ["--requests", "30", "--time-scale", "4", "--policies", "envoy:ROUND_ROBIN", "inferlb:default"]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["policy"] for r in rows] == ["envoy:ROUND_ROBIN", "inferlb:default"]
    for row in rows:
        assert set(row) >= RESULT_KEYS and row["mode"] == "live"
        assert row["requests"] == 30 and row["errors"] == 0 and row["ttft_p50_ms"] > 0
        assert row["imbalance_cv"] is not None and row["cores_used"] > 0
    assert rows[0]["picker_cpu_us"] is None and rows[1]["picker_cpu_us"] > 0


def test_a_mixed_fleet_run_names_its_fleet_and_counts_each_servers_capacity(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "conv.jsonl", requests=60)
    out = tmp_path / "out"
    fleet = "h100-llama3.1-8b:2,l4-llama3.2-3b:2"
    argv = ["bench", "--mode", "des", "--trace", str(trace), "--out", str(out), "--fleet", fleet, "--loads", "0.5"]
    argv += ["--jobs", "1", "--requests", "60", "--policies", "envoy:ROUND_ROBIN", "inferlb:default", "oracle"]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {(r["profile"], r["servers"]) for r in rows} == {(fleet, 4)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fleet"] == {"servers": 4, "profile": fleet}
    arrivals = load_arrivals(str(trace), 60, H100.block_size)
    each = 2 * capacity_rps(arrivals, H100, seed=0) + 2 * capacity_rps(arrivals, get_profile("l4-llama3.2-3b"), 0)
    assert summary["traces"]["conv.jsonl"]["capacity_rps"] == pytest.approx(each, rel=1e-3)
    assert f"4 servers: {fleet}" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fleet", "h100-llama3.1-8b:2", "--servers", "4"], "--servers goes with --profile"),
        (["--fleet", "h100-llama3.1-8b:two"], "--fleet: bad fleet"),
    ],
)
def test_a_bad_fleet_is_a_clear_error(tmp_path: Path, extra: list[str], message: str) -> None:
    trace = write_trace(tmp_path / "conv.jsonl", requests=10)
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--mode", "des", "--trace", str(trace), "--out", str(tmp_path / "o"), *extra])


# ---- repetitions -------------------------------------------------------------------------------------------


def _run_row(policy: str, repeat: int, p50: float, p99: float, hit: float) -> dict[str, object]:
    figures = {"ttft_p50_ms": p50, "ttft_p90_ms": p99, "ttft_p99_ms": p99, "e2e_p99_ms": 2 * p99}
    figures |= {"throughput_rps": 4.0, "output_tokens_per_s": 100.0, "prefix_hit_rate": hit, "imbalance_cv": 0.1}
    figures |= {"errors": 0, "shed": 0, "picker_cpu_us": None}
    return {"trace": "t.jsonl", "policy": policy, "load": 0.8, "rate_rps": 4.4, **figures, "repeat": repeat}


def test_repetitions_aggregate_to_means_with_intervals_and_the_table_names_what_lies_apart() -> None:
    rows = [
        _run_row("inferlb:default", 0, 100.0, 1000.0, 0.5),
        _run_row("other", 0, 200.0, 1050.0, 0.5),
        _run_row("inferlb:default", 1, 110.0, 1200.0, 0.5),
        _run_row("other", 1, 210.0, 1100.0, 0.5),
        _run_row("inferlb:default", 2, 120.0, 1100.0, 0.5),
        _run_row("other", 2, 220.0, 1150.0, 0.5),
    ]
    aggregated = aggregate(rows)
    assert [(r["policy"], r["runs"]) for r in aggregated] == [("inferlb:default", 3), ("other", 3)]
    ours = aggregated[0]
    assert ours["ttft_p50_ms"] == 110.0 and ours["ttft_p50_ms_ci95"] == pytest.approx(4.303 * 10 / 3**0.5, abs=1e-3)
    assert ours["prefix_hit_rate_ci95"] == 0.0 and set(AGGREGATED) <= set(ours)
    info = {"requests": 1000, "capacity_rps": 5.5, "slo_ttft_p99_ms": 3000.0, "start": 9500, "repeats": 3}
    info |= {"window": "auto", "reuse_share": 0.24}
    summary = {"fleet": {"servers": 4, "profile": "h100"}, "traces": {"t.jsonl": info}, "aggregate": aggregated}
    meta = {"mode": "live", "date": "today", "command": "inferlb bench quality", "machine": "m", "cpu": "c"}
    text = markdown(meta, rows, summary)
    assert "Window: requests 9500 .. 10500" in text and "reuse share 0.240" in text
    assert "| inferlb:default | 0.8 | 3 | 110 ± 24.8 |" in text
    assert "- load 0.8, other: TTFT p50 1.91x" in text  # p50 apart; p99 within the intervals
    assert "other #2" in text
