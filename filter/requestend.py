"""How the picker learns that a routed request has ended, without holding the request's routing stream open.

A request counts as in flight on its endpoint from the decision until it ends. The picker used to learn the end
from Envoy closing the ext_proc stream, which Envoy keeps open for the whole HTTP request; but then a picker
that exits or restarts breaks that stream, and with fail-closed Envoy resets the request it belongs to, a
streamed answer cut in the middle. So the picker ends the routing stream right after its decision, and Envoy
reports each routed request's end through its gRPC access-log service (``envoy.access_loggers.http_grpc``, to
the same gRPC port): one entry per finished request, batched, carrying Envoy's request id (``x-request-id``),
which the picker read from the request headers at decision time.

`OpenLeases` holds the leases of routed requests until their entry comes; `AccessLogReceiver` is the gRPC
service that takes the entries. A lease whose entry never comes (Envoy dropped it while its access-log stream
was down) is released after ``max_age_s`` and counted, so a lost entry costs a bounded error in the counts, not
a permanent one. Entries for requests this picker does not hold (routed before a restart, or repeated) are
counted and change nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from inferlb.scorer.inflight import Lease

__all__ = ["ACCESS_LOG_SERVICE", "AccessLogReceiver", "LeaseStats", "OpenLeases"]

ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
DEFAULT_MAX_AGE_S = 900.0
DEFAULT_CAPACITY = 1 << 18


@dataclass(slots=True)
class LeaseStats:
    """Counters (event-loop owned): leases held, ended by an access-log entry, expired, evicted for room, and
    entries that matched no held lease."""

    held: int = 0
    ended: int = 0
    expired: int = 0
    evicted: int = 0
    unknown_entries: int = 0
    log_streams: int = 0


class OpenLeases:
    """Leases of routed requests, keyed by request id, until the request's end is reported or they age out.

    A request id is Envoy's ``x-request-id``; a client may repeat one, so an id holds a queue of leases and each
    reported end releases the oldest. At most ``capacity`` leases are held (the oldest is released to make room,
    counted in ``evicted``); one older than ``max_age_s`` is released when the next lease is held or `expire`
    runs. Every operation is O(1) amortised. One event loop; not thread-safe.
    """

    def __init__(
        self,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_age_s > 0 or capacity < 1:
            raise ValueError(f"max_age_s must be > 0 and capacity >= 1; got {max_age_s!r}, {capacity!r}")
        self.max_age_s = max_age_s
        self.capacity = capacity
        self.clock = clock
        self.stats = LeaseStats()
        self._by_id: dict[str, deque[Lease]] = {}
        # Acquire order, for ageing out; entries of leases already released are skipped when reached.
        self._order: deque[tuple[float, str, Lease]] = deque()
        self._open = 0

    def __len__(self) -> int:
        """Leases held and not yet released."""
        return self._open

    def hold(self, request_id: str, lease: Lease) -> None:
        """Keep ``lease`` until `finish(request_id)`, or until it is ``max_age_s`` old."""
        now = self.clock()
        self.expire(now)
        while self._open >= self.capacity and self._order:
            self._drop_oldest(evicted=True)
        self._by_id.setdefault(request_id, deque()).append(lease)
        self._order.append((now, request_id, lease))
        self._open += 1
        self.stats.held += 1

    def finish(self, request_id: str) -> bool:
        """The request ``request_id`` ended: release its oldest held lease. False if none was held."""
        queue = self._by_id.get(request_id)
        while queue:
            lease = queue.popleft()
            if not queue:
                del self._by_id[request_id]
            if lease.released:
                continue
            lease.release()
            self._open -= 1
            self.stats.ended += 1
            return True
        self.stats.unknown_entries += 1
        return False

    def expire(self, now: float | None = None) -> int:
        """Release every lease older than ``max_age_s``; how many were released."""
        limit = (self.clock() if now is None else now) - self.max_age_s
        released = 0
        order = self._order
        while order and (order[0][2].released or order[0][0] <= limit):
            if self._drop_oldest(evicted=False):
                released += 1
        return released

    def release_all(self) -> None:
        """Release every held lease (the picker is stopping)."""
        while self._order:
            self._drop_oldest(evicted=False, count=False)

    def _drop_oldest(self, *, evicted: bool, count: bool = True) -> bool:
        _, request_id, lease = self._order.popleft()
        if lease.released:
            return False
        queue = self._by_id.get(request_id)
        if queue is not None:
            # Both queues are in acquire order, so the oldest lease of an id is at the front of its own queue.
            if queue[0] is lease:
                queue.popleft()
            else:
                queue.remove(lease)
            if not queue:
                del self._by_id[request_id]
        lease.release()
        self._open -= 1
        if count:
            if evicted:
                self.stats.evicted += 1
            else:
                self.stats.expired += 1
        return True


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access-log service: each HTTP entry ends the held lease of its request id.

    Envoy keeps one stream open per worker and sends entries in batches; the handler does O(1) work per entry
    on the routing event loop. ``leases`` is read on every message, so a reload may replace it. `close` ends
    every open stream (the picker is stopping: Envoy then reconnects to whichever picker listens next), so that
    these long-lived streams do not hold the server's shutdown for its whole grace period.
    """

    def __init__(self, leases: Callable[[], OpenLeases]) -> None:
        self._leases = leases
        self._closing: asyncio.Event | None = None

    def close(self) -> None:
        self._closed_event().set()

    def _closed_event(self) -> asyncio.Event:
        if self._closing is None:
            self._closing = asyncio.Event()
        return self._closing

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        self._leases().stats.log_streams += 1
        messages = aiter(request_iterator)
        closing = asyncio.ensure_future(self._closed_event().wait())
        try:
            while True:
                following = asyncio.ensure_future(anext(messages))
                await asyncio.wait((following, closing), return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    break
                try:
                    message = following.result()
                except StopAsyncIteration:
                    break
                leases = self._leases()
                for entry in message.http_logs.log_entry:
                    leases.finish(entry.request.request_id)
        finally:
            closing.cancel()
        return als_pb2.StreamAccessLogsResponse()
