"""Filters on server state. Each drops candidates that should not get the request; none ever empties the list
on its own judgement of load: when every candidate would be dropped, all are kept (a pick on imperfect data
beats a 503 while servers may well be able to serve)."""

from __future__ import annotations

import math

import numpy as np

from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.loadscorers import TtftPredictor

__all__ = ["MemoryFitFilter", "SaturationFilter", "StalenessFilter", "TtftSloFilter"]


def _keep(candidates: np.ndarray, keep: np.ndarray) -> np.ndarray:
    return candidates[keep] if keep.any() else candidates


class StalenessFilter:
    """Drops endpoints whose metrics are stale (no successful scrape within the signals' ``stale_after_s``, or
    the last scrape failed): a stale endpoint counts as saturated. If every candidate is stale, keeps them all."""

    name = "staleness"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        signals = state.signals
        now = signals.clock()
        if now <= signals.all_fresh_until or now > signals.any_fresh_until:  # all fresh, or none: keep all
            return candidates
        return _keep(candidates, signals.fresh_until[candidates] >= now)


class SaturationFilter:
    """Drops saturated endpoints, by the rule admission control uses (`Saturation`, configured once in the
    config's ``admission`` section): more than ``max_waiting`` queued requests, counting those sent since the
    scrape began, or KV-cache use above ``max_kv_usage``. Unknown values pass. If every candidate is saturated,
    keeps them all."""

    name = "saturation"

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        saturation = state.saturation
        if not saturation.any_over(state.signals, state.inflight):
            return candidates
        return _keep(candidates, ~saturation.over(state.signals, state.inflight)[candidates])


class MemoryFitFilter:
    """Drops endpoints whose free GPU memory is below ``margin`` x the request's estimated KV memory
    (prompt + max output tokens, x ``bytes_per_token``). Unknown memory passes. If none fits, keeps all."""

    name = "memory-fit"

    def __init__(self, bytes_per_token: float = 131072, margin: float = 1.3, default_output_tokens: int = 256) -> None:
        self.bytes_per_token = bytes_per_token
        self.margin = margin
        self.default_output_tokens = default_output_tokens

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        free = state.signals.snapshot.gpu_free_bytes[candidates]
        output = request.max_tokens if request.max_tokens is not None else self.default_output_tokens
        need = self.margin * self.bytes_per_token * (request.prompt_tokens + output)
        fits = np.isnan(free) | (free >= need)
        return _keep(candidates, fits) if not math.isnan(need) else candidates


class TtftSloFilter:
    """Drops endpoints predicted to miss the request's time-to-first-token objective (its class's
    ``ttft_slo_s``; see `TtftPredictor` for the prediction). Requests without an objective pass untouched. If
    every candidate would miss it, keeps them all: the scorers then choose the least bad."""

    name = "ttft-slo"

    def __init__(self, prefix_match: object | None = None, block_tokens: int = 64, guard: float = 2.0) -> None:
        self.predictor = TtftPredictor(prefix_match, block_tokens, guard)

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        slo = request.ttft_slo_s
        if slo is None:
            return candidates
        return _keep(candidates, self.predictor.seconds(request, state, candidates) <= slo)

    def prefill(self, request: RequestFeatures, endpoint: int) -> tuple[float, float] | None:
        return self.predictor.prefill(request, endpoint)
