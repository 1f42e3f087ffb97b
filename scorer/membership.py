"""Fleet membership: which endpoints the pool holds as discovery sources change their minds, and slow start.

A discovery source (the config file, etcd: `scorer.discovery`) says which endpoints should serve. `Membership.plan`
turns that into the next pool, against the current one and its requests in flight:

* an endpoint that stays keeps its index order, its counters, signals and prefix-index entries (the new pool's
  arrays are the old ones, remapped by `Plan.mapping`);
* an endpoint that joins is appended, with nothing known of it, and gets a slow-start `Ramp`;
* an endpoint that leaves with requests in flight stays as *draining*: it gets no new request, and its state goes
  when its last request ends (`Membership.plan` with the same wish list drops it then: the picker asks every
  `REAP_INTERVAL_S`); one that leaves idle goes at once.

Slow start: a cold server's queue is empty, so a load-aware picker would send it everything at once (herding) into
a cache that holds nothing. A joining endpoint is offered, of the decisions it could serve, a fraction that rises
from ``min_fraction`` to 1 over ``ramp_s`` seconds; the ramp runs ``idle_speedup`` times faster while the
endpoint's metrics show nothing waiting (it is taking its share easily). "Offered" means kept among the candidates;
the profile still chooses among them, so the ramp caps the endpoint's share and never forces traffic onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from inferlb.scorer.pool import Pool

if TYPE_CHECKING:
    from inferlb.scorer.config import EndpointConfig

__all__ = ["REAP_INTERVAL_S", "Membership", "Plan", "Ramp", "SlowStart"]

# How often the picker looks for draining endpoints whose last request has ended.
REAP_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class SlowStart:
    """How a joining endpoint ramps in: from ``min_fraction`` of the decisions it could serve to all of them over
    ``ramp_s`` seconds (0: no ramp), ``idle_speedup`` times faster while nothing waits on it."""

    ramp_s: float = 30.0
    min_fraction: float = 0.1
    idle_speedup: float = 2.0


class Ramp:
    """One joining endpoint's slow start (see the module's docstring). Owned by the routing event loop."""

    __slots__ = ("_at", "_credit", "done", "idle_speedup", "kept", "min_fraction", "offered", "progress_s", "ramp_s")

    def __init__(self, spec: SlowStart, now: float) -> None:
        self.ramp_s = spec.ramp_s
        self.min_fraction = spec.min_fraction
        self.idle_speedup = spec.idle_speedup
        self.progress_s = 0.0
        self.offered = 0  # decisions the endpoint could have served since it joined
        self.kept = 0  # of those, the ones it was left a candidate in
        self.done = not self.ramp_s > 0
        self._at = now
        self._credit = 1.0  # the first decision it could serve keeps it

    def fraction(self, now: float, idle: bool = False) -> float:
        """The share of its decisions the endpoint is offered now (1.0 once the ramp is done); advances the ramp
        by the time since the last call, ``idle_speedup`` times faster when ``idle``."""
        if self.done:
            return 1.0
        elapsed = max(now - self._at, 0.0)
        self._at = now
        self.progress_s += elapsed * (self.idle_speedup if idle else 1.0)
        if self.progress_s >= self.ramp_s:
            self.done = True
            return 1.0
        return self.min_fraction + (1.0 - self.min_fraction) * self.progress_s / self.ramp_s

    def offer(self, now: float, idle: bool = False) -> bool:
        """Whether the endpoint stays a candidate in this decision: deterministic thinning, each decision adding its
        fraction to a credit that one kept decision spends, so that it is kept in the first decision and then in
        its current fraction of them, with no backlog to catch up when the fraction rises."""
        fraction = self.fraction(now, idle)
        self.offered += 1
        self._credit += fraction
        if self.done or self._credit >= 1.0:
            self._credit = max(self._credit - 1.0, 0.0)
            self.kept += 1
            return True
        return False

    def describe(self, now: float) -> dict[str, object]:
        share = 1.0 if self.done else self.min_fraction + (1.0 - self.min_fraction) * self.progress_s / self.ramp_s
        return {"done": self.done, "fraction": round(share, 4), "progress_s": round(self.progress_s, 3)}


def slow_start(pool: Pool, candidates: np.ndarray, now: float, waiting: np.ndarray) -> np.ndarray:
    """``candidates`` without the ramping endpoints their ramps do not offer this decision (all of them if that
    would leave none). ``waiting``: each endpoint's scraped queue (NaN: unknown), which speeds a ramp when 0."""
    dropped: list[int] = []
    present = set(candidates.tolist())
    for index, ramp in pool.ramping:
        if ramp.done or index not in present:
            continue
        if not ramp.offer(now, idle=bool(waiting[index] == 0)):
            dropped.append(index)
    if not dropped or len(dropped) >= len(candidates):
        return candidates
    return candidates[~np.isin(candidates, dropped)]


@dataclass(frozen=True, slots=True)
class Plan:
    """The next pool. ``endpoints``: its endpoints in index order (the config list to build the pool and its
    collectors from); ``mapping[j]``: the index endpoint j had in the old pool (-1: it joined); ``draining``: the
    addresses that left with requests in flight; ``joined``, ``left`` (became draining or went idle) and
    ``removed`` (their state goes now: idle leavers and drained endpoints): addresses, for logs and counters."""

    endpoints: tuple[EndpointConfig, ...]
    mapping: np.ndarray
    draining: frozenset[str]
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # stayed, with other models or labels
    restarted: tuple[int, ...] = ()  # indices (new pool) of endpoints back before they drained: no prefix credit
    ramps: Mapping[str, Ramp] = field(default_factory=dict)  # the ramps of the pool's endpoints that are ramping

    @property
    def moves(self) -> bool:
        """Whether the pool's endpoints (or their order) differ from the old pool's."""
        return bool(self.joined or self.removed) or not np.array_equal(self.mapping, np.arange(len(self.mapping)))

    @property
    def empty(self) -> bool:
        return not (self.joined or self.left or self.removed or self.changed)


@dataclass(slots=True)
class Membership:
    """The slow-start ramps of the endpoints that joined (by address) and the plans between pools; counts what
    changed (``changes``: joined, left, removed, by count). Event-loop owned."""

    slow_start: SlowStart = field(default_factory=SlowStart)
    ramps: dict[str, Ramp] = field(default_factory=dict)
    changes: dict[str, int] = field(default_factory=lambda: {"joined": 0, "left": 0, "removed": 0, "changed": 0})

    def plan(self, pool: Pool, in_flight: np.ndarray, wanted: Sequence[EndpointConfig], now: float) -> Plan:
        """The pool that follows ``pool`` (whose requests in flight are ``in_flight``, aligned with it) when the
        endpoints ``wanted`` should serve. Endpoints that stay keep their order; those that join come last.
        Changes nothing here until `commit`."""
        wished = {e.address: e for e in wanted}
        configs: list[EndpointConfig] = []
        mapping: list[int] = []
        draining: set[str] = set()
        joined: list[str] = []
        left: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        restarted: list[int] = []
        ramps: dict[str, Ramp] = {}
        for endpoint in pool:
            address, config = endpoint.address, wished.get(endpoint.address)
            if config is None:  # not wanted any more
                if not endpoint.draining:
                    left.append(address)
                if in_flight[endpoint.index] > 0:
                    draining.add(address)
                    configs.append(pool.configs[endpoint.index])
                    mapping.append(endpoint.index)
                else:
                    removed.append(address)
                continue
            if endpoint.draining:
                # Back before its last request ended: a restarted server holds no cache, so it ramps in anew.
                joined.append(address)
                restarted.append(len(configs))
                ramps[address] = Ramp(self.slow_start, now)
            elif (config.models, dict(config.labels)) != (endpoint.models, dict(endpoint.labels)):
                changed.append(address)
            configs.append(config)
            mapping.append(endpoint.index)
        present = {e.address for e in pool}
        for config in wanted:
            if config.address not in present:
                joined.append(config.address)
                configs.append(config)
                mapping.append(-1)
                ramps[config.address] = Ramp(self.slow_start, now)
        staying = {c.address for c in configs}
        for address, ramp in self.ramps.items():
            if address in staying and address not in ramps and not ramp.done:
                ramps[address] = ramp
        return Plan(
            tuple(configs),
            np.array(mapping, dtype=np.intp),
            frozenset(draining),
            tuple(joined),
            tuple(left),
            tuple(removed),
            tuple(changed),
            tuple(restarted),
            ramps,
        )

    def pool(self, plan: Plan) -> Pool:
        """The pool a plan describes, with the ramps of its joining endpoints."""
        return Pool(plan.endpoints, draining=plan.draining, ramps=plan.ramps)

    def commit(self, plan: Plan) -> None:
        """The plan is in force: keep its ramps and count its changes. (`plan` changes nothing, so that a plan
        whose pool could not be built leaves no trace.)"""
        self.ramps = dict(plan.ramps)
        for name in ("joined", "left", "removed", "changed"):
            self.changes[name] += len(getattr(plan, name))

    def describe(self, address: str, now: float) -> Mapping[str, object] | None:
        ramp = self.ramps.get(address)
        return None if ramp is None or ramp.done else ramp.describe(now)
