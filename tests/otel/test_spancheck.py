"""Tests for otel/spancheck.py: only sane latency spans become records; the rest are counted."""

from __future__ import annotations

import time
from typing import Any

import pytest

from inferlb.otel.spancheck import CheckCounts, check_export
from inferlb.otel.spanwire import SpanBounds, SpanRecord

from .otlp import E2E, TTFT, request, server
from .otlp import span as otlp_span

# One "now" for the whole module: its parameters are built when pytest collects it, minutes before some run.
NOW = time.time_ns()
S = 1_000_000_000
BOUNDS = SpanBounds(max_age_s=600, max_ahead_s=60, max_latency_s=3600)
HERE = server("10.0.0.1:8000")


def span(**fields: Any) -> Any:
    """A span ending at NOW unless it says otherwise."""
    return otlp_span(**{"end_ns": NOW, **fields})


def check(spans, resource=HERE, max_spans: int = 1000) -> tuple[list[SpanRecord], CheckCounts]:
    counts = CheckCounts()
    return check_export(request(spans, **resource), BOUNDS, NOW, max_spans, counts), counts


def test_a_sane_span_becomes_a_record() -> None:
    records, counts = check([span(trace_id=b"\x07" * 16, end_ns=NOW, **{TTFT: 0.25, E2E: 2})])
    assert records == [SpanRecord(b"\x07" * 16, "10.0.0.1:8000", 0.25, 2.0, NOW / S)]
    assert (counts.spans, counts.llm_spans, counts.malformed, counts.out_of_bounds) == (1, 1, 0, 0)


@pytest.mark.parametrize(
    ("bad", "counter"),
    [
        pytest.param(span(end_ns=2**63 - 1, start_ns=NOW), "out_of_bounds", id="end-in-2262"),
        pytest.param(span(end_ns=2**64 - 1, start_ns=NOW), "out_of_bounds", id="end-max-uint64"),
        pytest.param(span(end_ns=NOW + 61 * S), "out_of_bounds", id="end-a-minute-ahead"),
        pytest.param(span(end_ns=NOW - 601 * S), "out_of_bounds", id="end-ten-minutes-ago"),
        pytest.param(span(end_ns=NOW, start_ns=NOW + S), "out_of_bounds", id="negative-duration"),
        pytest.param(span(end_ns=NOW, duration_ns=3601 * S), "out_of_bounds", id="absurd-duration"),
        pytest.param(span(**{TTFT: 3.0, E2E: 1.0}), "out_of_bounds", id="ttft-over-e2e"),
        pytest.param(span(**{TTFT: float("nan")}), "out_of_bounds", id="nan-ttft"),
        pytest.param(span(**{E2E: float("inf")}), "out_of_bounds", id="infinite-e2e"),
        pytest.param(span(**{TTFT: -0.2}), "out_of_bounds", id="negative-ttft"),
        pytest.param(span(**{TTFT: 0.0}), "out_of_bounds", id="zero-ttft"),
        pytest.param(span(**{TTFT: 5000.0, E2E: 6000.0}), "out_of_bounds", id="absurd-latency"),
        pytest.param(span(**{TTFT: 2**62}), "out_of_bounds", id="huge-int-latency"),
        pytest.param(span(**{TTFT: "fast"}), "malformed", id="string-latency"),
        pytest.param(span(**{TTFT: True}), "malformed", id="bool-latency"),
        pytest.param(span(**{TTFT: None, E2E: None}), "malformed", id="no-latency"),
        pytest.param(span(end_ns=0, start_ns=0), "malformed", id="no-times"),
        pytest.param(span(start_ns=0), "malformed", id="no-start"),
    ],
)
def test_an_insane_span_is_dropped_and_counted(bad, counter: str) -> None:
    records, counts = check([bad])
    assert records == []
    assert counts.llm_spans == 1 and getattr(counts, counter) == 1
    assert counts.malformed + counts.out_of_bounds == 1


def test_ttft_may_exceed_e2e_by_rounding_only() -> None:
    records, counts = check([span(**{TTFT: 1.0005, E2E: 1.0}), span(**{TTFT: 1.01, E2E: 1.0})])
    assert len(records) == 1 and counts.out_of_bounds == 1


def test_one_latency_is_enough() -> None:
    records, _ = check([span(**{TTFT: None, E2E: 1.0}), span(name="other", **{E2E: None})])
    assert [(r.ttft_s, r.e2e_s) for r in records] == [(None, 1.0), (0.2, None)]


def test_other_spans_and_envoys_are_counted_not_recorded() -> None:
    plain = span(name="http.request", **{TTFT: None, E2E: None})
    records, counts = check([plain])
    assert records == [] and (counts.spans, counts.llm_spans) == (1, 0)
    records, counts = check([span()], {"service.name": "envoy-gateway", **HERE})
    assert records == [] and (counts.spans, counts.envoy_spans, counts.llm_spans) == (1, 1, 0)


@pytest.mark.parametrize(
    ("trace_id", "kept"),
    [
        pytest.param(b"\x05" * 16, True, id="valid"),
        pytest.param(bytes(16), False, id="all-zero"),
        pytest.param(b"short", False, id="short"),
    ],
)
def test_only_a_valid_trace_id_is_kept(trace_id: bytes, kept: bool) -> None:
    records, _ = check([span(trace_id=trace_id)])
    assert records[0].trace_id == (trace_id if kept else None) and records[0].server == "10.0.0.1:8000"


@pytest.mark.parametrize(
    ("parent", "kept"),
    [
        pytest.param(b"\x09" * 8, True, id="valid"),
        pytest.param(bytes(8), False, id="all-zero"),
        pytest.param(b"", False, id="a-root-span"),
        pytest.param(b"short", False, id="short"),
    ],
)
def test_the_parent_span_id_is_kept_where_valid(parent: bytes, kept: bool) -> None:
    # The parent is the span id the picker put in the request's traceparent: it tells the requests of one trace apart.
    one = span()
    one.parent_span_id = parent
    records, _ = check([one])
    assert records[0].parent_id == (parent if kept else None)


def test_spans_past_the_per_export_limit_are_not_looked_at() -> None:
    req = request([span(), span(), span()], **HERE)
    req.resource_spans.append(request([span(), span()], **HERE).resource_spans[0])
    counts = CheckCounts()
    records = check_export(req, BOUNDS, NOW, 4, counts)
    assert len(records) == 4 and (counts.spans, counts.over_limit) == (4, 1)


@pytest.mark.parametrize(
    ("attributes", "tokens"),
    [
        ({"gen_ai.usage.completion_tokens": 120}, 120),  # vLLM's name
        ({"gen_ai.usage.output_tokens": 7}, 7),  # the GenAI conventions'
        ({}, None),
        ({"gen_ai.usage.completion_tokens": -1}, None),
        ({"gen_ai.usage.completion_tokens": 10**9}, None),
        ({"gen_ai.usage.completion_tokens": "120"}, None),
        ({"gen_ai.usage.completion_tokens": True}, None),
        ({"gen_ai.usage.completion_tokens": 1.5}, None),
    ],
)
def test_output_tokens_are_read_and_a_bad_count_costs_only_the_count(
    attributes: dict[str, Any], tokens: int | None
) -> None:
    records, counts = check([span(**{TTFT: 0.25, E2E: 2}, **attributes)])
    assert [(r.ttft_s, r.e2e_s, r.output_tokens) for r in records] == [(0.25, 2.0, tokens)]
    assert counts.malformed == counts.out_of_bounds == 0
