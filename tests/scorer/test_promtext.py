"""Tests for scorer/promtext.py: the families read through prometheus_client's parser, the vLLM snapshot built on
them, and the fast reader held to the same values on real, emulated and generated expositions."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from inferlb.scorer import promtext
from inferlb.scorer.promtext import (
    PICKER_METRICS,
    Histogram,
    LoraInfo,
    SignalReader,
    VllmSnapshot,
    read_families,
    read_samples,
    read_vllm,
    read_vllm_signals,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
FULL = FIXTURES / "vllm-0.32.0-cpu-metrics.txt"
QUEUED = FIXTURES / "vllm-0.32.0-cpu-metrics-queued.txt"


# ---- read_families -----------------------------------------------------------------------------------------

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
# TYPE pc_counter_total counter
pc_counter_total 7
# TYPE hist histogram
hist_bucket{le="+Inf"} 8
hist_count 8
hist_sum 9
untyped_one{x="y"} 10
"""


@pytest.mark.parametrize(
    ("wanted", "name", "values"),
    [
        pytest.param(["keep_me"], "keep_me", [1.0, 2.0], id="gauge"),
        pytest.param(["om_counter_total"], "om_counter_total", [6.0], id="counter-typed-without-_total"),
        pytest.param(["pc_counter"], "pc_counter_total", [7.0], id="counter-typed-with-_total"),
        pytest.param(["hist"], "hist_count", [8.0], id="histogram-count"),
        pytest.param(["untyped_one"], "untyped_one", [10.0], id="no-type-line"),
        pytest.param(["keep_me"], "other", [], id="not-wanted"),
        pytest.param(["a.b*c"], "keep_me", [], id="regex-characters"),
    ],
)
def test_read_families_finds_samples_by_their_printed_name(wanted: list[str], name: str, values: list[float]) -> None:
    assert [s.value for s in read_families(_WANTED_TEXT, wanted).samples(name)] == values


def test_read_families_keeps_the_declared_types() -> None:
    found = read_families(_WANTED_TEXT, ["hist", "keep_me"])
    assert [s.name for s in found.of_type("hist", "histogram")] == ["hist_bucket", "hist_count", "hist_sum"]
    assert found.of_type("hist", "gauge") == []
    assert {m.name: m.type for m in found.metrics if m.name.startswith("keep")} == {
        "keep_me": "gauge",
        "keep_me_not_this": "gauge",
    }


def test_read_families_skips_and_counts_only_the_wanted_malformed_lines() -> None:
    assert read_families(_WANTED_TEXT, ["keep_me"]).malformed == 0
    found = read_families(_WANTED_TEXT, ["other"])
    assert (found.malformed, [s.value for s in found.samples("other")]) == (1, [4.0])
    bad = 'x 1\nx{a="1" 2\nx 1_000\nx abc\nx{a="1",a="2"} 3\nx 4 5\n# TYPE x\n'
    found = read_families(bad, ["x"])
    assert (found.malformed, [s.value for s in found.samples("x")]) == (5, [1.0, 4.0])


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'x{a="\xff\xfe"} 1\n', id="invalid-bytes"),
        pytest.param(bytearray(b'x{a="\xc3"} 1\n'), id="truncated-sequence"),
        pytest.param(memoryview(b'x{a="\xff\xfe"} 1\n'), id="memoryview"),
    ],
)
def test_read_families_replaces_bytes_that_are_not_utf8(data: bytes) -> None:
    found = read_families(data, ["x"])
    (sample,) = found.samples("x")
    assert set(sample.labels["a"]) == {"\ufffd"}
    assert found.malformed == 0


@pytest.mark.parametrize("path", [FULL, QUEUED], ids=["full", "queued"])
def test_the_fixtures_have_every_picker_metric_but_the_old_and_the_lora_ones(path: Path) -> None:
    found = read_families(path.read_text(), PICKER_METRICS)
    assert found.malformed == 0
    # vLLM 0.32 dropped gpu_cache_usage_perc; lora_requests_info exists only when LoRA is enabled, and these
    # servers were started without it.
    histograms = {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"}
    histograms.add("vllm:request_queue_time_seconds")
    missing = {
        name
        for name in PICKER_METRICS
        if not (found.of_type(name, "histogram") if name in histograms else found.samples(name))
    }
    assert missing == {"vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"}


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


@pytest.mark.parametrize(
    ("body", "running", "block_size"),
    [
        # Each of these the fast reader once read otherwise than prometheus_client (found by the generated test).
        pytest.param(b"vllm:num_requests_running 2\n# a comment\nvllm:num_requests_running 3\n", 5, None, id="comment"),
        pytest.param(b"vllm:num_requests_running\t4\n", 4, None, id="tab-after-name"),
        pytest.param(b'vllm:num_requests_running {engine="0"} 4\n', 4, None, id="blank-before-labels"),
        pytest.param(b"  vllm:num_requests_running 4\n", 4, None, id="indented"),
        pytest.param(b"vllm:num_requests_running 1_000\n", None, None, id="underscore-value"),
        pytest.param(b"vllm:num_requests_running 4 abc\n", None, None, id="bad-timestamp"),
        pytest.param(
            b'vllm:cache_config_info{ block_size = "16" , num_gpu_blocks="9",} 1\n', None, 16, id="blanks-in-labels"
        ),
    ],
)
def test_the_fast_reader_reads_lines_as_prometheus_client_does(
    body: bytes, running: int | None, block_size: int | None
) -> None:
    fast = read_vllm_signals(body)
    assert (fast.running, fast.block_size) == (running, block_size)
    assert fast == dataclasses.replace(read_vllm(body, histograms=False), malformed=0)
    assert _collected(SignalReader().read(body)) == _collected(fast)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(FULL, id="vllm"),
        pytest.param(QUEUED, id="vllm-queued"),
        pytest.param(FIXTURES.parent / "dcgm" / "dcgm-exporter-h100x2-k8s.txt", id="dcgm"),
    ],
)
def test_read_samples_gives_every_series_as_prometheus_client_does(path: Path) -> None:
    body = path.read_bytes()
    parsed = [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]
    names = {s.name for s in parsed}
    assert len(names) > 20
    for name in names:
        expected = [(s.labels, float(s.value)) for s in parsed if s.name == name]
        # prometheus_client adds `_total` to the samples of a counter whose TYPE line names it without
        printed = name if re.search(rf"^{re.escape(name)}[{{ ]", body.decode(), re.M) else name.removesuffix("_total")
        assert read_samples(body, printed) == expected, name


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


# ---- the fast reader against prometheus_client, on generated expositions -----------------------------------

# The families the fast reader reads, and how a server types them; then look-alikes it must not read.
_FAST_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}
_LOOKALIKES = {
    "vllm:num_requests_running_extra": "gauge",
    "vllm:kv_cache_usage_perc_max": "gauge",
    "vllm:prefix_cache_hits_created": "gauge",
    "vllm:num_requests": "gauge",
    "process_open_fds": "gauge",
}
_LABEL_NAMES = ("engine", "model_name", "a", "le_extra", "_hidden")
_LABEL_TEXT = st.text(alphabet=st.sampled_from('ab c,{}="\\\n=é✓0123456789'), max_size=8)
_NUMBER = st.one_of(
    st.integers(min_value=-3, max_value=10**7).map(str),
    st.integers(min_value=0, max_value=10**6).map(lambda n: f"{n}.0"),
    st.floats(allow_nan=True, allow_infinity=True).map(floatToGoString),
    st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "1e3", "2.5E-1", "-0.0", "0.25"]),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def _labels(draw: st.DrawFn, family: str) -> dict[str, str]:
    labels = {n: draw(_LABEL_TEXT) for n in draw(st.lists(st.sampled_from(_LABEL_NAMES), unique=True, max_size=3))}
    if family == "vllm:cache_config_info":
        for key in ("block_size", "num_gpu_blocks"):
            if draw(st.booleans()) or key == "block_size":
                labels[key] = draw(st.sampled_from(["16", "128", "0", "None", "007", "1e3", ""]))
    if family == "vllm:lora_requests_info":
        adapters = st.lists(st.sampled_from(["sql", "chat", "a,b", 'q"t', "x\\y"]), max_size=3).map(",".join)
        for key in ("running_lora_adapters", "waiting_lora_adapters", "max_lora"):
            if draw(st.integers(0, 4)):
                labels[key] = draw(adapters) if key != "max_lora" else draw(st.sampled_from(["2", "None", "08"]))
    return labels


@st.composite
def _family_lines(draw: st.DrawFn, family: str, kind: str) -> list[str]:
    typed = family.removesuffix("_total") if kind == "counter" and draw(st.booleans()) else family
    header = []
    if draw(st.booleans()):
        header.append(f"# HELP {family} {_escape(draw(_LABEL_TEXT))}")
    if draw(st.integers(0, 3)):
        header.append(f"# TYPE {typed} {kind}")
    header = draw(st.permutations(header))
    lines = list(header)
    for _ in range(draw(st.integers(0, 4))):
        labels = draw(_labels(family))
        equals, comma = draw(st.sampled_from([("=", ","), ("=", ", "), (" = ", " , ")]))
        pairs = comma.join(f'{k}{equals}"{_escape(v)}"' for k, v in labels.items())
        if pairs and draw(st.integers(0, 5)) == 0:
            pairs += ","  # a trailing comma
        labelled = pairs or draw(st.booleans())
        head = family + (draw(st.sampled_from(["", "", " "])) + "{" + pairs + "}" if labelled else "")
        line = head + draw(st.sampled_from([" ", "  ", "\t"])) + draw(_NUMBER)
        if draw(st.integers(0, 4)) == 0:
            line += " " + str(draw(st.integers(min_value=-(10**12), max_value=2 * 10**12)))
        lines.append(draw(st.sampled_from(["", "", "", " ", "\t "])) + line + draw(st.sampled_from(["", "", " "])))
        if draw(st.integers(0, 6)) == 0:
            lines.append(draw(st.sampled_from(["# a comment", "#", "# HELPER text", "", "  # indented", " "])))
    return lines


@st.composite
def _expositions(draw: st.DrawFn) -> bytes:
    every = {**_FAST_FAMILIES, **_LOOKALIKES}
    names = draw(st.lists(st.sampled_from(sorted(every)), unique=True, max_size=len(every)))
    lines = []
    for name in names:
        if draw(st.integers(0, 4)) == 0:
            lines.append(draw(st.sampled_from(["# a comment between families", ""])))
        lines += draw(_family_lines(name, every[name]))
    text = draw(st.sampled_from(["\n", "\r\n"])).join(lines) + draw(st.sampled_from(["\n", "", "\n# EOF\n"]))
    return text.encode()


def _same(a: list[float] | None, b: list[float]) -> bool:
    if a is None:
        return not b
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


@given(_expositions())
@settings(max_examples=int(os.environ.get("PROMTEXT_EXAMPLES", 300)), deadline=None)
def test_the_fast_reader_reads_what_prometheus_client_parses(body: bytes) -> None:
    parsed = list(text_string_to_metric_families(body.decode()))
    for name in _FAST_FAMILIES:
        samples = [s for family in parsed for s in family.samples if s.name == name]
        # The reader's own per-family values, beneath the snapshot that combines them; and every label.
        found = promtext._sample_values(promtext._sample_lines(body, name.encode()), name.encode())
        assert _same(found, [float(s.value) for s in samples]), name
        read = read_samples(body, name)
        assert [labels for labels, _ in read] == [s.labels for s in samples], name
        assert _same([value for _, value in read], [float(s.value) for s in samples]), name
    fast = read_vllm_signals(body)
    assert fast == read_vllm(body, histograms=False)
    reader = SignalReader()
    for _ in range(2):
        assert _collected(reader.read(body)) == _collected(fast)
