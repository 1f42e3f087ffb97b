"""Tests for scorer/promtext.py: the Prometheus text reader and the vLLM snapshot built on it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from inferlb.scorer.promtext import (
    PICKER_METRICS,
    Exposition,
    Histogram,
    LoraInfo,
    Sample,
    SignalReader,
    VllmSnapshot,
    parse_exposition,
    read_vllm,
    read_vllm_signals,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
FULL = FIXTURES / "vllm-0.32.0-cpu-metrics.txt"
QUEUED = FIXTURES / "vllm-0.32.0-cpu-metrics-queued.txt"


def _samples(expo: Exposition) -> dict[str, list[Sample]]:
    return {name: family.samples for name, family in expo.families.items()}


# ---- parse_exposition ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "samples", "malformed"),
    [
        pytest.param("", {}, 0, id="empty"),
        pytest.param("\n\n  \n", {}, 0, id="blank-lines"),
        pytest.param("x 1", {"x": [Sample("x", (), 1.0)]}, 0, id="no-labels"),
        pytest.param("x{} 1", {"x": [Sample("x", (), 1.0)]}, 0, id="empty-labels"),
        pytest.param(
            'x{a="1",b="two"} 2.5',
            {"x": [Sample("x", (("a", "1"), ("b", "two")), 2.5)]},
            0,
            id="labels-in-printed-order",
        ),
        pytest.param('x{ a = "1" , } 2', {"x": [Sample("x", (("a", "1"),), 2.0)]}, 0, id="blanks-trailing-comma"),
        pytest.param(
            r'x{a="q\"b\\c\nd"} 1',
            {"x": [Sample("x", (("a", 'q"b\\c\nd'),), 1.0)]},
            0,
            id="label-escapes",
        ),
        pytest.param(
            'x{a="} {b=\\"c\\"}"} 1', {"x": [Sample("x", (("a", '} {b="c"}'),), 1.0)]}, 0, id="brace-in-value"
        ),
        pytest.param('x{a="1"}\t7', {"x": [Sample("x", (("a", "1"),), 7.0)]}, 0, id="tab-separator"),
        pytest.param("x 1\r\ny 2\r\n", {"x": [Sample("x", (), 1.0)], "y": [Sample("y", (), 2.0)]}, 0, id="crlf"),
        pytest.param("x 1 1700000000000", {"x": [Sample("x", (), 1.0)]}, 0, id="timestamp-ms"),
        pytest.param('x{a="b"} -3 -1', {"x": [Sample("x", (("a", "b"),), -3.0)]}, 0, id="negative-timestamp"),
        pytest.param("x 1 1700000000.5", {"x": [Sample("x", (), 1.0)]}, 0, id="timestamp-openmetrics-seconds"),
        pytest.param(
            '# TYPE h histogram\nh_bucket{le="0.5"} 2 # {trace_id="a b"} 0.3 1700000000.1\nh_bucket{le="+Inf"} 3',
            {"h": [Sample("h_bucket", (("le", "0.5"),), 2.0), Sample("h_bucket", (("le", "+Inf"),), 3.0)]},
            0,
            id="exemplar",
        ),
        pytest.param(
            'x 1 # {t="1"} 2\ny 5 10 # {} 1',
            {"x": [Sample("x", (), 1.0)], "y": [Sample("y", (), 5.0)]},
            0,
            id="exemplar-no-labels",
        ),
        pytest.param(
            "a +Inf\nb -Inf\nc Inf",
            {"a": [Sample("a", (), math.inf)], "b": [Sample("b", (), -math.inf)], "c": [Sample("c", (), math.inf)]},
            0,
            id="infinities",
        ),
        pytest.param(
            "x 1e3\ny -0.5e-2", {"x": [Sample("x", (), 1000.0)], "y": [Sample("y", (), -0.005)]}, 0, id="exponent"
        ),
        pytest.param(
            'x} 1\nx{a=1} 2\nx{a="1" 3\nx 1_000\nx 1 2 3\nx\n{a="b"} 1\n9x 1\nx abc\nx 1 abc\nx{a="1",a="2"} 1',
            {},
            11,
            id="malformed-samples-counted",
        ),
        pytest.param(
            "# TYPE x bogus\n# TYPE\n# HELP\n# TYPE 9x gauge\n# just a comment\n# EOF\n# HELPER text",
            {},
            4,
            id="malformed-directives-counted",
        ),
        pytest.param(
            "good 1\nbad{ 2\nalso_good 3",
            {"good": [Sample("good", (), 1.0)], "also_good": [Sample("also_good", (), 3.0)]},
            1,
            id="bad-line-among-good",
        ),
    ],
)
def test_parse_samples(text: str, samples: dict[str, list[Sample]], malformed: int) -> None:
    expo = parse_exposition(text)
    assert _samples(expo) == samples
    assert expo.malformed == malformed


def test_nan_value() -> None:
    (sample,) = parse_exposition("x NaN").families["x"].samples
    assert math.isnan(sample.value)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'x{a="\xff\xfe"} 1\n', id="invalid-bytes"),
        pytest.param(bytearray(b'x{a="\xc3"} 1\n'), id="truncated-sequence"),
        pytest.param(memoryview(b'x{a="\xff\xfe"} 1\n'), id="memoryview"),
    ],
)
def test_bytes_that_are_not_utf8_are_replaced(data: bytes) -> None:
    expo = parse_exposition(data)
    (sample,) = expo.families["x"].samples
    assert set(dict(sample.labels)["a"]) == {"\ufffd"}
    assert expo.malformed == 0


def test_utf8_bytes_decode() -> None:
    (sample,) = parse_exposition('x{a="é✓"} 1'.encode()).families["x"].samples
    assert sample.labels == (("a", "é✓"),)


def test_types_and_help_are_recorded() -> None:
    expo = parse_exposition(
        "# HELP g A gauge.\\nSecond line, a backslash: \\\\.\n# TYPE g gauge\ng 1\n"
        "# TYPE c_total counter\nc_total 2\n# HELP u no type\nu 3\n"
    )
    assert {name: (f.type, f.help) for name, f in expo.families.items()} == {
        "g": ("gauge", "A gauge.\nSecond line, a backslash: \\."),
        "c_total": ("counter", None),
        "u": ("untyped", "no type"),
    }


def test_declared_family_without_samples_exists() -> None:
    expo = parse_exposition("# TYPE lonely gauge\n")
    assert expo.families["lonely"].type == "gauge"
    assert expo.families["lonely"].samples == []


def test_duplicate_type_is_malformed_and_the_first_wins() -> None:
    expo = parse_exposition("# TYPE x gauge\n# TYPE x counter\nx 1")
    assert expo.families["x"].type == "gauge"
    assert expo.malformed == 1


def test_histogram_suffixes_map_to_their_family() -> None:
    expo = parse_exposition(
        '# TYPE h histogram\nh_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_count 2\nh_sum 1.5\nh_created 1.7e9\n'
    )
    assert list(expo.families) == ["h"]
    assert [s.name for s in expo.families["h"].samples] == ["h_bucket", "h_bucket", "h_count", "h_sum", "h_created"]


def test_openmetrics_counter_suffixes_map_to_their_family() -> None:
    expo = parse_exposition("# TYPE c counter\nc_total 3\nc_created 1.7e9\n# EOF\n")
    assert list(expo.families) == ["c"]
    assert [s.name for s in expo.families["c"].samples] == ["c_total", "c_created"]
    assert expo.get("c_total") is expo.families["c"]


def test_prometheus_client_created_gauges_are_their_own_families() -> None:
    expo = parse_exposition(
        "# TYPE c_total counter\nc_total 3\n# TYPE c_created gauge\nc_created 1.7e9\n"
        '# TYPE h histogram\nh_bucket{le="+Inf"} 0\nh_count 0\nh_sum 0\n# TYPE h_created gauge\nh_created 1.7e9\n'
    )
    assert {name: f.type for name, f in expo.families.items()} == {
        "c_total": "counter",
        "c_created": "gauge",
        "h": "histogram",
        "h_created": "gauge",
    }
    assert expo.get("c") is expo.families["c_total"]


def test_suffix_of_a_gauge_is_not_mapped() -> None:
    expo = parse_exposition("# TYPE g gauge\ng_total 1\ng_bucket 2")
    assert set(expo.families) == {"g", "g_total", "g_bucket"}
    assert expo.families["g_total"].type == "untyped"


def test_get_other_spelling_only_for_counters() -> None:
    expo = parse_exposition("# TYPE g gauge\ng 1\n# TYPE c_total counter\nc_total 1")
    assert expo.get("g_total") is None
    assert expo.get("c") is expo.families["c_total"]
    assert "c" in expo
    assert "nope" not in expo
    assert 3 not in expo


_WANTED_TEXT = """\
# HELP keep_me A gauge.
# TYPE keep_me gauge
keep_me{a="1"} 1
keep_me{a="2"} 2
# HELP keep_me_not_this Shares a prefix.
# TYPE keep_me_not_this gauge
keep_me_not_this 3
# TYPE other gauge
other 4
other{broken 5
# TYPE om_counter counter
om_counter_total 6
om_counter_created 1.7e9
# TYPE pc_counter_total counter
pc_counter_total 7
# TYPE pc_counter_created gauge
pc_counter_created 1.7e9
# TYPE hist histogram
hist_bucket{le="+Inf"} 8
hist_count 8
hist_sum 9
"""


@pytest.mark.parametrize(
    ("wanted", "families"),
    [
        pytest.param(["keep_me"], {"keep_me": [1.0, 2.0]}, id="prefix-sharing-family-skipped"),
        pytest.param(("other",), {"other": [4.0]}, id="tuple"),
        pytest.param({"om_counter_total"}, {"om_counter": [6.0, 1.7e9]}, id="openmetrics-counter-as-_total"),
        pytest.param(frozenset({"pc_counter"}), {"pc_counter_total": [7.0]}, id="text-counter-without-_total"),
        pytest.param(["pc_counter_total"], {"pc_counter_total": [7.0]}, id="text-counter-exact"),
        pytest.param(["hist"], {"hist": [8.0, 8.0, 9.0]}, id="histogram"),
        pytest.param([], {}, id="nothing"),
        pytest.param(["absent"], {}, id="absent"),
        pytest.param(["a.b*c"], {}, id="regex-characters"),
    ],
)
def test_wanted_filters_families(wanted: list[str], families: dict[str, list[float]]) -> None:
    expo = parse_exposition(_WANTED_TEXT, wanted)
    assert {name: [s.value for s in f.samples] for name, f in expo.families.items()} == families


def test_wanted_keeps_types_and_help() -> None:
    family = parse_exposition(_WANTED_TEXT, ["keep_me"]).families["keep_me"]
    assert (family.type, family.help) == ("gauge", "A gauge.")


def test_wanted_does_not_examine_other_families() -> None:
    assert parse_exposition(_WANTED_TEXT).malformed == 1
    assert parse_exposition(_WANTED_TEXT, ["keep_me"]).malformed == 0
    assert parse_exposition(_WANTED_TEXT, ["other"]).malformed == 1


@pytest.mark.parametrize("path", [FULL, QUEUED], ids=["full", "queued"])
def test_fixture_parses_cleanly_with_and_without_filter(path: Path) -> None:
    data = path.read_bytes()
    everything = parse_exposition(data)
    assert everything.malformed == 0
    assert len(everything.families) > 80
    picked = parse_exposition(data, PICKER_METRICS)
    assert picked.malformed == 0
    for name, family in picked.families.items():
        assert name in PICKER_METRICS
        assert family.samples == everything.families[name].samples
        assert family.type == everything.families[name].type


@pytest.mark.parametrize("path", [FULL, QUEUED], ids=["full", "queued"])
def test_fixture_has_every_picker_metric_but_the_old_and_the_lora_ones(path: Path) -> None:
    expo = parse_exposition(path.read_text(), PICKER_METRICS)
    # vLLM 0.32 dropped gpu_cache_usage_perc; lora_requests_info exists only when LoRA is enabled, and these
    # servers were started without it.
    assert {name for name in PICKER_METRICS if name not in expo} == {
        "vllm:gpu_cache_usage_perc",
        "vllm:lora_requests_info",
    }


# ---- read_vllm ----------------------------------------------------------------------------------------------

_NONE = VllmSnapshot(
    running=None,
    waiting=None,
    kv_cache_usage=None,
    block_size=None,
    num_gpu_blocks=None,
    prefix_cache_queries=None,
    prefix_cache_hits=None,
    num_preemptions=None,
    lora=None,
    ttft=None,
    e2e_latency=None,
    queue_time=None,
)


def test_read_vllm_full_fixture() -> None:
    snap = read_vllm(FULL.read_bytes())
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (0, 0, 0.0)
    assert (snap.block_size, snap.num_gpu_blocks) == (128, 8192)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits, snap.num_preemptions) == (72051, 19328, 0)
    assert snap.lora is None
    assert snap.malformed == 0
    assert snap.ttft is not None
    assert snap.ttft.bounds[:3] == (0.001, 0.005, 0.01)
    assert snap.ttft.bounds[-2:] == (2560.0, math.inf)
    assert snap.ttft.cumulative_counts[:4] == (0.0, 0.0, 63.0, 97.0)
    assert (snap.ttft.count, snap.ttft.sum) == (213.0, 37.52620577812195)
    assert snap.e2e_latency is not None
    assert (snap.e2e_latency.bounds[0], snap.e2e_latency.cumulative_counts[0]) == (0.3, 87.0)
    assert (snap.e2e_latency.count, snap.e2e_latency.sum) == (213.0, 116.92528772354126)
    assert snap.queue_time is not None
    assert len(snap.queue_time.bounds) == 22
    assert (snap.queue_time.count, snap.queue_time.sum) == (213.0, 0.9684625550017358)
    assert snap.queue_time.mean == pytest.approx(0.9684625550017358 / 213)


def test_read_vllm_queued_fixture() -> None:
    snap = read_vllm(QUEUED.read_text())
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (0, 0, 0.0)
    assert (snap.block_size, snap.num_gpu_blocks) == (32, 128)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits, snap.num_preemptions) == (21595, 0, 0)
    assert snap.ttft is not None and snap.e2e_latency is not None and snap.queue_time is not None
    assert (snap.ttft.count, snap.ttft.sum) == (60.0, 25.40484118461609)
    assert snap.e2e_latency.cumulative_counts[:3] == (9.0, 20.0, 36.0)
    assert (snap.queue_time.count, snap.queue_time.sum) == (60.0, 22.356782321000196)


def test_read_vllm_model_filter() -> None:
    data = FULL.read_bytes()
    assert read_vllm(data, model="tiny-llama") == read_vllm(data)
    other = read_vllm(data, model="another-model")
    # cache_config_info has no model_name label: it describes the server and is read whatever the model.
    assert other == VllmSnapshot(**{**_as_dict(_NONE), "block_size": 128, "num_gpu_blocks": 8192})


def _as_dict(snap: VllmSnapshot) -> dict[str, object]:
    return {name: getattr(snap, name) for name in VllmSnapshot.__slots__}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param(b"\x00\xff\xfe garbage {{{", id="binary"),
        pytest.param("<html><body>502 Bad Gateway</body></html>", id="html"),
        pytest.param("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n", id="no-samples"),
        pytest.param("other_metric 1\n", id="other-metrics"),
    ],
)
def test_read_vllm_missing_is_all_none(text: str | bytes) -> None:
    snap = read_vllm(text)
    assert _as_dict(snap) | {"malformed": 0} == _as_dict(_NONE)


_GARBAGE = """\
vllm:num_requests_running{model_name="m"} NaN
vllm:num_requests_waiting{model_name="m"} -1
vllm:kv_cache_usage_perc{model_name="m"} 1.5
vllm:gpu_cache_usage_perc{model_name="m"} +Inf
vllm:cache_config_info{block_size="None",num_gpu_blocks="0"} 1.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 2.5
vllm:prefix_cache_hits_total{model_name="m"} 1e400
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a"} NaN
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4
vllm:time_to_first_token_seconds_count{model_name="m"} 4
vllm:time_to_first_token_seconds_sum{model_name="m"} 1
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1",model_name="m"} 1
vllm:e2e_request_latency_seconds_count{model_name="m"} 1
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 1
vllm:request_queue_time_seconds_count{model_name="m"} 1
vllm:request_queue_time_seconds_sum{model_name="m"} 1
"""


def test_read_vllm_garbage_values_are_none() -> None:
    # NaN, a negative or fractional count, a usage above 1, "None" and 0 blocks, a counter out of float range,
    # LoRA info without a finite time or the waiting label, buckets that decrease, no +Inf bucket, a histogram
    # without a TYPE line: each becomes None, never a clamped or default value.
    snap = read_vllm(_GARBAGE)
    assert _as_dict(snap) | {"malformed": 0} == _as_dict(_NONE)


def _histogram_text(name: str, buckets: str, count: str, total: str, labels: str = "", *, typed: bool = True) -> str:
    """A histogram's lines; ``buckets`` is ``"le=count le=count..."``, ``labels`` ends with a comma if given."""
    lines = [f"# TYPE {name} histogram"] if typed else []
    for le_count in buckets.split():
        le, n = le_count.split("=")
        lines.append(f'{name}_bucket{{{labels}le="{le}"}} {n}')
    lines += [f"{name}_count{{{labels.rstrip(',')}}} {count}", f"{name}_sum{{{labels.rstrip(',')}}} {total}"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("buckets", "count", "total", "expected"),
    [
        pytest.param("1=1 2=3 +Inf=4", "4", "5.5", Histogram((1.0, 2.0, math.inf), (1.0, 3.0, 4.0), 5.5, 4.0), id="ok"),
        pytest.param("+Inf=2 1=1", "2", "1", Histogram((1.0, math.inf), (1.0, 2.0), 1.0, 2.0), id="unordered-lines"),
        pytest.param("+Inf=0", "0", "0", Histogram((math.inf,), (0.0,), 0.0, 0.0), id="empty-histogram"),
        pytest.param("1=1 2=3", "3", "1", None, id="no-inf-bucket"),
        pytest.param("1=3 +Inf=2", "2", "1", None, id="decreasing"),
        pytest.param("1=1 +Inf=2", "3", "1", None, id="count-differs"),
        pytest.param("1=1 +Inf=2", "2", "NaN", None, id="nan-sum"),
        pytest.param("1=1 1=1 +Inf=2", "2", "1", None, id="duplicate-bound"),
        pytest.param("abc=1 +Inf=2", "2", "1", None, id="bad-le"),
        pytest.param("NaN=1 +Inf=2", "2", "1", None, id="nan-le"),
        pytest.param("1=-1 +Inf=2", "2", "1", None, id="negative-count"),
    ],
)
def test_read_vllm_histogram_checks(buckets: str, count: str, total: str, expected: Histogram | None) -> None:
    snap = read_vllm(_histogram_text("vllm:time_to_first_token_seconds", buckets, count, total))
    assert snap.ttft == expected
    if expected is not None:
        assert snap.ttft is not None
        assert snap.ttft.mean == (expected.sum / expected.count if expected.count else None)


def test_read_vllm_histogram_without_sum_is_none() -> None:
    text = _histogram_text("vllm:request_queue_time_seconds", "+Inf=1", "1", "1").replace("_sum", "_other")
    assert read_vllm(text).queue_time is None


_TWO_ENGINES = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1200"} 1.0
"""


def test_read_vllm_sums_engines_and_averages_kv_usage() -> None:
    e2e = "vllm:e2e_request_latency_seconds"
    snap = read_vllm(
        _TWO_ENGINES
        + _histogram_text(e2e, "1=1 +Inf=2", "2", "3", 'engine="0",')
        + _histogram_text(e2e, "1=2 +Inf=2", "2", "1", 'engine="1",', typed=False)
    )
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (7, 1, 0.5)
    assert snap.prefix_cache_queries == 150
    assert (snap.block_size, snap.num_gpu_blocks) == (16, 2200)
    assert snap.e2e_latency == Histogram((1.0, math.inf), (3.0, 4.0), 4.0, 4.0)


def test_read_vllm_engines_that_disagree_give_none() -> None:
    text = _TWO_ENGINES.replace('block_size="16",engine="1"', 'block_size="32",engine="1"')
    text += _histogram_text("vllm:e2e_request_latency_seconds", "1=1 +Inf=2", "2", "3", 'engine="0",')
    text += _histogram_text("vllm:e2e_request_latency_seconds", "2=1 +Inf=2", "2", "3", 'engine="1",', typed=False)
    snap = read_vllm(text)
    assert (snap.block_size, snap.num_gpu_blocks) == (None, 2200)
    assert snap.e2e_latency is None


def test_read_vllm_falls_back_to_gpu_cache_usage() -> None:
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n'
    assert read_vllm(old).kv_cache_usage == 0.4
    assert read_vllm(old + 'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n').kv_cache_usage == 0.1
    assert read_vllm(old + 'vllm:kv_cache_usage_perc{model_name="m"} NaN\n').kv_cache_usage == 0.4


def test_read_vllm_openmetrics_counter_spelling() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 9\nvllm:prefix_cache_hits_created{model_name="m"} 1.7e9\n'
        "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total 2\n# EOF\n"
    )
    snap = read_vllm(text)
    assert (snap.prefix_cache_hits, snap.num_preemptions) == (9, 2)


def test_read_vllm_lora_takes_the_newest_sample() -> None:
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b",waiting_lora_adapters="c"} 1.8e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9\n'
    )
    assert read_vllm(text).lora == LoraInfo(running=("b",), waiting=("c",), max_lora=4)
    idle = 'vllm:lora_requests_info{max_lora="None",running_lora_adapters="",waiting_lora_adapters=""} 1\n'
    assert read_vllm(idle).lora == LoraInfo(running=(), waiting=(), max_lora=None)


def test_read_vllm_counts_malformed_lines_of_its_families() -> None:
    snap = read_vllm('vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_running{oops 3\nother{ 1\n')
    assert (snap.running, snap.malformed) == (2, 1)


def _emulator_exposition() -> bytes:
    from inferlb.sim.metrics import VllmMetrics

    metrics = VllmMetrics("m", block_size=16, num_gpu_blocks=28000, max_num_seqs=64, max_num_batched_tokens=8192)
    metrics.set_state(3, 2, 0.25)
    metrics.add_prefix_cache(1000, 640)
    metrics.add_preemptions(2)
    return metrics.render()


_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param((_FIXTURES / "vllm-0.32.0-cpu-metrics.txt").read_bytes(), id="real-vllm"),
        pytest.param((_FIXTURES / "vllm-0.32.0-cpu-metrics-queued.txt").read_bytes(), id="real-vllm-queued"),
        pytest.param(_emulator_exposition(), id="emulator"),
        pytest.param(b"", id="empty"),
        pytest.param(b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1 1700000000000\n", id="unlabelled"),
        pytest.param(b'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 5\n', id="dp"),
        pytest.param(b"vllm:num_requests_running_extra 9\nvllm:num_requests_waiting NaN\n", id="lookalike-nan"),
        pytest.param(b'vllm:kv_cache_usage_perc{a="b"} 1.7\nvllm:gpu_cache_usage_perc 0.5\n', id="kv-garbage"),
        pytest.param(b"vllm:gpu_cache_usage_perc 0.5\n", id="kv-old-name"),
        pytest.param(b'vllm:cache_config_info{block_size="None",num_gpu_blocks="12"} 1.0\n', id="cache-none"),
        pytest.param(b"\xff\xfe garbage \x00\nvllm:num_requests_running{ 3\n", id="binary"),
        pytest.param(
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 10.0\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat"} 20.0\n',
            id="lora-newest-wins",
        ),
    ],
)
def test_the_fast_signal_reader_agrees_with_the_parser(body: bytes) -> None:
    slow = read_vllm(body, histograms=False)
    fast = read_vllm_signals(body)
    assert dataclasses.replace(fast, malformed=slow.malformed) == slow
    # The collector's reader, fresh and after reading the same body (its hints then point at each family).
    reader = SignalReader()
    for _ in range(2):
        assert _collected(reader.read(body)) == _collected(fast)


def _collected(snap: VllmSnapshot) -> dict[str, object]:
    """The fields the metrics collector uses."""
    return {
        f: getattr(snap, f) for f in ("running", "waiting", "kv_cache_usage", "block_size", "num_gpu_blocks", "lora")
    }


def _moved(body: bytes, pad: int) -> bytes:
    """``body`` with ``pad`` bytes of comments in front, so every family starts elsewhere."""
    return b"# pad " + b"x" * pad + b"\n" + body


def test_the_collectors_reader_follows_families_that_move_appear_and_vanish() -> None:
    real = FULL.read_bytes()
    lora = b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 10.0\n'
    bodies = [
        real,
        _moved(real, 100),  # within the search window of the last positions
        _moved(real, 20_000),  # far beyond it
        real,  # back before the remembered positions
        QUEUED.read_bytes(),
        real.replace(b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"),  # the pre-0.10 name
        _emulator_exposition(),
        b'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 5\n',
        b"",
        real,
    ]
    reader = SignalReader()
    for body in bodies:
        assert _collected(reader.read(body)) == _collected(read_vllm_signals(body))
    # LoRA state, absent so far, is looked for again within RECHECK_ABSENT reads.
    with_lora = real + lora
    seen = [reader.read(with_lora).lora for _ in range(SignalReader.RECHECK_ABSENT)]
    assert seen[-1] == read_vllm_signals(with_lora).lora is not None
    assert all(s == seen[-1] for s in seen[seen.index(seen[-1]) :])


def test_the_collectors_reader_finds_a_family_whose_first_lines_precede_the_window() -> None:
    """A family that grew (more engines or models) may now begin before the search window: the reader steps
    back to its first line."""
    family = b"".join(b'vllm:num_requests_running{engine="%d"} %d\n' % (i, i) for i in range(400))
    body = b"# x\n" + family + b"vllm:num_requests_waiting 1\n"
    reader = SignalReader()
    reader.read(b"# x\n" + b"y" * len(family) + b'\nvllm:num_requests_running{engine="399"} 399\n')
    assert reader.read(body).running == sum(range(400))
