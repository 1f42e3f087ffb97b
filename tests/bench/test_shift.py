"""The traffic-shift benchmark's summary, from the committed per-policy runs (bench/results/shift-*.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inferlb.bench.shift import _any_policy, _summary

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        pytest.param(
            "python -m inferlb.bench.shift --out bench/results --policy default",
            "python -m inferlb.bench.shift --out bench/results --policy NAME",
            id="last",
        ),
        pytest.param(
            "inferlb bench shift --policy default --rate 8 --out 'a b'",
            "inferlb bench shift --rate 8 --out 'a b' --policy NAME",
            id="first",
        ),
        pytest.param("inferlb bench shift --policy=least-request", "inferlb bench shift --policy NAME", id="equals"),
        pytest.param("inferlb bench shift", "inferlb bench shift --policy NAME", id="none"),
    ],
)
def test_the_summary_command_stands_for_any_policy(command: str, shown: str) -> None:
    assert _any_policy(command) == shown


def test_the_summary_sums_up_every_policy_found(tmp_path: Path) -> None:
    for path in RESULTS.glob("shift-*.json"):
        shutil.copy(path, tmp_path)

    _summary(tmp_path)

    runs = json.loads((tmp_path / "shift.json").read_text(encoding="utf-8"))
    assert [r["policy"] for r in runs] == ["default", "least-request", "round-robin"]
    assert all("shares" not in r and "settle_s" in r for r in runs)
    table = (tmp_path / "shift.md").read_text(encoding="utf-8")
    assert "| round-robin | 2026-11-30 08:29 UTC | 16.0 | 0.251 | 0.25 | never |" in table
    # The first policy's command, with its policy standing for any (the default's run was made with the CLI).
    assert "Command: `inferlb bench shift --out bench/results --policy NAME`" in table
