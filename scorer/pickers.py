"""Pickers beyond max-score: weighted random and power of two choices. Both draw from their own generator."""

from __future__ import annotations

import numpy as np

from inferlb.scorer.features import RequestFeatures

__all__ = ["PowerOfTwoPicker", "WeightedRandomPicker"]


class WeightedRandomPicker:
    """Picks at random with probability proportional to the total score (uniformly when all are 0): spreads
    load in proportion to quality instead of sending everything to the one best endpoint."""

    name = "weighted-random"

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self._rng = rng if rng is not None else np.random.default_rng()

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int:
        n = len(totals)
        if n == 1:
            return 0
        weights = np.maximum(totals, 0.0)
        total = weights.sum()
        if not total > 0:
            return int(self._rng.integers(n))
        return int(np.searchsorted(np.cumsum(weights), self._rng.random() * total, side="right").clip(0, n - 1))


class PowerOfTwoPicker:
    """Draws two distinct candidates at random and keeps the one with the higher total (the first on a tie):
    nearly as good as the best while never herding every request onto one endpoint between two scrapes."""

    name = "power-of-two"

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self._rng = rng if rng is not None else np.random.default_rng()

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int:
        n = len(totals)
        if n == 1:
            return 0
        a, b = self._rng.choice(n, size=2, replace=False)
        return int(a if totals[a] >= totals[b] else b)
