"""In-flight accounting: the requests and estimated tokens the picker has sent to each endpoint and not yet
seen finish. It is the one signal with no scrape lag: it moves on every decision and every completion."""

from __future__ import annotations

import numpy as np


class InFlight:
    """Per-endpoint counters, as int64 arrays aligned with the pool (read them, never write them directly).

    Owned by the event loop that routes requests: not thread-safe, and it need not be, because the counters
    change only on that loop.
    """

    def __init__(self, size: int) -> None:
        self.requests = np.zeros(size, dtype=np.int64)
        self.tokens = np.zeros(size, dtype=np.int64)

    def acquire(self, index: int, tokens: int) -> Lease:
        """Count one request to endpoint ``index``; the returned lease must be released when it ends."""
        self.requests[index] += 1
        self.tokens[index] += tokens
        return Lease(self, index, tokens)

    def total(self) -> int:
        return int(self.requests.sum())


class Lease:
    """One counted request. ``release()`` is idempotent, so every exit path may call it."""

    __slots__ = ("_inflight", "index", "released", "tokens")

    def __init__(self, inflight: InFlight, index: int, tokens: int) -> None:
        self._inflight = inflight
        self.index = index
        self.tokens = tokens
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._inflight.requests[self.index] -= 1
        self._inflight.tokens[self.index] -= self.tokens
