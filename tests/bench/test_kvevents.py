"""The KV-events benchmark's bookkeeping: runs grouped into means and ranges, the report, and the cost probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferlb.bench.kvevents import _markdown, _summary, cost_rows


def _row(setup: str, hit: float, p99: float, seed: int) -> dict[str, object]:
    return {
        "trace": "t.jsonl",
        "load": 0.8,
        "setup": setup,
        "seed": seed,
        "prefix_hit_rate": hit,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": p99,
        "errors": 0,
    }


def test_runs_are_grouped_into_means_and_ranges() -> None:
    rows = [_row("one picker", 0.2, 100.0, 0), _row("one picker", 0.4, 300.0, 1), _row("kv", 0.5, 50.0, 0)]
    summary = {s["setup"]: s for s in _summary(rows, ("trace", "load", "setup"))}
    assert summary["one picker"]["runs"] == 2
    assert summary["one picker"]["prefix_hit_rate"] == pytest.approx(0.3)
    assert summary["one picker"]["ttft_p99_ms_range"] == [100.0, 300.0]
    assert summary["kv"]["runs"] == 1


def test_the_report_shows_every_group_and_the_live_windows() -> None:
    rows = [_row("one picker", 0.2, 100.0, 0)]
    document = {
        "meta": {"date": "d", "command": "c", "machine": "m"},
        "des_summary": _summary(rows, ("trace", "load", "setup")),
        "live_summary": [],
        "windows": {"t.jsonl": {"start": 3400, "requests": 400, "shared_block_share": 0.53}},
        "cost": [],
    }
    text = _markdown(document)
    assert "| t.jsonl | 0.8 | one picker | 1 | 0.200 [0.200-0.200] |" in text
    assert "requests 3400..3799, 53% of their prompt blocks" in text


def test_the_live_heading_names_the_servers_and_requests_the_run_used() -> None:
    live = [{**_row("one picker", 0.2, 100.0, 0), "round": 1}]
    document = {
        "meta": {"date": "d", "command": "c", "machine": "m"},
        "des_summary": [],
        "live_summary": _summary(live, ("trace", "setup")),
        "windows": {"t.jsonl": {"start": 0, "requests": 800, "shared_block_share": 0.2, "servers": 8}},
        "cost": [],
    }
    assert "## Live (8 servers, 800 requests)" in _markdown(document)


def test_the_cost_probe_measures_both_tokenizers(tmp_path: Path) -> None:
    rows = cost_rows(tmp_path, rounds=3)
    assert {r["tokenizer"] for r in rows} == {"pieces", "huggingface-bpe"}
    assert all(r["blocks"] > 0 and r["keys_us"] > 0 and r["match_us"] > 0 for r in rows)
