"""Tests for sim/metrics.py: the emulator's /metrics, checked against real vLLM 0.32 output with prometheus_client's
parser and the picker's readers, both as rendered and as a running emulator serves it over HTTP."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferlb.procs import free_port
from inferlb.scorer.promtext import PICKER_METRICS, read_vllm, read_vllm_signals
from inferlb.sim.fleet import serving
from inferlb.sim.metrics import CONTENT_TYPE, FINISHED_REASONS, VllmMetrics, _go_float
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
FIXTURE_FILES = ["vllm-0.32.0-cpu-metrics.txt", "vllm-0.32.0-cpu-metrics-queued.txt"]


def _metrics(**overrides: Any) -> VllmMetrics:
    options: dict[str, Any] = {
        "block_size": 128,
        "num_gpu_blocks": 8192,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
    }
    return VllmMetrics("tiny-llama", **(options | overrides))


def _finish(metrics: VllmMetrics, **overrides: Any) -> None:
    request: dict[str, Any] = {
        "queue_s": 0.2,
        "ttft_s": 0.05,
        "e2e_s": 1.2,
        "prefill_s": 0.04,
        "decode_s": 0.99,
        "prompt_tokens": 300,
        "generation_tokens": 100,
        "mean_itl_s": 0.01,
        "itl_count": 99,
    }
    metrics.record_finished(**(request | overrides))


def _active() -> VllmMetrics:
    metrics = _metrics()
    metrics.set_state(3, 2, 0.25)
    metrics.add_prefix_cache(1000, 300)
    metrics.add_prefix_cache(24, 24)
    metrics.add_preemptions(2)
    _finish(metrics)
    _finish(
        metrics,
        queue_s=0.6,
        ttft_s=0.7,
        e2e_s=3.0,
        prompt_tokens=20,
        generation_tokens=1,
        finished_reason="stop",
        mean_itl_s=None,
        itl_count=0,
    )
    _finish(metrics, ttft_s=0.005, mean_itl_s=None, itl_count=0, generation_tokens=1)
    return metrics


def _families(body: bytes | str) -> dict[str, Metric]:
    """An exposition's families by name, as prometheus_client parses them (counters named without ``_total``)."""
    families = list(text_string_to_metric_families(body.decode() if isinstance(body, bytes) else body))
    assert len({f.name for f in families}) == len(families), "a family printed in more than one group"
    return {f.name: f for f in families}


def _absent(families: dict[str, Metric]) -> set[str]:
    """The picker's metrics (samples as printed, histograms by family) that ``families`` lacks."""
    printed = {s.name for family in families.values() for s in family.samples}
    return {name for name in PICKER_METRICS if name not in printed and name not in families}


def _values(families: dict[str, Metric], name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels in printed order) -> value for the family ``name`` (a counter's with or without
    ``_total``)."""
    family = families[name.removesuffix("_total")]
    return {(s.name, tuple(s.labels.items())): s.value for s in family.samples}


_LABELS = (("engine", "0"), ("model_name", "tiny-llama"))


def test_read_vllm_reads_back_what_was_recorded() -> None:
    snap = read_vllm(_active().render())
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (3, 2, 0.25)
    assert (snap.block_size, snap.num_gpu_blocks) == (128, 8192)
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits, snap.num_preemptions) == (1024, 324, 2)
    assert snap.lora is None
    assert snap.malformed == 0
    assert snap.ttft is not None and snap.e2e_latency is not None and snap.queue_time is not None
    assert (snap.ttft.count, snap.ttft.sum) == (3.0, pytest.approx(0.755))
    # 0.005 lands in le=0.005 (a value on a bound counts there), 0.05 in le=0.06, 0.7 in le=0.75
    ttft = dict(zip(snap.ttft.bounds, snap.ttft.cumulative_counts, strict=True))
    cumulative = [ttft[b] for b in (0.001, 0.005, 0.04, 0.06, 0.5, 0.75, math.inf)]
    assert cumulative == [0, 1, 1, 2, 2, 3, 3]
    assert (snap.e2e_latency.count, snap.e2e_latency.sum) == (3.0, pytest.approx(5.4))
    assert snap.queue_time.cumulative_counts[:3] == (2.0, 2.0, 3.0)  # 0.2, 0.2 <= 0.3; 0.6 <= 0.8


def test_counters_and_other_histograms() -> None:
    expo = _families(_active().render())
    success = {dict(labels)["finished_reason"]: v for (_, labels), v in _values(expo, "vllm:request_success").items()}
    assert success == {"stop": 1, "length": 2, "abort": 0, "error": 0, "repetition": 0}
    assert list(success) == list(FINISHED_REASONS)
    assert list(_values(expo, "vllm:prompt_tokens_total").values()) == [620.0]
    assert list(_values(expo, "vllm:generation_tokens_total").values()) == [102.0]
    itl = _values(expo, "vllm:inter_token_latency_seconds")
    assert itl["vllm:inter_token_latency_seconds_count", _LABELS] == 99
    assert itl["vllm:inter_token_latency_seconds_sum", _LABELS] == pytest.approx(0.99)
    assert itl["vllm:inter_token_latency_seconds_bucket", (("engine", "0"), ("le", "0.01"), _LABELS[1])] == 99
    prompt = expo["vllm:request_prompt_tokens"].samples
    assert [(s.labels.get("le"), s.value) for s in prompt if s.name.endswith("_bucket")][4:7] == [
        ("20.0", 1.0),
        ("50.0", 1.0),
        ("100.0", 1.0),
    ]
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
        count = [s.value for s in expo[name].samples if s.name == name + "_count"]
        assert count == [3.0]


def _label_names(family: Metric) -> dict[str, set[tuple[str, ...]]]:
    """Per sample name, the label-name sequences (in printed order) its samples carry."""
    names: dict[str, set[tuple[str, ...]]] = {}
    for sample in family.samples:
        names.setdefault(sample.name, set()).add(tuple(sample.labels))
    return names


def _bucket_bounds(family: Metric) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name == family.name + "_bucket"]


@pytest.mark.parametrize("fixture", FIXTURE_FILES)
def test_emulator_matches_real_vllm(fixture: str) -> None:
    real = _families((FIXTURES / fixture).read_bytes())
    emulated = _families(_active().render())

    # Every picker metric is there in both, but for the pre-0.10 name and LoRA info (absent from both fixtures:
    # their servers ran without LoRA; the emulator has no LoRA).
    expected_absent = {"vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"}
    for expo in (real, emulated):
        assert _absent(expo) == expected_absent

    common = set(real) & set(emulated)
    wanted = {
        "vllm:request_success",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:inter_token_latency_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    } | {name.removesuffix("_total") for name in set(PICKER_METRICS) - expected_absent}
    assert wanted <= common
    assert set(emulated) <= set(real), "the emulator prints nothing vLLM does not"
    for name in sorted(common):
        mine, theirs = emulated[name], real[name]
        assert (mine.type, mine.documentation) == (theirs.type, theirs.documentation), name
        assert _label_names(mine) == _label_names(theirs), name
        if mine.type == "histogram":
            assert _bucket_bounds(mine) == _bucket_bounds(theirs), name


def test_family_order_follows_vllm() -> None:
    real = list(_families((FIXTURES / FIXTURE_FILES[0]).read_bytes()))
    emulated = list(_families(_active().render()))
    assert [name for name in real if name in emulated] == emulated


def test_cache_config_info_values() -> None:
    family = _families(_active().render())["vllm:cache_config_info"]
    (sample,) = family.samples
    labels = sample.labels
    assert sample.value == 1.0
    assert labels["block_size"] == "128"
    assert labels["num_gpu_blocks"] == "8192"
    assert labels["kv_cache_size_tokens"] == "1048576"
    assert labels["kv_cache_max_concurrency"] == "512.0"  # as the full fixture: 8192 blocks of 128, 2048 max_model_len
    assert (labels["cache_dtype"], labels["enable_prefix_caching"], labels["engine"]) == ("auto", "True", "0")


def test_extra_cache_config_and_engine() -> None:
    metrics = _metrics(engine="3", extra_cache_config={"gpu_memory_utilization": "0.95", "new_label": "x"})
    expo = _families(metrics.render())
    labels = expo["vllm:cache_config_info"].samples[0].labels
    assert (labels["gpu_memory_utilization"], labels["new_label"], labels["engine"]) == ("0.95", "x", "3")
    assert list(labels) == sorted(labels)
    running = expo["vllm:num_requests_running"].samples[0]
    assert list(running.labels.items()) == [("engine", "3"), ("model_name", "tiny-llama")]


def test_max_model_len_sizes_token_buckets() -> None:
    expo = _families(_metrics(max_model_len=32768).render())
    bounds = _bucket_bounds(expo["vllm:request_generation_tokens"])
    assert bounds[-3:] == ["10000.0", "20000.0", "+Inf"]


def test_model_name_is_escaped() -> None:
    metrics = VllmMetrics('we"ird\\name', block_size=16, num_gpu_blocks=10, max_num_seqs=4, max_num_batched_tokens=512)
    snap = read_vllm(metrics.render(), model='we"ird\\name')
    assert (snap.running, snap.num_gpu_blocks) == (0, 10)


def test_fresh_metrics_render_zeros() -> None:
    snap = read_vllm(_metrics().render())
    assert (snap.running, snap.waiting, snap.kv_cache_usage, snap.prefix_cache_queries) == (0, 0, 0.0, 0)
    assert snap.ttft is not None
    assert snap.ttft.count == 0
    assert snap.ttft.mean is None


def test_render_is_reused_until_something_changes() -> None:
    metrics = _active()
    body = metrics.render()
    assert metrics.render() is body
    metrics.set_state(3, 2, 0.25)  # the same state
    metrics.add_prefix_cache(0, 0)
    metrics.add_preemptions(0)
    assert metrics.render() is body
    metrics.set_state(4, 2, 0.25)
    assert metrics.render() != body
    body = metrics.render()
    _finish(metrics)
    before, after = read_vllm(body).ttft, read_vllm(metrics.render()).ttft
    assert before is not None and after is not None
    assert (after.count, after.sum) == (before.count + 1, pytest.approx(before.sum + 0.05))


def test_large_counts_use_go_exponent_form() -> None:
    metrics = _metrics()
    metrics.add_prefix_cache(1_234_567, 1_000_000)
    text = metrics.render().decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1.234567e+06\n' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 1e+06\n' in text
    assert read_vllm(text).prefix_cache_queries == 1_234_567


@pytest.mark.parametrize("fixture", FIXTURE_FILES)
def test_number_format_matches_every_number_in_the_fixture(fixture: str) -> None:
    for line in (FIXTURES / fixture).read_text().splitlines():
        if line and not line.startswith("#"):
            printed = line.rsplit(" ", 1)[1]
            assert _go_float(float(printed)) == printed, line


@pytest.mark.parametrize(
    ("value", "printed"),
    [
        pytest.param(0.0, "0.0", id="zero"),
        pytest.param(0.001, "0.001", id="small"),
        pytest.param(999999.0, "999999.0", id="below-exponent"),
        pytest.param(1e6, "1e+06", id="exponent"),
        pytest.param(1795989858.5667174, "1.7959898585667174e+09", id="timestamp"),
        pytest.param(1e22, "1e+22", id="python-exponent"),
        pytest.param(-2e6, "-2000000.0", id="negative"),
        pytest.param(math.inf, "+Inf", id="inf"),
        pytest.param(-math.inf, "-Inf", id="minus-inf"),
        pytest.param(math.nan, "NaN", id="nan"),
    ],
)
def test_go_float(value: float, printed: str) -> None:
    assert _go_float(value) == printed


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda m: m.set_state(-1, 0, 0.0), "running", id="negative-running"),
        pytest.param(lambda m: m.set_state(9, 0, 0.0), "max_num_seqs", id="above-max-num-seqs"),
        pytest.param(lambda m: m.set_state(1, 0, 1.5), "kv_cache_usage", id="usage-above-1"),
        pytest.param(lambda m: m.set_state(1, 0, math.nan), "kv_cache_usage", id="usage-nan"),
        pytest.param(lambda m: m.set_state(1, 2.5, 0.0), "waiting", id="fractional-waiting"),
        pytest.param(lambda m: m.add_prefix_cache(5, 6), "hits", id="more-hits-than-queries"),
        pytest.param(lambda m: m.add_preemptions(-1), "n must", id="negative-preemptions"),
        pytest.param(lambda m: _finish(m, finished_reason="timeout"), "finished_reason", id="unknown-reason"),
        pytest.param(lambda m: _finish(m, ttft_s=-0.1), "ttft_s", id="negative-time"),
        pytest.param(lambda m: _finish(m, e2e_s=math.inf), "e2e_s", id="infinite-time"),
        pytest.param(lambda m: _finish(m, prompt_tokens=-1), "prompt_tokens", id="negative-tokens"),
        pytest.param(lambda m: _finish(m, mean_itl_s=None, itl_count=3), "mean_itl_s", id="itl-count-without-mean"),
    ],
)
def test_bad_updates_raise_and_change_nothing(call: Any, message: str) -> None:
    metrics = _active()
    before = metrics.render()
    with pytest.raises(ValueError, match=message):
        call(metrics)
    assert metrics.render() == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"block_size": 0}, "block_size", id="zero-block-size"),
        pytest.param({"num_gpu_blocks": 1.5}, "num_gpu_blocks", id="fractional-blocks"),
        pytest.param({"max_num_seqs": True}, "max_num_seqs", id="bool"),
        pytest.param({"max_model_len": -1}, "max_model_len", id="negative-max-model-len"),
        pytest.param({"extra_cache_config": {"engine": "1"}}, "engine", id="engine-in-extra"),
        pytest.param({"extra_cache_config": {"bad-name": "1"}}, "bad-name", id="bad-label-name"),
    ],
)
def test_bad_construction_raises(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _metrics(**overrides)


def test_two_instances_are_independent() -> None:
    first, second = _metrics(), _metrics()
    first.set_state(1, 1, 0.5)
    assert read_vllm(second.render()).running == 0


def test_content_type() -> None:
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


# --- Over HTTP: what a picker scrapes from a running emulator, against real vLLM ---------------------------------

SHARED_FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
# The snapshot fields the picker reads; LoRA info is absent from both (no LoRA on either server).
READ_FIELDS = (
    "running",
    "waiting",
    "kv_cache_usage",
    "block_size",
    "num_gpu_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "ttft",
    "e2e_latency",
    "queue_time",
)
# The fields the metrics collector reads (its fast reader must agree with the full parser on them).
SIGNAL_FIELDS = ("running", "waiting", "kv_cache_usage", "block_size", "num_gpu_blocks")


async def _scrape_emulator() -> bytes:
    """A running emulator's ``GET /metrics`` after some traffic."""
    options = ServerOptions(profile=get_profile("h100-llama3.1-8b"), models=("m",), time_scale=50.0, jitter=0.0)
    server = EmulatedServer(f"127.0.0.1:{free_port()}", options)
    base = f"http://{server.address}"
    async with serving([server]), httpx.AsyncClient(timeout=10) as client:
        for prompt in ("one " * 40, "one " * 40, "two " * 10):
            body = {"model": "m", "prompt": prompt, "max_tokens": 5}
            assert (await client.post(f"{base}/v1/completions", json=body)).status_code == 200
        response = await client.get(f"{base}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    return response.content


def _real_expositions(source: str) -> list[tuple[str, bytes]]:
    if source == "repo":
        return [(name, (FIXTURES / name).read_bytes()) for name in FIXTURE_FILES]
    paths = sorted(SHARED_FIXTURES.glob("*.txt")) if SHARED_FIXTURES.is_dir() else []
    if not paths:
        pytest.skip(f"no real vLLM expositions in {SHARED_FIXTURES}")
    return [(path.name, path.read_bytes()) for path in paths]


@pytest.mark.parametrize("source", [pytest.param("repo", id="repo-fixtures"), pytest.param("shared", id="shared")])
async def test_a_running_emulators_metrics_read_as_real_vllms(source: str) -> None:
    real = _real_expositions(source)
    full = await _scrape_emulator()
    expected_absent = {"vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"}
    for name, body in [("emulator", full), *real]:
        assert _absent(_families(body)) == expected_absent, name
        snap = read_vllm(body)
        assert snap.malformed == 0, name
        missing = [field for field in READ_FIELDS if getattr(snap, field) is None]
        assert missing == [], name
        assert snap.lora is None, name
        signals = read_vllm_signals(body)
        quick = read_vllm(body, histograms=False)
        assert [getattr(signals, f) for f in SIGNAL_FIELDS] == [getattr(quick, f) for f in SIGNAL_FIELDS], name
    snap = read_vllm(full)
    assert snap.prefix_cache_queries == 90 and snap.prefix_cache_hits is not None and snap.prefix_cache_hits > 0
    assert snap.e2e_latency is not None and snap.e2e_latency.count == 3
