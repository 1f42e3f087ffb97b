"""Endpoint weights for Envoy's balancer (scorer/weights.py): in proportion to the profile's scores, at least 1,
none for a draining endpoint, a ramping one scaled by its slow start."""

from __future__ import annotations

import numpy as np

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.membership import Ramp, SlowStart
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.signals import Signals
from inferlb.scorer.weights import MAX_WEIGHT, endpoint_weights


def engine(pool: Pool, clock=lambda: 100.0) -> Engine:
    signals = Signals(len(pool), clock=clock)
    snapshot = signals.snapshot.with_values(
        waiting=[0, 12, 0][: len(pool)],
        running=[2, 20, 2][: len(pool)],
        kv_usage=[0.1, 0.9, 0.1][: len(pool)],
        scraped_at=[100.0] * len(pool),
    )
    signals.publish(snapshot)
    return Engine(pool, build_profile("default", np.random.default_rng(0), size=len(pool)), signals=signals)


def ep(n: int) -> EndpointConfig:
    return EndpointConfig(address=f"10.0.0.{n}:8000")


def test_a_loaded_endpoint_weighs_less_than_an_idle_one_and_the_best_weighs_most() -> None:
    weights = endpoint_weights(engine(Pool([ep(1), ep(2), ep(3)])))
    assert weights[0] == MAX_WEIGHT and weights[2] == MAX_WEIGHT
    assert 1 <= weights[1] < MAX_WEIGHT / 2


def test_a_draining_endpoint_has_no_weight_and_a_ramping_one_is_scaled() -> None:
    ramp = Ramp(SlowStart(ramp_s=10.0, min_fraction=0.2, idle_speedup=1.0), now=100.0)
    pool = Pool([ep(1), ep(2), ep(3)], draining=frozenset({"10.0.0.2:8000"}), ramps={"10.0.0.3:8000": ramp})
    weights = endpoint_weights(engine(pool))
    assert set(weights) == {0, 2}
    assert weights[0] == MAX_WEIGHT and weights[2] == round(MAX_WEIGHT * 0.2)
    assert ramp.offered == 0  # weighing is not a decision: the ramp's thinning is untouched
