"""A fast reader of the Prometheus text exposition (format 0.0.4, and the OpenMetrics lines vLLM may send), tuned
for the picker's scrape loop: every inference server's ``/metrics`` at 10 Hz, hundreds of servers on one core.

The speed comes from not looking at what is not needed: given the family names it wants, the reader lets one
compiled regex pick out, in C, the lines that start with one of those names, and parses only those. Everything
else (Python runtime metrics, HTTP metrics, the dozens of vLLM families the picker ignores) is skipped unparsed.

On top of the generic reader, :func:`read_vllm` turns one vLLM scrape into a :class:`VllmSnapshot` of the
signals the picker scores on. A missing or nonsensical metric becomes ``None`` for its field, never a guess.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

__all__ = [
    "PICKER_METRICS",
    "Exposition",
    "Histogram",
    "LoraInfo",
    "MetricFamily",
    "Sample",
    "SignalReader",
    "VllmSnapshot",
    "parse_exposition",
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

_TYPES = frozenset(
    ("counter", "gauge", "histogram", "gaugehistogram", "summary", "info", "stateset", "untyped", "unknown")
)

# Which suffixed sample names belong to a family of which declared type.
_SUFFIXES: tuple[tuple[str, frozenset[str]], ...] = (
    ("_bucket", frozenset(("histogram", "gaugehistogram"))),
    ("_count", frozenset(("histogram", "summary"))),
    ("_sum", frozenset(("histogram", "summary"))),
    ("_total", frozenset(("counter",))),
    ("_created", frozenset(("counter", "histogram", "summary"))),
    ("_gcount", frozenset(("gaugehistogram",))),
    ("_gsum", frozenset(("gaugehistogram",))),
    ("_info", frozenset(("info",))),
)

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_VALUE = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # a quoted label value, escapes allowed (an unrolled loop, for speed)
_PAIR = rf"[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*{_VALUE}"
_LABELS = rf"\{{[ \t]*((?:{_PAIR}(?:[ \t]*,[ \t]*{_PAIR})*)?)[ \t]*(?:,[ \t]*)?"  # without the closing brace
# What precedes the value on a line as prometheus_client prints it (`name{labels} value`), brace excluded.
_HEAD_RE = re.compile(rf"({_NAME})(?:[ \t]*{_LABELS})?")
# The whole line: the slow path, for lines the fast path cannot split (other blanks, "} " inside a label value).
# name, optional {labels}, value, optional timestamp, optional OpenMetrics exemplar (` # {...} v [ts]`).
_SAMPLE_RE = re.compile(
    rf"[ \t]*({_NAME})[ \t]*(?:{_LABELS}\}})?[ \t]+([^ \t\r]+)(?:[ \t]+([^ \t\r#][^ \t\r]*))?[ \t]*(?:#.*)?\r?"
)
_PAIR_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\\n]*(?:\\.[^"\\\n]*)*)"')
_DIRECTIVE_RE = re.compile(rf"#[ \t]+(HELP|TYPE)(?:[ \t]+({_NAME})(?:[ \t]+(.*))?)?[ \t\r]*")
_DIRECTIVE_START_RE = re.compile(r"#[ \t]+(?:HELP|TYPE)(?:[ \t\r]|$)")
_ESCAPE_RE = re.compile(r"\\(.)", re.S)
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


class Sample(NamedTuple):
    """One sample line: its metric name as printed (``x_bucket``, ``x_total``...), labels in printed order with
    escapes resolved, and the value (``nan``, ``inf`` and ``-inf`` included). Timestamps and exemplars are
    checked for form and dropped."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(slots=True)
class MetricFamily:
    """The samples of one family, in exposition order. ``type`` is the declared ``# TYPE`` (``"untyped"`` when
    none was declared); ``help`` the ``# HELP`` text with escapes resolved, or ``None``."""

    name: str
    type: str
    help: str | None = None
    samples: list[Sample] = field(default_factory=list)


@dataclass(slots=True)
class Exposition:
    """One parsed scrape: families by name, as the ``# TYPE`` lines name them, and the number of malformed lines.

    ``malformed`` counts only lines that were examined: with a ``wanted`` filter, lines of other families are
    skipped unparsed and are never counted. The caller owns the object; nothing else holds it.
    """

    families: dict[str, MetricFamily] = field(default_factory=dict)
    malformed: int = 0

    def get(self, name: str) -> MetricFamily | None:
        """The family ``name``; a counter is also found under its other spelling (``x`` or ``x_total``), since
        the 0.0.4 text format names counter families with ``_total`` and OpenMetrics names them without."""
        family = self.families.get(name)
        if family is not None:
            return family
        family = self.families.get(name[:-6] if name.endswith("_total") else name + "_total")
        return family if family is not None and family.type == "counter" else None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


class _Wanted(NamedTuple):
    lines: re.Pattern[str]  # finds the lines (samples, HELP, TYPE) whose name starts with a wanted prefix
    exact: frozenset[str]
    counter_alt: frozenset[str]  # the other spelling of each wanted name, accepted for counter families


@lru_cache(maxsize=64)
def _compile_wanted(wanted: frozenset[str]) -> _Wanted:
    # Pure memo of a compiled regex per distinct wanted set (the picker uses one); it holds no scrape state.
    alt = frozenset(w[:-6] if w.endswith("_total") else w + "_total" for w in wanted)
    prefixes = sorted({w[:-6] if w.endswith("_total") else w for w in wanted}, key=len, reverse=True)
    alternation = "|".join(re.escape(p) for p in prefixes) or "(?!)"
    lines = re.compile(rf"\n(#[ \t]+(?:HELP|TYPE)[ \t]+(?:{alternation})[^\n]*|(?:{alternation})[^\n]*)")
    return _Wanted(lines, wanted, alt)


def parse_exposition(text: str | bytes, wanted: Collection[str] | None = None) -> Exposition:
    """Parse a Prometheus text exposition; never raises on bad input.

    ``wanted``: family names to keep (``None`` keeps all). A line is looked at only if its metric name starts
    with a wanted name, a check done in C; a counter may be wanted as ``x`` or ``x_total`` alike. Sample names
    map to their family through the declared types: ``x_bucket``/``x_sum``/``x_count`` to histogram ``x``,
    ``x_total``/``x_created`` to counter ``x`` (OpenMetrics); a name with its own ``# TYPE`` line (as
    prometheus_client's ``x_created`` gauges) is its own family. Malformed lines are skipped and counted. Bytes
    that are not UTF-8 are decoded with U+FFFD replacements.
    """
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8", "replace")
    if wanted is None:
        return _parse_lines(text.split("\n"), None)
    spec = _compile_wanted(wanted if isinstance(wanted, frozenset) else frozenset(wanted))
    return _parse_lines(spec.lines.findall("\n" + text), spec)


def _parse_lines(lines: Iterable[str], wanted: _Wanted | None) -> Exposition:
    expo = Exposition()
    families = expo.families
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    # sample name -> its family, or None when the family is not wanted; reset when a TYPE line arrives
    resolved: dict[str, MetricFamily | None] = {}
    malformed = 0
    sample_match = _SAMPLE_RE.fullmatch
    for line in lines:
        if not line or line[0] == "#":
            if line and not _comment(line, types, helps, families, resolved, wanted):
                malformed += 1
            continue
        # Fast path: split at the first "} " (or blanks) and look the head up in a cache shared by all scrapes,
        # since every server of a pool prints the same names and label sets scrape after scrape.
        head, brace, tail = line.partition("} ")
        if brace:
            parts = tail.split() if "{" in head else []
        elif "{" in line:
            parts = []
        else:
            parts = line.split()
            head = parts.pop(0) if parts else ""
        parsed = _head(head) if parts else None
        if parsed is not None and (len(parts) == 1 or parts[1] == "#" or len(parts) == 2 or parts[2] == "#"):
            name, labels = parsed
            valuetext = parts[0]
            stamp = parts[1] if len(parts) > 1 and parts[1] != "#" else None
        else:
            m = sample_match(line)
            checked = _labels(m.group(2)) if m is not None else None
            if m is None or checked is None:
                if not line.isspace():
                    malformed += 1
                continue
            labels = checked
            name, _, valuetext, stamp = m.groups()
        try:
            if "_" in valuetext:  # float() takes "1_000"; Prometheus does not
                raise ValueError(valuetext)
            value = float(valuetext)
            if stamp is not None:
                float(stamp)
        except ValueError:
            malformed += 1
            continue
        family = resolved.get(name)
        if family is None:
            if name in resolved:
                continue
            family = resolved[name] = _resolve(name, types, helps, families, wanted)
            if family is None:
                continue
        family.samples.append(Sample(name, labels, value))
    expo.malformed = malformed
    return expo


@lru_cache(maxsize=8192)
def _head(head: str) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """Name and labels of a sample line's head (``name{a="b"``); None if malformed. A pure memo: a pool's servers
    print the same few hundred heads every scrape, so this parses each once."""
    m = _HEAD_RE.fullmatch(head)
    if m is None:
        return None
    labels = _labels(m.group(2))
    return None if labels is None else (m.group(1), labels)


def _labels(text: str | None) -> tuple[tuple[str, str], ...] | None:
    """The pairs of a label list already checked by a regex; None if a name repeats."""
    if not text:
        return ()
    pairs = _PAIR_RE.findall(text)
    if "\\" in text:
        pairs = [(k, _ESCAPE_RE.sub(_unescape, v)) for k, v in pairs]
    if len(pairs) > 1 and len({k for k, _ in pairs}) != len(pairs):
        return None
    return tuple(pairs)


def _comment(
    line: str,
    types: dict[str, str],
    helps: dict[str, str],
    families: dict[str, MetricFamily],
    resolved: dict[str, MetricFamily | None],
    wanted: _Wanted | None,
) -> bool:
    """Record a HELP or TYPE line; False when it is malformed. Other comments are ignored."""
    directive = _directive(line)
    if isinstance(directive, bool):
        return directive
    kind, name, text = directive
    if kind == "HELP":
        helps[name] = text
        family = families.get(name)
        if family is not None:
            family.help = text
        return True
    if name in types:
        return False
    types[name] = text
    resolved.clear()  # a late TYPE line may change where sample names already seen belong
    if _accepts(name, text, wanted):
        families[name] = MetricFamily(name, text, helps.get(name))
    return True


@lru_cache(maxsize=4096)
def _directive(line: str) -> tuple[str, str, str] | bool:
    """A comment line as (``HELP``/``TYPE``, name, text); True for any other comment, False when malformed. A
    pure memo, like :func:`_head`."""
    m = _DIRECTIVE_RE.fullmatch(line)
    if m is None or m.group(2) is None:
        return _DIRECTIVE_START_RE.match(line) is None
    kind, name, text = m.groups()
    text = (text or "").rstrip("\r")
    if kind == "TYPE":
        text = text.strip(" \t")
        return (kind, name, text) if text in _TYPES else False
    return kind, name, _ESCAPE_RE.sub(_unescape, text) if "\\" in text else text


def _resolve(
    name: str,
    types: dict[str, str],
    helps: dict[str, str],
    families: dict[str, MetricFamily],
    wanted: _Wanted | None,
) -> MetricFamily | None:
    """The family a sample name belongs to, created if need be; None if that family is not wanted."""
    family_name = name
    if name not in types:
        for suffix, kinds in _SUFFIXES:
            if name.endswith(suffix) and types.get(name[: -len(suffix)]) in kinds:
                family_name = name[: -len(suffix)]
                break
    family = families.get(family_name)
    if family is not None:
        return family
    kind = types.get(family_name, "untyped")
    if not _accepts(family_name, kind, wanted):
        return None
    family = families[family_name] = MetricFamily(family_name, kind, helps.get(family_name))
    return family


def _accepts(name: str, kind: str, wanted: _Wanted | None) -> bool:
    return wanted is None or name in wanted.exact or (kind == "counter" and name in wanted.counter_alt)


def _unescape(m: re.Match[str]) -> str:
    c = m.group(1)
    return _UNESCAPE.get(c, "\\" + c)


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
    """Read the picker's signals from one vLLM ``/metrics`` body; never raises on bad input.

    With ``model``, samples whose ``model_name`` label names another model are ignored; samples without a
    ``model_name`` label (``cache_config_info``, ``lora_requests_info``) are server-wide and always read.
    ``histograms=False`` skips the latency histograms (their buckets are most of the parsing work; the
    ``ttft``, ``e2e_latency`` and ``queue_time`` fields are then None): the 10 Hz scrape does without them.
    """
    expo = parse_exposition(text, PICKER_METRICS if histograms else _GAUGES_AND_COUNTERS)

    def values(name: str) -> list[float] | None:
        family = expo.get(name)
        if family is None:
            return None
        names = (family.name, family.name + "_total") if family.type == "counter" else (family.name,)
        found = [s.value for s in family.samples if s.name in names and _model_ok(s.labels, model)]
        return found or None

    kv = _mean_fraction(values("vllm:kv_cache_usage_perc"))
    if kv is None:
        kv = _mean_fraction(values("vllm:gpu_cache_usage_perc"))
    block_size, num_gpu_blocks = _cache_config(expo.get("vllm:cache_config_info"), model)
    return VllmSnapshot(
        running=_count(values("vllm:num_requests_running")),
        waiting=_count(values("vllm:num_requests_waiting")),
        kv_cache_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        prefix_cache_queries=_count(values("vllm:prefix_cache_queries_total")),
        prefix_cache_hits=_count(values("vllm:prefix_cache_hits_total")),
        num_preemptions=_count(values("vllm:num_preemptions_total")),
        lora=_lora(expo.get("vllm:lora_requests_info"), model),
        ttft=_histogram(expo.get("vllm:time_to_first_token_seconds"), model),
        e2e_latency=_histogram(expo.get("vllm:e2e_request_latency_seconds"), model),
        queue_time=_histogram(expo.get("vllm:request_queue_time_seconds"), model),
        malformed=expo.malformed,
    )


def _model_ok(labels: tuple[tuple[str, str], ...], model: str | None) -> bool:
    if model is None:
        return True
    for key, value in labels:
        if key == "model_name":
            return value == model
    return True


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
    if text is None or not text.isdigit():  # "None" is how vLLM prints an unset config value
        return None
    n = int(text)
    return n if n > 0 else None


def _cache_config(family: MetricFamily | None, model: str | None) -> tuple[int | None, int | None]:
    if family is None:
        return None, None
    configs = [dict(s.labels) for s in family.samples if s.name == family.name and _model_ok(s.labels, model)]
    if not configs:
        return None, None
    sizes = {_positive_int(c.get("block_size")) for c in configs}
    block_size = sizes.pop() if len(sizes) == 1 else None
    blocks = [_positive_int(c.get("num_gpu_blocks")) for c in configs]
    num_gpu_blocks = None if None in blocks else sum(b for b in blocks if b is not None)
    return block_size, num_gpu_blocks


def _lora(family: MetricFamily | None, model: str | None) -> LoraInfo | None:
    if family is None:
        return None
    # The gauge is set to the current time on every engine step; the newest label set is the current state.
    samples = [
        s for s in family.samples if s.name == family.name and math.isfinite(s.value) and _model_ok(s.labels, model)
    ]
    if not samples:
        return None
    labels = dict(max(samples, key=lambda s: s.value).labels)
    if "running_lora_adapters" not in labels or "waiting_lora_adapters" not in labels:
        return None
    return LoraInfo(
        running=tuple(a for a in labels["running_lora_adapters"].split(",") if a),
        waiting=tuple(a for a in labels["waiting_lora_adapters"].split(",") if a),
        max_lora=_positive_int(labels.get("max_lora")),
    )


def _histogram(family: MetricFamily | None, model: str | None) -> Histogram | None:
    if family is None or family.type != "histogram":
        return None
    bucket_name, sum_name, count_name = family.name + "_bucket", family.name + "_sum", family.name + "_count"
    # One series per label set without `le` (one per engine); they are added up when their bounds agree.
    buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    sums: dict[tuple[tuple[str, str], ...], list[float]] = {}
    counts: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for name, labels, value in family.samples:
        if model is not None and not _model_ok(labels, model):
            continue
        if name == bucket_name:
            split = _split_le(labels)
            if split is None:
                return None
            key, bound = split
            series = buckets.get(key)
            if series is None:
                buckets[key] = [(bound, value)]
            else:
                series.append((bound, value))
        elif name == sum_name:
            sums.setdefault(tuple(sorted(labels)), []).append(value)
        elif name == count_name:
            counts.setdefault(tuple(sorted(labels)), []).append(value)
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


@lru_cache(maxsize=4096)
def _split_le(labels: tuple[tuple[str, str], ...]) -> tuple[tuple[tuple[str, str], ...], float] | None:
    """A bucket's series key (its other labels, sorted) and its bound; None without a numeric ``le``. A pure memo:
    label tuples come from :func:`_head`'s cache, the same few hundred every scrape."""
    rest = [pair for pair in labels if pair[0] != "le"]
    if len(rest) != len(labels) - 1:
        return None
    try:
        bound = float(dict(labels)["le"])
    except ValueError:
        return None
    return tuple(sorted(rest)), bound


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
_BLOCK_SIZE = re.compile(rb'[{,]block_size="(\d+)"')
_NUM_BLOCKS = re.compile(rb'[{,]num_gpu_blocks="(\d+)"')


def _sample_lines(body: bytes, name: bytes) -> list[bytes]:
    """The sample lines of metric ``name`` (exactly that name, labelled or not).

    The text format keeps a family's lines together, so this finds the first sample line and reads on while
    lines carry the name.
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
        if start >= 0 and (start == 0 or body[start - 1] == 10) and _is_sample(body, name, start):
            return start
        pos = i + 1 - skip


def _is_sample(body: bytes, name: bytes, start: int) -> bool:
    """Whether a sample line of ``name`` begins at ``start``."""
    return body.startswith(name, start) and body[start + len(name) : start + len(name) + 1] in (b"{", b" ")


def _lines_from(body: bytes, name: bytes, start: int) -> list[bytes]:
    lines = []
    size = len(body)
    while start < size and _is_sample(body, name, start):
        end = body.find(b"\n", start)
        end = size if end < 0 else end
        lines.append(body[start:end])
        start = end + 1
    return lines


def _sample_values(lines: list[bytes], name: bytes) -> list[float] | None:
    """The values of well-formed sample lines (a malformed line is skipped, as the parser skips it)."""
    values = []
    for line in lines:
        if line[len(name) : len(name) + 1] == b"{":
            brace = line.rfind(b"}")
            if brace < 0:
                continue
            rest = line[brace + 1 :].split()
        else:
            rest = line[len(name) :].split()
        if not 1 <= len(rest) <= 2:
            continue
        try:
            values.append(float(rest[0]))
        except ValueError:
            continue
    return values or None


def _lora_lines(lines: list[bytes]) -> LoraInfo | None:
    """``vllm:lora_requests_info`` from its few sample lines, through the full parser (labels need it)."""
    if not lines:
        return None
    text = b"# TYPE vllm:lora_requests_info gauge\n" + b"\n".join(lines) + b"\n"
    return _lora(parse_exposition(text).get("vllm:lora_requests_info"), None)


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
                while start > 0:
                    before = body.rfind(b"\n", 0, start - 1) + 1
                    if not _is_sample(body, name, before):
                        break
                    start = before
        if start < 0:
            start = _sample_start(body, name, 0)
        if start < 0:
            self._absent.add(name)
            self._at.pop(name, None)
            return []
        self._absent.discard(name)
        self._at[name] = start
        return _lines_from(body, name, start)
