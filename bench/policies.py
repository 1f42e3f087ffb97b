"""Routing policies for the discrete-event simulator (`inferlb.sim.des`), the DES half of the routing-quality
benchmark: Envoy's balancers as Envoy implements them, random, every inferlb preset run through the routing unit
Envoy's requests take, and an oracle that reads the servers' exact state.

A DES policy is ``policy(arrival, view) -> server`` (or `Hold`/`Refuse`). `PresetPolicy` turns the fleet view
(stale scrapes, what a live picker's collectors see) into the engine's signals snapshot and routes through
`scorer.router.Router`, the same admission, decision and in-flight lease as the ext_proc service, on the
simulator's clock; its ``finished`` hook ends the request's lease and feeds its TTFT and E2E into the latency
statistics, as Envoy's access log and the servers' spans do live (both arrive when a request ends). Prompt token
counts are exact here, where the live filter estimates them from the text.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections.abc import Mapping, Sequence

import numpy as np

from inferlb.otel.latency import EndpointLatency
from inferlb.scorer.classes import Classifier, Waiter
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.experiments import Experiments, ExperimentSpec
from inferlb.scorer.features import PREFIX_BLOCK_TOKENS, RequestFeatures
from inferlb.scorer.inflight import InFlight, Lease, Load
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.registry import ProfileSpec
from inferlb.scorer.router import ADMISSION_POLL_S, Admit, Router
from inferlb.scorer.saturation import Saturation
from inferlb.scorer.signals import Signals, Snapshot
from inferlb.scorer.speeds import ServerSpeeds, SpeedHints
from inferlb.scorer.weights import endpoint_weights
from inferlb.sim.des import Arrival, FleetView, Hold, Refuse, RequestRecord
from inferlb.sim.profiles import ServerProfile

__all__ = [
    "MODEL",
    "LeastRequest",
    "Oracle",
    "PresetPolicy",
    "RandomPolicy",
    "Replicated",
    "RoundRobin",
    "WeightsTier",
]

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

    def __init__(self, profiles: Sequence[ServerProfile]) -> None:
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


PROFILE_LABEL = "inferlb.io/profile"  # the simulated endpoints' label naming their server profile


def declared_hints(profiles: Sequence[ServerProfile]) -> SpeedHints:
    """The relative speeds an operator would declare for these profiles (`pool.speeds`): the prefill rate the
    hardware's compute allows, its dense BF16 FLOPS at the profile's utilisation over the model's FLOPs per token
    (``1 / prefill_token_s``), which a spec sheet and the model card give."""
    return SpeedHints(PROFILE_LABEL, {p.name: 1.0 / p.prefill_token_s for p in profiles})


class PresetPolicy:
    """An inferlb preset (or profile spec) routed by the routing unit (`scorer.router.Router`) the ext_proc service
    uses, from what a picker would see, on the simulator's clock: admission (a request held for capacity is
    presented again at the next tick of the wait queue, ``poll_s``), the decision, the in-flight lease with its
    prefill backlog, and the lease's release when the request ends (``finished``). The config's defaults apply:
    one request class that waits up to 0.5 s, saturation at 16 queued requests or 95% KV-cache use."""

    def __init__(
        self,
        preset: str | ProfileSpec,
        profiles: Sequence[ServerProfile],
        *,
        seed: int,
        stale_after_s: float = 1.0,
        half_life_s: float = 10.0,
        classifier: Classifier | None = None,
        saturation: Saturation | None = None,
        poll_s: float = ADMISSION_POLL_S,
        experiments: Sequence[ExperimentSpec] = (),
        labels: Sequence[Mapping[str, str]] | None = None,
        learn_speeds: bool = True,
        kv_events: bool = False,
        declared_speeds: bool = True,
        first_tokens: bool = False,
    ) -> None:
        n = len(profiles)
        # Each endpoint is labelled with its profile, and the profiles' relative speeds are declared (`pool.speeds`)
        # as an operator would from the spec sheets (`declared_speeds`).
        endpoints = [
            EndpointConfig(
                f"10.0.{i // 250}.{i % 250 + 1}:8000",
                frozenset({MODEL}),
                {**(labels[i] if labels else {}), PROFILE_LABEL: profiles[i].name},
            )
            for i in range(n)
        ]
        self.pool = Pool(endpoints)
        self._now = 0.0  # the simulator's clock at the current decision

        def clock() -> float:
            return self._now

        self.signals = Signals(n, stale_after_s=stale_after_s, clock=clock)
        # With KV events, each server's cache tells the exact index what it stores and evicts, as vLLM's events do
        # live (here with no delay); the simulator's block hashes are keys the requests carry as they are.
        self._kv_listening = False
        if kv_events:
            sizes = {p.block_size for p in profiles}
            if len(sizes) != 1:
                raise ValueError(f"KV events need one block size across the fleet, not {sorted(sizes)}")
            self.signals.kv = KVBlockIndex(n, clock=clock, block_size=sizes.pop())
            for endpoint in range(n):
                self.signals.kv.subscribed(endpoint, True)
        self.inflight = InFlight(n, clock=clock)
        # With the filter timing the responses (otel.latency_source: stream), each request's first token reaches
        # its lease, and the prefill backlog is exact: the leases are told at the first decision after it.
        self.inflight.first_tokens = first_tokens
        self._prefilling: list[set[str]] | None = [set() for _ in range(n)] if first_tokens else None
        hints = declared_hints(profiles) if declared_speeds else None
        relative = None if hints is None else hints.of([e.labels for e in self.pool])
        profile = build_profile(preset, np.random.default_rng(seed), size=n, speeds=relative)
        if saturation is None:  # the config's defaults, with the declared speeds as the picker passes them
            saturation = Saturation(speeds=relative)
        self.engine = Engine(self.pool, profile, self.inflight, self.signals, saturation)
        # Experiments run as live: their arms' engines share this state, their statistics run on this clock.
        self.experiments = (
            Experiments.over(
                self.engine, experiments, lambda name: name, np.random.default_rng(seed + 1), speeds=relative
            )
            if experiments
            else None
        )
        # The servers' speeds, learned from the requests' timings as the live picker learns them.
        self.speeds = ServerSpeeds(n, clock, relative=relative) if learn_speeds else None
        self.router = Router(self.engine, classifier, poll_s=poll_s, experiments=self.experiments, speeds=self.speeds)
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
        self._inflight_at_scrape = np.full(n, np.nan)
        self._latency_dirty = False
        self._leases: dict[str, Lease] = {}
        self._routed_at: dict[str, float] = {}
        self._held: dict[str, tuple[Admit, Waiter]] = {}
        self._ticked = -1.0  # the last tick of the wait queue
        self.decide_cpu_s = 0.0  # CPU time in the routing unit alone: the picker's per-request work
        self.decisions = 0
        self.held = self.waited_out = self.refused = 0

    def __call__(self, arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        self._sync(view)  # the collectors' work in a live picker, not the request's
        started = time.process_time()
        try:
            return self._route(arrival)
        finally:
            self.decide_cpu_s += time.process_time() - started

    def _route(self, arrival: Arrival) -> int | Hold | Refuse:
        router = self.router
        held = self._held.get(arrival.id)
        if held is None:
            admit = router.admit(self._features(arrival))
            if admit.verdict == "shed":
                self.refused += 1
                return Refuse("shed")
            if admit.verdict == "wait":
                assert admit.candidates is not None
                rc = admit.request_class
                self._held[arrival.id] = (admit, router.queue.enter(admit.candidates, rc.priority, rc.max_wait_s))
                self.held += 1
                return Hold(self._next_tick())
            request, saturated = admit.request, False
        else:
            admit, waiter = held
            if self._ticked != self._now:  # the queue's tick at this moment, once
                self._ticked = self._now
                router.queue.release()
            if waiter.outcome is None:
                return Hold(self._next_tick())
            del self._held[arrival.id]
            request, saturated = admit.request, not waiter.outcome
            self.waited_out += saturated
        routed = router.route(request, saturated=saturated)
        self.decisions += 1
        self._leases[arrival.id] = routed.lease
        if self._prefilling is not None and routed.lease.unprefilled:
            self._prefilling[routed.lease.index].add(arrival.id)
        if self.speeds is not None:
            self._routed_at[arrival.id] = self._now
        return routed.decision.endpoint.index

    def _features(self, arrival: Arrival) -> RequestFeatures:
        step = self._block_step[0]
        return RequestFeatures(
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
            cache_keys=tuple(arrival.prompt_hashes) if self.signals.kv is not None else (),
        )

    def _first_tokens(self, view: FleetView) -> None:
        """Tell the leases of the requests whose first token came since the last decision (the observing stream's
        report, live)."""
        assert self._prefilling is not None
        for server, waiting in enumerate(self._prefilling):
            if waiting:
                for request in view.engines[server].running:
                    if request.first_token_at is not None and request.id in waiting:
                        waiting.discard(request.id)
                        self._leases[request.id].first_token()

    def _next_tick(self) -> float:
        poll = self.router.queue.poll_s
        return (math.floor(self._now / poll + 1e-9) + 1) * poll

    def finished(self, record: RequestRecord, now: float) -> None:
        """A request ended (Envoy's access log, and its span, would reach the picker now): release its lease and
        feed its latencies to the statistics."""
        lease = self._leases.pop(record.id, None)
        if lease is not None:
            lease.release()
            if self._prefilling is not None:
                self._prefilling[lease.index].discard(record.id)
        routed_at = self._routed_at.pop(record.id, None)
        if record.error is None:
            self.latency.observe(record.server, record.ttft_s, record.e2e_s, now=now)
            self._latency_dirty = True
            if self.speeds is not None and routed_at is not None and record.ttft_s is not None:
                # Timed from the decision, as the server's span and the filter time it: a hold is not the server's.
                waited = routed_at - record.arrival_s
                self._now = now
                e2e = None if record.e2e_s is None else record.e2e_s - waited
                self.speeds.observed(record.id, record.ttft_s - waited, e2e, record.output_tokens)
        if self.experiments is not None:
            self._now = now
            self.report(self.experiments, record)

    def report(self, experiments: Experiments, record: RequestRecord) -> None:
        """Tell the experiments a request's outcome, as the filter's timing of its response does live."""
        failed = record.error is not None and record.error != "shed"
        if not failed and record.ttft_s is not None:
            experiments.first_token(record.id, record.ttft_s)
        experiments.outcome(record.id, failed=failed, e2e_s=record.e2e_s)

    def _sync(self, view: FleetView) -> None:
        """Publish a snapshot when a scrape or a latency changed (the collectors' work)."""
        self._now = view.now
        if self._prefilling is not None:
            self._first_tokens(view)
        kv = self.signals.kv
        if kv is not None:
            if not self._kv_listening:
                self._kv_listening = True
                for endpoint, engine in enumerate(view.engines):
                    listener = engine.cache.listener
                    if isinstance(listener, _CacheEvents):  # another replica follows this server too
                        listener.indices.append(kv)
                    else:
                        engine.cache.listener = _CacheEvents([kv], endpoint)
            kv.tick()
        snaps = view.snapshots
        changed = self._latency_dirty
        for i, snap in enumerate(snaps):
            if snap is not None and snap.scraped_at != self._scraped[i]:
                self._scraped[i] = snap.scraped_at
                # Nothing was sent between that scrape and this decision; a request that ended since lowers the base
                # by one, and the rule errs towards saturated.
                self._inflight_at_scrape[i] = self.inflight.requests[i]
                changed = True
        if not changed:
            return
        self._latency_dirty = False
        n = len(snaps)
        nan = np.full(n, np.nan)
        running, waiting, kv_usage, util, scraped = (nan.copy() for _ in range(5))
        for i, snap in enumerate(snaps):
            if snap is None:
                continue
            running[i], waiting[i], kv_usage[i] = snap.running, snap.waiting, snap.kv_cache_usage
            util[i] = snap.gpu_utilization
            scraped[i] = snap.scraped_at
        arrays = self.latency.arrays(now=view.now)
        speeds = self.speeds
        learned = (
            {}
            if speeds is None
            else {
                "prefill_tokens_per_s": speeds.prefill_tokens_per_s(),
                "decode_step_s": speeds.decode_step_s(),
                "peak_tokens_per_s": speeds.peak_tokens_per_s(),
            }
        )
        self.signals.publish(
            self._fixed.with_values(
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                gpu_util=util,
                ttft_s=arrays["ttft_ewma"],
                e2e_s=arrays["e2e_ewma"],
                scraped_at=scraped,
                inflight_at_scrape=self._inflight_at_scrape,
                **learned,
            )
        )


class _CacheEvents:
    """One simulated server's KV events, straight into the exact index of every picker that follows it (its block
    hashes serve as the keys)."""

    def __init__(self, indices: list[KVBlockIndex], endpoint: int) -> None:
        self.indices, self.endpoint = indices, endpoint

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        for index in self.indices:
            index.store(self.endpoint, hashes, hashes)

    def removed(self, hashes: list[int]) -> None:
        for index in self.indices:
            index.remove(self.endpoint, hashes)

    def cleared(self) -> None:
        for index in self.indices:
            index.clear(self.endpoint)


class WeightsTier(PresetPolicy):
    """inferlb's weights tier: no per-request pick. Every ``interval_s`` the picker computes endpoint weights from
    its preset's scores (`scorer.weights.endpoint_weights`, the code the picker pushes to Envoy with) on what it
    sees without a hop: the scraped signals and the latencies of finished requests, no in-flight counts of its
    own. Between updates Envoy's LEAST_REQUEST balances by those weights on its own active-request counts, the
    way Envoy does with unequal weights: an earliest-deadline schedule on ``weight / (active + 1)``, modelled as
    a smooth weighted round robin on those effective weights."""

    def __init__(self, preset: str, profiles: Sequence[ServerProfile], *, seed: int, interval_s: float = 1.0) -> None:
        super().__init__(preset, profiles, seed=seed)
        self.interval_s = interval_s
        n = len(profiles)
        self._weights = np.ones(n)
        self._credit = np.zeros(n)
        self._active = np.zeros(n)
        self._updated = -math.inf
        self._servers: dict[str, int] = {}
        self.updates = 0

    def __call__(self, arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        self._sync(view)
        started = time.process_time()
        try:
            if view.now - self._updated >= self.interval_s:  # the picker's weights push (its CPU, not Envoy's)
                self._updated = view.now
                weights = endpoint_weights(self.engine, now=view.now)
                self._weights = np.array([weights.get(i, 1) for i in range(len(self._weights))], dtype=float)
                self.updates += 1
            effective = self._weights / (self._active + 1.0)
            self._credit += effective
            chosen = int(np.argmax(self._credit))
            self._credit[chosen] -= effective.sum()
            self._active[chosen] += 1
            self._servers[arrival.id] = chosen
            self.decisions += 1
            return chosen
        finally:
            self.decide_cpu_s += time.process_time() - started

    def finished(self, record: RequestRecord, now: float) -> None:
        server = self._servers.pop(record.id, None)
        if server is not None:
            self._active[server] -= 1
        if record.error is None:  # the spans still arrive: the latencies are the picker's to know
            self.latency.observe(record.server, record.ttft_s, record.e2e_s, now=now)
            self._latency_dirty = True


class Replicated:
    """``replicas`` pickers (a `PresetPolicy` each: its own routing unit, in-flight counts and prefix index), each
    given the arrivals in turn, as Envoy spreads its picker streams. With ``sync_delay_s`` (None: they share
    nothing) each replica sees what the others have in flight, and the prompts they routed, as they were
    ``sync_delay_s`` earlier: the Redis exchange of `scorer.replicas` (its publishing interval plus a round
    trip), on the simulator's clock; 0 is a perfect exchange. Each request's end and latency go to the replica
    that routed it."""

    def __init__(
        self,
        preset: str | ProfileSpec,
        profiles: Sequence[ServerProfile],
        *,
        seed: int,
        replicas: int,
        sync_delay_s: float | None,
        kv_events: bool = False,
    ) -> None:
        if replicas < 1 or (sync_delay_s is not None and sync_delay_s < 0):
            raise ValueError(f"replicas must be >= 1 and sync_delay_s >= 0 or None; got {replicas}, {sync_delay_s}")
        self.replicas = [
            PresetPolicy(preset, profiles, seed=seed + 7919 * i, kv_events=kv_events) for i in range(replicas)
        ]
        self.sync_delay_s = sync_delay_s
        n = len(profiles)
        # Per replica: the times its own load changed, and the load from then on.
        self._times: list[list[float]] = [[-math.inf] for _ in range(replicas)]
        self._counts: list[list[Load]] = [[Load.zero(n)] for _ in range(replicas)]
        # Every decision's prompt blocks, in time order: (time, replica, endpoint, hashes); a cursor per replica.
        self._prompts: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._cursor = [0] * replicas
        self._owner: dict[str, int] = {}
        self._next = 0

    @property
    def decisions(self) -> int:
        return sum(r.decisions for r in self.replicas)

    @property
    def decide_cpu_s(self) -> float:
        return sum(r.decide_cpu_s for r in self.replicas)

    @property
    def held(self) -> int:
        return sum(r.held for r in self.replicas)

    @property
    def waited_out(self) -> int:
        return sum(r.waited_out for r in self.replicas)

    def __call__(self, arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        owner = self._owner.get(arrival.id)
        if owner is None:
            owner = self._owner[arrival.id] = self._next % len(self.replicas)
            self._next += 1
        replica = self.replicas[owner]
        if self.sync_delay_s is not None and len(self.replicas) > 1:
            self._sync(owner, view.now - self.sync_delay_s)
        answer = replica(arrival, view)
        if isinstance(answer, int):
            self._changed(owner, view.now)
            hashes = replica._features(arrival).prefix_hashes
            if hashes:
                self._prompts.append((view.now, owner, answer, hashes))
        return answer

    def finished(self, record: RequestRecord, now: float) -> None:
        owner = self._owner.pop(record.id, None)
        if owner is None:
            return
        self.replicas[owner].finished(record, now)
        self._changed(owner, now)

    def _changed(self, owner: int, now: float) -> None:
        self._times[owner].append(now)
        self._counts[owner].append(self.replicas[owner].inflight.own())

    def _sync(self, owner: int, cutoff: float) -> None:
        """What replica ``owner`` has heard by now: the others' counts and prompts as of ``cutoff``."""
        replica = self.replicas[owner]
        heard = [
            self._counts[other][bisect.bisect_right(self._times[other], cutoff) - 1]
            for other in range(len(self.replicas))
            if other != owner
        ]
        replica.inflight.set_peers(Load.sum(heard, len(replica.pool)))
        prompts, cursor = self._prompts, self._cursor[owner]
        while cursor < len(prompts) and prompts[cursor][0] <= cutoff:
            _, source, endpoint, hashes = prompts[cursor]
            if source != owner:
                replica.engine.observe_pick(RequestFeatures(prefix_hashes=hashes), endpoint)
            cursor += 1
        self._cursor[owner] = cursor
