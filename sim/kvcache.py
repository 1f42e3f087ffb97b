"""Paged KV-cache blocks with automatic prefix caching, as vLLM's V1 block pool keeps them.

Blocks are counted, not stored: what matters for timing and routing is how many blocks are free, which prompt
blocks are cached, and which cached block is evicted next. A block is *held* while some running request uses it
and *free* otherwise. A free block whose content is known (it has a hash) stays cached until it is evicted;
allocation takes never-used or uncached free blocks first, then evicts cached free blocks least recently freed
first. (vLLM keeps one free queue in free order, so it may evict an old cached block while an uncached one is
free; the difference only shows when the cache is nearly full of cached blocks.)

A request's blocks are tracked by its `BlockTable`: the hashes it holds a reference on, plus a count of blocks
that have no hash (the partial last block, output tokens, or a block whose hash another request cached first).

A `KVListener`, when one is set, hears every change to *which hashes are cached*: blocks newly cached, cached
blocks evicted, and the whole cache cleared; this is what vLLM publishes as KV-cache events (`sim/kvevents.py`).
Holding and releasing blocks that stay cached is not a change. Without a listener the cost is one ``is None`` test.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["BlockTable", "KVCache", "KVListener"]


class KVListener(Protocol):
    """Hears the changes to the set of cached block hashes, in the order they happen, on the cache's thread.

    Calls must be cheap and must not raise (they run inside engine steps); the lists passed are not reused by the
    cache, so a listener may keep them.
    """

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """``hashes`` (consecutive blocks of one prompt, in order) became cached. ``parent`` is the hash of the block
        before the first of them (None: it is the prompt's first block); ``token_ids`` are those blocks' tokens,
        ``block_size`` per block, or empty when the caller does not know them."""

    def removed(self, hashes: list[int]) -> None:
        """Cached blocks with these hashes were evicted (least recently freed first)."""

    def cleared(self) -> None:
        """Every cached block was dropped (a restart)."""


class BlockTable:
    """The blocks one request holds. Owned by the engine; a `KVCache` changes it."""

    __slots__ = ("hashed", "plain")

    def __init__(self) -> None:
        self.hashed: list[int] = []
        self.plain = 0

    @property
    def blocks(self) -> int:
        return len(self.hashed) + self.plain


class KVCache:
    """``num_blocks`` blocks of ``block_size`` tokens. Single-threaded; every method is O(blocks touched).

    Invariants: ``0 <= free <= num_blocks``; ``used == num_blocks - free`` equals the sum of the blocks held by
    the live block tables; every hash in the LRU is cached with no holder.
    """

    __slots__ = ("_lru", "_refs", "block_size", "free", "listener", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int, listener: KVListener | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache needs num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self._refs: dict[int, int] = {}  # cached hash -> number of holders (0: free but still cached)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached hashes with no holder, oldest first
        self.listener = listener

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, as vLLM's ``kv_cache_usage_perc`` reports it (0..1)."""
        return (self.num_blocks - self.free) / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def cached_hashes(self) -> list[int]:
        """Every hash cached now, held or free (a copy, in no particular order): the truth a KV-event index mirrors."""
        return list(self._refs)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """(leading blocks of ``hashes[:limit]`` that are cached, how many of those are free) — no side effects."""
        refs = self._refs
        hits = idle = 0
        for h in hashes[:limit] if limit < len(hashes) else hashes:
            count = refs.get(h)
            if count is None:
                break
            hits += 1
            if count == 0:
                idle += 1
        return hits, idle

    def take_cached(self, table: BlockTable, hashes: Sequence[int]) -> None:
        """Make ``table`` hold the cached blocks ``hashes`` (all must be cached; see `match`)."""
        refs, lru = self._refs, self._lru
        for h in hashes:
            count = refs[h]
            if count == 0:
                del lru[h]
                self.free -= 1
            refs[h] = count + 1
        table.hashed.extend(hashes)

    def allocate(self, table: BlockTable, n: int) -> bool:
        """Give ``table`` ``n`` new unhashed blocks, evicting cached free blocks if needed; False if too few free."""
        if n <= 0:
            return True
        if n > self.free:
            return False
        uncached = self.free - len(self._lru)
        if n > uncached:
            lru, refs = self._lru, self._refs
            if self.listener is None:
                for _ in range(n - uncached):
                    h, _ = lru.popitem(last=False)
                    del refs[h]
            else:
                evicted = [lru.popitem(last=False)[0] for _ in range(n - uncached)]
                for h in evicted:
                    del refs[h]
                self.listener.removed(evicted)
        self.free -= n
        table.plain += n
        return True

    def register(
        self, table: BlockTable, hashes: Sequence[int], parent: int | None = None, token_ids: Sequence[int] = ()
    ) -> None:
        """``table`` has filled blocks with these hashes: cache them, unless another holder cached one first.

        ``parent`` (the hash of the block before ``hashes[0]``, None for a prompt's first block) and ``token_ids``
        (``block_size`` ids per hash, or empty) only serve the listener, which hears one `KVListener.stored` per run
        of consecutive blocks newly cached."""
        if table.plain == 0:
            return
        refs = self._refs
        # Bulk dict operations: the simulator registers millions of blocks, so keep the per-block work in C.
        fresh = dict.fromkeys([h for h in hashes if h not in refs], 1)
        if len(fresh) > table.plain:
            fresh = dict.fromkeys(list(fresh)[: table.plain], 1)
        refs.update(fresh)
        table.plain -= len(fresh)
        table.hashed.extend(fresh)
        if self.listener is not None and fresh:
            self._announce(hashes, fresh, parent, token_ids)

    def _announce(self, hashes: Sequence[int], fresh: dict[int, int], parent: int | None, ids: Sequence[int]) -> None:
        """Tell the listener about the runs of ``hashes`` that are in ``fresh`` (each hash once, in order)."""
        listener, bs = self.listener, self.block_size
        if listener is None:
            return
        pending = set(fresh)
        start = -1
        for i, h in enumerate([*hashes, None]):
            if h is not None and h in pending:
                pending.discard(h)
                if start < 0:
                    start = i
            elif start >= 0:
                before = hashes[start - 1] if start else parent
                tokens = ids[start * bs : i * bs] if ids else ()
                listener.stored(list(hashes[start:i]), before, tokens)
                start = -1

    def release(self, table: BlockTable) -> None:
        """Free every block of ``table``. Hashed blocks stay cached; the last block of a prompt is evicted first."""
        refs = self._refs
        held = table.hashed[::-1]
        counts = list(map(refs.__getitem__, held))
        if counts.count(1) == len(counts):
            idle = dict.fromkeys(held, 0)
        else:
            idle = dict.fromkeys([h for h, c in zip(held, counts, strict=True) if c == 1], 0)
            refs.update([(h, c - 1) for h, c in zip(held, counts, strict=True) if c > 1])
        refs.update(idle)
        self._lru.update(dict.fromkeys(idle))
        self.free += len(idle) + table.plain
        table.hashed = []
        table.plain = 0

    def reset(self) -> None:
        """Forget everything (a restart). Block tables still alive must be discarded by the caller."""
        self.free = self.num_blocks
        self._refs.clear()
        self._lru.clear()
        if self.listener is not None:
            self.listener.cleared()
