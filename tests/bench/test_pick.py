"""Tests for bench/pick.py's A/B mode: the default preset's pick here against another checkout's interpreter."""

from __future__ import annotations

import shutil
import sys

import pytest

from inferlb.bench import pick
from inferlb.bench.pick import SIZES, against


def test_against_measures_both_sides_in_alternation_and_gives_the_ratio() -> None:
    result = against(sys.executable, rounds=2, decisions=200)  # this checkout against itself
    assert [r["endpoints"] for r in result["rows"]] == list(SIZES)
    assert len(result["raw"]["this"]) == len(result["raw"]["other"]) == 2
    for row in result["rows"]:
        assert row["this_p50_us"] > 0 and row["other_p50_us"] > 0
        assert row["ratio"] == round(row["this_p50_us"] / row["other_p50_us"], 3)
        assert 0 < row["this_best_us"] <= row["this_p50_us"] and 0 < row["other_best_us"] <= row["other_p50_us"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian package valgrind)")
def test_an_instruction_count_is_the_same_on_every_run() -> None:
    # What the count is for: a figure the machine's load does not move, unlike a timing (each run ~30 s).
    first = pick.instructions(sys.executable, 8, 100)
    again = pick.instructions(sys.executable, 8, 100)
    assert first > 100_000_000  # the interpreter's start-up and imports, then the decisions
    assert abs(first - again) / first < 0.005
