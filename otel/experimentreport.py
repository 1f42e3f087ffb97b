"""An experiment's verdict from exported spans, offline: ``inferlb experiment report --from SPANS.jsonl``.

The picker's ``inferlb.route`` span names the experiment and arm of each request it routed (``inferlb.experiment``,
``inferlb.arm``); the server's ``llm_request`` span, in the same trace (the picker's traceparent is its parent),
gives the request's TTFT and E2E (with its output tokens, the time per output token), and its status whether it
failed. Joined by trace id, each arm's outcomes go
through the same sequential test as the live experiment (`scorer.sequential.compare`) against the control: the
arm named ``control``, else the arm of the experiment's first routed request in the file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferlb.otel.heatmap import otlp_attributes
from inferlb.otel.routespans import ROUTE_SPAN
from inferlb.otel.spancheck import output_tokens
from inferlb.scorer.experiments import LATENCY_BUCKETS_S, TPOT_BUCKETS_S, comparison_json, histogram_quantile
from inferlb.scorer.histogram import Histogram
from inferlb.scorer.sequential import Moments, compare

__all__ = ["ArmFigures", "experiment_report"]

LLM_SPAN = "llm_request"
TTFT = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
STATUS_ERROR = 2  # OTLP's Status.STATUS_CODE_ERROR
DEFAULT_CONTROL = "control"  # the arm compared against, when it is there and no other is named


@dataclass(slots=True)
class ArmFigures:
    """One arm's outcomes in the file: log-moments and histograms of TTFT, E2E and the time per output token (TPOT,
    (E2E - TTFT) / (output tokens - 1)), and the error indicator."""

    requests: int = 0
    finished: int = 0
    ttft: Moments = field(default_factory=Moments)
    e2e: Moments = field(default_factory=Moments)
    tpot: Moments = field(default_factory=Moments)
    errors: Moments = field(default_factory=Moments)
    ttft_histogram: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    tpot_histogram: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS_S))

    def add(self, ttft_s: Any, e2e_s: Any, failed: bool, tokens: int | None = None) -> None:
        self.finished += 1
        self.errors.add(1.0 if failed else 0.0)
        if failed:
            return
        if _positive(ttft_s):
            self.ttft.add(math.log(ttft_s))
            self.ttft_histogram.observe(ttft_s)
        if _positive(e2e_s):
            self.e2e.add(math.log(e2e_s))
        if tokens is not None and tokens > 1 and _positive(ttft_s) and _positive(e2e_s):
            tpot = (e2e_s - ttft_s) / (tokens - 1)
            if tpot > 0:
                self.tpot.add(math.log(tpot))
                self.tpot_histogram.observe(tpot)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def experiment_report(
    requests: Iterable[ExportTraceServiceRequest],
    *,
    control: str | None = None,
    alpha: float = 0.05,
    min_samples: int = 200,
    latency_tau: float = 0.1,
    error_tau: float = 0.01,
) -> dict[str, Any]:
    """Per experiment in the spans: each arm's counts and TTFT quantiles, and each other arm's comparison with the
    control: ``control`` when given (ValueError when an experiment has no arm of that name), else as the module's
    docstring says. Server spans of no routed experiment request are counted, not used."""
    routed: dict[bytes, tuple[str, str]] = {}  # trace id -> (experiment, arm)
    order: dict[str, list[str]] = {}  # experiment -> arms, in the order first routed
    outcomes: dict[bytes, tuple[Any, Any, bool, int | None]] = {}
    for request in requests:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    if span.name == ROUTE_SPAN:
                        attributes = otlp_attributes(span.attributes)
                        experiment, arm = attributes.get("inferlb.experiment"), attributes.get("inferlb.arm")
                        if isinstance(experiment, str) and isinstance(arm, str):
                            routed[span.trace_id] = (experiment, arm)
                            arms = order.setdefault(experiment, [])
                            if arm not in arms:
                                arms.append(arm)
                    elif span.name == LLM_SPAN:
                        attributes = otlp_attributes(span.attributes)
                        failed = span.status.code == STATUS_ERROR
                        tokens = output_tokens(attributes)
                        outcomes[span.trace_id] = (attributes.get(TTFT), attributes.get(E2E), failed, tokens)
    if control is not None:
        for experiment, arms in order.items():
            if control not in arms:
                raise ValueError(
                    f"control {control!r}: experiment {experiment!r} has no arm of that name (its arms: "
                    f"{', '.join(arms)})"
                )
    figures: dict[str, dict[str, ArmFigures]] = {e: {a: ArmFigures() for a in arms} for e, arms in order.items()}
    for trace_id, (experiment, arm) in routed.items():
        one = figures[experiment][arm]
        one.requests += 1
        outcome = outcomes.get(trace_id)
        if outcome is not None:
            one.add(*outcome)
    unmatched = sum(trace_id not in routed for trace_id in outcomes)
    report = []
    for experiment, by_arm in figures.items():
        base = control or (DEFAULT_CONTROL if DEFAULT_CONTROL in by_arm else next(iter(by_arm)))
        comparisons = {}
        for name, arm in by_arm.items():
            if name == base:
                continue
            comparisons[name] = {
                metric: comparison_json(
                    compare(
                        getattr(by_arm[base], metric),
                        getattr(arm, metric),
                        tau=tau,
                        alpha=alpha,
                        min_samples=min_samples,
                    )
                )
                for metric, tau in (
                    ("ttft", latency_tau),
                    ("e2e", latency_tau),
                    ("tpot", latency_tau),
                    ("errors", error_tau),
                )
            }
        report.append(
            {
                "name": experiment,
                "control": base,
                "arms": [
                    {
                        "name": name,
                        "requests": arm.requests,
                        "finished": arm.finished,
                        "error_rate": arm.errors.mean if arm.errors.count else None,
                        "ttft_s": {f"p{q}": histogram_quantile(arm.ttft_histogram, q / 100) for q in (50, 90, 99)},
                        "tpot_s": {f"p{q}": histogram_quantile(arm.tpot_histogram, q / 100) for q in (50, 90, 99)},
                    }
                    for name, arm in by_arm.items()
                ],
                "comparisons": comparisons,
            }
        )
    return {"experiments": report, "server_spans_without_experiment": unmatched}
