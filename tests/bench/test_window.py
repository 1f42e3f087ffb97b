"""bench/window.py: the reuse share, the scan for the window where prefixes repeat, ``--start``'s values; and the
live runner's plan of runs (bench/liverun.py `plan_runs`): repetitions interleaved, one seed per repetition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferlb.bench.liverun import LiveRun, plan_runs
from inferlb.bench.window import choose_window, parse_start, reuse_share, reuse_window


def _mooncake(path: Path, blocks: list[list[int]]) -> Path:
    """A Mooncake-format trace, one request per second, one 512-token block per id."""
    rows = [
        {"timestamp": 1000 * k, "input_length": 512 * len(ids), "output_length": 16, "hash_ids": ids}
        for k, ids in enumerate(blocks)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# Six first turns with nothing in common, then three turns of one conversation, each repeating the last.
FIRST_TURNS = [[10 * k + 1, 10 * k + 2] for k in range(6)]
CONVERSATION = [[100, 101], [100, 101, 102], [100, 101, 102, 103]]


@pytest.mark.parametrize(
    ("blocks", "share"),
    [
        pytest.param([[1, 2], [3, 4]], 0.0, id="nothing-shared"),
        pytest.param([[1, 2], [1, 2, 3]], 2 / 5, id="a-second-turn"),
        pytest.param([[1], [1], [1], [1]], 3 / 4, id="one-block-four-times"),
        pytest.param([[], []], None, id="no-block-ids"),
    ],
)
def test_the_reuse_share_counts_blocks_an_earlier_request_had(blocks: list[list[int]], share: float | None) -> None:
    assert reuse_share(blocks) == share


def test_the_scan_finds_the_window_where_prefixes_repeat() -> None:
    blocks = FIRST_TURNS + CONVERSATION
    assert reuse_window(blocks, 3, step=1) == (6, pytest.approx(5 / 9))
    # A coarse step still tries the last possible start.
    assert reuse_window(blocks, 3, step=4)[0] == 6


def test_ties_go_to_the_earliest_window_and_a_short_trace_starts_at_0() -> None:
    assert reuse_window([[1], [1], [2], [2]], 2, step=1) == (0, 0.5)
    assert reuse_window([[1], [1]], 10) == (0, 0.5)


def test_no_block_ids_means_no_window_to_find() -> None:
    assert reuse_window([(), (), ()], 2, step=1) == (0, None)


def test_choose_window_reads_the_trace(tmp_path: Path) -> None:
    trace = _mooncake(tmp_path / "t.jsonl", FIRST_TURNS + CONVERSATION)
    auto = choose_window(trace, 3, "auto")
    assert (auto.start, auto.requests, auto.auto) == (6, 3, True)
    assert auto.reuse == pytest.approx(5 / 9)
    given = choose_window(trace, 3, 0)
    assert (given.start, given.reuse, given.auto) == (0, 0.0, False)
    with pytest.raises(ValueError, match="past the end"):
        choose_window(trace, 3, 9)


def test_an_azure_trace_has_no_reuse_and_keeps_its_start(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:17:0{k}.0000000,{100 + k},10" for k in range(5)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows), encoding="utf-8")
    window = choose_window(trace, 3, "auto")
    assert (window.start, window.reuse, window.auto) == (0, None, False)


@pytest.mark.parametrize(
    ("text", "value"),
    [pytest.param("auto", "auto", id="auto"), pytest.param("0", 0, id="zero"), pytest.param("250", 250, id="n")],
)
def test_start_takes_a_count_or_auto(text: str, value: int | str) -> None:
    assert parse_start(text) == value


@pytest.mark.parametrize("text", [pytest.param("-1", id="negative"), pytest.param("best", id="word")])
def test_a_bad_start_says_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match="--start"):
        parse_start(text)


# ---- the plan of live runs ---------------------------------------------------------------------------------


def test_repetitions_are_interleaved_round_robin_over_the_contenders() -> None:
    runs = plan_runs(["a.jsonl", "b.jsonl"], [0.8], ["x", "y", "z"], repeats=2, seed=5)
    assert [(r.trace, r.repeat, r.policy) for r in runs] == [
        ("a.jsonl", 0, "x"), ("a.jsonl", 0, "y"), ("a.jsonl", 0, "z"),
        ("a.jsonl", 1, "x"), ("a.jsonl", 1, "y"), ("a.jsonl", 1, "z"),
        ("b.jsonl", 0, "x"), ("b.jsonl", 0, "y"), ("b.jsonl", 0, "z"),
        ("b.jsonl", 1, "x"), ("b.jsonl", 1, "y"), ("b.jsonl", 1, "z"),
    ]  # fmt: skip
    assert {r.seed for r in runs if r.repeat == 0} == {5} and {r.seed for r in runs if r.repeat == 1} == {6}


def test_within_a_repetition_every_load_runs_every_contender() -> None:
    runs = plan_runs(["a.jsonl"], [0.5, 0.8], ["x", "y"], repeats=1, seed=0)
    assert runs == [
        LiveRun("a.jsonl", 0.5, "x", 0, 0),
        LiveRun("a.jsonl", 0.5, "y", 0, 0),
        LiveRun("a.jsonl", 0.8, "x", 0, 0),
        LiveRun("a.jsonl", 0.8, "y", 0, 0),
    ]


def test_fewer_than_one_repeat_is_refused() -> None:
    with pytest.raises(ValueError, match="--repeats"):
        plan_runs(["a.jsonl"], [0.8], ["x"], repeats=0, seed=0)
