"""Request classes and admission control.

A class is chosen per request by the first rule that matches (prompt size, stream flag, model, or the value of
a class header the client sends); requests no rule matches get the default class. A class says what happens
when every endpoint that could serve the request is saturated: ``wait`` (interactive traffic waits up to
``max_wait_s`` for capacity, then is routed anyway to the best endpoint) or ``shed`` (batch traffic is refused
at once with 429 and ``retry-after``). It also carries a priority and a TTFT objective for reporting, and may
restrict the request to endpoints with given labels (its pool).

Saturated means: the endpoint's latest metrics are fresh and show more than ``max_waiting`` queued requests or
KV-cache use above ``max_kv_usage``; a stale endpoint counts as saturated too, unless every candidate is stale
(then nothing is known and the pick goes ahead).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals, Snapshot

__all__ = ["Admission", "ClassRule", "Classifier", "RequestClass"]


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
        snapshot = signals.snapshot
        if snapshot is not self._for:  # once per scrape
            full = snapshot.over(self.max_waiting, self.max_kv_usage)
            self._full, self._any_full, self._for = full, bool(full.any()), snapshot
        if not self._any_full and now <= signals.all_fresh_until:
            return False  # the usual case: nothing is full and every endpoint is fresh
        fresh = signals.fresh_until[candidates] >= now
        if not fresh.any():
            return False
        return bool((self._full[candidates] | ~fresh).all())


def parse_seconds(value: object) -> float:
    """A finite, non-negative number of seconds, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"must be a number of seconds >= 0; got {value!r}")
    return float(value)
