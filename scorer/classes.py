"""Request classes and admission control.

A class is chosen per request by its objective, when the gateway names one (the Endpoint Picker protocol's
``x-gateway-inference-objective`` header: the class of that name), else by the first rule that matches (prompt
size, stream flag, model, or the value of a class header the client sends); requests no rule matches get the
default class. A class says what happens when every endpoint that could serve the request is saturated:
``wait`` (interactive traffic waits up to ``max_wait_s`` for capacity, then is routed anyway to the best
endpoint) or ``shed`` (batch traffic is refused at once with 429 and ``retry-after``); a class with a negative
priority is sheddable (the protocol's rule) unless its config says otherwise. Waiting requests are let through
highest ``priority`` first, then in arrival order, at most one per endpoint with room per tick (`WaitQueue`). A
class may also restrict the request to endpoints with given labels (its pool) and carry a TTFT objective, which
the ``ttft-slo`` filter routes by.

Saturated means what `scorer.saturation.Saturation` says (the one rule, shared with the ``saturation`` filter):
more than ``max_waiting`` queued requests, counting the growth of the requests in flight there since the last
scrape began, or KV-cache use above ``max_kv_usage``; a stale endpoint counts as saturated too, unless every
candidate is stale (then nothing is known and the pick goes ahead).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures

__all__ = ["Admission", "ClassRule", "Classifier", "RequestClass", "WaitQueue", "Waiter"]


@dataclass(frozen=True, slots=True)
class RequestClass:
    """What a class of requests gets. ``on_saturation``: "wait" or "shed"."""

    name: str
    priority: int = 0
    ttft_slo_s: float | None = None
    on_saturation: str = "wait"
    max_wait_s: float = 0.5
    retry_after_s: int = 5
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClassRule:
    """Conditions that must all hold (None: any)."""

    request_class: RequestClass
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    stream: bool | None = None
    models: frozenset[str] | None = None
    header_values: frozenset[str] | None = None

    def matches(self, request: RequestFeatures) -> bool:
        return (
            (self.min_prompt_tokens is None or request.prompt_tokens >= self.min_prompt_tokens)
            and (self.max_prompt_tokens is None or request.prompt_tokens <= self.max_prompt_tokens)
            and (self.stream is None or request.stream == self.stream)
            and (self.models is None or request.model in self.models)
            and (self.header_values is None or request.class_hint in self.header_values)
        )


class Classifier:
    """The first matching rule's class, else ``default``. Stateless; safe to share."""

    def __init__(self, rules: Sequence[ClassRule] = (), default: RequestClass | None = None) -> None:
        self.rules = tuple(rules)
        self.default = default or RequestClass("default")
        self.by_name = {rule.request_class.name: rule.request_class for rule in self.rules}

    def classify(self, request: RequestFeatures) -> RequestClass:
        if request.objective is not None:
            named = self.by_name.get(request.objective)
            if named is not None:
                return named
        for rule in self.rules:
            if rule.matches(request):
                return rule.request_class
        return self.default


class Admission:
    """Decides, before the pick, whether a request goes ahead, waits for capacity, or is shed, by the routing
    core's saturation rule (`State.saturation`) and clock (``state.signals.clock``).

    ``label_masks`` caches, per class, which endpoints carry its labels. One event loop.
    """

    def __init__(self, state: State) -> None:
        self.state = state
        self.pool = state.pool
        self.signals = state.signals
        self._label_masks: dict[str, np.ndarray] = {}

    def pool_mask(self, request_class: RequestClass) -> np.ndarray | None:
        """The endpoints a class may use (None: all)."""
        if not request_class.labels:
            return None
        mask = self._label_masks.get(request_class.name)
        if mask is None:
            wanted = request_class.labels.items()
            mask = np.array([all(e.labels.get(k) == v for k, v in wanted) for e in self.pool], dtype=bool)
            mask.setflags(write=False)
            self._label_masks[request_class.name] = mask
        return mask

    def saturated(self, candidates: np.ndarray, now: float | None = None) -> bool:
        """Whether every candidate is saturated (see the module docstring)."""
        if not len(candidates):
            return False
        state = self.state
        signals = state.signals
        now = signals.clock() if now is None else now
        saturation = state.saturation
        if now <= signals.all_fresh_until:  # the usual case: every endpoint is fresh
            return saturation.any_over(signals, state.inflight) and bool(
                saturation.over(signals, state.inflight)[candidates].all()
            )
        if now > signals.any_fresh_until:  # nothing is fresh: nothing is known
            return False
        over = saturation.over(signals, state.inflight)
        fresh = signals.fresh_until[candidates] >= now
        if not fresh.any():
            return False
        return bool((over[candidates] | ~fresh).all())

    def room(self, candidates: np.ndarray, now: float | None = None) -> np.ndarray:
        """The candidates that are not saturated: fresh and not over; all of them when none is fresh."""
        state = self.state
        now = state.signals.clock() if now is None else now
        over = state.saturation.over(state.signals, state.inflight)
        fresh = state.signals.fresh_until[candidates] >= now
        if not fresh.any():
            return candidates
        return candidates[fresh & ~over[candidates]]


@dataclass(order=True, slots=True)
class Waiter:
    """One request waiting for capacity. ``outcome``: None while it waits, True when room came, False when its
    wait ran out."""

    key: tuple[int, int]  # (-priority, arrival): the order waiters are let through
    deadline: float = field(compare=False)
    candidates: np.ndarray = field(compare=False)
    outcome: bool | None = field(default=None, compare=False)
    future: asyncio.Future[bool] | None = field(default=None, compare=False)

    def settle(self, outcome: bool) -> None:
        self.outcome = outcome
        if self.future is not None and not self.future.done():
            self.future.set_result(outcome)


class WaitQueue:
    """Requests of ``wait`` classes waiting for capacity, let through highest priority first, then in order of
    arrival; a newcomer of a ``wait`` class that finds room where such a waiter may go queues behind it (`ahead`).

    Every ``poll_s`` the waiters are visited in that order (`release`, one tick): a waiter goes ahead if one of its
    candidates has room (`Admission.room`) and no waiter before it in this tick took that endpoint, so each
    endpoint with room lets at most one waiter through per tick (the metrics that show the room are up to a scrape
    old; letting every waiter through at once would refill the endpoint at once). A waiter whose deadline passes
    goes ahead anyway (waited out). Time is the routing core's clock. `enter` and `release` are the queue itself
    (the simulator calls them on its virtual clock); `wait` is them on an event loop, whose ticking task runs only
    while someone waits.
    """

    def __init__(self, admission: Admission, poll_s: float = 0.02) -> None:
        self.admission = admission
        self.poll_s = poll_s
        self.clock = admission.signals.clock
        self._waiters: list[Waiter] = []
        self._arrivals = itertools.count()
        self._ticker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    def ahead(self, candidates: np.ndarray, priority: int) -> bool:
        """Whether a waiter of ``priority`` or higher, still waiting, may use one of ``candidates``: a newcomer that
        found room there queues behind it, or it would take the room that waiter was waiting for."""
        key = -priority
        for waiter in self._waiters:
            if waiter.key[0] <= key and waiter.outcome is None and np.intersect1d(waiter.candidates, candidates).size:
                return True
        return False

    def enter(self, candidates: np.ndarray, priority: int, max_wait_s: float) -> Waiter:
        """Queue a request for room among ``candidates``, for at most ``max_wait_s``."""
        waiter = Waiter((-priority, next(self._arrivals)), self.clock() + max_wait_s, candidates)
        self._waiters.append(waiter)
        return waiter

    async def wait(self, candidates: np.ndarray, priority: int, max_wait_s: float) -> bool:
        """Wait for room among ``candidates``, at most ``max_wait_s``: True when room came, False when the wait
        ran out. Cancelling the caller removes it from the queue."""
        loop = asyncio.get_running_loop()
        waiter = self.enter(candidates, priority, max_wait_s)
        waiter.future = future = loop.create_future()
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick_while_waited_on(), name="admission queue")
        try:
            return await future
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, now: float | None = None) -> int:
        """One tick: let through the waiters that may go (see the class docstring); returns how many went."""
        now = self.clock() if now is None else now
        taken: set[int] = set()
        gone = 0
        for waiter in sorted(self._waiters):
            if waiter.outcome is not None or (waiter.future is not None and waiter.future.done()):
                continue
            free = [int(i) for i in self.admission.room(waiter.candidates, now) if int(i) not in taken]
            if free:
                taken.add(free[0])
                waiter.settle(True)
            elif now >= waiter.deadline:
                waiter.settle(False)
            else:
                continue
            gone += 1
        self._waiters = [w for w in self._waiters if w.outcome is None and not (w.future and w.future.done())]
        return gone

    async def _tick_while_waited_on(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.poll_s)
            self.release()
