"""Joining the servers' latency spans to endpoints, on the picker's event loop: the join rule and its counters.

The spans arrive as validated `SpanRecord`s from the receiver process (otel/receiverproc.py decodes, checks the
sender and the span's bounds; otel/spanfeed.py brings the records here in bounded slices). A record moves an
endpoint's latency only when

(a) its trace id joins a decision this picker made (`TraceJoin`, filled by the filter at each decision; among
    several decisions of one trace, the one whose span id the span names as its parent), it was sent from the
    host of the endpoint that decision chose or from a relay (``otel.relays``: an OpenTelemetry Collector's
    network), and the join is consumed: one span per decision. A client may choose its own trace id
    (``traceparent``), so without the sender's check anything allowed to send spans could give any endpoint the
    latency of its choice for each request it sent; such a span is ``unverified`` and leaves the decision to
    its server's span. A second span with a joined trace id is a ``duplicate`` and changes nothing; or
(b) name joins are on (``otel.join_by_name``, off by default) and it names a pool endpoint (``server.address`` +
    ``server.port`` of the span or its resource, or ``inferlb.endpoint``) and was sent from that endpoint's own
    host: a server may speak for itself, not for its neighbours (``unverified`` otherwise). Where several servers
    share a host, or a client runs on one, anything there could speak for all of them: hence off by default, for
    servers that propagate the trace context (vLLM and the emulator do).

Anything else is ``unjoined``. A trace id wins over the name: the decision is what the picker knows.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from inferlb.otel.heatmap import LLM_SPAN, HeatmapAggregator
from inferlb.otel.spanwire import SpanRecord
from inferlb.scorer.networks import IPAddress, Networks, unmapped

__all__ = ["CHILD_COUNTERS", "LLM_SPAN", "ReceiverStats", "SpanJoiner", "TraceJoin"]

Observe = Callable[[int, float | None, float | None], None]


class _Decision:
    __slots__ = ("at", "endpoint", "order", "partner", "request_id")

    def __init__(self, endpoint: int, at: float, partner: bytes | None, request_id: str = "", order: int = 0) -> None:
        self.endpoint, self.at, self.partner, self.request_id, self.order = endpoint, at, partner, request_id, order


class TraceJoin:
    """Trace id (16 bytes) -> the endpoints of the decisions that continued it, each consumed by the first span
    that joins it.

    A decision is kept under its trace id and the span id the picker put in the request's ``traceparent`` (the
    parent the server's span names). A client may send several requests in one trace (an agent's calls, each with
    the same ``traceparent``): each is a decision of its own, and a span joins the decision whose span id is its
    parent; a span whose parent is none of them (Envoy's tracer put its own span between) joins the oldest
    decision of its trace that it may speak for (`find`). So each request's span counts for its own decision,
    not for the newest decision of the trace.

    Bounded by size and by age: at most ``capacity`` decisions wait for their span (a new one evicts the oldest,
    counted in `evicted`), and a decision older than ``max_age_s`` (its span is not coming: the request died, the
    server sends none) is forgotten (`expired`). Joined trace ids are remembered as long, and at most
    ``capacity // 4`` of them, to tell a `duplicate` from an unknown id (an older repeat counts as unjoined: it is
    ignored either way). So memory does not grow with traffic: when spans join, only the decisions of requests
    still running (plus the exporters' delay) and ``max_age_s`` of joined ids are held; when they do not,
    ``capacity`` decisions at most, about 400 B each.

    Event-loop owned (not thread-safe); ``clock`` is monotonic seconds.
    """

    def __init__(
        self, capacity: int = 65536, max_age_s: float = 300.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1 or not max_age_s > 0:
            raise ValueError(f"TraceJoin needs capacity >= 1 and max_age_s > 0; got {capacity!r}, {max_age_s!r}")
        self.capacity, self.max_age_s, self.clock = capacity, max_age_s, clock
        self._remember = max(1, capacity // 4)
        # Key: trace id + span id (24 bytes), oldest first. A decision without a known span id (Envoy's alias of
        # it, or a caller that gave none) gets a serial number of this join's own in its place.
        self._map: OrderedDict[bytes, _Decision] = OrderedDict()
        # Trace id -> per endpoint, its decisions' keys, oldest first: a span finds the oldest decision of its trace
        # that it may speak for by looking at one key per endpoint, however many decisions the trace has.
        self._traces: dict[bytes, dict[int, dict[bytes, None]]] = {}
        self._joined: OrderedDict[bytes, float] = OrderedDict()  # trace id -> when it joined
        self._serial = 0
        self._order = 0  # each decision's place in the order they were made
        self.evicted = 0
        """Decisions forgotten because ``capacity`` newer ones were waiting (only grows)."""
        self.expired = 0
        """Decisions forgotten because no span came within ``max_age_s`` (only grows)."""

    def record(
        self,
        trace_id: bytes,
        endpoint: int,
        also: bytes | None = None,
        request_id: str = "",
        span_id: bytes | None = None,
    ) -> None:
        """A decision for ``endpoint`` whose server span will carry ``trace_id`` and name ``span_id`` (8 bytes; None:
        not known) as its parent, or carry ``also`` if given (Envoy's trace id, when Envoy's tracer may replace
        ours): the first span with either consumes both. ``request_id``: the request's (for experiments'
        outcomes; "" if it has none)."""
        now = self.clock()
        self._expire(now)
        key = trace_id + (span_id if span_id is not None and len(span_id) == 8 else self._next_serial())
        alias = None if also is None or also == trace_id else also + self._next_serial()
        self._order += 1
        order = self._order
        self._add(key, _Decision(endpoint, now, alias, request_id, order))
        if alias is not None:
            self._add(alias, _Decision(endpoint, now, key, request_id, order))
        while len(self._map) > self.capacity:
            old_key, old = self._map.popitem(last=False)
            self._unindex(old_key, old.endpoint)
            if old.partner is not None and self._pop(old.partner) is not None:
                self.evicted += 1
            self.evicted += 1

    def find(
        self, trace_id: bytes, parent: bytes | None = None, accept: Callable[[int], bool] | None = None
    ) -> bytes | None:
        """The key of the decision a span of ``trace_id`` whose parent is ``parent`` joins: the one recorded with that
        span id; else the oldest of the trace's whose endpoint ``accept`` takes (any, without ``accept``); else,
        if the trace has decisions, the oldest (which the span may not speak for). None: the trace has none."""
        if parent is not None:
            exact = trace_id + parent
            if exact in self._map:
                return exact
            if exact in self._joined:
                return None  # its decision was taken: this span is a duplicate
        by_endpoint = self._traces.get(trace_id)
        if not by_endpoint:
            return None
        oldest, taken = None, None
        for endpoint, keys in by_endpoint.items():
            key = next(iter(keys))
            order = self._map[key].order
            if oldest is None or order < self._map[oldest].order:
                oldest = key
            if (accept is None or accept(endpoint)) and (taken is None or order < self._map[taken].order):
                taken = key
        return taken if taken is not None else oldest

    def endpoint_of(self, key: bytes) -> int:
        """The endpoint of the waiting decision ``key`` (from `find`)."""
        return self._map[key].endpoint

    def consume(self, trace_id: bytes, parent: bytes | None = None) -> int | None:
        """The endpoint of the decision a span of ``trace_id`` (and ``parent``) joins, which is then forgotten; None
        if there is none (any more)."""
        taken = self.take(trace_id, parent)
        return None if taken is None else taken[0]

    def take(self, trace_id: bytes, parent: bytes | None = None) -> tuple[int, str] | None:
        """`consume`, with the decision's request id: (endpoint, request id)."""
        key = self.find(trace_id, parent)
        return None if key is None else self.take_key(key, parent)

    def take_key(self, key: bytes, parent: bytes | None = None) -> tuple[int, str] | None:
        """Consume the decision ``key`` (from `find`) for a span whose parent is ``parent``: (endpoint, request id),
        or None if it is too old."""
        decision = self._pop(key)
        if decision is None:
            return None
        if decision.partner is not None:
            self._pop(decision.partner)
        now = self.clock()
        if now - decision.at > self.max_age_s:
            self.expired += 1
            return None
        joined = key[:16] if parent is None else key[:16] + parent
        self._joined[joined] = now
        self._joined.move_to_end(joined)
        while len(self._joined) > self._remember:
            self._joined.popitem(last=False)
        return decision.endpoint, decision.request_id

    def joined(self, trace_id: bytes, parent: bytes | None = None) -> bool:
        """Whether a span with ``trace_id`` and ``parent`` joined within the last ``max_age_s`` (a second one is a
        duplicate)."""
        at = self._joined.get(trace_id if parent is None else trace_id + parent)
        return at is not None and self.clock() - at <= self.max_age_s

    def get(self, trace_id: bytes, parent: bytes | None = None) -> int | None:
        """The endpoint of the decision a span of ``trace_id`` (and ``parent``) would join, without consuming it
        (for tests and tools)."""
        key = self.find(trace_id, parent)
        return None if key is None else self._map[key].endpoint

    def remap(self, mapping: np.ndarray) -> None:
        """After a membership change: a decision waiting for its span that named endpoint ``mapping[j]`` names
        endpoint j of the next pool; one whose endpoint is not in the next pool is forgotten (`expired`: its
        span has no endpoint to count for any more)."""
        moved = {int(old): new for new, old in enumerate(np.asarray(mapping).tolist()) if old >= 0}
        for key, decision in list(self._map.items()):
            index = moved.get(decision.endpoint)
            if index is None:
                self._pop(key)
                self.expired += 1
            else:
                decision.endpoint = index
        self._traces = {}
        for key, decision in self._map.items():  # in their order
            self._traces.setdefault(key[:16], {}).setdefault(decision.endpoint, {})[key] = None

    def expire(self) -> None:
        """Forget what is older than ``max_age_s`` now (`record` does this as it goes; call it when idle)."""
        self._expire(self.clock())

    def _expire(self, now: float) -> None:
        horizon = now - self.max_age_s
        while self._map:
            key, decision = next(iter(self._map.items()))
            if decision.at >= horizon:
                break
            self._pop(key)
            self.expired += 1
        while self._joined:
            key, at = next(iter(self._joined.items()))
            if at >= horizon:
                break
            del self._joined[key]

    def _next_serial(self) -> bytes:
        self._serial += 1
        return self._serial.to_bytes(8, "big")

    def _add(self, key: bytes, decision: _Decision) -> None:
        self._pop(key)  # the same trace and span id again (a client's replayed traceparent): the newer decision
        self._map[key] = decision
        trace_id = key[:16]
        self._joined.pop(trace_id, None)
        self._traces.setdefault(trace_id, {}).setdefault(decision.endpoint, {})[key] = None

    def _pop(self, key: bytes) -> _Decision | None:
        decision = self._map.pop(key, None)
        if decision is not None:
            self._unindex(key, decision.endpoint)
        return decision

    def _unindex(self, key: bytes, endpoint: int) -> None:
        by_endpoint = self._traces.get(key[:16])
        if by_endpoint is None:
            return
        keys = by_endpoint.get(endpoint)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del by_endpoint[endpoint]
        if not by_endpoint:
            del self._traces[key[:16]]

    def __len__(self) -> int:
        return len(self._map)

    @property
    def remembered(self) -> int:
        """Joined spans (trace id, and parent where the span named one) remembered for duplicate detection."""
        return len(self._joined)


CHILD_COUNTERS = (
    "requests",
    "untrusted_sender",
    "unauthenticated",
    "invalid_requests",
    "busy_requests",
    "slow_requests",
    "incomplete_requests",
    "dropped_requests",
    "dropped_spans",
    "spans",
    "envoy_spans",
    "llm_spans",
    "malformed",
    "out_of_bounds",
    "over_limit",
    "rate_limited",
)
"""The counters the receiver process keeps and sends as increments (see `ReceiverStats`)."""


@dataclass(slots=True)
class ReceiverStats:
    """The receiver's counters, all only growing (event-loop owned).

    Export requests: ``requests`` received; refused whole: ``untrusted_sender`` (peer outside the allowlist),
    ``unauthenticated`` (token missing or wrong), ``invalid_requests`` (not protobuf), ``busy_requests`` (every
    slot held by calls still sending), ``slow_requests`` (the message did not come in time), ``incomplete_requests``
    (the call ended before a whole message, or the message was over the size limit), ``dropped_requests`` (the
    picker was behind; their ``dropped_spans`` are not counted below).

    Spans of the other requests: ``over_limit`` (past ``max_spans_per_request``, not looked at), and ``spans``
    looked at: ``envoy_spans`` (Envoy's own), ``llm_spans`` (latency spans), the rest other spans. Each latency
    span has one outcome: ``malformed``, ``out_of_bounds``, ``rate_limited`` (over the span budget) in the
    receiver process; ``joined_by_trace``, ``joined_by_resource``, ``duplicate``, ``unverified``, ``unjoined`` here
    (see the module docstring). ``restarts``: receiver processes started again after one died.
    """

    requests: int = 0
    untrusted_sender: int = 0
    unauthenticated: int = 0
    invalid_requests: int = 0
    busy_requests: int = 0
    slow_requests: int = 0
    incomplete_requests: int = 0
    dropped_requests: int = 0
    dropped_spans: int = 0
    spans: int = 0
    envoy_spans: int = 0
    llm_spans: int = 0
    malformed: int = 0
    out_of_bounds: int = 0
    over_limit: int = 0
    rate_limited: int = 0
    joined_by_trace: int = 0
    joined_by_resource: int = 0
    duplicate: int = 0
    unverified: int = 0
    unjoined: int = 0
    restarts: int = 0

    def add(self, increments: Mapping[str, object]) -> None:
        """Add the receiver process's increments; names it does not keep and values that are not counts are
        ignored (a broken child cannot set the picker's other counters)."""
        for name in CHILD_COUNTERS:
            value = increments.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class SpanJoiner:
    """Applies the join rule (module docstring) to records: ``observe(endpoint_index, ttft_s, e2e_s)`` gets every
    joined latency and ``heatmap`` (if any) the record at its end time. ``endpoints``: the pool's ``ip:port``
    addresses in index order. `add` is O(1), never raises for any record, and runs on the event loop."""

    def __init__(
        self,
        observe: Observe,
        endpoints: Sequence[str],
        join: TraceJoin,
        stats: ReceiverStats,
        *,
        heatmap: HeatmapAggregator | None = None,
        by_name: bool = False,
        relays: Networks | None = None,
    ) -> None:
        self.stats, self.heatmap = stats, heatmap
        self.by_name = by_name  # rule (b); a reload may change it
        self.relays = (
            relays if relays is not None else Networks(())
        )  # may speak for any endpoint; a reload may change it
        # Told (request id, record) of each span joined by trace to a decision with a request id (experiments).
        self.outcome: Callable[[str, SpanRecord], None] | None = None
        self.rebind(observe, endpoints, join)

    def rebind(self, observe: Observe, endpoints: Sequence[str], join: TraceJoin) -> None:
        """Feed another pool from now on (after a config reload)."""
        self.observe, self.join = observe, join
        self.addresses = list(endpoints)
        self._index = {address: i for i, address in enumerate(self.addresses)}
        self._hosts = [unmapped(address.rpartition(":")[0].strip("[]")) for address in self.addresses]

    def add(self, sender: IPAddress | None, record: SpanRecord) -> None:
        """One record sent from ``sender`` (None: unknown, so no endpoint's own host)."""
        stats = self.stats
        taken = None
        if record.trace_id is not None:
            join, hosts = self.join, len(self._hosts)
            key = join.find(record.trace_id, record.parent_id, lambda e: e < hosts and self._speaks_for(sender, e))
            if key is not None:
                decided = join.endpoint_of(key)
                if decided < hosts and not self._speaks_for(sender, decided):
                    stats.unverified += 1  # the decision stays for its server's own span
                    return
                taken = join.take_key(key, record.parent_id)
        endpoint = None if taken is None else taken[0]
        if endpoint is not None and endpoint < len(self.addresses):
            stats.joined_by_trace += 1
            if self.outcome is not None and taken is not None and taken[1]:
                self.outcome(taken[1], record)
        else:
            named = self._index.get(record.server) if record.server is not None else None
            if named is not None and self.by_name and sender is not None and self._hosts[named] == unmapped(sender):
                stats.joined_by_resource += 1
                endpoint = named
            elif record.trace_id is not None and self.join.joined(record.trace_id, record.parent_id):
                stats.duplicate += 1
                return
            elif named is not None:
                stats.unverified += 1
                return
            else:
                stats.unjoined += 1
                return
        self.observe(endpoint, record.ttft_s, record.e2e_s)
        if self.heatmap is not None:
            self.heatmap.add(record.end_s, self.addresses[endpoint], record.ttft_s, record.e2e_s)

    def _speaks_for(self, sender: IPAddress | None, endpoint: int) -> bool:
        """Whether a span from ``sender`` may report on endpoint ``endpoint``: its own host, or a relay."""
        return sender is not None and (self._hosts[endpoint] == unmapped(sender) or self.relays.contains(sender))
