"""Cumulative Prometheus histograms of TTFT and E2E per endpoint, for ``/metrics`` and Grafana heatmap panels.

Fixed bucket bounds (vLLM's own for TTFT and end-to-end latency, so dashboards built for vLLM read the same),
numpy counters per endpoint: memory is fixed by the pool size. One event loop; not thread-safe.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["E2E_BOUNDS_S", "TTFT_BOUNDS_S", "LatencyHistograms"]

TTFT_BOUNDS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BOUNDS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class _Histogram:
    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, size: int, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = np.zeros((size, len(bounds) + 1), dtype=np.int64)  # the last column is +Inf
        self.sums = np.zeros(size)

    def observe(self, endpoint: int, value: float) -> None:
        self.counts[endpoint, bisect.bisect_left(self.bounds, value)] += 1
        self.sums[endpoint] += value


class LatencyHistograms:
    """``observe(endpoint, ttft_s, e2e_s)`` (either may be None; non-finite or negative values are skipped);
    ``render(addresses)`` gives the Prometheus text of both families, one series per endpoint."""

    def __init__(self, size: int) -> None:
        self.ttft = _Histogram(size, TTFT_BOUNDS_S)
        self.e2e = _Histogram(size, E2E_BOUNDS_S)

    def observe(self, endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
            self.ttft.observe(endpoint, ttft_s)
        if e2e_s is not None and math.isfinite(e2e_s) and e2e_s >= 0:
            self.e2e.observe(endpoint, e2e_s)

    def render(self, addresses: Sequence[str]) -> list[str]:
        lines: list[str] = []
        for name, help_text, histogram in (
            ("inferlb_endpoint_ttft_seconds", "Time to first token per endpoint, from the servers' spans.", self.ttft),
            ("inferlb_endpoint_e2e_seconds", "End-to-end latency per endpoint, from the servers' spans.", self.e2e),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            les = [repr(b) for b in histogram.bounds] + ["+Inf"]
            for i, address in enumerate(addresses):
                label = address.replace("\\", "\\\\").replace('"', '\\"')
                cumulative = np.cumsum(histogram.counts[i])
                lines += [
                    f'{name}_bucket{{endpoint="{label}",le="{le}"}} {int(c)}'
                    for le, c in zip(les, cumulative, strict=True)
                ]
                lines.append(f'{name}_sum{{endpoint="{label}"}} {float(histogram.sums[i])!r}')
                lines.append(f'{name}_count{{endpoint="{label}"}} {int(cumulative[-1])}')
        return lines
