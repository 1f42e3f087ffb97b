"""The hop benchmark's figures and report, on the rows of a past run (bench/results/hop.json of 2026-11-30, kept
as a fixture so that a new run of the benchmark does not move what these tests pin)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inferlb.bench.hop import POLICY, VARIANTS, _markdown, cpu_ratio_to_floor

RESULTS = Path(__file__).resolve().parents[1] / "fixtures" / "bench" / "hop-2026-11-30.json"


@pytest.fixture
def results() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(RESULTS.read_text(encoding="utf-8"))
    return document


def test_the_inferlb_variants_run_the_default_preset() -> None:
    assert POLICY == "default"
    assert {v.gateway for v in VARIANTS} == {"envoy", "noop", "inferlb", "inferlb-timed", "inferlb-held"}


def test_cpu_ratio_to_floor_is_each_variant_over_the_noop_picker(results: dict[str, Any]) -> None:
    ratios = cpu_ratio_to_floor(results["rows"])

    by = {(r["variant"], r["concurrency"]): r["picker_cpu_us"] for r in results["rows"]}
    assert set(ratios) == {"inferlb headers", "inferlb body", "inferlb body timed"}  # that run had no held variant
    for variant, per_concurrency in ratios.items():
        floor = "noop body" if "body" in variant else "noop headers"
        assert set(per_concurrency) == {"1", "16", "64"}
        for c, ratio in per_concurrency.items():
            assert ratio == round(by[(variant, int(c))] / by[(floor, int(c))], 3)
    assert ratios["inferlb headers"]["1"] == pytest.approx(1.28, abs=0.005)  # as that run's hop.md showed


def test_a_variant_without_a_picker_figure_has_no_ratio(results: dict[str, Any]) -> None:
    rows = [dict(r, picker_cpu_us=None) if r["variant"] == "noop body" else r for r in results["rows"]]
    ratios = cpu_ratio_to_floor(rows)
    assert "inferlb body" not in ratios and "inferlb headers" in ratios


def test_the_report_shows_the_ratios(results: dict[str, Any]) -> None:
    results["cpu_ratio_to_floor"] = cpu_ratio_to_floor(results["rows"])
    text = _markdown(results)
    assert "## inferlb (least-request) against the floor (same run)" in text  # meta.policy missing: that run's
    assert "| 1 | headers | 1.28x | +0.81, +1.10 |" in text
    assert "| 64 | body | 1.39x |" in text
    assert text.count("| 16 | inferlb body |") == 1
