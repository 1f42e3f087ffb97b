"""The emulator's ``/metrics``: vLLM's own families, as vLLM 0.32 prints them through prometheus_client.

What a scraper sees matches a real server family for family: the HELP text, the TYPE, label names in sorted order
(``engine``, ``finished_reason``, ``le``, ``model_name``), counters named with ``_total`` in their TYPE line and
each counter and histogram followed by its ``_created`` gauge family, histogram bucket bounds, and number
formatting (``0.0``, ``1.7959898585667174e+09``, ``+Inf``). The families are the ones a picker reads plus the
request counters and histograms a dashboard plots; vLLM's other families are not emulated.

`render()` is cheap: everything static (HELP/TYPE lines, label strings, ``_created`` families, cache_config_info)
is built once, each histogram keeps its rendered text until its next observation, and the whole body is reused
until something changes, so scraping an idle emulator costs next to nothing.
"""

from __future__ import annotations

import math
import numbers
import re
import time
from collections.abc import Mapping, Sequence

from inferlb.otel.promhist import E2E_BOUNDS_S, TTFT_BOUNDS_S
from inferlb.scorer.histogram import Histogram

__all__ = ["CONTENT_TYPE", "FINISHED_REASONS", "VllmMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` vLLM answers ``GET /metrics`` with."""

FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``finished_reason`` label values, in the order it prints them."""

# Bucket bounds as vLLM 0.32 prints them (see tests/fixtures/vllm/); the picker's own TTFT and E2E histograms use
# vLLM's TTFT and latency bounds too.
_TTFT_BUCKETS: tuple[float, ...] = TTFT_BOUNDS_S
_ITL_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_LATENCY_BUCKETS: tuple[float, ...] = E2E_BOUNDS_S

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50... up to ``limit``: vLLM's token-count buckets, sized by max_model_len."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


def _go_float(value: float) -> str:
    """A float as prometheus_client prints it: Go's shortest form, which uses an exponent from 1e+06 up."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:
        digits = (text[:dot] + text[dot + 1 :]).rstrip("0")
        mantissa = digits[0] + "." + digits[1:] if len(digits) > 1 else digits
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _count(n: int) -> str:
    """A whole number as prometheus_client prints a float holding it (``3.0``, ``1.234567e+06``)."""
    return f"{n}.0" if n < 1_000_000 else _go_float(float(n))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Mapping[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))


def _header(name: str, help_text: str, kind: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


class _Histogram:
    """One histogram series as vLLM prints it, counted in a `Histogram`; its text is rebuilt only after an
    observation."""

    __slots__ = ("_bucket_heads", "_count_head", "_created", "_header", "_sum_head", "_text", "counts")

    def __init__(self, name: str, help_text: str, bounds: Sequence[float], labels: Mapping[str, str], created: str):
        self.counts = Histogram(bounds)
        self._header = _header(name, help_text, "histogram")
        self._bucket_heads = [
            f"{name}_bucket{{{_labels({**labels, 'le': _go_float(b)})}}} " for b in (*self.counts.bounds, math.inf)
        ]
        self._count_head = f"{name}_count{{{_labels(labels)}}} "
        self._sum_head = f"{name}_sum{{{_labels(labels)}}} "
        self._created = (
            _header(f"{name}_created", help_text, "gauge") + f"{name}_created{{{_labels(labels)}}} {created}\n"
        )
        self._text: str | None = None

    def observe(self, value: float, times: int = 1) -> None:
        self.counts.observe_many(value, times)  # `le`: a value on a bound counts in that bucket
        self._text = None

    def render(self) -> str:
        if self._text is None:
            counts = self.counts
            lines = [head + _count(n) for head, n in zip(self._bucket_heads, counts.cumulative(), strict=True)]
            lines.append(self._count_head + _count(counts.count))
            lines.append(self._sum_head + _go_float(counts.sum))
            self._text = self._header + "\n".join(lines) + "\n" + self._created
        return self._text


class VllmMetrics:
    """The metrics of one emulated vLLM server (one engine), rendered as vLLM 0.32's ``GET /metrics`` body.

    Counters only grow; `set_state` sets the gauges. Every method raises ValueError on values a real server could
    not report (negative counts, a KV usage outside 0-1, more running requests than ``max_num_seqs``) and then
    changes nothing. Not thread-safe: it belongs to the emulator's event loop, where every call is made.

    ``max_model_len`` sizes the token-count histograms' buckets (1, 2, 5, 10... up to it) and
    ``kv_cache_max_concurrency``, as in vLLM; its default, 2048, gives the buckets the fixtures show.
    ``extra_cache_config`` adds or overrides ``vllm:cache_config_info`` labels. ``max_num_seqs`` and
    ``max_num_batched_tokens`` are kept as attributes; vLLM prints neither in these families.
    """

    def __init__(
        self,
        model_name: str,
        *,
        block_size: int,
        num_gpu_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        engine: str = "0",
        extra_cache_config: Mapping[str, str] | None = None,
        max_model_len: int = 2048,
    ) -> None:
        for field, value in (
            ("block_size", block_size),
            ("num_gpu_blocks", num_gpu_blocks),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VllmMetrics {field} must be an integer >= 1; got {value!r}")
        extra = dict(extra_cache_config or {})
        for key in extra:
            if not _LABEL_NAME.fullmatch(key) or key.startswith("__") or key == "engine":
                raise ValueError(f"extra_cache_config key {key!r} must be a label name other than 'engine'")
        self.model_name = model_name
        self.engine = engine
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

        self._running = 0
        self._waiting = 0
        self._kv_cache_usage = 0.0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success = dict.fromkeys(FINISHED_REASONS, 0)
        self._body: bytes | None = None  # the last render, until something changes

        labels = {"engine": engine, "model_name": model_name}
        label_text = _labels(labels)
        created = _go_float(time.time())

        def gauge(name: str, help_text: str) -> str:
            return _header(name, help_text, "gauge") + f"{name}{{{label_text}}} "

        def counter(name: str, help_text: str) -> tuple[str, str]:
            base = name.removesuffix("_total")
            after = (
                "\n" + _header(f"{base}_created", help_text, "gauge") + f"{base}_created{{{label_text}}} {created}\n"
            )
            return _header(name, help_text, "counter") + f"{name}{{{label_text}}} ", after

        self._running_head = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting_head = "\n" + gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_head = "\n" + gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._queries = counter(
            "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._hits = counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.")
        self._preempt = counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
        self._prompt = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self._generation = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")

        success_help = "Count of successfully processed requests."
        by_reason = {r: _labels({**labels, "finished_reason": r}) for r in FINISHED_REASONS}
        self._success_header = _header("vllm:request_success_total", success_help, "counter")
        self._success_heads = {r: f"vllm:request_success_total{{{text}}} " for r, text in by_reason.items()}
        self._success_created = _header("vllm:request_success_created", success_help, "gauge") + "".join(
            f"vllm:request_success_created{{{text}}} {created}\n" for text in by_reason.values()
        )

        token_buckets = _one_two_five(max_model_len)
        self._prompt_hist = _Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets, labels, created
        )
        self._generation_hist = _Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets, labels, created
        )
        self._ttft = _Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
            labels,
            created,
        )
        self._itl = _Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
            labels,
            created,
        )
        self._e2e = _Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY_BUCKETS,
            labels,
            created,
        )
        self._queue = _Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
            labels,
            created,
        )
        self._prefill = _Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
            labels,
            created,
        )
        self._decode = _Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
            labels,
            created,
        )
        # In vLLM's order: the token counts, then the timings.
        self._histograms = (
            self._prompt_hist,
            self._generation_hist,
            self._ttft,
            self._itl,
            self._e2e,
            self._queue,
            self._prefill,
            self._decode,
        )
        config = _labels({**self._default_cache_config(), **extra, "engine": engine})
        self._cache_config = (
            _header("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
            + f"vllm:cache_config_info{{{config}}} 1.0\n"
        )

    def _default_cache_config(self) -> dict[str, str]:
        """vLLM 0.32's CacheConfig labels, valued as a GPU server with prefix caching on would print them."""
        tokens = self.block_size * self.num_gpu_blocks
        return {
            "_block_size_resolved": "True",
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(self.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(tokens / self.max_model_len),
            "kv_cache_memory_bytes": "None",
            "kv_cache_size_tokens": str(tokens),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }

    # ---- updates ------------------------------------------------------------------------------------------

    def set_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The scheduler gauges: requests running and waiting, and the KV cache's used fraction (0-1)."""
        _check_count("running", running)
        _check_count("waiting", waiting)
        if running > self.max_num_seqs:
            raise ValueError(f"running must be <= max_num_seqs ({self.max_num_seqs}); got {running}")
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be a fraction in [0, 1]; got {kv_cache_usage!r}")
        state = (running, waiting, float(kv_cache_usage))
        if state != (self._running, self._waiting, self._kv_cache_usage):
            self._running, self._waiting, self._kv_cache_usage = state
            self._body = None

    def add_prefix_cache(self, queries: int, hits: int) -> None:
        """Add to the prefix-cache counters, in tokens: ``hits`` of the ``queries`` were found cached."""
        _check_count("queries", queries)
        _check_count("hits", hits)
        if hits > queries:
            raise ValueError(f"hits must be <= queries; got hits={hits}, queries={queries}")
        if queries:
            self._prefix_queries += queries
            self._prefix_hits += hits
            self._body = None

    def add_preemptions(self, n: int) -> None:
        """Add ``n`` preemptions to ``vllm:num_preemptions_total``."""
        _check_count("n", n)
        if n:
            self._preemptions += n
            self._body = None

    def record_finished(
        self,
        *,
        queue_s: float,
        ttft_s: float,
        e2e_s: float,
        prefill_s: float,
        decode_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str = "length",
        mean_itl_s: float | None = None,
        itl_count: int = 0,
    ) -> None:
        """One finished request: adds to the success and token counters, observes every request histogram.

        ``vllm:inter_token_latency_seconds`` gets ``itl_count`` observations of ``mean_itl_s`` (vLLM observes each
        gap between tokens, ``generation_tokens - 1`` of them; the emulator knows their mean).
        """
        if finished_reason not in self._success:
            raise ValueError(f"finished_reason must be one of {', '.join(FINISHED_REASONS)}; got {finished_reason!r}")
        for name, seconds in (
            ("queue_s", queue_s),
            ("ttft_s", ttft_s),
            ("e2e_s", e2e_s),
            ("prefill_s", prefill_s),
            ("decode_s", decode_s),
        ):
            _check_seconds(name, seconds)
        _check_count("prompt_tokens", prompt_tokens)
        _check_count("generation_tokens", generation_tokens)
        _check_count("itl_count", itl_count)
        if mean_itl_s is not None:
            _check_seconds("mean_itl_s", mean_itl_s)
        elif itl_count:
            raise ValueError(f"itl_count={itl_count} needs mean_itl_s")
        self._success[finished_reason] += 1
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens
        self._prompt_hist.observe(prompt_tokens)
        self._generation_hist.observe(generation_tokens)
        self._ttft.observe(ttft_s)
        if mean_itl_s is not None and itl_count:
            self._itl.observe(mean_itl_s, itl_count)
        self._e2e.observe(e2e_s)
        self._queue.observe(queue_s)
        self._prefill.observe(prefill_s)
        self._decode.observe(decode_s)
        self._body = None

    # ---- output -------------------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The ``GET /metrics`` body (UTF-8, served as `CONTENT_TYPE`)."""
        if self._body is not None:
            return self._body
        parts = [
            self._running_head,
            _count(self._running),
            self._waiting_head,
            _count(self._waiting),
            self._kv_head,
            _go_float(self._kv_cache_usage),
            "\n",
        ]
        for (head, after), value in (
            (self._queries, self._prefix_queries),
            (self._hits, self._prefix_hits),
            (self._preempt, self._preemptions),
            (self._prompt, self._prompt_tokens),
            (self._generation, self._generation_tokens),
        ):
            parts += (head, _count(value), after)
        parts.append(self._success_header)
        for reason, head in self._success_heads.items():
            parts += (head, _count(self._success[reason]), "\n")
        parts.append(self._success_created)
        parts += [h.render() for h in self._histograms]
        parts.append(self._cache_config)
        self._body = "".join(parts).encode()
        return self._body


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0; got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if not (0.0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number of seconds >= 0; got {value!r}")
