"""Routing policies for the discrete-event simulator (`inferlb.sim.des`), the DES half of the routing-quality
benchmark: Envoy's balancers as Envoy implements them, random, every inferlb preset run through the real scoring
engine, and an oracle that reads the servers' exact state.

A DES policy is ``policy(arrival, view) -> server``. `PresetPolicy` turns the fleet view (stale scrapes plus the
policy's own in-flight counts, what a live picker sees) into the engine's signals snapshot and asks
`scorer.engine.Engine.decide`, the same call the ext_proc filter makes; its ``finished`` hook feeds completed
requests' TTFT and E2E into the latency statistics, as the servers' spans do live (spans arrive when a request
ends). Prompt token counts are exact here, where the live filter estimates them from the text.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np

from inferlb.otel.latency import EndpointLatency
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import PREFIX_BLOCK_TOKENS, RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.registry import ProfileSpec
from inferlb.scorer.signals import Signals, Snapshot
from inferlb.sim.des import Arrival, FleetView, RequestRecord
from inferlb.sim.profiles import Profile

__all__ = ["MODEL", "LeastRequest", "Oracle", "PresetPolicy", "RandomPolicy", "RoundRobin"]

MODEL = "bench-model"


class RoundRobin:
    """Envoy's ROUND_ROBIN over equal weights: each server in turn."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        i = self._next % len(view.servers)
        self._next = i + 1
        return i


class LeastRequest:
    """Envoy's LEAST_REQUEST over equal weights: the fewer active requests of ``choices`` random servers (Envoy's
    default choice count is 2). Active requests are Envoy's own count, here the policy's in-flight count."""

    def __init__(self, seed: int, choices: int = 2) -> None:
        self._rng = random.Random(seed)
        self._choices = choices

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        n = len(view.servers)
        picks = [self._rng.randrange(n) for _ in range(self._choices)]
        return min(picks, key=lambda i: view.inflight[i])


class RandomPolicy:
    """Envoy's RANDOM: uniform."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        return self._rng.randrange(len(view.servers))


class Oracle:
    """The bound: reads each engine's exact state (which a real router cannot) and sends the request where its
    first token would come soonest by a work estimate: the prefill work queued ahead of it (waiting prompts, less
    what their prefixes hit, plus the unfinished prefill of running requests), plus this request's prefill less
    what that server's prefix cache holds right now, divided by the server's prefill rate; decode work adds
    per running request. Greedy per request, not a schedule: it is a strong reference, not a proof of optimality.
    """

    def __init__(self, profiles: Sequence[Profile]) -> None:
        # Seconds per prefill token and per running sequence-step, from each server's step-time model.
        self._prefill_s = [p.step_time(8192, 0, 0, 0) / 8192 for p in profiles]
        self._decode_s = [p.step_time(0, 0, 1, 2048) for p in profiles]

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        best, best_cost = 0, float("inf")
        for i, engine in enumerate(view.engines):
            if not engine.ready or engine.hung:
                continue
            queued = sum(r.prompt_tokens - r.computed for r in engine.waiting)
            queued += sum(max(0, r.prompt_tokens - r.computed) for r in engine.running)
            hit_blocks, _ = engine.cache.match(arrival.prompt_hashes, len(arrival.prompt_hashes))
            own = max(0, arrival.prompt_tokens - hit_blocks * engine.cache.block_size)
            cost = (queued + own) * self._prefill_s[i] * engine.slowdown
            cost += len(engine.running) * self._decode_s[i] * engine.slowdown
            if cost < best_cost:
                best, best_cost = i, cost
        return best


class PresetPolicy:
    """An inferlb preset (or profile spec), deciding through the real engine from what a picker would see."""

    def __init__(
        self,
        preset: str | ProfileSpec,
        profiles: Sequence[Profile],
        *,
        seed: int,
        stale_after_s: float = 1.0,
        half_life_s: float = 10.0,
    ) -> None:
        n = len(profiles)
        endpoints = [EndpointConfig(f"10.0.{i // 250}.{i % 250 + 1}:8000", frozenset({MODEL})) for i in range(n)]
        self.pool = Pool(endpoints)
        self._now = 0.0  # the simulator's clock at the current decision
        self.inflight = InFlight(n, clock=lambda: self._now)
        self.signals = Signals(n, stale_after_s=stale_after_s)
        profile = build_profile(preset, np.random.default_rng(seed), size=n)
        self.engine = Engine(self.pool, profile, self.inflight, self.signals)
        self.latency = EndpointLatency(n, window_s=60.0, half_life_s=half_life_s)
        total = np.array([p.gpu_memory_bytes * p.gpu_count for p in profiles], dtype=float)
        # What never changes: the KV cache's size, and GPU memory (vLLM pre-allocates its share at start-up).
        self._fixed = Snapshot.empty(n).with_values(
            kv_tokens=[p.num_gpu_blocks * p.block_size for p in profiles],
            gpu_total_bytes=total,
            gpu_free_bytes=total * (1 - np.array([p.gpu_memory_utilization for p in profiles])),
        )
        self._block_step = [max(1, PREFIX_BLOCK_TOKENS // p.block_size) for p in profiles]
        self._scraped: list[float] = [-1.0] * n
        self._sent_at_scrape = np.full(n, np.nan)
        self._latency_dirty = False
        self.decide_cpu_s = 0.0  # CPU time in Engine.decide alone: the picker's per-request work
        self.decisions = 0

    def __call__(self, arrival: Arrival, view: FleetView) -> int:
        self._sync(view)  # the collectors' work in a live picker, not the request's
        step = self._block_step[0]
        features = RequestFeatures(
            path="/v1/completions",
            method="POST",
            request_id=arrival.id,
            model=MODEL,
            stream=True,
            max_tokens=arrival.output_tokens,
            prompt_chars=arrival.prompt_tokens * 4,
            prompt_tokens=arrival.prompt_tokens,
            # The servers' block hashes are chained, so every step-th one is a chained hash of 64-token blocks.
            prefix_hashes=tuple(arrival.prompt_hashes[step - 1 :: step]),
        )
        started = time.process_time()
        index = self.engine.decide(features).endpoint.index
        self.decide_cpu_s += time.process_time() - started
        self.decisions += 1
        # As the filter does once the request goes (the counts are the simulator's, set again on the next call).
        self.inflight.acquire(index, arrival.prompt_tokens)
        return index

    def finished(self, record: RequestRecord, now: float) -> None:
        """A request ended (its span would reach the picker now): feed its latencies to the statistics."""
        if record.error is None:
            self.latency.observe(record.server, record.ttft_s, record.e2e_s, now=now)
            self._latency_dirty = True

    def _sync(self, view: FleetView) -> None:
        """Publish a snapshot when a scrape or a latency changed, with ages mapped onto the monotonic clock."""
        self._now = view.now
        self.inflight.requests[:] = view.inflight
        self.inflight.tokens[:] = view.inflight_tokens
        snaps = view.snapshots
        changed = self._latency_dirty
        for i, snap in enumerate(snaps):
            if snap is not None and snap.scraped_at != self._scraped[i]:
                self._scraped[i] = snap.scraped_at
                # Exact here: nothing was sent between that scrape and this decision.
                self._sent_at_scrape[i] = self.inflight.sent[i]
                changed = True
        if not changed:
            return
        self._latency_dirty = False
        n = len(snaps)
        now_mono = time.monotonic()
        nan = np.full(n, np.nan)
        running, waiting, kv_usage, util, scraped = (nan.copy() for _ in range(5))
        for i, snap in enumerate(snaps):
            if snap is None:
                continue
            running[i], waiting[i], kv_usage[i] = snap.running, snap.waiting, snap.kv_cache_usage
            util[i] = snap.gpu_utilization
            scraped[i] = now_mono - (view.now - snap.scraped_at)
        arrays = self.latency.arrays(now=view.now)
        self.signals.publish(
            self._fixed.with_values(
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                gpu_util=util,
                ttft_s=arrays["ttft_ewma"],
                e2e_s=arrays["e2e_ewma"],
                scraped_at=scraped,
                sent_at_scrape=self._sent_at_scrape,
            )
        )
