"""The guidellm report parser of bench/external.py, on a trimmed report guidellm 0.8.1 wrote in a real run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from inferlb.bench.external import ExternalError, guidellm_version, parse_guidellm

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "guidellm-report.json"


@pytest.fixture
def report() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return document


def test_parses_the_client_figures(report: dict[str, Any]) -> None:
    figures = parse_guidellm(report)

    assert figures.source == "guidellm (client)"
    assert (figures.requests, figures.errors) == (200, 0)
    assert figures.ttft_p50_ms == pytest.approx(46.707, abs=1e-3)
    assert figures.ttft_p90_ms == pytest.approx(69.445, abs=1e-3)
    assert figures.ttft_p99_ms == pytest.approx(88.515, abs=1e-3)
    # guidellm reports request latency in seconds; the parser gives milliseconds.
    assert figures.e2e_p50_ms == pytest.approx(702.748, abs=1e-3)
    assert figures.e2e_p99_ms == pytest.approx(906.096, abs=1e-3)
    assert figures.requests_per_s == pytest.approx(3.9723, abs=1e-4)
    assert figures.output_tokens_per_s == pytest.approx(394.89, abs=1e-2)
    assert figures.prompt_tokens_p50 == 972
    assert figures.output_tokens == 19882
    assert (figures.queue_p50_ms, figures.queue_p99_ms) == (None, None)  # the client cannot see queueing


def test_counts_errored_and_incomplete_requests_as_errors(report: dict[str, Any]) -> None:
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    totals.update(errored=3, incomplete=2, total=205)

    figures = parse_guidellm(report)

    assert (figures.requests, figures.errors) == (205, 5)


def test_reads_the_tool_version(report: dict[str, Any]) -> None:
    assert guidellm_version(report) == "0.8.1"


def _without(report: dict[str, Any], *path: str) -> dict[str, Any]:
    broken = copy.deepcopy(report)
    node = broken
    for key in path[:-1]:
        node = node[key] if isinstance(node, dict) else node[int(key)]
    del node[path[-1]]
    return broken


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param(("benchmarks",), "has no benchmarks", id="no-benchmarks"),
        pytest.param(("benchmarks", "0", "metrics"), r"has no benchmarks\[0\]\.metrics$", id="no-metrics"),
        pytest.param(
            ("benchmarks", "0", "metrics", "time_to_first_token_ms"),
            r"has no benchmarks\[0\]\.metrics\.time_to_first_token_ms$",
            id="no-ttft",
        ),
        pytest.param(
            ("benchmarks", "0", "metrics", "request_latency", "successful", "percentiles"),
            r"has no benchmarks\[0\]\.metrics\.request_latency\.successful\.percentiles$",
            id="no-latency-percentiles",
        ),
        pytest.param(
            ("benchmarks", "0", "metrics", "request_totals", "errored"),
            r"has no benchmarks\[0\]\.metrics\.request_totals\.errored$",
            id="no-errored-count",
        ),
    ],
)
def test_names_the_missing_field(report: dict[str, Any], path: tuple[str, ...], message: str) -> None:
    with pytest.raises(ExternalError, match=message):
        parse_guidellm(_without(report, *path))


def test_refuses_a_report_without_any_benchmark(report: dict[str, Any]) -> None:
    report["benchmarks"] = []

    with pytest.raises(ExternalError, match="has no benchmarks"):
        parse_guidellm(report)
