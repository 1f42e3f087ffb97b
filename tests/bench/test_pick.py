"""Tests for bench/pick.py's A/B mode: the default preset's pick here against another checkout's interpreter."""

from __future__ import annotations

import sys

from inferlb.bench.pick import SIZES, against


def test_against_measures_both_sides_in_alternation_and_gives_the_ratio() -> None:
    result = against(sys.executable, rounds=2, decisions=200)  # this checkout against itself
    assert [r["endpoints"] for r in result["rows"]] == list(SIZES)
    assert len(result["raw"]["this"]) == len(result["raw"]["other"]) == 2
    for row in result["rows"]:
        assert row["this_p50_us"] > 0 and row["other_p50_us"] > 0
        assert row["ratio"] == round(row["this_p50_us"] / row["other_p50_us"], 3)
