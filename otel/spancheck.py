"""Decoding and checking an OTLP export: protobuf in, compact `SpanRecord`s out. Runs in the receiver process
(otel/receiverproc.py), never on the picker's event loop: parsing a 4 MiB export holds the GIL for tens of
milliseconds.

A span is a latency span when it is named ``llm_request`` (vLLM's) or carries ``gen_ai.latency.time_to_first_token``
or ``gen_ai.latency.e2e``; other spans are counted and dropped, and so are all spans of a resource whose
``service.name`` starts with ``envoy`` (Envoy's own). A latency span becomes a record only when it is sane, else
it is counted and dropped:

- ``malformed``: a latency attribute that is not a number; neither latency present; start or end time unset;
- ``out_of_bounds``: a latency that is not finite, not positive or over ``max_latency_s``; TTFT greater than
  E2E (beyond a small slack); end before start; a duration over ``max_latency_s``; an end time more than
  ``max_age_s`` before or ``max_ahead_s`` after the receiver's clock (so one span dated 2262 cannot move the
  heatmap's window, nor one dated 1970 count as news).

Only the first ``max_spans`` spans of an export are looked at; the rest count as ``over_limit``. A trace id
that is not 16 bytes, or all zero (W3C: invalid), is dropped from the record (the span may still name its
server). Times are compared as integers of nanoseconds, so no float overflows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferlb.otel.heatmap import E2E_ATTRIBUTE, LLM_SPAN, TTFT_ATTRIBUTE, otlp_attributes, span_endpoint
from inferlb.otel.spanwire import MAX_OUTPUT_TOKENS, SpanBounds, SpanRecord

# The tokens a server generated for the request: vLLM's name, then the current GenAI semantic conventions'.
OUTPUT_TOKEN_ATTRIBUTES = ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")

__all__ = ["OUTPUT_TOKEN_ATTRIBUTES", "CheckCounts", "check_export", "output_tokens"]

_NS = 1_000_000_000
_MALFORMED = "malformed"
_OUT_OF_BOUNDS = "out_of_bounds"


@dataclass(slots=True)
class CheckCounts:
    """What became of an export's spans: ``spans`` looked at (of which ``envoy_spans``, ``llm_spans``, and of
    those ``malformed`` and ``out_of_bounds``); ``over_limit`` not looked at. Only grows."""

    spans: int = 0
    envoy_spans: int = 0
    llm_spans: int = 0
    malformed: int = 0
    out_of_bounds: int = 0
    over_limit: int = 0

    def items(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_export(
    request: ExportTraceServiceRequest, bounds: SpanBounds, now_ns: int, max_spans: int, counts: CheckCounts
) -> list[SpanRecord]:
    """The sane latency spans of ``request`` as records, in order; ``counts`` gets the rest. Never raises for
    anything a sender can put in a well-formed protobuf."""
    records: list[SpanRecord] = []
    budget = max_spans
    oldest = now_ns - int(bounds.max_age_s * _NS)
    newest = now_ns + int(bounds.max_ahead_s * _NS)
    for resource_spans in request.resource_spans:
        resource = otlp_attributes(resource_spans.resource.attributes)
        service = resource.get("service.name")
        is_envoy = isinstance(service, str) and service.lower().startswith("envoy")
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            if budget <= 0:
                counts.over_limit += len(spans)
                continue
            if len(spans) > budget:
                counts.over_limit += len(spans) - budget
            for span in spans[:budget] if len(spans) > budget else spans:
                budget -= 1
                counts.spans += 1
                if is_envoy:
                    counts.envoy_spans += 1
                    continue
                outcome = _check(span, resource, bounds, oldest, newest)
                if outcome is None:
                    continue
                counts.llm_spans += 1
                if isinstance(outcome, SpanRecord):
                    records.append(outcome)
                elif outcome == _MALFORMED:
                    counts.malformed += 1
                else:
                    counts.out_of_bounds += 1
    return records


def _check(
    span: Any, resource: Mapping[str, Any], bounds: SpanBounds, oldest: int, newest: int
) -> SpanRecord | str | None:
    """None (not a latency span), _MALFORMED, _OUT_OF_BOUNDS or the span's SpanRecord."""
    attributes = otlp_attributes(span.attributes)
    raw_ttft, raw_e2e = attributes.get(TTFT_ATTRIBUTE), attributes.get(E2E_ATTRIBUTE)
    if span.name != LLM_SPAN and raw_ttft is None and raw_e2e is None:
        return None
    if raw_ttft is None and raw_e2e is None:
        return _MALFORMED
    limit = bounds.max_latency_s
    ttft, e2e = _latency(raw_ttft, limit), _latency(raw_e2e, limit)
    if isinstance(ttft, str):
        return ttft
    if isinstance(e2e, str):
        return e2e
    if ttft is not None and e2e is not None and ttft > e2e * 1.001 + bounds.ttft_slack_s:
        return _OUT_OF_BOUNDS
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if not start or not end:
        return _MALFORMED
    if end < start or end - start > limit * _NS or not oldest <= end <= newest:
        return _OUT_OF_BOUNDS
    raw_id = bytes(span.trace_id)
    trace_id = raw_id if len(raw_id) == 16 and any(raw_id) else None
    raw_parent = bytes(span.parent_span_id)
    parent_id = raw_parent if len(raw_parent) == 8 and any(raw_parent) else None
    endpoint = span_endpoint(attributes, resource)
    return SpanRecord(trace_id, endpoint, ttft, e2e, end / _NS, output_tokens(attributes), parent_id)


def output_tokens(attributes: Mapping[str, Any]) -> int | None:
    """The span's output token count, or None where it reports none, or one no server could have made (a bad count
    costs the span only its time per output token, never its latency)."""
    for name in OUTPUT_TOKEN_ATTRIBUTES:
        value = attributes.get(name)
        if value is not None:
            if type(value) is int and 0 <= value <= MAX_OUTPUT_TOKENS:
                return value
            return None
    return None


def _latency(value: Any, limit: float) -> float | str | None:
    """A latency attribute: None (absent), its seconds, or why it is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _MALFORMED
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return _OUT_OF_BOUNDS
    if not math.isfinite(seconds) or not 0.0 < seconds <= limit:
        return _OUT_OF_BOUNDS
    return seconds
