"""Prefix-cache affinity: send a prompt where its leading blocks were recently sent, so the server's prefix
cache can skip their prefill.

The picker cannot see the servers' caches; it remembers where it sent things. ``PrefixIndex`` keeps, per
endpoint, the most recently routed prompt blocks (``RequestFeatures.prefix_hashes``, chained hashes, so a
block's hash stands for the whole prefix up to it) and answers how many leading blocks of a new prompt each
endpoint holds. It is approximate both ways: a server may have evicted what the index remembers, and it may
still hold what the index forgot. ``PrefixAffinityScorer`` turns that into a score with a guard against piling
work onto one hot endpoint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from inferlb.scorer.chainmatch import match_depth
from inferlb.scorer.engine import NEUTRAL_SCORE, State
from inferlb.scorer.features import PREFIX_BLOCK_TOKENS, RequestFeatures
from inferlb.scorer.inflight import overloaded
from inferlb.scorer.kvindex import KVBlockIndex

__all__ = ["PrefixAffinityScorer", "PrefixIndex", "overloaded"]

logger = logging.getLogger(__name__)


class PrefixIndex:
    """An approximate, bounded record of the prompt blocks recently routed to each of ``size`` endpoints.

    Each endpoint keeps at most ``capacity_blocks`` block hashes in LRU order: recording a block it already
    holds refreshes it, and beyond capacity the least recently recorded are forgotten. Within one ``record``
    the leading blocks count as the most recent, so a prompt's tail is forgotten before its head (the head is
    what other prompts share, and servers evict the same way round).

    Costs: ``match`` is O(len(hashes) + endpoints that matched), independent of how many blocks are held;
    ``record`` is O(len(hashes)) amortised. Memory is bounded by ``size x capacity_blocks`` entries of about
    250 bytes (an LRU entry per endpoint, a shared hash → endpoint-bitmask entry, the hash itself). `fit` lowers
    an endpoint's capacity to what its server's KV cache can hold (its tokens over ``PREFIX_BLOCK_TOKENS``): an
    index that remembers more than the server holds claims blocks the server has evicted, and grows with
    traffic for no gain (65536 blocks of 64 tokens is 4M tokens; an H100 serving an 8B model holds 0.45M).

    Not thread-safe: use it from the one event loop that routes requests.
    """

    def __init__(self, size: int, capacity_blocks: int = 65536) -> None:
        if size < 1:
            raise ValueError(f"a prefix index needs at least one endpoint, not size={size}")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, not {capacity_blocks}")
        self.size = size
        self.capacity_blocks = capacity_blocks
        # block hash -> bitmask of the endpoints holding it (bit i = endpoint i). A Python int is a compact,
        # fast bitset here: one AND per block narrows every endpoint at once during a match.
        self._holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(size)]
        self._capacity = [capacity_blocks] * size  # per endpoint: capacity_blocks, or less once `fit` knows
        self._fitted_to: np.ndarray | None = None
        # The last match, for the next caller asking about the same request (the prefix-affinity and the
        # predicted-TTFT scorers both do, once per pick); any record invalidates it.
        self._memo: tuple[Sequence[int], tuple[np.ndarray, int]] | None = None

    def fit(self, kv_tokens: np.ndarray) -> None:
        """Cap each endpoint's capacity at its server's KV cache, ``kv_tokens`` (aligned with the endpoints; NaN or
        not positive: unknown, capacity_blocks stays), in blocks of ``PREFIX_BLOCK_TOKENS``. Blocks over a lowered
        capacity are forgotten at the endpoint's next record. Cheap when the capacities did not change."""
        if self._fitted_to is not None and np.array_equal(self._fitted_to, kv_tokens, equal_nan=True):
            return
        self._fitted_to = np.array(kv_tokens, dtype=np.float64, copy=True)
        blocks = np.where(np.isfinite(kv_tokens) & (kv_tokens > 0), np.ceil(kv_tokens / PREFIX_BLOCK_TOKENS), np.inf)
        self._capacity = [int(min(self.capacity_blocks, b)) for b in blocks.tolist()]

    def adopt(self, old: PrefixIndex, mapping: np.ndarray) -> None:
        """Take over what ``old`` (the index of the previous pool) holds: endpoint j here gets the blocks endpoint
        ``mapping[j]`` held there (-1: it joined and holds nothing); endpoints not mapped are forgotten. Costs
        O(blocks held) unless the pool only grew at its end (then O(endpoints): the two share their tables, and ``old``
        must not be used again). Call it before any record."""
        if old is self:
            return
        self._memo = None
        size = old.size
        if np.array_equal(mapping[:size], np.arange(size)) and not (mapping[size:] >= 0).any():
            # The pool grew at its end: every bit keeps its meaning, so the dicts change hands as they are.
            self._holders, self._lru[:size], self._capacity[:size] = old._holders, old._lru, old._capacity
            return
        holders: dict[int, int] = {}
        for j, i in enumerate(mapping.tolist()):
            if i < 0:
                continue
            self._lru[j] = lru = old._lru[i]
            self._capacity[j] = old._capacity[i]
            bit = 1 << j
            for block in lru:
                holders[block] = holders.get(block, 0) | bit
        self._holders = holders

    def forget(self, endpoint: int) -> None:
        """Drop every block recorded for ``endpoint`` (its server restarted: its cache is empty)."""
        self._memo = None
        bit = 1 << endpoint
        holders = self._holders
        for block in self._lru[endpoint]:
            rest = holders[block] & ~bit
            if rest:
                holders[block] = rest
            else:
                del holders[block]
        self._lru[endpoint] = OrderedDict()

    def capacity(self, endpoint: int) -> int:
        """How many blocks ``endpoint`` may hold now."""
        return self._capacity[endpoint]

    def record(self, endpoint: int, hashes: Sequence[int]) -> None:
        """Remember that the prompt with these block hashes was sent to ``endpoint`` (0 <= endpoint < size)."""
        if not 0 <= endpoint < self.size:
            raise ValueError(f"endpoint {endpoint} is outside the index (size {self.size})")
        self._memo = None
        capacity = self._capacity[endpoint]
        lru = self._lru[endpoint]
        holders = self._holders
        bit = 1 << endpoint
        # Head last, so that it is the most recently used; more than capacity blocks would evict each other.
        for block in reversed(hashes[:capacity]):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                holders[block] = holders.get(block, 0) | bit
        for _ in range(len(lru) - capacity):
            old, _ = lru.popitem(last=False)
            rest = holders[old] & ~bit
            if rest:
                holders[old] = rest
            else:
                del holders[old]

    def match(self, hashes: Sequence[int]) -> np.ndarray:
        """How many leading blocks of ``hashes`` each endpoint holds: an int64 array of length ``size``.

        An endpoint's count stops at the first block it does not hold, even if it holds later ones.
        """
        return self.match_depth(hashes)[0]

    def match_depth(self, hashes: Sequence[int]) -> tuple[np.ndarray, int]:
        """``match`` and the largest count in it (0: no endpoint holds even the first block). The counts array
        is read-only (it may be shared with the next caller asking about the same hashes object)."""
        memo = self._memo
        if memo is not None and memo[0] is hashes:
            return memo[1]
        result = self._match_depth(hashes)
        result[0].setflags(write=False)
        self._memo = (hashes, result)
        return result

    def _match_depth(self, hashes: Sequence[int]) -> tuple[np.ndarray, int]:
        return match_depth(self._holders, hashes, self.size)

    def held(self, endpoint: int) -> int:
        """The number of blocks recorded for ``endpoint`` (at most its `capacity`)."""
        return len(self._lru[endpoint])

    def __len__(self) -> int:
        """The number of distinct blocks held by any endpoint."""
        return len(self._holders)


class PrefixAffinityScorer:
    """Scores each candidate by the fraction of the request's prefix blocks it holds, leading blocks only.

    Scores are in [0, 1]: matched blocks / ``len(request.prefix_hashes)``. A request without prefix hashes
    (no body, or a prompt shorter than one block) scores ``NEUTRAL_SCORE`` everywhere. The imbalance guard:
    a candidate with more than ``guard x (mean in-flight requests over the other candidates + 1)`` requests in
    flight scores 0 (`overloaded`), so that a popular prefix cannot pile every request onto one endpoint; the load
    scorers then choose among the rest, and the prefix follows it there.

    The index must have one entry per pool endpoint (a mismatch raises in ``score``, which the engine counts
    and scores neutral); it is fitted to the servers' KV-cache sizes as the snapshot reports them. ``on_pick``
    records the request's blocks for the chosen endpoint; it never raises (a failure is counted in
    ``record_errors`` and logged once). Not thread-safe, like the index.
    """

    name = "prefix-affinity"
    bounded = True

    def __init__(self, index: PrefixIndex, *, guard: float = 2.0) -> None:
        self.index = index
        self.guard = guard
        self.record_errors = 0
        self._fitted_for: object | None = None
        self._neutral = np.zeros(0)

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        hashes = request.prefix_hashes
        kv = state.signals.kv
        if kv is not None and request.cache_keys and kv.live.any():
            return self._score_exact(request, state, candidates, kv)
        if not hashes:  # every request of a headers-only route: the same read-only array each time
            if len(self._neutral) != len(candidates):
                self._neutral = np.full(len(candidates), NEUTRAL_SCORE)
                self._neutral.setflags(write=False)
            return self._neutral
        guess = self._guess(hashes, state, candidates)
        if guess is None:
            return np.zeros(len(candidates))
        return self._guarded(guess, state, candidates)

    def _guess(self, hashes: tuple[int, ...], state: State, candidates: np.ndarray) -> np.ndarray | None:
        """The approximate index's fraction of ``hashes`` each candidate holds (a new array), None when no
        endpoint holds even the first block. Fits the index to the servers' caches once per snapshot."""
        index = self.index
        if index.size != len(state.pool):
            raise ValueError(f"the prefix index has {index.size} endpoints, the pool {len(state.pool)}")
        snapshot = state.signals.snapshot
        if snapshot is not self._fitted_for and len(snapshot.kv_tokens) == index.size:
            index.fit(snapshot.kv_tokens)  # once per snapshot; work only when a server's cache size changed
            self._fitted_for = snapshot
        counts, deepest = index.match_depth(hashes)
        return counts[candidates] / len(hashes) if deepest else None

    def _score_exact(
        self, request: RequestFeatures, state: State, candidates: np.ndarray, kv: KVBlockIndex
    ) -> np.ndarray:
        """Where an endpoint's server reports its cache (`KVBlockIndex.live`), the fraction of the request's cache
        keys it holds (blocks sent there whose events have not come yet included); elsewhere the approximate
        index's fraction."""
        keys = request.cache_keys
        exact, _ = kv.match_depth(keys)
        scores = exact[candidates] / len(keys)
        live = kv.live[candidates]
        if live.all():
            return self._guarded(scores, state, candidates)
        hashes = request.prefix_hashes
        guess = self._guess(hashes, state, candidates) if hashes else NEUTRAL_SCORE
        return self._guarded(np.where(live, scores, 0.0 if guess is None else guess), state, candidates)

    def _guarded(self, scores: np.ndarray, state: State, candidates: np.ndarray) -> np.ndarray:
        over = state.inflight.overloaded(candidates, self.guard)
        if over is not None:
            scores[over] = 0.0
        return scores

    def on_pick(self, request: RequestFeatures, endpoint: int) -> None:
        hashes = request.prefix_hashes
        if not hashes:
            return
        try:
            self.index.record(endpoint, hashes)
        except Exception:
            if not self.record_errors:
                logger.exception("prefix index could not record a decision (logged once)")
            self.record_errors += 1
