"""Request classes and admission control.

A class is chosen per request by the first rule that matches (prompt size, stream flag, model, or the value of
a class header the client sends); requests no rule matches get the default class. A class says what happens
when every endpoint that could serve the request is saturated: ``wait`` (interactive traffic waits up to
``max_wait_s`` for capacity, then is routed anyway to the best endpoint) or ``shed`` (batch traffic is refused
at once with 429 and ``retry-after``). Waiting requests are let through highest ``priority`` first, then in
arrival order, at most one per endpoint with room per tick (`WaitQueue`). A class may also restrict the request
to endpoints with given labels (its pool) and carry a TTFT objective, which the ``ttft-slo`` filter routes by.

Saturated means: the endpoint's latest metrics are fresh and show more than ``max_waiting`` queued requests or
KV-cache use above ``max_kv_usage``; a stale endpoint counts as saturated too, unless every candidate is stale
(then nothing is known and the pick goes ahead).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals, Snapshot

__all__ = ["Admission", "ClassRule", "Classifier", "RequestClass", "WaitQueue"]


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

    def classify(self, request: RequestFeatures) -> RequestClass:
        for rule in self.rules:
            if rule.matches(request):
                return rule.request_class
        return self.default


class Admission:
    """Decides, before the pick, whether a request goes ahead, waits for capacity, or is shed.

    ``label_masks`` caches, per class, which endpoints carry its labels. One event loop.
    """

    def __init__(self, pool: Pool, signals: Signals, *, max_waiting: float = 16, max_kv_usage: float = 0.95) -> None:
        self.pool = pool
        self.signals = signals
        self.max_waiting = max_waiting
        self.max_kv_usage = max_kv_usage
        self._label_masks: dict[str, np.ndarray] = {}
        self._for: Snapshot | None = None
        self._full = np.zeros(0, dtype=bool)
        self._any_full = False

    def pool_mask(self, request_class: RequestClass) -> np.ndarray | None:
        """The endpoints a class may use (None: all)."""
        if not request_class.labels:
            return None
        mask = self._label_masks.get(request_class.name)
        if mask is None:
            wanted = request_class.labels.items()
            mask = np.array([all(e.labels.get(k) == v for k, v in wanted) for e in self.pool], dtype=bool)
            self._label_masks[request_class.name] = mask
        return mask

    def saturated(self, candidates: np.ndarray, now: float | None = None) -> bool:
        """Whether every candidate is saturated (see the module docstring)."""
        if not len(candidates):
            return False
        now = time.monotonic() if now is None else now
        signals = self.signals
        self._refresh()
        if not self._any_full and now <= signals.all_fresh_until:
            return False  # the usual case: nothing is full and every endpoint is fresh
        fresh = signals.fresh_until[candidates] >= now
        if not fresh.any():
            return False
        return bool((self._full[candidates] | ~fresh).all())

    def room(self, candidates: np.ndarray, now: float | None = None) -> np.ndarray:
        """The candidates that are not saturated: fresh and not full; all of them when none is fresh."""
        now = time.monotonic() if now is None else now
        self._refresh()
        fresh = self.signals.fresh_until[candidates] >= now
        if not fresh.any():
            return candidates
        return candidates[fresh & ~self._full[candidates]]

    def _refresh(self) -> None:
        snapshot = self.signals.snapshot
        if snapshot is not self._for:  # once per scrape
            full = snapshot.over(self.max_waiting, self.max_kv_usage)
            self._full, self._any_full, self._for = full, bool(full.any()), snapshot


@dataclass(order=True, slots=True)
class _Waiter:
    key: tuple[int, int]  # (-priority, arrival): the order waiters are let through
    deadline: float = field(compare=False)
    candidates: np.ndarray = field(compare=False)
    future: asyncio.Future[bool] = field(compare=False)


class WaitQueue:
    """Requests of ``wait`` classes waiting for capacity, let through highest priority first, then in order of
    arrival.

    Every ``poll_s`` the waiters are visited in that order: a waiter goes ahead if one of its candidates has room
    (`Admission.room`) and no waiter before it in this tick took that endpoint, so each endpoint with room lets at
    most one waiter through per tick (the metrics that show the room are up to a scrape old; letting every
    waiter through at once would refill the endpoint at once). A waiter whose deadline passes goes ahead anyway
    (waited out). One event loop; the ticking task runs only while someone waits.
    """

    def __init__(self, admission: Admission, poll_s: float = 0.02) -> None:
        self.admission = admission
        self.poll_s = poll_s
        self._waiters: list[_Waiter] = []
        self._arrivals = itertools.count()
        self._ticker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, candidates: np.ndarray, priority: int, max_wait_s: float) -> bool:
        """Wait for room among ``candidates``, at most ``max_wait_s``: True when room came, False when the wait
        ran out. Cancelling the caller removes it from the queue."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            (-priority, next(self._arrivals)), time.monotonic() + max_wait_s, candidates, loop.create_future()
        )
        self._waiters.append(waiter)
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick_while_waited_on(), name="admission queue")
        try:
            return await waiter.future
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, now: float | None = None) -> int:
        """One tick: let through the waiters that may go (see the class docstring); returns how many went."""
        now = time.monotonic() if now is None else now
        taken: set[int] = set()
        gone = 0
        for waiter in sorted(self._waiters):
            if waiter.future.done():
                continue
            free = [int(i) for i in self.admission.room(waiter.candidates, now) if int(i) not in taken]
            if free:
                taken.add(free[0])
                waiter.future.set_result(True)
            elif now >= waiter.deadline:
                waiter.future.set_result(False)
            else:
                continue
            gone += 1
        self._waiters = [w for w in self._waiters if not w.future.done()]
        return gone

    async def _tick_while_waited_on(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.poll_s)
            self.release()


def parse_seconds(value: object) -> float:
    """A finite, non-negative number of seconds, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"must be a number of seconds >= 0; got {value!r}")
    return float(value)
