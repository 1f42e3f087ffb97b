"""The demo's comparison: the table and the verdict from synthetic runs, and the scenario end to end in a short
form through the real Envoy."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from inferlb.demo import DemoOptions, run_demo
from inferlb.democompare import quantile, route_failures, share_timeline, slowed_share, table, verdict
from inferlb.demoscenario import Record, RunResult, ScenarioOptions

SLOW, FAST = "10.0.0.1:8000", "10.0.0.2:8000"


def run(name: str, ttfts: list[float], servers: list[str], *, hits: int = 50, errors: int = 0) -> RunResult:
    records = [
        Record(float(i), 200, server, f"{name}-{i}", ttft, ttft + 1.0, None)
        for i, (ttft, server) in enumerate(zip(ttfts, servers, strict=True))
    ]
    records += [Record(99.0, 0, "", "", None, None, "ConnectError: refused") for _ in range(errors)]
    return RunResult(name, tuple(records), SLOW, 4.0, hits, 100, 10.0)


def test_quantiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([], 0.5) is None


def test_the_table_has_a_row_per_measure_and_a_column_per_run() -> None:
    rr = run("round robin", [0.05] * 8 + [2.0, 3.0], [SLOW, FAST] * 5, hits=40)
    ours = run("inferlb default", [0.04] * 10, [FAST] * 10, hits=70, errors=1)
    lines = table(rr, ours)
    assert lines[0].split() == ["round", "robin", "inferlb", "default"]
    labels = [re.split(r"\s{2,}", line.strip())[0] for line in lines[1:]]
    assert labels == [
        "requests answered",
        "TTFT p50 (client)",
        "TTFT p99 (client)",
        "to the slowed server after 4 s",
        "prefix-cache hit rate (servers)",
        "errors",
    ]
    cells = {re.split(r"\s{2,}", line.strip())[0]: re.split(r"\s{2,}", line.strip())[1:] for line in lines[1:]}
    assert cells["requests answered"] == ["10/10", "10/11"]
    assert cells["TTFT p99 (client)"] == ["3.00 s", "40 ms"]
    assert cells["to the slowed server after 4 s"] == ["3/6 (50%)", "0/6 (0%)"]
    assert cells["prefix-cache hit rate (servers)"] == ["40%", "70%"]
    assert cells["errors"] == ["0", "1"]


@pytest.mark.parametrize(
    ("ours", "expected"),
    [
        pytest.param([0.1] * 10, "TTFT p99 10.0x lower (100 ms vs 1.00 s)", id="better"),
        pytest.param([2.0] * 10, "TTFT p99 2.0x higher (2.00 s vs 1.00 s)", id="worse"),
        pytest.param([1.01] * 10, "TTFT p99 about the same (1.01 s vs 1.00 s)", id="same"),
    ],
)
def test_the_verdict_is_computed_from_the_measurements_either_way(ours: list[float], expected: str) -> None:
    rr = run("round robin", [1.0] * 10, [SLOW, FAST] * 5)
    line = verdict(rr, run("inferlb default", ours, [FAST] * 10))
    assert line.startswith("inferlb default vs round robin: " + expected)
    assert "0% of the requests after the slowdown to the slowed server (round robin 50%)" in line


def test_the_slowed_share_counts_requests_sent_after_the_slowdown() -> None:
    result = run("x", [0.1] * 6, [SLOW, SLOW, SLOW, SLOW, SLOW, FAST])  # sent at 0..5 s; slowed at 4 s
    assert slowed_share(result) == 0.5
    assert slowed_share(run("x", [0.1] * 2, [SLOW, FAST])) is None  # nothing sent after 4 s


def test_the_timeline_shows_traffic_leaving_the_slowed_server() -> None:
    rr = run("round robin", [0.05] * 12, [SLOW, FAST, FAST] * 4)  # sent at 0, 1, ..., 11 s
    ours = run("inferlb default", [0.05] * 12, [SLOW] * 4 + [FAST] * 8)
    header, *rows = share_timeline(rr, ours)
    assert header.split()[-7:] == ["0-2", "2-4", "4-6", "6-8", "8-10", "10-12", "s"]
    assert rows[0].split()[-6:] == ["50%", "50%", "0%", "50%", "50%", "0%"]
    assert rows[1].split()[-6:] == ["100%", "100%", "0%", "0%", "0%", "0%"]
    assert [row[:15] for row in rows] == ["round robin    ", "inferlb default"]


def test_a_request_that_went_another_way_than_its_run_meant_is_a_failure() -> None:
    rr = run("round robin", [0.1] * 2, [SLOW, FAST])
    ours = run("inferlb default", [0.1] * 2, [FAST, FAST])
    log = [
        {"request_id": "round robin-0", "cluster": "demo_round_robin", "upstream": SLOW, "picked": "-"},
        {"request_id": "round robin-1", "cluster": "demo_round_robin", "upstream": FAST, "picked": "-"},
        {"request_id": "inferlb default-0", "cluster": "inferlb_picked", "upstream": FAST, "picked": FAST},
        {"request_id": "inferlb default-1", "cluster": "inferlb_fallback", "upstream": FAST, "picked": "-"},
    ]
    printed: list[str] = []
    failures = route_failures(rr, ours, log, printed.append)
    assert printed == [
        "round robin: routed by Envoy's ROUND_ROBIN cluster: 2/2 (access log)",
        "inferlb default: routed by the picker through Envoy's ORIGINAL_DST cluster: 1/2 (access log)",
    ]
    assert failures == ["inferlb default: only 1 of 2 requests went through inferlb_picked"]
    assert route_failures(rr, ours, log[:1], printed.append)[0].startswith("round robin: only 1 of 2")


@pytest.mark.slow  # 45 s on two cores; CI runs it (make test-slow)
@pytest.mark.envoy
def test_the_scenario_in_short_form_shows_the_slowed_server_losing_its_share_under_inferlb(tmp_path: Path) -> None:
    out = io.StringIO()
    scenario = ScenarioOptions(duration_s=10, slow_at_s=3, rate=12, slowdown=10)
    code = run_demo(DemoOptions(backends=3, scenario=scenario), tmp_path, stream=out)
    text = out.getvalue()
    assert code == 0, text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if re.fullmatch(r"\s+round robin\s+inferlb default", line))
    body = lines[header + 1 : lines.index("", header)]
    rows = {re.split(r"\s{2,}", line.strip())[0]: re.split(r"\s{2,}", line.strip())[1:] for line in body}
    for label in ("requests answered", "TTFT p50 (client)", "TTFT p99 (client)", "prefix-cache hit rate (servers)"):
        assert len(rows[label]) == 2, (label, text)
    assert rows["errors"] == ["0", "0"], text
    rr_share, our_share = (int(re.findall(r"\((\d+)%\)", cell)[0]) for cell in rows["to the slowed server after 3 s"])
    # Round robin gives it a third whatever happens; the picker moves traffic off a server ten times slower.
    assert 25 <= rr_share <= 40, text
    assert our_share < 0.75 * rr_share, text
    assert re.search(r"^inferlb default vs round robin: TTFT p99 .*(lower|higher|about the same)", text, re.M), text
    timeline = next(i for i, line in enumerate(lines) if line.startswith("sent to the slowed server, by time sent"))
    assert [line.split("  ")[0] for line in lines[timeline + 1 : timeline + 3]] == ["round robin", "inferlb default"]
    assert "routed by Envoy's ROUND_ROBIN cluster: " in text
    assert "routed by the picker through Envoy's ORIGINAL_DST cluster: " in text
    assert "HTTP 400" in text and "HTTP 404" in text
    assert (tmp_path / "heatmap.png").stat().st_size > 0 and (tmp_path / "heatmap.html").stat().st_size > 0
