"""Reading inference servers' Prometheus text expositions (format 0.0.4, as prometheus_client prints it).

Two readers of one vLLM ``/metrics`` body, both giving a :class:`VllmSnapshot` of the signals the picker scores on
(a missing or nonsensical metric becomes ``None`` for its field, never a guess):

- the fast reader of the picker's scrape loop (every server's ``/metrics`` at 10 Hz, hundreds of servers on one
  core): `read_vllm_signals` and the collector's `SignalReader` search the bytes for the few sample lines they
  need and parse only those, skipping the histogram buckets that are most of a vLLM exposition;
- `read_vllm`, off the hot path (the demo, benchmarks, tests), with the latency histograms too: prometheus_client's
  parser on the lines of the families it wants (`read_families`).

`read_samples` gives one metric's samples, labels included, the fast reader's way: the GPU collector reads DCGM
exporters with it on the routing event loop, where prometheus_client's parser (pure Python, tens of µs a line) would
cost a millisecond or more per read.

The tests hold the two to the same values (tests/scorer/test_promtext.py: real vLLM expositions, the emulator's,
and generated ones).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import lru_cache

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = [
    "PICKER_METRICS",
    "Families",
    "Histogram",
    "LoraInfo",
    "SignalReader",
    "VllmSnapshot",
    "read_families",
    "read_samples",
    "read_vllm",
    "read_vllm_signals",
]

PICKER_METRICS: tuple[str, ...] = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # the pre-0.10 name of kv_cache_usage_perc; vLLM 0.32 no longer prints it
    "vllm:cache_config_info",
    # Counters as vLLM's TYPE lines name them: prometheus_client's text format keeps `_total` in the family name.
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:lora_requests_info",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:num_preemptions_total",
)
"""The metric families the picker reads from a vLLM server, spelled as vLLM's ``# TYPE`` lines spell them."""


@dataclass(frozen=True, slots=True)
class Families:
    """The families `read_families` found, as prometheus_client parsed them, and the lines it could not parse.

    prometheus_client names a counter family without ``_total`` and its samples with it, and makes each sample
    line that follows no ``# TYPE`` of its own an untyped family of one sample: so readers look samples up by
    their printed name (`samples`), which is what a server prints whatever its TYPE lines say."""

    metrics: list[Metric]
    malformed: int  # lines of the wanted families that did not parse (skipped)

    def samples(self, name: str) -> list[Sample]:
        """Every sample printed as ``name`` (``x``, ``x_total``, ``x_bucket``...), in exposition order."""
        return [s for metric in self.metrics for s in metric.samples if s.name == name]

    def of_type(self, name: str, kind: str) -> list[Sample]:
        """The samples of the families named ``name`` and declared ``kind`` (``histogram``...), in order."""
        return [s for metric in self.metrics if metric.name == name and metric.type == kind for s in metric.samples]


@lru_cache(maxsize=64)
def _wanted_lines(wanted: frozenset[str]) -> re.Pattern[str]:
    # Pure memo of a compiled regex per distinct wanted set: it finds the lines (samples, HELP, TYPE) whose name
    # starts with a wanted name, a counter's without its `_total`.
    prefixes = sorted({w[:-6] if w.endswith("_total") else w for w in wanted}, key=len, reverse=True)
    alternation = "|".join(re.escape(p) for p in prefixes) or "(?!)"
    return re.compile(rf"\n[ \t]*(#[ \t]+(?:HELP|TYPE)[ \t]+(?:{alternation})[^\n]*|(?:{alternation})[^\n]*)")


def read_families(text: str | bytes, wanted: Collection[str]) -> Families:
    """The families of ``text`` whose names start with one of ``wanted``, parsed by prometheus_client; never raises
    on bad input.

    A regex picks those lines out first (in C), so the pure-Python parser sees only them: a vLLM exposition's
    dozens of other families cost nothing. A line the parser refuses is skipped and counted in ``malformed``
    (prometheus_client stops at the first; then each line is tried alone). Bytes that are not UTF-8 are decoded
    with U+FFFD replacements.
    """
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8", "replace")
    lines = _wanted_lines(wanted if isinstance(wanted, frozenset) else frozenset(wanted)).findall("\n" + text)
    try:
        return Families(list(text_string_to_metric_families("\n".join(lines))), 0)
    except ValueError:
        pass
    good = [line for line in lines if _parses(line)]
    return Families(list(text_string_to_metric_families("\n".join(good))), len(lines) - len(good))


def _parses(line: str) -> bool:
    # A line's parse does not depend on the lines around it (the family it joins does, but that never raises).
    try:
        for _ in text_string_to_metric_families(line):
            pass
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------------------------------------------
# vLLM


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram as Prometheus prints it: ``bounds`` strictly increasing and ending with ``inf``,
    ``cumulative_counts`` non-decreasing with the last one equal to ``count``."""

    bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        """``sum / count``, or None when nothing was observed."""
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """``vllm:lora_requests_info``: the adapters of running and waiting requests, and ``--max-loras``."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int | None


@dataclass(frozen=True, slots=True)
class VllmSnapshot:
    """What the picker reads from one vLLM scrape. Every field is None when its metric is missing or garbage
    (NaN, negative, a fraction where a count belongs, a broken histogram); nothing is ever filled in.

    Counts are summed over the series of a family (one per engine with data parallelism); ``kv_cache_usage``
    (a 0-1 fraction) is their mean. ``num_gpu_blocks`` is summed over engines; ``block_size`` is None unless all
    engines agree. Counters (``prefix_cache_*``, ``num_preemptions``) are cumulative since server start.
    ``malformed`` is the number of malformed lines among those examined.
    """

    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    block_size: int | None
    num_gpu_blocks: int | None
    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    num_preemptions: int | None
    lora: LoraInfo | None
    ttft: Histogram | None
    e2e_latency: Histogram | None
    queue_time: Histogram | None
    malformed: int = 0


_HISTOGRAMS = frozenset(
    {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"}
)
_GAUGES_AND_COUNTERS = tuple(name for name in PICKER_METRICS if name not in _HISTOGRAMS)


def read_vllm(text: str | bytes, *, model: str | None = None, histograms: bool = True) -> VllmSnapshot:
    """Read the picker's signals from one vLLM ``/metrics`` body with prometheus_client's parser; never raises on
    bad input.

    With ``model``, samples whose ``model_name`` label names another model are ignored; samples without a
    ``model_name`` label (``cache_config_info``, ``lora_requests_info``) are server-wide and always read.
    ``histograms=False`` skips the latency histograms (their buckets are most of the parsing work; the
    ``ttft``, ``e2e_latency`` and ``queue_time`` fields are then None).
    """
    found = read_families(text, PICKER_METRICS if histograms else _GAUGES_AND_COUNTERS)

    def samples(name: str) -> list[Sample]:
        return [s for s in found.samples(name) if _model_ok(s.labels, model)]

    def values(name: str) -> list[float] | None:
        return [float(s.value) for s in samples(name)] or None

    kv = _mean_fraction(values("vllm:kv_cache_usage_perc"))
    if kv is None:
        kv = _mean_fraction(values("vllm:gpu_cache_usage_perc"))
    block_size, num_gpu_blocks = _cache_config([s.labels for s in samples("vllm:cache_config_info")])
    return VllmSnapshot(
        running=_count(values("vllm:num_requests_running")),
        waiting=_count(values("vllm:num_requests_waiting")),
        kv_cache_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        prefix_cache_queries=_count(values("vllm:prefix_cache_queries_total")),
        prefix_cache_hits=_count(values("vllm:prefix_cache_hits_total")),
        num_preemptions=_count(values("vllm:num_preemptions_total")),
        lora=_lora([(s.labels, float(s.value)) for s in samples("vllm:lora_requests_info")]),
        ttft=_histogram(found, "vllm:time_to_first_token_seconds", model),
        e2e_latency=_histogram(found, "vllm:e2e_request_latency_seconds", model),
        queue_time=_histogram(found, "vllm:request_queue_time_seconds", model),
        malformed=found.malformed,
    )


def _model_ok(labels: Mapping[str, str], model: str | None) -> bool:
    return model is None or labels.get("model_name", model) == model


def _count(values: list[float] | None) -> int | None:
    if values is None:
        return None
    total = 0
    for v in values:
        if not (v >= 0 and v.is_integer()):  # rejects NaN, inf, negatives and fractions
            return None
        total += int(v)
    return total


def _mean_fraction(values: list[float] | None) -> float | None:
    if values is None or not all(0.0 <= v <= 1.0 for v in values):
        return None
    return sum(values) / len(values)


def _positive_int(text: str | None) -> int | None:
    # "None" is how vLLM prints an unset config value; only ASCII digits, as the fast reader's byte regexes read
    if text is None or not (text.isascii() and text.isdigit()):
        return None
    n = int(text)
    return n if n > 0 else None


def _cache_config(configs: list[dict[str, str]]) -> tuple[int | None, int | None]:
    """Block size (when every engine agrees) and GPU blocks (summed) from ``cache_config_info``'s label sets."""
    if not configs:
        return None, None
    sizes = {_positive_int(c.get("block_size")) for c in configs}
    block_size = sizes.pop() if len(sizes) == 1 else None
    blocks = [_positive_int(c.get("num_gpu_blocks")) for c in configs]
    num_gpu_blocks = None if None in blocks else sum(b for b in blocks if b is not None)
    return block_size, num_gpu_blocks


def _lora(samples: list[tuple[dict[str, str], float]]) -> LoraInfo | None:
    """``lora_requests_info`` from its (labels, value) samples."""
    # The gauge is set to the current time on every engine step; the newest label set is the current state.
    timed = [(labels, value) for labels, value in samples if math.isfinite(value)]
    if not timed:
        return None
    labels = max(timed, key=lambda sample: sample[1])[0]
    if "running_lora_adapters" not in labels or "waiting_lora_adapters" not in labels:
        return None
    return LoraInfo(
        running=tuple(a for a in labels["running_lora_adapters"].split(",") if a),
        waiting=tuple(a for a in labels["waiting_lora_adapters"].split(",") if a),
        max_lora=_positive_int(labels.get("max_lora")),
    )


_SeriesKey = tuple[tuple[str, str], ...]  # a series' labels but `le`, sorted


def _histogram(found: Families, name: str, model: str | None) -> Histogram | None:
    """The histogram ``name`` (declared by a ``# TYPE`` line), its series (one per engine) added up when their
    bounds agree; None when it is missing or broken."""
    bucket_name, sum_name, count_name = name + "_bucket", name + "_sum", name + "_count"
    buckets: dict[_SeriesKey, list[tuple[float, float]]] = {}
    sums: dict[_SeriesKey, list[float]] = {}
    counts: dict[_SeriesKey, list[float]] = {}
    for sample in found.of_type(name, "histogram"):
        labels, value = sample.labels, float(sample.value)
        if not _model_ok(labels, model):
            continue
        if sample.name == bucket_name:
            try:
                bound = float(labels["le"])
            except (KeyError, ValueError):
                return None
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            buckets.setdefault(key, []).append((bound, value))
        elif sample.name == sum_name:
            sums.setdefault(tuple(sorted(labels.items())), []).append(value)
        elif sample.name == count_name:
            counts.setdefault(tuple(sorted(labels.items())), []).append(value)
    if not buckets or buckets.keys() != sums.keys() or buckets.keys() != counts.keys():
        return None
    merged: Histogram | None = None
    for key, series in buckets.items():
        one = _one_histogram(series, sums[key], counts[key])
        if one is None:
            return None
        if merged is None:
            merged = one
        elif merged.bounds != one.bounds:
            return None
        else:
            merged = Histogram(
                merged.bounds,
                tuple(a + b for a, b in zip(merged.cumulative_counts, one.cumulative_counts, strict=True)),
                merged.sum + one.sum,
                merged.count + one.count,
            )
    return merged


def _one_histogram(buckets: list[tuple[float, float]], sums: list[float], counts: list[float]) -> Histogram | None:
    if len(sums) != 1 or len(counts) != 1:
        return None
    buckets.sort()
    bounds, cumulative = (tuple(column) for column in zip(*buckets, strict=True))
    total, count = sums[0], counts[0]
    # bounds strictly increasing up to +Inf; counts finite, non-negative, non-decreasing, the last one == count
    if bounds[-1] != math.inf or not all(map(math.isfinite, bounds[:-1])) or len(set(bounds)) != len(bounds):
        return None
    if not all(map(math.isfinite, cumulative)) or cumulative[0] < 0 or list(cumulative) != sorted(cumulative):
        return None
    if count != cumulative[-1] or not math.isfinite(total):
        return None
    return Histogram(bounds, cumulative, total, count)


_SIGNAL_NAMES = {
    "running": b"vllm:num_requests_running",
    "waiting": b"vllm:num_requests_waiting",
    "kv": b"vllm:kv_cache_usage_perc",
    "kv_old": b"vllm:gpu_cache_usage_perc",
    "queries": b"vllm:prefix_cache_queries_total",
    "hits": b"vllm:prefix_cache_hits_total",
    "preemptions": b"vllm:num_preemptions_total",
    "cache": b"vllm:cache_config_info",
    "lora": b"vllm:lora_requests_info",
}
_LORA = _SIGNAL_NAMES["lora"]
# A label of the set (after "{" or ","; blanks allowed around "="). Digits only: a match cannot start inside another
# label's value, since a quote there is escaped or closes that value.
# At most nine digits each: a label value of more (a server's bug or a forgery) is no reading. An unbounded one
# overflows the signal arrays' float64 (400 digits) or Python's int parsing (over 4,300).
_BLOCK_SIZE = re.compile(rb'[{,][ \t]*block_size[ \t]*=[ \t]*"(\d{1,9})"')
_NUM_BLOCKS = re.compile(rb'[{,][ \t]*num_gpu_blocks[ \t]*=[ \t]*"(\d{1,9})"')


def _sample_lines(body: bytes, name: bytes) -> list[bytes]:
    """The sample lines of metric ``name`` (exactly that name, labelled or not), each from the name on.

    The text format keeps a family's lines together, so this finds the first sample line and reads on while
    lines carry the name (or are comments, which parsers skip).
    """
    start = _sample_start(body, name, 0)
    return [] if start < 0 else _lines_from(body, name, start)


def _sample_start(body: bytes, name: bytes, pos: int) -> int:
    """Where the first sample line of ``name`` at or after ``pos`` begins, or -1. The search looks for the name
    without its ``vllm:`` prefix, which is rare in the text, instead of a pattern that every line starts with."""
    short = name[5:] if name.startswith(b"vllm:") else name
    skip = len(name) - len(short)
    while True:
        i = body.find(short, pos + skip)
        if i < 0:
            return -1
        start = i - skip
        if start == 0 or (start > 0 and body[start - 1] == 10):  # what servers print: the name starts the line
            if _is_sample(body, name, start):
                return start
        elif start > 0 and body[start - 1] in _BLANKS:  # parsers allow blanks before the name
            line = start - 1
            while line > 0 and body[line - 1] in _BLANKS:
                line -= 1
            if (line == 0 or body[line - 1] == 10) and _is_sample(body, name, start):
                return line
        pos = i + 1 - skip


_AFTER_NAME = (b"{", b" ", b"\t")  # what may follow a sample line's metric name
_BLANKS = b" \t"
# What `_line` tells of a line that holds no sample of the family: a comment or a blank line, which parsers skip;
# the family's own TYPE line, which comes before its first sample; a line that ends the family's group.
_SKIPPED, _TYPE, _OTHER = -1, -2, -3


def _is_sample(body: bytes, name: bytes, start: int) -> bool:
    """Whether a sample of ``name`` begins at ``start`` (the name, then a label set or blanks)."""
    return body.startswith(name, start) and body[start + len(name) : start + len(name) + 1] in _AFTER_NAME


def _line(body: bytes, name: bytes, start: int, end: int) -> int:
    """What the line ``body[start:end]`` is to the group of family ``name``: where its sample of ``name`` begins
    (after any blanks), else `_SKIPPED`, `_TYPE` or `_OTHER` (another family's sample, HELP or TYPE line)."""
    first = start
    while first < end and body[first] in _BLANKS:
        first += 1
    if _is_sample(body, name, first):
        return first
    if first == end or (first + 1 == end and body[first] == 13):  # blank ("\r" alone: a CRLF line's)
        return _SKIPPED
    if body[first] != 35:  # "#"
        return _OTHER
    # "#", blanks, HELP or TYPE, blanks, the family's name: without slicing the line (HELP texts are long)
    keyword = first + 1
    while keyword < end and body[keyword] in _BLANKS:
        keyword += 1
    kind = body[keyword : keyword + 4]
    at = keyword + 4
    if (kind != b"HELP" and kind != b"TYPE") or at >= end or body[at] not in _BLANKS:
        return _SKIPPED  # a plain comment
    while at < end and body[at] in _BLANKS:
        at += 1
    if at < end and not _owns(body, name, at):
        return _OTHER
    return _TYPE if kind == b"TYPE" else _SKIPPED


def _lines_from(body: bytes, name: bytes, start: int) -> list[bytes]:
    """The sample lines of ``name`` from the line beginning at ``start`` to the end of the family's group (comments
    and blank lines within it are skipped, as parsers skip them)."""
    return _group(body, name, start)[0]


def _group(body: bytes, name: bytes, start: int) -> tuple[list[bytes], int]:
    """`_lines_from`, and where the line that ended the group begins (``len(body)`` at the end)."""
    lines = []
    size = len(body)
    while start < size:
        if _is_sample(body, name, start):  # what servers print: the name at the start of the line
            end = body.find(b"\n", start)
            end = size if end < 0 else end
            lines.append(body[start:end])
        elif body.startswith(_HELP, start) or body.startswith(_TYPE_LINE, start):
            if not _owns(body, name, start + 7):  # what servers print next: the next family's HELP or TYPE line
                break
            end = body.find(b"\n", start)
            end = size if end < 0 else end
        else:
            end = body.find(b"\n", start)
            end = size if end < 0 else end
            first = _line(body, name, start, end)
            if first >= 0:
                lines.append(body[first:end])
            elif first == _OTHER:
                break
        start = end + 1
    return lines, start


_HELP, _TYPE_LINE = b"# HELP ", b"# TYPE "
_NAME_ENDS = (b" ", b"\t", b"\r", b"\n", b"")


def _owns(body: bytes, name: bytes, at: int) -> bool:
    """Whether the HELP or TYPE line whose name begins at ``at`` is family ``name``'s (a counter's may name it
    without ``_total``)."""
    if body.startswith(name, at):
        return body[at + len(name) : at + len(name) + 1] in _NAME_ENDS
    if not name.endswith(b"_total"):
        return False
    base = name[:-6]
    return body.startswith(base, at) and body[at + len(base) : at + len(base) + 1] in _NAME_ENDS


def _sample_values(lines: list[bytes], name: bytes) -> list[float] | None:
    """The values of well-formed sample lines (a malformed line is skipped, as the parser skips it)."""
    values = []
    for line in lines:
        value = _value(line, name)
        if value is not None:
            values.append(value)
    return values or None


def _value(line: bytes, name: bytes) -> float | None:
    """The value of one sample line of ``name``; None if the line is malformed."""
    if line[len(name) : len(name) + 1] == b"{":  # what servers print, without `_labels_span`'s call
        brace = line.rfind(b"}")
        if brace < 0:
            return None
        rest = line[brace + 1 :].split()
    elif (span := _labels_span(line, name)) is None:
        rest = line[len(name) :].split()
    elif span[1] < 0:
        return None
    else:
        rest = line[span[1] + 1 :].split()
    # float() takes "1_000", Prometheus does not (95: "_"; an int's `in` is far cheaper than a bytes' here)
    if not 1 <= len(rest) <= 2 or 95 in rest[0] or 95 in rest[-1]:
        return None
    try:
        if len(rest) == 2:
            float(rest[1])  # the timestamp: checked, not kept
        return float(rest[0])
    except ValueError:
        return None


def _labels_span(line: bytes, name: bytes) -> tuple[int, int] | None:
    """Where the label set of a sample line of ``name`` opens and closes (``{`` and ``}``), or None without one.
    A label value may hold braces; the value after the set may not, so the last ``}`` closes it. A ``{`` without
    a ``}`` gives (i, -1)."""
    i = len(name)
    if line[i : i + 1] != b"{":
        i = len(line) - len(line[i:].lstrip(b" \t"))
        if line[i : i + 1] != b"{":
            return None
    return i, line.rfind(b"}", i)


_PAIR = re.compile(rb'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
_ESCAPE = re.compile(rb"\\(.)", re.S)
_UNESCAPED = {b"\\": b"\\", b'"': b'"', b"n": b"\n"}


def _unescape(m: re.Match[bytes]) -> bytes:
    return _UNESCAPED.get(m.group(1), m.group(0))  # other escapes stay as printed, as prometheus_client keeps them


def read_samples(body: bytes | str, name: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of each sample line of metric ``name`` (exactly that name), in order, wherever in the
    body: the fast reader's way to a family's labels, the same as prometheus_client's parser gives (the tests
    compare them). Malformed lines are skipped; never raises on bad input. scorer/dcgm.py reads DCGM exporters
    with it."""
    if isinstance(body, str):
        body = body.encode("utf-8", "replace")
    metric = name.encode()
    lines: list[bytes] = []
    start = _sample_start(body, metric, 0)
    while start >= 0:  # every group of the name, as a parser finds them (a family printed in pieces)
        group, end = _group(body, metric, start)
        lines += group
        start = _sample_start(body, metric, end) if end < len(body) else -1
    return _samples(lines, metric)


def _samples(lines: list[bytes], name: bytes) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of well-formed sample lines of ``name``."""
    samples = []
    for line in lines:
        value = _value(line, name)
        if value is None:
            continue
        span = _labels_span(line, name)
        samples.append((dict(_label_pairs(line[span[0] + 1 : span[1]])) if span is not None else {}, value))
    return samples


@lru_cache(maxsize=4096)
def _label_pairs(text: bytes) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs of a label set's text, escapes resolved. A pure memo: a server prints the same
    label sets scrape after scrape, only the values change."""
    pairs = []
    for key, raw in _PAIR.findall(text):
        value = _ESCAPE.sub(_unescape, raw) if b"\\" in raw else raw
        pairs.append((key.decode(), value.decode("utf-8", "replace")))
    return tuple(pairs)


def _lora_lines(lines: list[bytes]) -> LoraInfo | None:
    """``vllm:lora_requests_info`` from its few sample lines (printed only by servers with LoRA enabled)."""
    return _lora(_samples(lines, _LORA)) if lines else None


def read_vllm_signals(body: bytes) -> VllmSnapshot:
    """The 10 Hz scrape's fast path: the same fields as ``read_vllm(body, histograms=False)`` (no model filter),
    found by searching for each metric's name instead of parsing every line. Never raises on bad input.

    A vLLM exposition is mostly histogram buckets the picker does not read; skipping them unparsed is most of
    the saving (the equivalence is checked by the tests on real vLLM expositions and the emulator's).
    """
    return _read_signals(body, _sample_lines, counters=True)


def _read_signals(body: bytes | str, lines: Callable[[bytes, bytes], list[bytes]], *, counters: bool) -> VllmSnapshot:
    """The signals of ``body``, each family's sample lines found by ``lines(body, name)``; the prefix-cache and
    preemption counters only with ``counters``."""
    if isinstance(body, str):
        body = body.encode("utf-8", "replace")
    names = _SIGNAL_NAMES

    def values(key: str) -> list[float] | None:
        return _sample_values(lines(body, names[key]), names[key])

    kv = _mean_fraction(values("kv"))
    if kv is None:  # servers older than vLLM 0.10 print the old name
        kv = _mean_fraction(values("kv_old"))
    block_size = num_gpu_blocks = None
    cache_lines = lines(body, names["cache"])
    if cache_lines:
        sizes = [int(m.group(1)) if (m := _BLOCK_SIZE.search(line)) else 0 for line in cache_lines]
        if len(set(sizes)) == 1 and sizes[0] > 0:
            block_size = sizes[0]
        blocks = [int(m.group(1)) if (m := _NUM_BLOCKS.search(line)) else 0 for line in cache_lines]
        if all(b > 0 for b in blocks):
            num_gpu_blocks = sum(blocks)
    return VllmSnapshot(
        running=_count(values("running")),
        waiting=_count(values("waiting")),
        kv_cache_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        prefix_cache_queries=_count(values("queries")) if counters else None,
        prefix_cache_hits=_count(values("hits")) if counters else None,
        num_preemptions=_count(values("preemptions")) if counters else None,
        lora=_lora_lines(lines(body, names["lora"])),
        ttft=None,
        e2e_latency=None,
        queue_time=None,
    )


class SignalReader:
    """`read_vllm_signals` for one endpoint, scrape after scrape, reading only what the metrics collector uses:
    running, waiting, KV-cache use and geometry, LoRA state (the prefix-cache and preemption counters stay None).

    A server prints its families in the same order every time, so the reader remembers where each family began
    in the last body and searches from a little before there: a few KB instead of the whole exposition (most of
    a vLLM exposition is histogram buckets). LoRA state, printed only by servers with LoRA enabled, is looked
    for again after an absence only on every `RECHECK_ABSENT`-th read (a server's configuration changes only with
    a restart, and an absent family costs a scan of the whole body).
    The results equal ``read_vllm_signals``'s on those fields (the tests compare them). One endpoint, one thread.
    """

    WINDOW = 2048
    RECHECK_ABSENT = 10

    def __init__(self) -> None:
        self._at: dict[bytes, int] = {}  # where each family's first sample line began in the last body
        self._absent: set[bytes] = set()
        self._reads = 0

    def read(self, body: bytes) -> VllmSnapshot:
        self._reads += 1
        return _read_signals(body, self._lines, counters=False)

    def _lines(self, body: bytes, name: bytes) -> list[bytes]:
        if name == _LORA and name in self._absent and self._reads % self.RECHECK_ABSENT:
            return []
        at = self._at.get(name)
        start = -1
        if at is not None:
            start = _sample_start(body, name, max(0, at - self.WINDOW))
            if start >= 0:  # found from the hint: step back to the family's first sample line, if need be
                line = start
                while line > 0:
                    before = body.rfind(b"\n", 0, line - 1) + 1
                    if body.startswith(_TYPE_LINE, before) or (
                        body.startswith(_HELP, before) and not _owns(body, name, before + 7)
                    ):
                        break  # what servers print before a family: its TYPE line (or the last one's HELP)
                    kind = _line(body, name, before, line - 1)
                    if kind >= 0:
                        start = before
                    elif kind != _SKIPPED:  # its TYPE line, or another family's: the group begins after it
                        break
                    line = before
        if start < 0:
            start = _sample_start(body, name, 0)
        if start < 0:
            self._absent.add(name)
            self._at.pop(name, None)
            return []
        self._absent.discard(name)
        self._at[name] = start
        return _lines_from(body, name, start)
