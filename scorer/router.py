"""The routing unit: one request's way through the routing core, the same for Envoy's requests and the simulator's.

1. `Router.admit`: the request's class (`Classifier`), then admission control: go ahead, be shed, or wait for
   capacity (`Admission`, by the one saturation rule of `scorer.saturation`).
2. A waiting request waits in the router's `WaitQueue` (on an event loop: `Router.wait`; the simulator calls the
   queue on its virtual clock) and then goes ahead, as ``saturated`` if its wait ran out.
3. `Router.route`: the profile's decision (`Engine.decide`) and the request's in-flight lease, which counts it,
   its prompt tokens and its prefill backlog on the chosen endpoint until `Lease.release` at the request's end.
   A request that an experiment covers (`scorer.experiments`) is assigned its arm by `Router.admit`, and decided
   by the arm's engine, on the same state, among the arm's endpoints; the other engines learn where it went.

Nothing here does I/O; time is the routing core's clock (``engine.signals.clock``), so a test or the simulator
runs it on a clock of its own. One event loop.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Literal, NamedTuple

import numpy as np

from inferlb.scorer.classes import Admission, Classifier, RequestClass, WaitQueue
from inferlb.scorer.engine import Decision, Engine
from inferlb.scorer.errors import NoEndpointError, RoutingError, shown
from inferlb.scorer.experiments import Arm, Experiments
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import Lease
from inferlb.scorer.speeds import ServerSpeeds

__all__ = ["ADMISSION_POLL_S", "Admit", "Routed", "Router"]

# How often a request waiting for capacity looks again (the snapshot changes once per scrape, ~100 ms).
ADMISSION_POLL_S = 0.02
# A request finds its server idle when the prefill backlog ahead of it is at most this share of its own tokens.
IDLE_BACKLOG_SHARE = 0.1


class Admit(NamedTuple):
    """What admission says of a request: ``go``, ``shed`` (refuse it, 429) or ``wait`` (for room among
    ``candidates``). ``request`` is the request with its class's fields set. Immutable."""

    verdict: Literal["go", "shed", "wait"]
    request: RequestFeatures
    request_class: RequestClass
    candidates: np.ndarray | None = None


class Routed(NamedTuple):
    """A decision and the lease that counts its request in flight (release it when the request ends). Immutable."""

    decision: Decision
    lease: Lease
    pick_s: float
    arm: Arm | None = None  # the experiment arm the request was assigned to, if an experiment covers it


class Router:
    """Admission, decision and lease for one pool and profile (``engine``); a config reload builds a new one."""

    def __init__(
        self,
        engine: Engine,
        classifier: Classifier | None = None,
        *,
        poll_s: float = ADMISSION_POLL_S,
        experiments: Experiments | None = None,
        speeds: ServerSpeeds | None = None,
    ) -> None:
        self.engine = engine
        # Told each request's predicted prefill work, to learn the servers' speeds from its timing (a reload
        # passes the same one on).
        self.speeds = speeds
        # Requests an experiment covers route with their arm's engine (which shares this engine's state).
        self.experiments = experiments if experiments else None
        self.pool = engine.pool
        self.classifier = classifier or Classifier()
        self.admission = Admission(engine.state)
        self.queue = WaitQueue(self.admission, poll_s)
        self.shed: Counter[str] = Counter()  # request class -> requests shed

    def admit(self, request: RequestFeatures) -> Admit:
        """Classify ``request`` and say whether it goes ahead, is shed or waits: it waits or is shed (as its class
        says) when every endpoint that could serve it is saturated."""
        request_class = self.classifier.classify(request)
        pool_mask = self.admission.pool_mask(request_class)
        if request.subset is not None:  # the gateway's subset hint: only those of its endpoints
            hinted = self.pool.address_mask(request.subset)
            pool_mask = hinted if pool_mask is None else pool_mask & hinted
        request = request.classified(request_class.name, request_class.priority, request_class.ttft_slo_s, pool_mask)
        experiments = self.experiments
        arm = None
        if experiments is not None:
            # Its arm is drawn once, here: the arm's endpoints bound where it may wait for room and be routed.
            arm = experiments.assign(request)
            mask = experiments.outside if arm is None else arm.mask
            if mask is not None:
                pool_mask = mask if pool_mask is None else pool_mask & mask
            # A release arm with a model of its own routes (and, in the filter, sends) the request as that model.
            request = request.assigned(arm, pool_mask, None if arm is None else arm.spec.model)
        try:
            candidates = self.pool.model_indices(request.model)
        except RoutingError:
            return Admit("go", request, request_class)  # the pick refuses it, with the reason
        if request.pool_mask is not None:
            candidates = candidates[request.pool_mask[candidates]]
        if not self.admission.saturated(candidates):
            if request_class.on_saturation == "shed" or not self.queue.ahead(candidates, request_class.priority):
                return Admit("go", request, request_class)
            # Waiters of its priority or higher were here first: the room that came is theirs, at the next tick.
            return Admit("wait", request, request_class, candidates)
        if request_class.on_saturation == "shed":
            self.shed[request_class.name] += 1
            if experiments is not None and arm is not None:
                experiments.shed(arm)
            return Admit("shed", request, request_class, candidates)
        return Admit("wait", request, request_class, candidates)

    def _check_subset(self, request: RequestFeatures) -> None:
        """Raise ``NoEndpointError`` when no endpoint of the gateway's subset hint may serve ``request`` (the
        protocol's 503); ``UnknownModelError`` when none in the pool serves its model."""
        candidates = self.pool.model_indices(request.model)
        if request.pool_mask is not None:
            candidates = candidates[request.pool_mask[candidates]]
        if not candidates.size:
            listed = len(request.subset or ())
            raise NoEndpointError(
                f"none of the {listed} endpoint(s) in the gateway's subset hint is a serving member of this pool "
                f"for model {shown(request.model)}"
            )

    def served(
        self, lease: Lease, address: str, request: RequestFeatures | None = None, *, request_id: str = ""
    ) -> str:
        """The data plane reports that ``address`` served the request counted by ``lease`` (the Endpoint Picker
        protocol's served endpoint). If that is another member than the one picked (a retry went to the next
        endpoint listed), the request counts there from now on, its timing teaches the servers' speeds nothing (it
        holds the failed attempt), and, given its ``request``, every engine's prefix index learns where its prompt
        went (each arm's, with experiments). ``request_id``: the request's, where ``request`` is not given. The
        outcome: ``as-picked``, ``elsewhere`` (moved), or ``unknown`` (an address outside the pool, or a request no
        longer counted here)."""
        where = lease.current()
        index = self.pool.find(address) if where is not None and where[0] is self.engine.inflight else None
        if where is None or index is None:
            return "unknown"
        if index == where[1]:
            return "as-picked"
        lease.move(index)
        rid = request.request_id if request is not None else request_id
        if self.speeds is not None and rid:
            self.speeds.forget(rid)
        if request is not None:
            for engine in self._engines():
                engine.observe_pick(request, index)
        return "elsewhere"

    async def wait(self, admit: Admit) -> bool:
        """Hold a ``wait`` request until room comes (True) or its class's ``max_wait_s`` runs out (False)."""
        assert admit.candidates is not None
        request_class = admit.request_class
        return await self.queue.wait(admit.candidates, request_class.priority, request_class.max_wait_s)

    def route(self, request: RequestFeatures, *, saturated: bool = False) -> Routed:
        """Decide and count the request in flight. ``saturated``: it waited as long as its class allows and no
        capacity came (the decision's reason says so). Raises ``RoutingError`` when no endpoint can serve it."""
        arm: Arm | None = request.arm  # assigned by `admit`
        experiments = self.experiments
        if arm is not None and (experiments is None or not experiments.owns(arm)):
            arm = None  # admitted before a reload that ended its experiment: it routes as the rest do now
        engine = self.engine if arm is None else arm.engine
        if request.subset is not None:
            self._check_subset(request)
        started = time.perf_counter()
        decision = engine.decide(request)
        if saturated:
            decision = decision._replace(reason="saturated")
        # The prompt is the work a request brings before its first token: what the in-flight token count and the
        # predicted-TTFT scorer weigh.
        index = decision.endpoint.index
        prefill = decision.prefill
        if experiments is not None:
            prefill = self._share(request, engine, index, prefill, experiments)
        speeds = self.speeds
        if speeds is not None and prefill is not None and request.request_id:
            # The work the prediction counted before this request's first token: the backlog and its own tokens.
            uncached, rate = prefill
            backlog = engine.inflight.pending_prefill_at(index, rate)
            # Whether it found the server with nothing ahead of it (no prefill backlog, an empty scraped queue): its
            # timing then shows how fast the server prefills, not how long its queue was (`ServerSpeeds.peak...`).
            idle = backlog <= IDLE_BACKLOG_SHARE * uncached and not engine.signals.snapshot.waiting[index] > 0
            speeds.sent(request.request_id, index, backlog + uncached, idle=idle)
        lease = engine.inflight.acquire(index, request.prompt_tokens, prefill, streamed=request.stream)
        if request.cache_keys and (kv := engine.signals.kv) is not None:
            kv.sent(index, request.cache_keys)  # pending there until the server's events confirm them
        if arm is not None and experiments is not None:
            experiments.routed(request.request_id, arm)
        return Routed(decision, lease, time.perf_counter() - started, arm)

    def _engines(self) -> tuple[Engine, ...]:
        """The pool's engine and, with experiments, each arm's own, each once: all share the servers."""
        main, experiments = self.engine, self.experiments
        if experiments is None:
            return (main,)
        return (main, *(e for e in experiments.engines if e is not main))

    def _share(
        self,
        request: RequestFeatures,
        engine: Engine,
        index: int,
        prefill: tuple[float, float] | None,
        experiments: Experiments,
    ) -> tuple[float, float] | None:
        """With experiments, the requests of every arm and of none share the servers. Each engine but ``engine``
        (which decided) learns that ``request`` went to ``index`` (its prefix index: the server now caches the
        prompt), and a request whose profile estimates no prefill (round robin) is estimated by the first engine
        that can, so that the prefill backlog the other arms' predictions price counts its prompt. The prefill
        estimate the lease is to count."""
        for other in self._engines():
            if other is engine:
                continue
            if prefill is None:
                prefill = other.prefill_at(request, index)
            other.observe_pick(request, index)
        return prefill
