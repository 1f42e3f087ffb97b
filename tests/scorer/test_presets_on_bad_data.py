"""Every preset gives a valid decision on fleets whose signals are missing, stale, zero or garbage."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import PRESET_NAMES, build_profile
from inferlb.scorer.signals import Signals

N = 5
NAN, INF = math.nan, math.inf


def fleet(kind: str) -> Signals:
    signals = Signals(N, stale_after_s=1.0)
    now = time.monotonic()
    if kind == "missing":
        return signals  # never scraped: everything NaN, everything stale
    values: dict[str, list[float] | list[bool]] = {"scraped_at": [now] * N}
    if kind == "stale":
        values["scraped_at"] = [now - 60] * N
        values["running"] = [1, 2, 3, 4, 5]
    elif kind == "some-stale-some-down":
        values["scraped_at"] = [now, now - 60, now, now, now]
        values["up"] = [True, True, False, True, True]
        values["waiting"] = [0, 0, 0, 9, 1]
    elif kind == "zero":
        for name in ("running", "waiting", "kv_usage", "kv_tokens", "gpu_util", "gpu_free_bytes", "gpu_total_bytes"):
            values[name] = [0.0] * N
        values["ttft_s"] = [0.0] * N
        values["prefill_tokens_per_s"] = [0.0] * N
    elif kind == "garbage":
        values["running"] = [-3, INF, NAN, 1e300, 2]
        values["waiting"] = [NAN, -1, INF, 0, 1e9]
        values["kv_usage"] = [7.0, -2.0, NAN, INF, 0.5]
        values["gpu_util"] = [2.0, NAN, -1, 0.5, INF]
        values["gpu_free_bytes"] = [-5, INF, NAN, 1e12, 0]
        values["gpu_total_bytes"] = [0, 0, NAN, 1e12, -1]
        values["ttft_s"] = [-1, 0, NAN, INF, 1e-300]
        values["e2e_s"] = [INF, NAN, 0, -4, 3]
        values["prefill_tokens_per_s"] = [-1, 0, NAN, INF, 1e-300]
    elif kind == "all-saturated":
        values["waiting"] = [100] * N
        values["kv_usage"] = [0.99] * N
    signals.publish(signals.snapshot.with_values(**values))
    return signals


REQUESTS = [
    RequestFeatures(model="m", prompt_tokens=1000, max_tokens=200, prefix_hashes=tuple(range(40))),
    RequestFeatures(model="m", prompt_tokens=0, session_key="user-7"),
    RequestFeatures(model=None),  # a headers-only route
]


@pytest.mark.parametrize("kind", ["missing", "stale", "some-stale-some-down", "zero", "garbage", "all-saturated"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_decides_on_bad_data(preset: str, kind: str) -> None:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(N)])
    engine = Engine(pool, build_profile(preset, np.random.default_rng(0), size=N), signals=fleet(kind))
    for _ in range(20):
        for request in REQUESTS:
            decision = engine.decide(request)
            assert 0 <= decision.endpoint.index < N
            assert np.isfinite(decision.totals).all()
            assert all(0.0 <= s <= 1.0 for s in decision.scores.values()), decision.scores
    assert not engine.scorer_errors, dict(engine.scorer_errors)
