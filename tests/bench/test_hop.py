"""The hop benchmark's figures and report, on the rows of a past run (bench/results/hop.json of 2026-11-30, kept
as a fixture so that a new run of the benchmark does not move what these tests pin)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.bench import perfprof
from inferlb.bench.hop import (
    BODY,
    MODEL,
    POLICY,
    TIER,
    VARIANTS,
    _markdown,
    alone,
    cpu_ratio_rounds,
    cpu_ratio_to_floor,
    start_backends,
    weights_to_envoy,
)
from inferlb.envoyconf import EnvoyOptions
from inferlb.scorer.promtext import SignalReader
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll, process_state

RESULTS = Path(__file__).resolve().parents[1] / "fixtures" / "bench" / "hop-2026-11-30.json"


@pytest.fixture
def results() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(RESULTS.read_text(encoding="utf-8"))
    return document


def test_the_inferlb_variants_run_the_default_preset() -> None:
    assert POLICY == "default"
    gateways = {v.gateway for v in VARIANTS}
    assert gateways == {"envoy", "noop", "inferlb", "inferlb-rr", "inferlb-timed", "inferlb-held"}
    assert {gateway for gateway, _ in TIER} == {"envoy", "envoy-lr", "inferlb-weights"}


def _run(
    variant: str, r: int, envoy_cpu_us: float, p50_ms: float, picker_cpu_us: float | None = None
) -> dict[str, Any]:
    return {
        "variant": variant,
        "concurrency": 16,
        "round": r,
        "envoy_cpu_us": envoy_cpu_us,
        "picker_cpu_us": picker_cpu_us,
        "p50_ms": p50_ms,
    }


def test_the_weights_tier_is_compared_with_envoy_alone_within_each_round() -> None:
    rows = [
        # Round 0 on a quiet machine, round 1 on a busy one, round 2 in between: the ratios are taken per round.
        _run("envoy-rr body", 0, 100.0, 2.0),
        _run("envoy-lr body", 0, 110.0, 2.0),
        _run("inferlb weights body", 0, 104.0, 2.1, picker_cpu_us=1.0),
        _run("envoy-rr body", 1, 200.0, 4.0),
        _run("envoy-lr body", 1, 200.0, 4.0),
        _run("inferlb weights body", 1, 219.0, 4.8, picker_cpu_us=1.0),
        _run("envoy-rr body", 2, 150.0, 3.0),
        _run("envoy-lr body", 2, 150.0, 3.0),
        _run("inferlb weights body", 2, 150.0, 3.0),
        _run("inferlb weights headers", 0, 50.0, 1.0),  # no Envoy-alone run of its kind: left out
    ]
    found = weights_to_envoy(rows)
    assert set(found) == {"body"}
    entry = found["body"]["16"]
    assert entry["rounds"] == 3
    assert entry["cpu"] == 1.05 and entry["cpu_range"] == [1.0, 1.1]  # 105/100, 220/200, 150/150
    assert entry["p50"] == 1.05 and entry["p50_range"] == [1.0, 1.2]
    assert entry["cpu_vs_least_request"] == pytest.approx(1.0, abs=0.001)  # 105/110, 220/200, 150/150: the median
    assert "inferlb weights body" not in cpu_ratio_to_floor(rows)


def test_the_report_shows_the_weights_tier_ratios_and_the_runs(results: dict[str, Any]) -> None:
    rows = [
        _run("envoy-rr body", 0, 100.0, 2.0) | {"rps": 1000.0, "errors": 0},
        _run("envoy-lr body", 0, 100.0, 2.0) | {"rps": 1000.0, "errors": 0},
        _run("inferlb weights body", 0, 103.0, 2.2, picker_cpu_us=2.0) | {"rps": 990.0, "errors": 0},
    ]
    report = _markdown(dict(results, tier_rows=rows, weights_to_envoy=weights_to_envoy(rows)))
    assert "## The weights tier against Envoy alone" in report
    assert "| 16 | body | 1.05x (1.05 to 1.05) | 1.10x (1.10 to 1.10) | 1.05x | 1.10x | 1 |" in report
    assert "| 16 | inferlb weights body | 990 | 2.200 | 103.0 | 2.0 | 0 |" in report


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
    assert "| 1 | headers | 1.28x | — | +0.81, +1.10 |" in text  # that run kept no rounds
    assert "| 64 | body | 1.39x |" in text
    assert text.count("| 16 | inferlb body |") == 1


def _rounds(results: dict[str, Any], factors: list[float]) -> list[dict[str, Any]]:
    """The run's rows as if measured in len(factors) rounds, inferlb's picker CPU scaled by each round's factor."""
    return [
        {**r, "round": i, "picker_cpu_us": r["picker_cpu_us"] * (f if r["variant"].startswith("inferlb") else 1.0)}
        for i, f in enumerate(factors)
        for r in results["rows"]
        if r["picker_cpu_us"] is not None
    ]


def test_cpu_ratio_rounds_takes_the_ratio_within_each_round(results: dict[str, Any]) -> None:
    rows = _rounds(results, [1.0, 1.2, 0.9])
    by = {(r["variant"], r["concurrency"]): r["picker_cpu_us"] for r in results["rows"]}
    base = by[("inferlb body", 16)] / by[("noop body", 16)]
    entry = cpu_ratio_rounds(rows)["inferlb body"]["16"]
    assert entry["rounds"] == 3
    assert entry["median"] == pytest.approx(base, abs=0.001)
    assert entry["range"] == [pytest.approx(base * 0.9, abs=0.001), pytest.approx(base * 1.2, abs=0.001)]
    # A round whose floor run has no figure drops out of that ratio, not the others.
    rows = [dict(r, picker_cpu_us=None) if (r["variant"], r["round"]) == ("noop body", 1) else r for r in rows]
    assert cpu_ratio_rounds(rows)["inferlb body"]["16"]["rounds"] == 2
    assert cpu_ratio_rounds(rows)["inferlb headers"]["16"]["rounds"] == 3


def test_the_report_shows_the_spread_of_the_rounds(results: dict[str, Any]) -> None:
    results["cpu_ratio_to_floor"] = cpu_ratio_to_floor(results["rows"])
    results["cpu_ratio_rounds"] = cpu_ratio_rounds(_rounds(results, [1.0, 1.1]))
    text = _markdown(results)
    assert "| 1 | headers | 1.28x | 1.28 to 1.40 (2) | +0.81, +1.10 |" in text
    assert "the spread is the machine's noise" in text


def test_the_report_splits_the_extra_cpu_into_the_routing_path_and_the_scoring(results: dict[str, Any]) -> None:
    # That run had no round-robin variants: give it some, between the floor and the preset it measured.
    rows = results["rows"]
    by = {(r["variant"], r["concurrency"]): r for r in rows}
    for c in (1, 16, 64):
        for kind in ("headers", "body"):
            floor, ours = by[(f"noop {kind}", c)]["picker_cpu_us"], by[(f"inferlb {kind}", c)]["picker_cpu_us"]
            rr = dict(by[(f"inferlb {kind}", c)], variant=f"inferlb rr {kind}", picker_cpu_us=(floor + ours) / 2)
            rows.append(rr)
    # The picker's own pick times, kept from runs after 2026-12-02: shown where both presets have them.
    by[("inferlb rr body", 64)] = rows[-1]
    rows[-1]["pick_us"], by[("inferlb body", 64)]["pick_us"] = 9.6, 76.9
    results["own_work"]["decide_cold"] = {"round-robin": 26.0, "default": 83.7}
    text = _markdown(results)

    assert "## Where inferlb's picker CPU over the floor goes (same run)" in text
    floor, ours = by[("noop body", 64)]["picker_cpu_us"], by[("inferlb body", 64)]["picker_cpu_us"]
    half = (ours - floor) / 2
    row = (
        f"| 64 | body | {floor:.0f} | {half:+.0f} | {half:+.0f} | 10, 77 | {(floor + half) / floor:.2f}x |"
        f" {ours / floor:.2f}x |"
    )
    assert row in text
    assert "| 64 | headers |" in text and "| — |" in text  # no pick times in that row
    assert "| default | 83.7 |" in text
    assert "inferlb rr body" in cpu_ratio_to_floor(rows)


def test_the_split_shows_the_pickers_background_cpu_per_request(results: dict[str, Any]) -> None:
    # inferlb scrapes its servers with no request coming, the floor does nothing: at a run's request rate, that
    # background CPU is a share of each request's figure, which the split shows.
    rows = results["rows"]
    by = {(r["variant"], r["concurrency"]): r for r in rows}
    rows.append(dict(by[("inferlb body", 64)], variant="inferlb rr body"))
    results["idle_cpu_ms_per_s"] = {"noop": 0.0, "inferlb": 25.0, "inferlb-rr": 24.0}
    text = _markdown(results)

    assert "in CPU ms a second: noop 0.0, inferlb 25.0, inferlb-rr 24.0" in text
    assert " idle µs/req |" in text
    ours = by[("inferlb body", 64)]
    row = next(line for line in text.splitlines() if line.startswith("| 64 | body |") and "x |" in line)
    assert row.endswith(f" {25.0 * 1000 / ours['rps']:.0f} |")


def test_the_report_shows_the_handlers_instructions_beside_the_floors(results: dict[str, Any]) -> None:
    assert "CPU instructions per request through the stream handler" not in _markdown(results)  # not counted
    results["own_work"]["instructions"] = {
        "noop": {"headers": 34_000, "body": 40_000},
        "round-robin": {"headers": 137_000, "body": 197_000},
        "default": {"headers": 364_000, "body": 507_000},
    }
    text = _markdown(results)

    assert "| request | noop | round-robin | default | round-robin - noop | default - noop |" in text
    assert "| body | 40,000 | 197,000 | 507,000 | +157,000 | +467,000 |" in text


def test_a_run_without_the_round_robin_variants_has_no_split(results: dict[str, Any]) -> None:
    assert "Where inferlb's picker CPU" not in _markdown(results)


def _picker(label: str, cpu: float, kernel: float, interpreter: float) -> dict[str, Any]:
    share = {part: 0.0 for part, _ in perfprof.PARTS} | {perfprof.OTHER: 0.0}
    share |= {"kernel": kernel, "Python interpreter": interpreter, perfprof.OTHER: 1.0 - kernel - interpreter}
    return {
        "label": label,
        "picker_cpu_us": cpu,
        "share": share,
        "us_per_request": {k: v * cpu for k, v in share.items()},
    }


def test_the_report_splits_each_pickers_cpu_by_library(results: dict[str, Any]) -> None:
    assert "by library" not in _markdown(results)  # a run from before the split
    pickers = {
        "noop": _picker("floor", 400.0, 0.5, 0.25),
        "inferlb-rr": _picker("round robin", 440.0, 0.5, 0.3),
        "inferlb": _picker(POLICY, 600.0, 0.4, 0.5),
    }
    text = _markdown(dict(results, native_profile={"concurrency": 16, "request": "body", "pickers": pickers}))

    assert "## Where each picker's CPU goes, by library (perf, body requests, c=16)" in text
    assert f"| part | floor µs | round robin µs | {POLICY} µs | {POLICY} - floor µs |" in text
    assert "| kernel | 200 | 220 | 240 | +40 |" in text
    assert "| Python interpreter | 100 | 132 | 300 | +200 |" in text
    assert "| all | 400 | 440 | 600 | +200 |" in text


def test_the_report_says_why_the_split_by_library_was_skipped(results: dict[str, Any]) -> None:
    text = _markdown(dict(results, native_profile={"skipped": "perf is not installed (Debian package linux-perf)"}))

    assert "split of the pickers' CPU by library (perf) was skipped: perf is not installed" in text


@pytest.mark.envoy
def test_the_backends_serve_metrics_the_picker_reads_and_completions_elsewhere(tmp_path: Path) -> None:
    # Without a vLLM exposition every scrape fails and the default preset routes without server signals: the
    # benchmark would measure a picker that no fleet runs.
    backends = start_backends(2, tmp_path)
    try:
        scrapes = [httpx.get(f"http://{a}/metrics", timeout=10) for a in backends.addresses]
        completion = httpx.post(f"http://{backends.addresses[0]}/v1/completions", content=BODY, timeout=10)
    finally:
        backends.process.stop()
    for scrape in scrapes:
        assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
        signals = SignalReader().read(scrape.content)
        assert (signals.running, signals.waiting, signals.kv_cache_usage) == (2, 0, 0.1)
        assert signals.block_size == 16 and signals.num_gpu_blocks == 8192
    assert completion.json()["id"] == "cmpl-1"


@pytest.mark.envoy
def test_the_floor_gateway_starts_and_routes_through_the_do_nothing_picker(tmp_path: Path) -> None:
    # The floor's picker serves gRPC only (no admin API): the gateway must not wait for one.
    backends = start_backends(2, tmp_path)
    try:
        options = StackOptions(
            servers=tuple(backends.addresses),
            models=(MODEL,),
            envoy=EnvoyOptions(access_log_path=None),
            picker_command=(sys.executable, "-m", "inferlb.bench.noop_picker"),
        )
        with LocalStack(options, tmp_path / "noop") as stack:
            replies = [httpx.post(stack.gateway_url + "/v1/completions", content=BODY, timeout=10) for _ in range(4)]
            # Paused while another stack is measured, then on again (`alone`): every process stopped, then serving.
            stack.pause()
            assert stack.envoy is not None and stack.picker is not None
            for process in (stack.envoy, stack.picker):
                poll(lambda p=process: process_state(p.pid) == "T", f"{process.name} stopped")
            stack.resume()
            replies.append(httpx.post(stack.gateway_url + "/v1/completions", content=BODY, timeout=10))
    finally:
        backends.process.stop()
    assert [r.status_code for r in replies] == [200] * 5
    assert {r.json()["id"] for r in replies} == {"cmpl-1"}


class _Stack:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def pause(self) -> None:
        self.log.append(f"pause {self.name}")

    def resume(self) -> None:
        self.log.append(f"resume {self.name}")


def test_each_stack_is_measured_with_the_others_paused_and_they_resume_even_after_a_failure() -> None:
    log: list[str] = []
    stacks: dict[str, Any] = {name: _Stack(log, name) for name in ("noop", "inferlb", "envoy")}
    with alone(stacks, "inferlb"):
        log.append("measure")
    assert log == ["pause noop", "pause envoy", "measure", "resume noop", "resume envoy"]
    log.clear()
    with pytest.raises(RuntimeError), alone(stacks, "noop"):
        raise RuntimeError("wrk failed")
    assert log == ["pause inferlb", "pause envoy", "resume inferlb", "resume envoy"]


@pytest.mark.envoy
def test_the_weights_tier_routes_through_envoy_over_the_pickers_endpoints(tmp_path: Path) -> None:
    """The picker is Envoy's control plane: the fallback cluster's endpoints (none in the bootstrap) come over ADS
    with the picker's weights, and the weights tier's requests reach the servers without a picker hop."""
    backends = start_backends(2, tmp_path)
    try:
        options = StackOptions(
            servers=tuple(backends.addresses),
            models=(MODEL,),
            envoy=EnvoyOptions(access_log_path=None, xds=True, tier="weights"),
        )
        with LocalStack(options, tmp_path / "weights") as stack:
            assert "inferlb_fallback" in stack.envoy_path.read_text() and "127.0.0.1" not in _fallback(stack)
            replies = [httpx.post(stack.gateway_url + "/v1/completions", content=BODY, timeout=10) for _ in range(8)]
            clusters = httpx.get(f"{stack.admin_url}/clusters", timeout=5).text
            routed = stack.envoy_counters("cluster.inferlb_fallback.upstream_rq_total")
            picks = httpx.get(f"{stack.picker_admin_url}/metrics", headers=stack.admin_headers, timeout=5).text
    finally:
        backends.process.stop()
    assert [r.status_code for r in replies] == [200] * 8
    for address in backends.addresses:
        assert f"inferlb_fallback::{address}::weight::" in clusters
    assert routed["cluster.inferlb_fallback.upstream_rq_total"] == 8
    assert "inferlb_decisions_total{" not in picks  # no request took the hop


def _fallback(stack: LocalStack) -> str:
    text = stack.envoy_path.read_text()
    return text[text.index("- name: inferlb_fallback") :]
