"""``inferlb experiment report --from SPANS.jsonl``: route spans joined with server spans by trace id, and the live
experiments' sequential test on them."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.trace.v1 import trace_pb2

from inferlb.cli import main
from inferlb.otel.experimentreport import experiment_report
from inferlb.otel.routespans import ROUTE_SPAN

from .otlp import E2E, TTFT, request, span


def _spans(n: int, *, faster: float, failing_every: int = 0, seed: int = 1) -> list[trace_pb2.Span]:
    rng = random.Random(seed)
    spans = []
    for i in range(n):
        trace_id = i.to_bytes(16, "big")
        arm = "treatment" if i % 2 else "control"
        spans.append(
            span(
                ROUTE_SPAN,
                trace_id,
                **{
                    "inferlb.experiment": "ab",
                    "inferlb.arm": arm,
                    "gen_ai.latency.time_to_first_token": None,
                    "gen_ai.latency.e2e": None,
                },
            )
        )
        ttft = rng.lognormvariate(-1.0, 0.3) * (faster if arm == "treatment" else 1.0)
        server = span(
            "llm_request", trace_id, **{"gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.e2e": ttft * 3}
        )
        if failing_every and arm == "treatment" and i % failing_every == 1:
            server.status.code = trace_pb2.Status.STATUS_CODE_ERROR
        spans.append(server)
    spans.append(span("llm_request", b"\xff" * 16))  # a server span of no experiment's request
    return spans


def test_a_faster_arm_is_found_better_and_nothing_is_found_in_an_a_a() -> None:
    (ab,) = experiment_report([request(_spans(800, faster=0.7))])["experiments"]
    assert ab["control"] == "control" and [a["requests"] for a in ab["arms"]] == [400, 400]
    assert ab["comparisons"]["treatment"]["ttft"]["verdict"] == "better"
    assert ab["comparisons"]["treatment"]["ttft"]["high"] < 0
    report = experiment_report([request(_spans(800, faster=1.0))])
    (aa,) = report["experiments"]
    assert {m["verdict"] for m in aa["comparisons"]["treatment"].values()} == {"no difference yet"}
    assert report["server_spans_without_experiment"] == 1
    # The control can be named: then the other arm is the one compared.
    (named,) = experiment_report([request(_spans(800, faster=0.7))], control="treatment")["experiments"]
    assert named["comparisons"]["control"]["ttft"]["verdict"] == "worse"


def test_the_arm_named_control_is_the_control_even_when_another_was_routed_first() -> None:
    spans = _spans(800, faster=0.7)
    first = [spans[2], spans[3]]  # a treatment request (its route span and its server span), first in the file
    (ab,) = experiment_report([request(first + spans[:2] + spans[4:])])["experiments"]
    assert ab["control"] == "control"
    assert ab["comparisons"]["treatment"]["ttft"]["verdict"] == "better"


def test_a_control_the_experiment_does_not_have_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"control 'stable': experiment 'ab' has no arm of that name \(its arms: con"):
        experiment_report([request(_spans(100, faster=1.0))], control="stable")


def test_failed_server_spans_count_as_errors() -> None:
    (ab,) = experiment_report([request(_spans(800, faster=1.0, failing_every=4))], min_samples=50)["experiments"]
    treatment = next(a for a in ab["arms"] if a["name"] == "treatment")
    assert treatment["error_rate"] == pytest.approx(0.5)
    assert ab["comparisons"]["treatment"]["errors"]["verdict"] == "worse"


def test_the_command_reads_a_collector_file_and_refuses_one_without_experiments(tmp_path: Path, capsys) -> None:
    path = tmp_path / "spans.jsonl"
    lines = [json_format.MessageToJson(request(_spans(800, faster=0.7)[:800]), indent=None)]
    lines.append(json_format.MessageToJson(request(_spans(800, faster=0.7)[800:]), indent=None))
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.json"
    assert main(["experiment", "report", "--from", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "treatment vs control, ttft:" in printed and ": better" in printed
    assert json.loads(out.read_text())["experiments"][0]["name"] == "ab"
    empty = tmp_path / "none.jsonl"
    empty.write_text(json_format.MessageToJson(request([span("llm_request")]), indent=None) + "\n")
    assert main(["experiment", "report", "--from", str(empty)]) == 2
    assert "no inferlb.route span names an experiment" in capsys.readouterr().err


def test_output_tokens_give_each_arm_its_time_per_output_token() -> None:
    rng = random.Random(3)
    spans = []
    for i in range(800):
        trace_id = i.to_bytes(16, "big")
        arm = "treatment" if i % 2 else "control"
        routed = {"inferlb.experiment": "ab", "inferlb.arm": arm, TTFT: None, E2E: None}
        spans.append(span(ROUTE_SPAN, trace_id, **routed))
        tpot = rng.lognormvariate(math.log(0.02), 0.2) * (0.8 if arm == "treatment" else 1.0)
        ttft = rng.lognormvariate(-1.0, 0.3)  # the same for both: only decoding differs
        attributes = {TTFT: ttft, E2E: ttft + 100 * tpot, "gen_ai.usage.completion_tokens": 101}
        spans.append(span("llm_request", trace_id, **attributes))
    (ab,) = experiment_report([request(spans)])["experiments"]
    by_arm = {a["name"]: a for a in ab["arms"]}
    assert by_arm["control"]["tpot_s"]["p50"] == pytest.approx(0.02, rel=0.1)
    assert by_arm["treatment"]["tpot_s"]["p50"] == pytest.approx(0.016, rel=0.1)
    assert ab["comparisons"]["treatment"]["tpot"]["verdict"] == "better"
    assert ab["comparisons"]["treatment"]["ttft"]["verdict"] == "no difference yet"
