"""Session affinity: requests that carry the same session (or user) key go to the same endpoint, so a
conversation keeps finding its KV cache, unless that endpoint is overloaded.

``ConsistentHashRing`` is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018):
each endpoint owns ``vnodes`` points on a 64-bit ring; a key goes to the first endpoint clockwise from its own
point that may serve it and is not loaded beyond ``c x (mean load + 1)``. Taking an endpoint out moves only
the keys it held, and an overloaded endpoint spills its keys to their next endpoint on the ring, not all to
one neighbour. Points come from BLAKE2b, not Python's salted ``hash``, so every picker process and every
restart agrees on the ring.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import numpy as np

from inferlb.scorer.engine import NEUTRAL_SCORE, State
from inferlb.scorer.features import RequestFeatures

__all__ = ["ConsistentHashRing", "SessionAffinityScorer"]

# Points the walk visits one by one before it switches to one vectorised pass over the whole ring (reached
# only when nearly every endpoint is excluded).
_WALK = 32


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class ConsistentHashRing:
    """Endpoints ``0..size-1`` on a hash ring with ``vnodes`` points each. Immutable after construction, so
    safe to share between tasks and threads.

    ``lookup`` costs O(log(size x vnodes)) plus O(size) vectorised work when loads are given.
    """

    def __init__(self, size: int, vnodes: int = 160, names: Sequence[str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"a hash ring needs at least one endpoint, not size={size}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, not {vnodes}")
        if names is not None and len(names) != size:
            raise ValueError(f"names must name each of the {size} endpoints, not {len(names)}")
        self.size = size
        self.vnodes = vnodes
        # An endpoint's points come from its name (its address, in a picker): when one leaves, the others' indices
        # shift but their points stay, so only the keys it held move. By index, ~90% of the keys moved.
        labels = [str(i) for i in range(size)] if names is None else list(names)
        ring = sorted((_point(f"{labels[i]}#{vnode}"), i) for i in range(size) for vnode in range(vnodes))
        self._points = [point for point, _ in ring]
        self._owners = [endpoint for _, endpoint in ring]
        self._owner_array = np.array(self._owners, dtype=np.intp)
        self._owner_array.flags.writeable = False

    def lookup(
        self, key: str, allowed: np.ndarray | None = None, loads: np.ndarray | None = None, c: float = 1.25
    ) -> int | None:
        """The endpoint for ``key``: the first one clockwise from the key's point that is ``allowed`` (a bool
        array of length ``size``; None allows all) and, when ``loads`` (per endpoint, length ``size``) are
        given, whose load is at most ``c x (mean load over the allowed endpoints + 1)``. None when no endpoint
        is allowed. ``c`` must be >= 1, which guarantees that some allowed endpoint qualifies.
        """
        if not c >= 1.0:
            raise ValueError(f"c must be >= 1 (the load bound is c x (mean + 1)), not {c}")
        for name, array in (("allowed", allowed), ("loads", loads)):
            if array is not None and len(array) != self.size:
                raise ValueError(f"{name} must have one entry per endpoint ({self.size}), not {len(array)}")
        eligible = allowed
        if loads is not None:
            considered = loads if allowed is None else loads[allowed]
            if not len(considered):
                return None
            # sum / len rather than mean(): a third of the cost on small arrays.
            eligible = loads <= c * (considered.sum() / len(considered) + 1.0)
            if allowed is not None:
                eligible &= allowed
        owners = self._owners
        count = len(owners)
        start = bisect.bisect_left(self._points, _point(key))
        if eligible is None:
            return owners[start % count]
        for step in range(min(count, _WALK)):
            endpoint = owners[(start + step) % count]
            if eligible[endpoint]:
                return endpoint
        on_ring = eligible[self._owner_array]
        after = on_ring[start:]
        if after.any():
            return owners[start + int(after.argmax())]
        if on_ring.any():
            return owners[int(on_ring.argmax())]
        return None


class SessionAffinityScorer:
    """1.0 for the candidate that the ring's bounded-load lookup of ``request.session_key`` chooses among the
    candidates (loads: in-flight requests), 0.0 for the others; ``NEUTRAL_SCORE`` for all without a session
    key. The ring must have one entry per pool endpoint (a mismatch raises in ``score``, which the engine counts
    and scores neutral). Stateless apart from the immutable ring.
    """

    name = "session-affinity"
    bounded = True

    def __init__(self, ring: ConsistentHashRing, *, c: float = 1.25) -> None:
        self.ring = ring
        self.c = c

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        key = request.session_key
        if key is None:
            return np.full(len(candidates), NEUTRAL_SCORE)
        ring = self.ring
        if ring.size != len(state.pool):
            raise ValueError(f"the hash ring has {ring.size} endpoints, the pool {len(state.pool)}")
        allowed = None
        if len(candidates) != ring.size:  # candidates are distinct endpoints: as many as the ring means all
            allowed = np.zeros(ring.size, dtype=bool)
            allowed[candidates] = True
        chosen = ring.lookup(key, allowed, state.inflight.requests, self.c)
        if chosen is None:
            return np.zeros(len(candidates))
        return (candidates == chosen).astype(np.float64)
