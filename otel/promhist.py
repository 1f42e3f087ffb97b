"""Cumulative TTFT and E2E histograms per endpoint, for ``/metrics`` and Grafana heatmap panels.

Fixed bucket bounds (vLLM's own for TTFT and end-to-end latency, so dashboards built for vLLM read the same), one
`Histogram` per endpoint and metric: memory is fixed by the pool size. inferlb/metrics.py exposes them at scrape
time. One event loop; not thread-safe.
"""

from __future__ import annotations

import math

import numpy as np

from inferlb.scorer.histogram import Histogram

__all__ = ["E2E_BOUNDS_S", "TTFT_BOUNDS_S", "LatencyHistograms"]

TTFT_BOUNDS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BOUNDS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class LatencyHistograms:
    """``observe(endpoint, ttft_s, e2e_s)`` (either may be None; non-finite or negative values are skipped) into
    ``ttft[endpoint]`` and ``e2e[endpoint]``, one `Histogram` each for the endpoints ``0 .. size - 1``."""

    def __init__(self, size: int) -> None:
        self.ttft = [Histogram(TTFT_BOUNDS_S) for _ in range(size)]
        self.e2e = [Histogram(E2E_BOUNDS_S) for _ in range(size)]

    def moved(self, mapping: np.ndarray) -> LatencyHistograms:
        """The histograms of the next pool after a membership change: endpoint j keeps the counts of endpoint
        ``mapping[j]`` here (its series in ``/metrics`` carry on, never reset); one that joined (-1) starts empty."""
        moved = LatencyHistograms(0)
        moved.ttft = [self.ttft[i] if i >= 0 else Histogram(TTFT_BOUNDS_S) for i in np.asarray(mapping).tolist()]
        moved.e2e = [self.e2e[i] if i >= 0 else Histogram(E2E_BOUNDS_S) for i in np.asarray(mapping).tolist()]
        return moved

    def observe(self, endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
            self.ttft[endpoint].observe(ttft_s)
        if e2e_s is not None and math.isfinite(e2e_s) and e2e_s >= 0:
            self.e2e[endpoint].observe(e2e_s)
