"""The latency heatmap: LLM request spans aggregated into endpoint x time and latency-bucket x time grids.

`HeatmapAggregator` holds the grids. The picker feeds it the records its span receiver joins (otel/receiver.py)
or the latencies the filter times on the response stream (otel/loop.py); two feeders take spans:

- `add_otlp_request`, for OTLP protobuf requests received from the inference servers;
- `load_otlp_json_lines`, which reads the OTLP/JSON lines files an OpenTelemetry collector's file exporter writes
  (replay them through `add_otlp_request`; ``inferlb heatmap`` does).

A span counts as one LLM request when it is named ``llm_request`` (vLLM's per-request span) or carries both
``gen_ai.latency.time_to_first_token`` and ``gen_ai.latency.e2e``. Its endpoint (``ip:port``) is, first match wins:
the span's ``inferlb.endpoint`` attribute; the span's ``server.address`` + ``server.port``; the resource's
``server.address`` + ``server.port`` (what vLLM's process, or the emulator, sets); the resource's
``inferlb.endpoint``. The request lands in the time bucket of the span's end time.

The renderers (PNG, HTML, JSON) are in `inferlb.otel.render`; they take the dict `HeatmapAggregator.grid` returns.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferlb.scorer.address import format_address
from inferlb.scorer.histogram import Histogram, check_bounds

__all__ = [
    "DEFAULT_LATENCY_BOUNDS",
    "E2E_ATTRIBUTE",
    "LLM_SPAN",
    "TTFT_ATTRIBUTE",
    "HeatmapAggregator",
    "add_otlp_request",
    "latency_seconds",
    "load_otlp_json_lines",
    "otlp_attributes",
    "span_endpoint",
]

LLM_SPAN = "llm_request"
TTFT_ATTRIBUTE = "gen_ai.latency.time_to_first_token"
E2E_ATTRIBUTE = "gen_ai.latency.e2e"
ENDPOINT_ATTRIBUTE = "inferlb.endpoint"

# 24 bounds, log-spaced from 1 ms to 100 s (adjacent bounds ~1.65x apart), rounded to 3 significant digits so the
# JSON and the axis labels stay readable.
DEFAULT_LATENCY_BOUNDS: tuple[float, ...] = tuple(float(f"{10 ** (-3 + 5 * k / 23):.3g}") for k in range(24))
"""Upper edges (seconds) of the default latency buckets; values above the last one go to an overflow bucket."""

_QUANTILE = 0.95
_MAX_BOUNDS = 256


class _Cell:
    """One endpoint in one time bucket: the request count and a TTFT histogram over the latency buckets."""

    __slots__ = ("count", "hi", "lo", "p95", "ttft")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.count = 0
        self.ttft = Histogram(bounds)  # requests without a TTFT are counted, but not here
        self.lo = math.inf
        self.hi = -math.inf
        self.p95: float | None = None  # cached; None = to be computed (only read when ttft.count > 0)


class _Bucket:
    __slots__ = ("cells", "latency")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.cells: dict[str, _Cell] = {}
        self.latency = Histogram(bounds)  # every endpoint's TTFTs


class HeatmapAggregator:
    """Endpoint x time (request count, P95 TTFT) and TTFT-latency-bucket x time (count) grids.

    Time is cut into buckets of ``bucket_s`` seconds (bucket ``k`` starts at ``k * bucket_s``, Unix seconds). Each
    (endpoint, time bucket) cell keeps its request count and a histogram of its TTFTs over ``latency_bounds``
    (upper edges in seconds, strictly increasing, plus an overflow bucket), never the raw values; the P95 is read
    from that histogram, interpolated log-linearly within the bucket that holds it and clamped to the cell's
    smallest and largest TTFT, so it is exact for a cell of one value and otherwise within one bucket's width.

    Memory is bounded: only the newest ``max_buckets`` time buckets are kept (the window follows the newest end
    time added, not the wall clock, so a replayed file keeps its own last hour); a record older than the window is
    counted in `late`. With ``clock`` (Unix seconds, e.g. ``time.time``) and ``max_ahead_s``, a record that ends
    more than ``max_ahead_s`` after ``clock()`` is counted in `ahead` and dropped: one record dated in the far
    future would otherwise move the window there and make every real record after it late. At most
    ``max_endpoints`` endpoints have data in the window; a record for another endpoint is counted in `dropped` (an
    endpoint whose buckets have all left the window frees its place). Worst case that is ``max_buckets *
    max_endpoints`` cells of ``len(latency_bounds) + 1`` counters each.

    `add` is O(1) (amortised: a new newest bucket evicts the old ones) and never raises; it and `grid` may be
    called from any thread (one lock). E2E latencies are accepted with each record, for spans' sake, but the grids
    are TTFT grids; a record with no TTFT still counts as a request. Counters only grow: `dropped`, `late`,
    `invalid` (a non-finite or negative time or latency, or an endpoint that is not a string; the bad latency is
    ignored, a bad time or endpoint drops the record), `unattributed` (records with no endpoint) and `ahead`.

    Raises ``ValueError`` from the constructor for a bad parameter, saying what is expected.
    """

    def __init__(
        self,
        bucket_s: float = 10.0,
        latency_bounds: Sequence[float] = DEFAULT_LATENCY_BOUNDS,
        max_buckets: int = 360,
        max_endpoints: int = 1024,
        *,
        clock: Callable[[], float] | None = None,
        max_ahead_s: float | None = None,
    ) -> None:
        if isinstance(bucket_s, bool) or not isinstance(bucket_s, int | float) or not math.isfinite(bucket_s):
            raise ValueError(f"bucket_s must be a number of seconds > 0, e.g. 10; got {bucket_s!r}")
        if bucket_s <= 0:
            raise ValueError(f"bucket_s must be a number of seconds > 0, e.g. 10; got {bucket_s!r}")
        bounds = tuple(float(b) for b in latency_bounds)
        if not 1 <= len(bounds) <= _MAX_BOUNDS:
            raise ValueError(f"latency_bounds must have 1..{_MAX_BOUNDS} upper edges; got {len(bounds)}")
        if not all(math.isfinite(b) and b > 0 for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"latency_bounds must be finite seconds > 0 in increasing order; got {list(bounds)}")
        bounds = check_bounds(bounds)
        for name, value in (("max_buckets", max_buckets), ("max_endpoints", max_endpoints)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if (clock is None) != (max_ahead_s is None) or (max_ahead_s is not None and not 0 <= max_ahead_s < math.inf):
            raise ValueError(f"clock and max_ahead_s (seconds >= 0) go together; got {clock!r}, {max_ahead_s!r}")
        self.clock, self.max_ahead_s = clock, max_ahead_s
        self.bucket_s = float(bucket_s)
        self.latency_bounds = bounds
        self.max_buckets = max_buckets
        self.max_endpoints = max_endpoints
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}
        self._newest: int | None = None
        self._last_seen: dict[str, int] = {}  # endpoint -> newest bucket index it has data in
        self.dropped = 0
        """Records dropped because ``max_endpoints`` other endpoints already had data in the window."""
        self.late = 0
        """Records dropped because they ended before the oldest kept time bucket."""
        self.invalid = 0
        """Records or latencies ignored because a value was malformed (see the class docstring)."""
        self.unattributed = 0
        """Records dropped because no endpoint was known for them."""
        self.ahead = 0
        """Records dropped because they ended more than ``max_ahead_s`` after the clock."""

    def add(self, end_time_s: float, endpoint: str | None, ttft_s: float | None, e2e_s: float | None) -> None:
        """Count one request that ended at ``end_time_s`` (Unix seconds) on ``endpoint``; never raises.

        ``ttft_s``/``e2e_s`` are seconds, None when unknown. ``endpoint`` None counts in `unattributed`.
        """
        ttft = latency_seconds(ttft_s)
        bad = (ttft_s is not None and ttft is None) or (e2e_s is not None and latency_seconds(e2e_s) is None)
        with self._lock:
            if bad:
                self.invalid += 1
            if endpoint is None:
                self.unattributed += 1
                return
            if not isinstance(endpoint, str) or not endpoint or latency_seconds(end_time_s) is None:
                if not bad:
                    self.invalid += 1
                return
            if self.clock is not None and self.max_ahead_s is not None and end_time_s > self.clock() + self.max_ahead_s:
                self.ahead += 1
                return
            index = math.floor(end_time_s / self.bucket_s)
            if self._newest is None or index > self._newest:
                self._advance(index)
            elif index <= self._newest - self.max_buckets:
                self.late += 1
                return
            if endpoint not in self._last_seen and len(self._last_seen) >= self.max_endpoints:
                self.dropped += 1
                return
            bucket = self._buckets.get(index)
            if bucket is None:
                bucket = self._buckets[index] = _Bucket(self.latency_bounds)
            cell = bucket.cells.get(endpoint)
            if cell is None:
                cell = bucket.cells[endpoint] = _Cell(self.latency_bounds)
            self._last_seen[endpoint] = max(index, self._last_seen.get(endpoint, index))
            cell.count += 1
            if ttft is not None:
                cell.ttft.observe(ttft)
                if ttft < cell.lo:
                    cell.lo = ttft
                if ttft > cell.hi:
                    cell.hi = ttft
                cell.p95 = None
                bucket.latency.observe(ttft)

    def _advance(self, newest: int) -> None:
        """Make ``newest`` the newest bucket: evict the buckets and endpoints that fall out of the window."""
        self._newest = newest
        oldest = newest - self.max_buckets + 1
        for index in [i for i in self._buckets if i < oldest]:
            del self._buckets[index]
        for endpoint in [e for e, last in self._last_seen.items() if last < oldest]:
            del self._last_seen[endpoint]

    def grid(self) -> dict[str, Any]:
        """A JSON-ready snapshot of the window.

        - ``bucket_s``; ``times``: the start (Unix seconds) of every time bucket from the oldest with data to the
          newest, gaps included; ``endpoints``: those with data in the window, sorted (IP addresses numerically);
        - ``p95_ttft_s[e][t]``: P95 TTFT of endpoint ``e`` in bucket ``t``, None where it has no TTFT;
          ``count[e][t]``: its requests;
        - ``latency_bounds_s``: the latency buckets' upper edges; ``latency_counts[b][t]``: TTFTs in latency bucket
          ``b`` (all endpoints), with one more row than there are bounds: the overflow bucket;
        - ``ahead``, ``dropped``, ``late``, ``invalid``, ``unattributed``: the counters.
        """
        with self._lock:
            if self._buckets:
                first, last = min(self._buckets), max(self._buckets)
                indices = list(range(first, last + 1))
            else:
                indices = []
            endpoints = sorted(self._last_seen, key=_endpoint_order)
            columns = [self._buckets.get(i) for i in indices]
            p95: list[list[float | None]] = []
            count: list[list[int]] = []
            for endpoint in endpoints:
                p95_row: list[float | None] = []
                count_row: list[int] = []
                for column in columns:
                    cell = column.cells.get(endpoint) if column is not None else None
                    if cell is None:
                        p95_row.append(None)
                        count_row.append(0)
                        continue
                    count_row.append(cell.count)
                    if cell.ttft.count and cell.p95 is None:
                        cell.p95 = self._quantile(cell, _QUANTILE)
                    p95_row.append(cell.p95 if cell.ttft.count else None)
                p95.append(p95_row)
                count.append(count_row)
            latency = [
                [column.latency.counts[b] if column is not None else 0 for column in columns]
                for b in range(len(self.latency_bounds) + 1)
            ]
            counters = {
                "ahead": self.ahead,
                "dropped": self.dropped,
                "late": self.late,
                "invalid": self.invalid,
                "unattributed": self.unattributed,
            }
        return {
            "bucket_s": self.bucket_s,
            "times": [i * self.bucket_s for i in indices],
            "endpoints": endpoints,
            "p95_ttft_s": p95,
            "count": count,
            "latency_bounds_s": list(self.latency_bounds),
            "latency_counts": latency,
            **counters,
        }

    def _quantile(self, cell: _Cell, q: float) -> float:
        rank = max(1, math.ceil(q * cell.ttft.count - 1e-9))  # nearest rank, 1-based
        seen = 0
        bounds = self.latency_bounds
        for i, c in enumerate(cell.ttft.counts):
            if c and seen + c >= rank:
                lower = max(bounds[i - 1] if i > 0 else cell.lo, cell.lo)
                upper = min(bounds[i] if i < len(bounds) else cell.hi, cell.hi)
                if upper <= lower:
                    return upper
                fraction = (rank - seen) / c
                if lower > 0:
                    return float(lower * (upper / lower) ** fraction)
                return lower + (upper - lower) * fraction
            seen += c
        return cell.hi  # unreachable while the counts sum to the count


def latency_seconds(value: Any) -> float | None:
    """``value`` as finite seconds >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _endpoint_order(endpoint: str) -> tuple[int, int, int, str]:
    host, _, port = endpoint.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        return (0, ip.version, int(ip), port.zfill(5))
    except ValueError:
        return (1, 0, 0, endpoint)


# --- spans -> records ---------------------------------------------------------------------------------------


def _feed(
    aggregator: HeatmapAggregator,
    name: str,
    end_ns: int | None,
    attributes: Mapping[str, Any],
    resource: Mapping[str, Any],
) -> bool:
    """Add one span if it is an LLM request span; True if it was one."""
    if name != LLM_SPAN and not (TTFT_ATTRIBUTE in attributes and E2E_ATTRIBUTE in attributes):
        return False
    end_s = end_ns / 1e9 if end_ns else math.nan  # OTLP's "unset" is 0; the aggregator counts NaN as invalid
    aggregator.add(
        end_s, span_endpoint(attributes, resource), attributes.get(TTFT_ATTRIBUTE), attributes.get(E2E_ATTRIBUTE)
    )
    return True


def span_endpoint(attributes: Mapping[str, Any], resource: Mapping[str, Any]) -> str | None:
    """The "ip:port" a span names as its server: ``inferlb.endpoint``, else ``server.address`` + ``server.port``
    of the span, then of its resource; None if none does."""
    named = attributes.get(ENDPOINT_ATTRIBUTE)
    if isinstance(named, str) and named:
        return named
    for source in (attributes, resource):
        address, port = source.get("server.address"), source.get("server.port")
        # OTEL_RESOURCE_ATTRIBUTES only carries strings, so "8000" is as good as 8000.
        if isinstance(port, str) and port.isascii() and port.isdigit():
            port = int(port)
        if isinstance(address, str) and address and isinstance(port, int) and not isinstance(port, bool):
            return format_address(address.strip("[]"), port)
    named = resource.get(ENDPOINT_ATTRIBUTE)
    return named if isinstance(named, str) and named else None


def add_otlp_request(aggregator: HeatmapAggregator, request: ExportTraceServiceRequest) -> int:
    """Add the LLM request spans of one received OTLP request; returns how many spans were LLM requests.

    Uses each span's ``end_time_unix_nano`` and the span's and its resource's attributes. Spans of other kinds are
    skipped; a malformed one is counted by the aggregator (`HeatmapAggregator.invalid` and friends), never raised.
    """
    matched = 0
    for resource_spans in request.resource_spans:
        resource = otlp_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                matched += _feed(
                    aggregator, span.name, span.end_time_unix_nano, otlp_attributes(span.attributes), resource
                )
    return matched


def otlp_attributes(pairs: Any) -> dict[str, Any]:
    """OTLP protobuf key-values as a dict of their scalar values (arrays and maps are left out)."""
    attributes: dict[str, Any] = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        if kind in ("string_value", "int_value", "double_value", "bool_value"):
            attributes[pair.key] = getattr(pair.value, kind)
    return attributes


def load_otlp_json_lines(path: str | Path) -> Iterator[ExportTraceServiceRequest]:
    """The `ExportTraceServiceRequest` on each line of an OTLP/JSON lines file, lazily, in file order.

    That is the OpenTelemetry collector file exporter's format: one request per line in the OTLP/JSON encoding
    (camelCase keys, 64-bit integers as strings, trace and span ids in hex). Ids in protobuf's own JSON spelling
    (base64, as ``json_format.MessageToJson`` writes them) are read as well. Unknown fields are ignored (so are the
    spans of pre-1.0 collectors' ``instrumentationLibrarySpans``); blank lines are skipped.

    Raises ``OSError`` if the file cannot be read and ``ValueError`` naming the file and line number for a line
    that is not such a request.
    """
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                document = json.loads(raw)
                if not isinstance(document, dict):
                    raise ValueError(f"a JSON object was expected, not {type(document).__name__}")
                _hex_ids_to_base64(document)
                request = ExportTraceServiceRequest()
                json_format.ParseDict(document, request, ignore_unknown_fields=True)
            except (ValueError, TypeError, json_format.ParseError, RecursionError) as exc:
                raise ValueError(f"{path}:{number}: not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
            yield request


_ID_LENGTHS = {"traceId": 16, "spanId": 8, "parentSpanId": 8}


def _hex_ids_to_base64(document: dict[str, Any]) -> None:
    """Rewrite OTLP/JSON's hex ids in place into the base64 protobuf's JSON parser expects.

    A 16-byte id is 32 characters in hex and 24 in base64 (8 bytes: 16 and 12), so the lengths tell them apart.
    """

    def fix(obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        for key, size in _ID_LENGTHS.items():
            value = obj.get(key)
            if isinstance(value, str) and len(value) == 2 * size:
                with contextlib.suppress(ValueError):  # not hex: the parser judges it as base64
                    obj[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")

    for resource_spans in _list(document.get("resourceSpans")):
        for scope_spans in _list(_dict(resource_spans).get("scopeSpans")):
            for span in _list(_dict(scope_spans).get("spans")):
                fix(span)
                for link in _list(_dict(span).get("links")):
                    fix(link)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
