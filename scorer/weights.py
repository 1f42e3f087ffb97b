"""Weights for Envoy's own balancer: the routing tier without a per-request hop.

Every update interval the picker scores its pool as the profile would score a request that names no model and
brings no prompt (so the load, queue, KV-cache, latency and GPU signals count, and prefix affinity does not),
and turns the totals into Envoy endpoint weights: the best endpoint gets ``MAX_WEIGHT``, and each
``HALVING_POINTS`` of total score an endpoint is behind it halves its weight, every one at least 1 (Envoy cannot
weigh an endpoint 0, and an endpoint the filters drop, stale or saturated, is not removed: it keeps the least
share). Exponential, not proportional: the default preset's totals sum eight scorers, most of them neutral for
a request without a prompt, so a server with a long queue still totals about four fifths of an idle one's, and
weights in proportion would barely steer. A ramping endpoint's weight is scaled by its
slow-start fraction. Envoy's LEAST_REQUEST (or round robin) then balances by these weights between updates, on
its own in-flight counts.
"""

from __future__ import annotations

import numpy as np

from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import RoutingError
from inferlb.scorer.features import RequestFeatures

__all__ = ["HALVING_POINTS", "MAX_WEIGHT", "endpoint_weights"]

MAX_WEIGHT = 1000
HALVING_POINTS = 0.25  # a quarter of one scorer's full weight behind the best: half the weight

_PROBE = RequestFeatures()


def endpoint_weights(engine: Engine, now: float | None = None) -> dict[int, int]:
    """Each serving endpoint's weight by index (draining endpoints have none)."""
    pool = engine.pool
    serving = pool.all_indices
    weights = {int(i): 1 for i in serving}
    try:
        candidates, _, totals = engine.rank(_PROBE, thin=False)
    except RoutingError:
        return weights  # nothing passes the filters: equal shares
    top = float(totals.max()) if len(totals) else 0.0
    shares = np.exp2(-(top - totals) / HALVING_POINTS)
    for index, share in zip(candidates.tolist(), shares.tolist(), strict=True):
        weights[index] = max(1, round(MAX_WEIGHT * share))
    clock = engine.signals.clock() if now is None else now
    waiting = engine.signals.snapshot.waiting
    for index, ramp in pool.ramping:
        if index in weights and not ramp.done:
            fraction = ramp.fraction(clock, idle=bool(waiting[index] == 0))
            weights[index] = max(1, round(weights[index] * fraction))
    return weights
