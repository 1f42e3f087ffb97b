"""When an endpoint is saturated: the one rule that admission control and the ``saturation`` filter share.

An endpoint is saturated when its latest metrics show more than ``max_waiting`` queued requests or KV-cache use
above ``max_kv_usage``. The queue counted is the scraped one plus the growth since that scrape began of the
requests this picker has in flight there (`InFlight.requests` against `Snapshot.inflight_at_scrape`): the queue
cannot have grown by more than the requests sent since, less those that ended. On the scraped queue alone, the few
endpoints under the threshold at the last scrape would take every request until the next one: at full load that
herding put 130 of 358 requests in half a second onto one of 16 servers in the simulator, and raised the
time-to-first-token p99 2.5 times. Counting every request sent since the scrape, finished or not, saturated servers
that answer fast (more than ``max_waiting`` short requests per endpoint between two scrapes); counting the requests
sent since that were still in flight saturated servers that simply run many requests at once: 64 clients on 4
servers put 16 in flight on each, and the few ends not yet reported (Envoy's access log sends them in batches) took
each over 16, so requests waited in admission while the servers had nothing queued (the hop benchmark: the picker's
CPU per request at concurrency 64 rose by a fifth). Unknown values are not over.

On a fleet of unequal servers (the config's ``pool.speeds``) the queue limit is a time: an endpoint's limit is
``max_waiting`` times its declared relative speed over the fastest endpoint's, so that a queue counts as long when
the fastest server would take as long to clear it. With one limit for all, the slow servers were the unsaturated
ones whenever a burst filled the fast ones, and the ``saturation`` filter sent them the burst (in the simulator, 8
H100s, 4 A100s and 4 L4s on the Azure code trace: TTFT p99 1.3-1.4x the oracle's; bench/results/quality/fleets).

Freshness is not part of the rule: admission counts a stale endpoint as saturated (unless every candidate is
stale), and the staleness filter drops stale endpoints (`Signals.fresh_until`).
"""

from __future__ import annotations

import math

import numpy as np

from inferlb.scorer.inflight import InFlight
from inferlb.scorer.signals import Signals, Snapshot

__all__ = ["Saturation"]


class Saturation:
    """The thresholds (the config's ``admission`` section) and, per scrape, each endpoint's limit. One event loop."""

    def __init__(
        self, max_waiting: float = 16, max_kv_usage: float = 0.95, *, speeds: np.ndarray | None = None
    ) -> None:
        if not max_waiting >= 0:
            raise ValueError(f"max_waiting must be >= 0; got {max_waiting!r}")
        if not 0 < max_kv_usage <= 1:
            raise ValueError(f"max_kv_usage must be in (0, 1]; got {max_kv_usage!r}")
        if speeds is not None and not (len(speeds) and np.isfinite(speeds).all() and (speeds > 0).all()):
            raise ValueError("speeds must be positive numbers, one per endpoint")
        self.max_waiting = max_waiting
        self.max_kv_usage = max_kv_usage
        # Per endpoint (or one for all): the queued requests past which it is saturated (see the module docstring).
        self.waiting_limit: float | np.ndarray = (
            max_waiting if speeds is None else max_waiting * np.asarray(speeds, dtype=float) / float(np.max(speeds))
        )
        self._for: Snapshot | None = None
        # Per endpoint, the InFlight.requests count past which it is saturated: -inf when the scrape already says so,
        # +inf when its queue is unknown or the scrape did not note what was in flight.
        self._limit = np.zeros(0)
        # The last answer: for which snapshot and counters, at which decision and lowered count, and for how many
        # decisions more it holds (see `over`).
        self._over_for: tuple[Snapshot, InFlight] | None = None
        self._over_at = 0
        self._lowered_at = 0
        self._holds_for = -math.inf
        self._over = np.zeros(0, dtype=bool)
        self._any = False

    def over(self, signals: Signals, inflight: InFlight) -> np.ndarray:
        """Per endpoint of the pool: saturated now (read-only). Computed again only when it may have changed, so
        that admission and the filter of one request, and requests in a row, share it."""
        self._refresh(signals, inflight)
        return self._over

    def any_over(self, signals: Signals, inflight: InFlight) -> bool:
        """Whether any endpoint of the pool is saturated now (``over(...).any()``, computed with it)."""
        self._refresh(signals, inflight)
        return self._any

    def _refresh(self, signals: Signals, inflight: InFlight) -> None:
        snapshot = signals.snapshot
        cached = self._over_for
        # Every decision adds one to one endpoint's `InFlight.requests`, and nothing else raises it (the peers' counts
        # add at most what they sent, which counts as decisions), so an endpoint under by h requests stays under for
        # h more decisions; one over stays over until a count falls (`InFlight.lowered`: a request ended), which
        # matters only while one is over.
        if (
            cached is not None
            and cached[0] is snapshot
            and cached[1] is inflight
            and inflight.decisions - self._over_at <= self._holds_for
            and (not self._any or inflight.lowered == self._lowered_at)
        ):
            return
        if snapshot is not self._for:  # once per scrape, not once per pick
            waiting_limit = self.waiting_limit
            if isinstance(waiting_limit, np.ndarray) and len(waiting_limit) != len(snapshot.waiting):
                waiting_limit = self.max_waiting  # a snapshot of another pool: the speeds are not its endpoints'
            room = np.where(np.isnan(snapshot.waiting), math.inf, waiting_limit - snapshot.waiting)
            base = snapshot.inflight_at_scrape
            with np.errstate(invalid="ignore"):  # -inf + inf where the queue is infinite: over anyway
                limit = room + np.where(np.isnan(base), math.inf, base)
            self._limit = np.where(snapshot.over(waiting_limit, self.max_kv_usage), -math.inf, limit)
            self._for = snapshot
        requests = inflight.requests
        over = requests > self._limit  # in flight now - in flight at the scrape > the queue's room at the scrape
        over.setflags(write=False)
        self._over = over
        self._any = bool(over.any())
        # The fewest requests by which an endpoint is under (inf: none can reach saturation).
        self._holds_for = float(np.minimum.reduce(self._limit - requests, where=~over, initial=math.inf))
        self._over_for = (snapshot, inflight)
        self._over_at = inflight.decisions
        self._lowered_at = inflight.lowered
