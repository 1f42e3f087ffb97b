"""The picker's own span per routed request: ``inferlb.route``.

Each span records the decision (endpoint, profile, request class, every scorer's score for the chosen endpoint,
the prompt-token estimate, the experiment and arm) or the refusal (status, shed), continues the client's W3C
trace when it sent one, and is the parent of the server's span: the traceparent injected upstream names this span.
A change of an experiment's weights is an ``inferlb.experiment`` span of its own, with the change as an event.
The tracer provider is passed in (never the global one); with none configured the picker makes no spans at all.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferlb.scorer.engine import Decision
from inferlb.scorer.experiments import WeightChange
from inferlb.scorer.features import RequestFeatures

__all__ = ["EXPERIMENT_SPAN", "ROUTE_SPAN", "WEIGHT_CHANGE_EVENT", "RouteSpans"]

logger = logging.getLogger(__name__)

ROUTE_SPAN = "inferlb.route"
EXPERIMENT_SPAN = "inferlb.experiment"
WEIGHT_CHANGE_EVENT = "inferlb.experiment.weight_change"
_PROPAGATOR = TraceContextTextMapPropagator()


class RouteSpans:
    """Makes the ``inferlb.route`` spans. `routed`/`refused` never raise (failures are counted in ``errors``)."""

    def __init__(self, tracer_provider: trace_api.TracerProvider) -> None:
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("inferlb.picker")
        self.errors = 0

    def routed(self, features: RequestFeatures, decision: Decision, started_ns: int) -> tuple[bytes, str] | None:
        """A span for a routed request; returns (trace id, traceparent to inject upstream) or None on failure."""
        try:
            span = self._start(features, started_ns)
            span.set_attributes(
                {
                    "inferlb.outcome": "routed",
                    "inferlb.endpoint": decision.endpoint.address,
                    "inferlb.profile": decision.profile,
                    "inferlb.picker": decision.reason,
                    "inferlb.candidates": len(decision.candidates),
                    **{f"inferlb.score.{name}": float(score) for name, score in decision.scores.items()},
                }
            )
            context = span.get_span_context()
            span.end()
            return context.trace_id.to_bytes(16, "big"), f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
        except Exception:
            self._failed()
            return None

    def refused(self, features: RequestFeatures, status: int, kind: str, started_ns: int) -> None:
        try:
            span = self._start(features, started_ns)
            span.set_attributes(
                {
                    "inferlb.outcome": "shed" if status == 429 else "refused",
                    "http.response.status_code": status,
                    "inferlb.error": kind,
                }
            )
            span.set_status(trace_api.Status(trace_api.StatusCode.ERROR, kind))
            span.end()
        except Exception:
            self._failed()

    def weight_changed(self, change: WeightChange) -> None:
        """An ``inferlb.experiment`` span with one event, ``inferlb.experiment.weight_change``, for a change of an
        experiment's weights (a ramp step, a guard's cut or roll-back, an operator's action)."""
        try:
            attributes: dict[str, Any] = {
                "inferlb.experiment": change.experiment,
                "inferlb.change.kind": change.kind,
                "inferlb.change.reason": change.reason,
                **{f"inferlb.weight.{arm}": weight for arm, weight in change.weights.items()},
            }
            if change.arm is not None:
                attributes["inferlb.arm"] = change.arm
            span = self.tracer.start_span(EXPERIMENT_SPAN, context=Context(), kind=trace_api.SpanKind.INTERNAL)
            span.add_event(WEIGHT_CHANGE_EVENT, attributes)
            span.set_attributes(attributes)
            span.end()
        except Exception:
            self._failed()

    def _start(self, features: RequestFeatures, started_ns: int) -> Any:
        parent = Context()
        if features.traceparent:
            parent = _PROPAGATOR.extract({"traceparent": features.traceparent}, context=Context())
        attributes: dict[str, Any] = {"inferlb.prompt_tokens": features.prompt_tokens, "http.route": features.path}
        if features.model is not None:
            attributes["gen_ai.request.model"] = features.model[:256]  # a refused client's name: bounded
        if features.request_class is not None:
            attributes["inferlb.request_class"] = features.request_class
        if features.request_id:
            attributes["inferlb.request_id"] = features.request_id
        arm = features.arm
        if arm is not None:
            attributes["inferlb.experiment"] = arm.experiment
            attributes["inferlb.arm"] = arm.name
        return self.tracer.start_span(
            ROUTE_SPAN, context=parent, kind=trace_api.SpanKind.INTERNAL, start_time=started_ns, attributes=attributes
        )

    def _failed(self) -> None:
        if not self.errors:
            logger.exception("could not record an inferlb.route span (logged once)")
        self.errors += 1

    def shutdown(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()
