"""Tests for otel/heatmap.py and otel/render.py: the grids, their bounds, the span feeders, the renderers, the CLI."""

from __future__ import annotations

import html
import importlib.resources
import json
import math
import random
import struct
import threading
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferlb.cli import main
from inferlb.otel.heatmap import (
    DEFAULT_LATENCY_BOUNDS,
    HeatmapAggregator,
    add_otlp_request,
    load_otlp_json_lines,
)
from inferlb.otel.render import PAGE_TEMPLATE, render_html, render_json, render_png
from inferlb.sim.spans import RequestSpans

T0 = 1_700_000_000.0  # a bucket boundary for 10 s buckets
ENDPOINTS = ["10.0.0.2:8000", "10.0.0.10:8000", "10.0.0.3:8000", "[fd00::1]:8000"]
SLOW = "10.0.0.3:8000"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BUCKET_RATIO = DEFAULT_LATENCY_BOUNDS[1] / DEFAULT_LATENCY_BOUNDS[0]


def fleet(buckets: int = 12, per_cell: int = 40, seed: int = 1) -> Iterator[tuple[float, str, float, float]]:
    """Synthetic requests: TTFT ~ lognormal around 120 ms, 1.2 s on the slow endpoint."""
    rng = random.Random(seed)
    for b in range(buckets):
        for endpoint in ENDPOINTS:
            median = 1.2 if endpoint == SLOW else 0.12
            for _ in range(per_cell):
                ttft = median * math.exp(rng.gauss(0, 0.4))
                yield T0 + 10 * b + rng.uniform(0, 9.99), endpoint, ttft, ttft + rng.uniform(1, 5)


def filled(**kwargs: Any) -> HeatmapAggregator:
    aggregator = HeatmapAggregator(**kwargs)
    for record in fleet():
        aggregator.add(*record)
    return aggregator


# --- aggregation ---------------------------------------------------------------------------------------------


def test_grid_shape_and_the_slow_endpoint_is_the_hot_row() -> None:
    grid = filled().grid()
    assert grid["bucket_s"] == 10.0
    assert grid["times"] == [T0 + 10 * b for b in range(12)]
    # IPv4 numerically, then IPv6.
    assert grid["endpoints"] == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.10:8000", "[fd00::1]:8000"]
    assert grid["count"] == [[40] * 12 for _ in ENDPOINTS]
    slow = grid["endpoints"].index(SLOW)
    for t in range(12):
        column = [row[t] for row in grid["p95_ttft_s"]]
        assert max(column) == column[slow]
        assert column[slow] > 3 * max(v for i, v in enumerate(column) if i != slow)
    assert len(grid["latency_counts"]) == len(grid["latency_bounds_s"]) + 1
    assert [sum(row[t] for row in grid["latency_counts"]) for t in range(12)] == [160] * 12
    assert grid["dropped"] == grid["late"] == grid["invalid"] == grid["unattributed"] == 0
    json.dumps(grid, allow_nan=False)  # JSON-ready as it is


def test_p95_is_within_one_latency_bucket_of_the_exact_value() -> None:
    rng = random.Random(7)
    aggregator = HeatmapAggregator()
    values = [0.05 * math.exp(rng.gauss(0, 1)) for _ in range(500)]
    for v in values:
        aggregator.add(T0, "10.0.0.1:8000", v, None)
    estimate = aggregator.grid()["p95_ttft_s"][0][0]
    exact = float(np.percentile(values, 95, method="inverted_cdf"))
    assert exact / BUCKET_RATIO <= estimate <= exact * BUCKET_RATIO


def test_p95_is_exact_for_one_value_and_for_identical_values() -> None:
    aggregator = HeatmapAggregator()
    aggregator.add(T0, "10.0.0.1:8000", 0.123, 1.0)
    for _ in range(10):
        aggregator.add(T0, "10.0.0.2:8000", 2.5, 3.0)
    assert aggregator.grid()["p95_ttft_s"] == [[0.123], [2.5]]


def test_latency_buckets_use_upper_edges_and_an_overflow_row() -> None:
    aggregator = HeatmapAggregator(latency_bounds=[0.1, 1.0])
    for ttft in (0.0, 0.1, 0.5, 1.0, 7.0, 700.0):
        aggregator.add(T0, "10.0.0.1:8000", ttft, None)
    grid = aggregator.grid()
    assert grid["latency_bounds_s"] == [0.1, 1.0]
    assert grid["latency_counts"] == [[2], [2], [2]]
    assert grid["p95_ttft_s"] == [[700.0]]


def test_requests_without_ttft_count_but_have_no_p95() -> None:
    aggregator = HeatmapAggregator()
    aggregator.add(T0, "10.0.0.1:8000", None, 3.0)
    aggregator.add(T0 + 10, "10.0.0.1:8000", 0.2, None)
    grid = aggregator.grid()
    assert grid["count"] == [[1, 1]]
    assert grid["p95_ttft_s"] == [[None, 0.2]]
    assert sum(row[0] for row in grid["latency_counts"]) == 0


def test_malformed_records_are_counted_not_raised() -> None:
    aggregator = HeatmapAggregator()
    aggregator.add(T0, "10.0.0.1:8000", math.nan, 1.0)  # bad TTFT: the request still counts
    aggregator.add(T0, "10.0.0.1:8000", -1.0, None)
    aggregator.add(T0, "10.0.0.1:8000", 0.1, math.inf)
    aggregator.add(math.nan, "10.0.0.1:8000", 0.1, 1.0)  # bad time: dropped
    aggregator.add(T0, cast(Any, 42), 0.1, 1.0)
    aggregator.add(T0, "", 0.1, 1.0)
    aggregator.add(T0, None, 0.1, 1.0)
    aggregator.add(T0, "10.0.0.1:8000", cast(Any, True), None)
    aggregator.add(10**400, "10.0.0.1:8000", 0.1, None)
    grid = aggregator.grid()
    assert grid["count"] == [[4]]
    assert grid["p95_ttft_s"] == [[0.1]]
    assert (grid["invalid"], grid["unattributed"]) == (8, 1)


def test_gaps_in_time_are_empty_columns() -> None:
    aggregator = HeatmapAggregator(bucket_s=5)
    aggregator.add(T0 + 1, "10.0.0.1:8000", 0.1, 1.0)
    aggregator.add(T0 + 16, "10.0.0.1:8000", 0.2, 1.0)
    grid = aggregator.grid()
    assert grid["times"] == [T0, T0 + 5, T0 + 10, T0 + 15]
    assert grid["count"] == [[1, 0, 0, 1]]
    assert grid["p95_ttft_s"] == [[0.1, None, None, 0.2]]


def test_an_empty_aggregator_has_an_empty_grid() -> None:
    grid = HeatmapAggregator().grid()
    assert grid["times"] == grid["endpoints"] == grid["p95_ttft_s"] == grid["count"] == []
    assert grid["latency_counts"] == [[] for _ in range(len(DEFAULT_LATENCY_BOUNDS) + 1)]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        pytest.param({"bucket_s": 0}, "bucket_s must be", id="bucket-zero"),
        pytest.param({"bucket_s": math.nan}, "bucket_s must be", id="bucket-nan"),
        pytest.param({"latency_bounds": []}, "latency_bounds must have", id="no-bounds"),
        pytest.param({"latency_bounds": [1.0, 0.5]}, "increasing order", id="unsorted"),
        pytest.param({"latency_bounds": [0.0, 1.0]}, "> 0", id="zero-bound"),
        pytest.param({"max_buckets": 0}, "max_buckets must be", id="max-buckets"),
        pytest.param({"max_endpoints": 1.5}, "max_endpoints must be", id="max-endpoints"),
    ],
)
def test_bad_parameters_say_what_is_expected(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        HeatmapAggregator(**kwargs)


# --- bounded memory ------------------------------------------------------------------------------------------


def test_only_the_newest_buckets_are_kept_and_older_records_are_late() -> None:
    aggregator = HeatmapAggregator(max_buckets=3)
    for b in range(10):
        aggregator.add(T0 + 10 * b, "10.0.0.1:8000", 0.1 * (b + 1), None)
    grid = aggregator.grid()
    assert grid["times"] == [T0 + 70, T0 + 80, T0 + 90]
    assert grid["p95_ttft_s"] == [[pytest.approx(0.8), pytest.approx(0.9), pytest.approx(1.0)]]
    assert sum(sum(row) for row in grid["latency_counts"]) == 3
    aggregator.add(T0 + 69.9, "10.0.0.1:8000", 0.1, None)  # just before the window
    aggregator.add(T0 + 70.0, "10.0.0.1:8000", 0.1, None)  # the oldest kept bucket
    grid = aggregator.grid()
    assert grid["late"] == 1
    assert grid["count"] == [[2, 1, 1]]
    assert len(aggregator._buckets) <= 3


def test_endpoints_over_the_cap_are_dropped_until_a_slot_frees() -> None:
    aggregator = HeatmapAggregator(max_buckets=2, max_endpoints=2)
    aggregator.add(T0, "10.0.0.1:8000", 0.1, None)
    aggregator.add(T0 + 10, "10.0.0.2:8000", 0.1, None)
    aggregator.add(T0 + 10, "10.0.0.3:8000", 0.1, None)
    grid = aggregator.grid()
    assert grid["endpoints"] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert grid["dropped"] == 1
    # 10.0.0.1's only bucket leaves the window: its place goes to the next newcomer.
    aggregator.add(T0 + 20, "10.0.0.3:8000", 0.1, None)
    grid = aggregator.grid()
    assert grid["endpoints"] == ["10.0.0.2:8000", "10.0.0.3:8000"]
    assert grid["times"] == [T0 + 10, T0 + 20]
    assert grid["dropped"] == 1


def test_two_threads_adding_while_a_third_reads() -> None:
    aggregator = HeatmapAggregator(max_endpoints=8)
    per_thread = 20_000
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(endpoint: str) -> None:
        try:
            for i in range(per_thread):
                aggregator.add(T0 + (i % 50), endpoint, 0.001 * (i % 997), 1.0)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        while not stop.is_set():
            aggregator.grid()

    threads = [threading.Thread(target=writer, args=(f"10.0.0.{i}:8000",)) for i in (1, 2)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stop.set()
    watcher.join(timeout=60)
    assert not errors
    grid = aggregator.grid()
    assert [sum(row) for row in grid["count"]] == [per_thread, per_thread]
    assert sum(sum(row) for row in grid["latency_counts"]) == 2 * per_thread


# --- feeders -------------------------------------------------------------------------------------------------


def vllm_provider(exporter: Any, address: str | None = "10.0.0.7") -> TracerProvider:
    attributes: dict[str, Any] = {"service.name": "vllm"}
    if address is not None:
        attributes |= {"server.address": address, "server.port": 8000}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def record(spans: RequestSpans, end_s: float, ttft_s: float) -> None:
    spans.record(
        traceparent=None,
        tracestate=None,
        request_id="cmpl-1",
        model="m",
        start_ns=int((end_s - 2) * 1e9),
        end_ns=int(end_s * 1e9),
        ttft_s=ttft_s,
        e2e_s=2.0,
        queue_s=0.01,
        prompt_tokens=10,
        completion_tokens=20,
        max_tokens=None,
    )


def kv(key: str, value: Any) -> common_pb2.KeyValue:
    if isinstance(value, int):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))
    if isinstance(value, float):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=value))
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def otlp_span(name: str, end_s: float, **attributes: Any) -> trace_pb2.Span:
    return trace_pb2.Span(
        name=name,
        trace_id=b"\x01" * 16,
        span_id=b"\x02" * 8,
        end_time_unix_nano=int(end_s * 1e9),
        attributes=[kv(k.replace("__", "."), v) for k, v in attributes.items()],
    )


def otlp_request(resource: dict[str, Any], *spans: trace_pb2.Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[kv(k, v) for k, v in resource.items()]),
                scope_spans=[trace_pb2.ScopeSpans(spans=list(spans))],
            )
        ]
    )


LATENCY = {"gen_ai__latency__time_to_first_token": 0.4, "gen_ai__latency__e2e": 3.0}


def test_otlp_requests_use_end_time_resource_and_span_attributes() -> None:
    aggregator = HeatmapAggregator()
    matched = add_otlp_request(
        aggregator,
        otlp_request(
            {"server.address": "10.0.0.5", "server.port": 8000},
            otlp_span("llm_request", T0 + 3, **LATENCY),
            otlp_span("llm_request", T0 + 13, gen_ai__latency__time_to_first_token=0.6),
            otlp_span("other", T0 + 3, **LATENCY, server__address="fd00::9", server__port=8001),
            otlp_span("http.request", T0 + 3),  # not an LLM request
            otlp_span("llm_request", 0, **LATENCY),  # no end time
        ),
    )
    # OTEL_RESOURCE_ATTRIBUTES carries the port as a string.
    matched += add_otlp_request(
        aggregator,
        otlp_request({"server.address": "10.0.0.6", "server.port": "8000"}, otlp_span("llm_request", T0, **LATENCY)),
    )
    assert matched == 5
    grid = aggregator.grid()
    assert grid["endpoints"] == ["10.0.0.5:8000", "10.0.0.6:8000", "[fd00::9]:8001"]
    assert grid["p95_ttft_s"] == [[0.4, 0.6], [0.4, None], [0.4, None]]
    assert grid["invalid"] == 1


def sdk_requests(tmp_path: Path, ends: list[tuple[str, float, float]]) -> list[ExportTraceServiceRequest]:
    """One OTLP request per (address, end time, TTFT), encoded from real SDK spans by the OTLP exporter's encoder."""
    requests = []
    for address, end_s, ttft in ends:
        memory = InMemorySpanExporter()
        provider = vllm_provider(memory, address=address)
        record(RequestSpans(provider), end_s, ttft)
        requests.append(encode_spans(memory.get_finished_spans()))
        provider.shutdown()
    return requests


def write_lines(path: Path, requests: list[ExportTraceServiceRequest], extra: Sequence[str] = ()) -> Path:
    lines = [json_format.MessageToJson(r, indent=None) for r in requests]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def test_json_lines_round_trip_and_collector_hex_ids(tmp_path: Path) -> None:
    requests = sdk_requests(tmp_path, [("10.0.0.1", T0 + 1, 0.2), ("10.0.0.2", T0 + 2, 0.9)])
    # The collector's file exporter writes ids in hex (OTLP/JSON), and may add fields this protobuf lacks.
    collector_line = json.dumps(
        {
            "resourceSpans": [
                {
                    "resource": {
                        "attributes": [
                            {"key": "server.address", "value": {"stringValue": "10.0.0.3"}},
                            {"key": "server.port", "value": {"intValue": "8000"}},
                        ]
                    },
                    "scopeSpans": [
                        {
                            "scope": {"name": "vllm.llm_engine"},
                            "spans": [
                                {
                                    "traceId": "5b8efff798038103d269b633813fc60c",
                                    "spanId": "eee19b7ec3c1b174",
                                    "name": "llm_request",
                                    "kind": 2,
                                    "endTimeUnixNano": str(int((T0 + 4) * 1e9)),
                                    "attributes": [
                                        {"key": "gen_ai.latency.time_to_first_token", "value": {"doubleValue": 0.3}},
                                        {"key": "gen_ai.latency.e2e", "value": {"doubleValue": 1.0}},
                                    ],
                                    "someFutureField": True,
                                }
                            ],
                        }
                    ],
                }
            ]
        }
    )
    path = write_lines(tmp_path / "spans.jsonl", requests, ["", collector_line])
    loaded = list(load_otlp_json_lines(path))
    assert loaded[:2] == requests
    hex_span = loaded[2].resource_spans[0].scope_spans[0].spans[0]
    assert hex_span.trace_id.hex() == "5b8efff798038103d269b633813fc60c"
    assert hex_span.span_id.hex() == "eee19b7ec3c1b174"
    aggregator = HeatmapAggregator()
    assert sum(add_otlp_request(aggregator, r) for r in loaded) == 3
    grid = aggregator.grid()
    assert grid["endpoints"] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert grid["p95_ttft_s"] == [[0.2], [0.9], [0.3]]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("{not json", id="not-json"),
        pytest.param("[1, 2]", id="not-an-object"),
        pytest.param('{"resourceSpans": 5}', id="wrong-type"),
    ],
)
def test_a_malformed_line_names_its_number(tmp_path: Path, bad: str) -> None:
    path = write_lines(tmp_path / "spans.jsonl", sdk_requests(tmp_path, [("10.0.0.1", T0, 0.1)]), ["", bad])
    with pytest.raises(ValueError, match=r"spans\.jsonl:3: not an OTLP/JSON ExportTraceServiceRequest"):
        list(load_otlp_json_lines(path))


# --- renderers -----------------------------------------------------------------------------------------------


def png_size(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk follows the signature
    return width, height


@pytest.mark.parametrize("empty", [pytest.param(False, id="fleet"), pytest.param(True, id="empty")])
def test_png(tmp_path: Path, empty: bool) -> None:
    grid = HeatmapAggregator().grid() if empty else filled().grid()
    path = tmp_path / "heatmap.png"
    render_png(grid, path)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    width, height = png_size(data)
    assert width == 1200 and 500 <= height <= 2000
    assert 5_000 < len(data) < 2_000_000


def test_png_with_requests_per_endpoint_is_taller(tmp_path: Path) -> None:
    plain, counted = tmp_path / "plain.png", tmp_path / "counted.png"
    render_png(filled().grid(), plain)
    render_png(filled().grid(), counted, endpoint_counts=True)
    (width, height), (counted_width, counted_height) = png_size(plain.read_bytes()), png_size(counted.read_bytes())
    assert counted_width == width == 1200 and counted_height > height


def test_html_is_self_contained_and_embeds_the_data() -> None:
    aggregator = filled()
    aggregator.add(T0, "</script><script>alert(1)</script>", 0.1, None)  # endpoints come from spans: untrusted
    grid = aggregator.grid()
    page = render_html(grid, refresh_s=5)
    assert page.startswith("<!doctype html>")
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert "alert(1)</script>" not in page
    start = page.index('type="application/json">') + len('type="application/json">')
    embedded = json.loads(page[start : page.index("</script>", start)])
    assert embedded == grid
    assert "const REFRESH_S = 5;" in page and 'const JSON_URL = "heatmap.json";' in page
    static = render_html(grid, refresh_s=None, json_url=None)
    assert "const REFRESH_S = null;" in static


def test_the_page_template_ships_with_the_package() -> None:
    # The page is read from the installed package (pyproject's package-data for inferlb.otel), not from the tree.
    assert importlib.resources.files("inferlb.otel").joinpath(PAGE_TEMPLATE).is_file()
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "*.j2" in pyproject["tool"]["setuptools"]["package-data"]["inferlb.otel"]
    title = 'a "quoted" <title> & more'
    page = render_html(filled().grid(), title=title)
    assert page.count(html.escape(title)) == 2 and page.endswith("</html>\n")


def test_json_round_trips() -> None:
    grid = filled().grid()
    assert json.loads(render_json(grid)) == grid


@pytest.mark.parametrize("render", [render_json, render_html, lambda g: render_png(g, "unused.png")])
def test_renderers_reject_a_malformed_grid(render: Any) -> None:
    grid = filled().grid()
    grid["count"] = grid["count"][:-1]
    with pytest.raises(ValueError, match=r"grid\['count'\] must be a list of 4 rows"):
        render(grid)
    with pytest.raises(ValueError, match="lacks times"):
        render({k: v for k, v in grid.items() if k != "times"})


# --- CLI -----------------------------------------------------------------------------------------------------


def test_cli_renders_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ends = [(f"10.0.0.{i}", T0 + 7 * j, 2.0 if i == 3 else 0.1 + 0.01 * j) for i in (1, 2, 3) for j in range(20)]
    source = write_lines(tmp_path / "spans.jsonl", sdk_requests(tmp_path, ends))
    out, as_json, as_html = tmp_path / "h.png", tmp_path / "h.json", tmp_path / "h.html"
    argv = ["heatmap", "--from", str(source), "--out", str(out), "--bucket-s", "30"]
    assert main([*argv, "--json", str(as_json), "--html", str(as_html)]) == 0
    assert "heatmap: 60 requests on 3 endpoints in 6 buckets of 30 s; wrote" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    grid = json.loads(as_json.read_bytes())
    assert grid["bucket_s"] == 30 and grid["endpoints"] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert 'const JSON_URL = "h.json";' in as_html.read_text()


@pytest.mark.parametrize(
    ("content", "extra", "words"),
    [
        pytest.param("{}\n{oops\n", [], "spans.jsonl:2: not an OTLP/JSON", id="malformed"),
        pytest.param("{}\n", [], "no llm_request span", id="no-spans"),
        pytest.param("{}\n", ["--bucket-s", "0"], "--bucket-s: bucket_s must be", id="bucket"),
        pytest.param(None, [], "No such file", id="missing"),
    ],
)
def test_cli_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, extra: list[str], words: str
) -> None:
    source = tmp_path / "spans.jsonl"
    if content is not None:
        source.write_text(content)
    assert main(["heatmap", "--from", str(source), "--out", str(tmp_path / "h.png"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlb: error: ") and words in err
    assert not (tmp_path / "h.png").exists()


def test_a_record_from_the_far_future_does_not_move_the_window() -> None:
    now = 1_700_000_000.0
    aggregator = HeatmapAggregator(bucket_s=10, clock=lambda: now, max_ahead_s=60)
    aggregator.add(now - 5, "10.0.0.1:8000", 0.2, 1.0)
    aggregator.add((2**63 - 1) / 1e9, "10.0.0.1:8000", 20.0, 30.0)  # an end time of year 2262
    aggregator.add(now + 61, "10.0.0.1:8000", 20.0, 30.0)
    aggregator.add(now + 59, "10.0.0.1:8000", 0.3, 1.0)  # clock skew within bounds is fine
    aggregator.add(now, "10.0.0.1:8000", 0.2, 1.0)
    grid = aggregator.grid()
    assert (grid["ahead"], grid["late"]) == (2, 0)
    assert grid["times"][0] == 1_699_999_990.0 and grid["times"][-1] == 1_700_000_050.0
    assert sum(grid["count"][0]) == 3


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"clock": lambda: 0.0}, id="clock-alone"),
        pytest.param({"max_ahead_s": 60.0}, id="bound-alone"),
        pytest.param({"clock": lambda: 0.0, "max_ahead_s": -1.0}, id="negative"),
    ],
)
def test_the_future_bound_needs_a_clock(options) -> None:
    with pytest.raises(ValueError, match="max_ahead_s"):
        HeatmapAggregator(**options)
