"""What the picker decided, for the admin API: a bounded log of recent decisions and cheap running counters.

`DecisionLog.record` runs on every request, so it only appends to a ring and bumps counters (about a
microsecond); formatting happens when someone asks (`recent`; inferlb/metrics.py for /metrics).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from inferlb.scorer.engine import Decision
from inferlb.scorer.histogram import Histogram

__all__ = ["PICK_BUCKETS_S", "DecisionLog"]

# How many of the best candidates a ranking shows.
RANKING_LENGTH = 5

# Upper bounds of the pick-latency histogram, seconds (10 µs .. 10 ms).
PICK_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


MAX_KEPT_CHARS = 256
"""How much of a client's request id and model name a decision entry keeps."""


class DecisionLog:
    """Recent decisions (at most ``capacity``) and totals since start. One event loop; not thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        self._recent: deque[tuple[float, str, str | None, Decision | None, int, float, tuple[str, str] | None]] = deque(
            maxlen=capacity
        )
        self.by_endpoint: Counter[tuple[str, str]] = Counter()  # (endpoint, reason) -> decisions
        self.refused: Counter[int] = Counter()  # HTTP status -> requests refused
        self.shed: Counter[str] = Counter()  # request class -> requests shed by admission control
        self.pick_s = Histogram(PICK_BUCKETS_S)  # seconds each decision took

    def record(
        self,
        request_id: str,
        model: str | None,
        decision: Decision,
        pick_s: float,
        arm: tuple[str, str] | None = None,
    ) -> None:
        """A routed request; ``arm``: (experiment, arm) when an experiment covered it."""
        self._recent.append((time.time(), request_id[:MAX_KEPT_CHARS], model, decision, 0, pick_s, arm))
        self.by_endpoint[decision.endpoint.address, decision.reason] += 1
        self.pick_s.observe(pick_s)

    def forget_endpoints_but(self, addresses: Iterable[str]) -> None:
        """Drop the counts of endpoints other than ``addresses`` (the pool after a membership change): with pods
        that come and go, one series per address ever routed to would grow without end."""
        keep = set(addresses)
        for key in [k for k in self.by_endpoint if k[0] not in keep]:
            del self.by_endpoint[key]

    def record_refusal(self, request_id: str, model: str | None, status: int) -> None:
        # A refused request's model and id are the client's: keep a bounded head of each, or a flood of 4 MiB
        # model names would hold capacity * 4 MiB here.
        cut = None if model is None else model[:MAX_KEPT_CHARS]
        self._recent.append((time.time(), request_id[:MAX_KEPT_CHARS], cut, None, status, 0.0, None))
        self.refused[status] += 1

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The last ``limit`` decisions, newest first, with each scorer's score for the chosen endpoint and, for
        pools of up to `RANKED_UP_TO_CANDIDATES` candidates, the best `RANKING_LENGTH` candidates with theirs."""
        out = []
        for at, request_id, model, decision, status, pick_s, arm in list(self._recent)[-limit:][::-1]:
            entry: dict[str, Any] = {"time": at, "request_id": request_id, "model": model}
            if arm is not None:
                entry["experiment"], entry["arm"] = arm
            if decision is None:
                entry.update(outcome="refused", status=status)
            else:
                totals = sorted(decision.totals.tolist(), reverse=True)
                entry.update(
                    outcome="routed",
                    endpoint=decision.endpoint.address,
                    profile=decision.profile,
                    reason=decision.reason,
                    scores=decision.scores,
                    total=totals[0],
                    runner_up_total=totals[1] if len(totals) > 1 else None,
                    candidates=len(decision.candidates),
                    pick_us=round(pick_s * 1e6, 1),
                )
                if decision.per_scorer:
                    entry["ranking"] = _ranking(decision)
            out.append(entry)
        return out


def _ranking(decision: Decision) -> list[dict[str, Any]]:
    chosen = decision.endpoint.index
    order = decision.totals.argsort(kind="stable")[::-1][:RANKING_LENGTH]
    return [
        {
            "endpoint_index": int(decision.candidates[i]),
            "chosen": int(decision.candidates[i]) == chosen,
            "total": float(decision.totals[i]),
            "scores": {name: float(scores[i]) for name, scores in decision.per_scorer},
        }
        for i in order
    ]
