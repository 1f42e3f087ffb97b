"""The routing-quality figures of one contender on one trace at one load, the same for the simulator and for the
live gateway: latency quantiles, throughput, prefix-cache hit rate, load imbalance, errors and shed requests."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from inferlb.bench.stats import cv, percentile, rounded
from inferlb.scorer.promtext import read_families

__all__ = ["Outcome", "summarise"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the benchmark saw it. Times in seconds; ``error`` None on success; ``shed``: refused by
    admission control (429), which is a deliberate answer, not an error."""

    server: str
    arrival_s: float
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    error: str | None = None
    shed: bool = False


def _ms(values: Sequence[float], q: float) -> float | None:
    return rounded(percentile(values, q), 2, 1000)


def summarise(
    outcomes: Sequence[Outcome],
    busy_s: Sequence[float],
    prefix_hits: float,
    prefix_queries: float,
) -> dict[str, float | int | None]:
    """The figures of results.json for one run. Throughput counts successful requests over the span from the
    first arrival to the last completion. ``busy_s`` is each server's time spent computing (its coefficient of
    variation is the imbalance: 0 when every server worked equally); ``prefix_*`` are the servers' prefix-cache
    counters over the run, in tokens, as vLLM counts them."""
    ok = [o for o in outcomes if o.error is None and not o.shed]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    start = min((o.arrival_s for o in outcomes), default=0.0)
    end = max((o.arrival_s + (o.e2e_s or 0.0) for o in ok), default=start)
    span = end - start
    return {
        "requests": len(outcomes),
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p90_ms": _ms(ttft, 90),
        "ttft_p99_ms": _ms(ttft, 99),
        "e2e_p50_ms": _ms(e2e, 50),
        "e2e_p99_ms": _ms(e2e, 99),
        "throughput_rps": round(len(ok) / span, 3) if span > 0 else None,
        "output_tokens_per_s": round(sum(o.output_tokens for o in ok) / span, 1) if span > 0 else None,
        "prefix_hit_rate": round(prefix_hits / prefix_queries, 4) if prefix_queries > 0 else None,
        "imbalance_cv": rounded(cv(busy_s), 4),
        "errors": sum(1 for o in outcomes if o.error is not None),
        "shed": sum(1 for o in outcomes if o.shed),
    }


def goodput(points: Sequence[tuple[float, float | None]], slo_ms: float) -> float | None:
    """The highest offered rate (req/s) of a load sweep at which TTFT p99 stayed within ``slo_ms``, from
    ``(rate, ttft_p99_ms)`` points; between the last rate that met the SLO and the first that missed it, the
    crossing is interpolated linearly. None if even the lowest rate missed it."""
    ordered = sorted(points)
    best: float | None = None
    previous: tuple[float, float] | None = None
    for rate, p99 in ordered:
        if p99 is not None and p99 <= slo_ms:
            best, previous = rate, (rate, p99)
            continue
        if previous is not None and p99 is not None and math.isfinite(p99) and p99 > previous[1]:
            r0, y0 = previous
            best = r0 + (rate - r0) * (slo_ms - y0) / (p99 - y0)
        break
    return None if best is None else round(best, 3)


def picker_samples(admin_url: str, name: str) -> dict[str, float]:
    """The samples a picker's ``/metrics`` prints as ``name``, by the value of their one label ("" without one)."""
    text = httpx.get(f"{admin_url}/metrics", timeout=10).text
    return {next(iter(s.labels.values()), ""): s.value for s in read_families(text, [name]).samples(name)}
