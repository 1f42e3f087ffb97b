"""Paged KV-cache blocks with automatic prefix caching, as vLLM's V1 block pool keeps them.

Blocks are counted, not stored: what matters for timing and routing is how many blocks are free, which prompt
blocks are cached, and which cached block is evicted next. A block is *held* while some running request uses it
and *free* otherwise. A free block whose content is known (it has a hash) stays cached until it is evicted;
allocation takes never-used or uncached free blocks first, then evicts cached free blocks least recently freed
first. (vLLM keeps one free queue in free order, so it may evict an old cached block while an uncached one is
free; the difference only shows when the cache is nearly full of cached blocks.)

A request's blocks are tracked by its `BlockTable`: the hashes it holds a reference on, plus a count of blocks
that have no hash (the partial last block, output tokens, or a block whose hash another request cached first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BlockTable", "KVCache"]


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

    __slots__ = ("_lru", "_refs", "block_size", "free", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache needs num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self._refs: dict[int, int] = {}  # cached hash -> number of holders (0: free but still cached)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached hashes with no holder, oldest first

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
            for _ in range(n - uncached):
                h, _ = lru.popitem(last=False)
                del refs[h]
        self.free -= n
        table.plain += n
        return True

    def register(self, table: BlockTable, hashes: Sequence[int]) -> None:
        """``table`` has filled blocks with these hashes: cache them, unless another holder cached one first."""
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
