"""The exact prefix-cache index: per endpoint, the blocks its server says it holds, from the server's KV events.

`PrefixIndex` (scorer/prefix.py) guesses a server's cache from what the picker sent there. A server that publishes
KV events (`scorer.kvevents`) says exactly what it stored and evicted; `KVBlockIndex` keeps that, per endpoint,
keyed by chained keys of the blocks' token ids (`scorer.tokenizer.cache_keys`), so that a request tokenized the
same way matches it block by block. vLLM's own block hashes cannot be recomputed outside the server (they are
seeded per process), which is why every stored block is keyed again from the token ids its event carries, and
the server's hash is kept only to follow its parent links and its removals.

Between a decision and the server's event for it (the prompt's prefill) there is a gap in which the next request
with the same prefix would find nothing. A decision therefore records its blocks as *pending* on the chosen
endpoint for ``pending_s``; the server's event confirms them, or they lapse.

An endpoint's exact view is *live* while its events are to be trusted: subscribed and in sequence (a gap that
replay cannot fill makes it unsure for ``resync_s``: blocks stored during the gap are unknown), and not stale
(requests were routed there, yet no event came for ``stale_s``: its publisher has stopped). Where an endpoint is
not live, the scorers use the approximate index for it. Nor is one live while most blocks it reported lately are
*orphans*, runs whose parent the index never heard of: vLLM announces a block once, when it enters the cache, so
after a missed event every block that continues a prompt still cached (a shared system prompt, say) is unknown
here, long after ``resync_s``; such an endpoint stays unsure until its reports chain up again (a new prompt, or a
cleared cache). `tick` recomputes liveness and lets pending blocks lapse;
the subscriber (or the simulator) calls it a few times a second, and the hot path only reads `live`.

Bounds: at most ``max_blocks`` confirmed blocks per endpoint (beyond, the endpoint is no longer live: its view
is incomplete), and at most ``max_pending`` pending blocks in all (oldest lapse first). Not thread-safe: one
event loop owns it.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from inferlb.scorer.chainmatch import match_depth
from inferlb.scorer.features import token_block_hashes
from inferlb.scorer.kvevents import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

__all__ = ["KVBlockIndex", "KVEndpointState"]

logger = logging.getLogger(__name__)

# An endpoint whose recent reports are mostly orphans is unsure: over about the last ORPHAN_WINDOW blocks it
# reported, more than ORPHAN_SHARE of them (and at least ORPHAN_MIN) continued blocks the index never heard of.
ORPHAN_WINDOW = 256
ORPHAN_SHARE = 0.5
ORPHAN_MIN = 16


@dataclass(slots=True)
class KVEndpointState:
    """What the index knows of one endpoint's event stream (read by /endpoints)."""

    subscribed: bool = False
    last_event_at: float | None = None
    # The first decision with cache keys sent there since its last event (None: none since).
    waiting_since: float | None = None
    unsure_until: float = 0.0
    overflowed: bool = False
    mismatch: str = ""  # why its events cannot be used at all (a block size other than the index's)
    # Blocks it reported lately, and of them those whose parent was unknown: sums decayed by ORPHAN_WINDOW blocks.
    reported: float = 0.0
    orphaned: float = 0.0
    reason: str = "not subscribed"
    # The last sequence number the collector applied (None: none yet), here so that it follows the endpoint across
    # a membership change: the next pool's collector goes on from it rather than asking replay for everything.
    sequence: int | None = None


class KVBlockIndex:
    """Per endpoint (``size`` of them), the blocks of ``block_size`` tokens its server holds, from its KV events.

    ``clock`` is the routing core's (seconds). Events for another block size, for a LoRA adapter or for a medium
    other than the GPU's are counted in `skipped` and change nothing; a stored run whose parent the index does
    not know (it was evicted, or its event was missed) is counted as ``orphan``.
    """

    def __init__(
        self,
        size: int,
        *,
        clock: Callable[[], float],
        block_size: int = 16,
        pending_s: float = 2.0,
        stale_s: float = 5.0,
        resync_s: float = 30.0,
        max_blocks: int = 1 << 20,
        max_pending: int = 1 << 18,
    ) -> None:
        if size < 1:
            raise ValueError(f"a KV block index needs at least one endpoint, not size={size}")
        self.size = size
        self.block_size = block_size
        self.clock = clock
        self.pending_s = pending_s
        self.stale_s = stale_s
        self.resync_s = resync_s
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self._holders: dict[int, int] = {}  # key -> bitmask of the endpoints holding it (confirmed or pending)
        self._by_hash: list[dict[BlockHash, int]] = [{} for _ in range(size)]  # server's hash -> key
        self._held: list[Counter[int]] = [Counter() for _ in range(size)]  # key -> server hashes naming it
        self._pending: list[dict[int, float]] = [{} for _ in range(size)]  # key -> when it lapses
        self._lapse: deque[tuple[float, int, int]] = deque()  # (when, endpoint, key), oldest first
        self.states = [KVEndpointState() for _ in range(size)]
        self.live = np.zeros(size, dtype=bool)
        self.skipped: Counter[str] = Counter()
        self._memo: tuple[Sequence[int], tuple[np.ndarray, int]] | None = None

    # -- what servers report --------------------------------------------------------------------------------

    def apply(self, endpoint: int, batch: EventBatch) -> None:
        """Apply one batch of ``endpoint``'s events, in order."""
        self._heard(endpoint)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(endpoint, event)
            elif isinstance(event, BlockRemoved):
                if event.medium not in (None, "GPU"):
                    self.skipped["medium"] += 1
                    continue
                self.remove(endpoint, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(endpoint)
        self._refresh(endpoint, self.clock())

    def store(self, endpoint: int, hashes: Sequence[BlockHash], keys: Sequence[int]) -> None:
        """The server of ``endpoint`` cached blocks named ``hashes`` by it and ``keys`` here (aligned)."""
        self._heard(endpoint)
        self._memo = None
        by_hash, held, pending = self._by_hash[endpoint], self._held[endpoint], self._pending[endpoint]
        holders = self._holders
        bit = 1 << endpoint
        for server_hash, key in zip(hashes, keys, strict=True):
            if server_hash in by_hash:
                continue  # stored twice (a replay overlapping what was seen): nothing new
            if len(by_hash) >= self.max_blocks:
                state = self.states[endpoint]
                if not state.overflowed:
                    logger.warning(
                        "endpoint %d reports more than %d cached blocks; its exact view is off",
                        endpoint,
                        self.max_blocks,
                    )
                state.overflowed = True
                return
            by_hash[server_hash] = key
            held[key] += 1
            pending.pop(key, None)
            holders[key] = holders.get(key, 0) | bit

    def remove(self, endpoint: int, hashes: Iterable[BlockHash]) -> None:
        """The server of ``endpoint`` evicted these blocks (unknown ones are ignored)."""
        self._heard(endpoint)
        self._memo = None
        by_hash, held, pending = self._by_hash[endpoint], self._held[endpoint], self._pending[endpoint]
        for server_hash in hashes:
            key = by_hash.pop(server_hash, None)
            if key is None:
                continue
            held[key] -= 1
            if held[key] <= 0:
                del held[key]
                if key not in pending:
                    self._drop(endpoint, key)
        if self.states[endpoint].overflowed and len(by_hash) < self.max_blocks:
            self.states[endpoint].overflowed = False

    def clear(self, endpoint: int) -> None:
        """Forget everything ``endpoint`` held (its cache was reset, or its server is another one now)."""
        self._heard(endpoint)
        self._memo = None
        for key in set(self._held[endpoint]) | set(self._pending[endpoint]):
            self._drop(endpoint, key)
        self._by_hash[endpoint] = {}
        self._held[endpoint] = Counter()
        self._pending[endpoint] = {}
        state = self.states[endpoint]
        state.overflowed = False
        state.reported = state.orphaned = 0.0  # an empty cache: what it stores next chains from nothing
        state.mismatch = ""  # a reset or restarted server: its next blocks say their size again
        self._refresh(endpoint, self.clock())

    def restarted(self, endpoint: int) -> None:
        """``endpoint``'s server is another process now (it came back while draining): forget what it held and where
        its sequence was; the new server's numbers start again."""
        self.clear(endpoint)
        self.states[endpoint].sequence = None

    def subscribed(self, endpoint: int, on: bool) -> None:
        """Whether ``endpoint``'s event stream is being read now (the subscriber says so)."""
        state = self.states[endpoint]
        state.subscribed = on
        if not on:
            state.waiting_since = None
        self._refresh(endpoint, self.clock())

    def lost(self, endpoint: int) -> None:
        """Events of ``endpoint`` were missed and could not be replayed: what it stored meanwhile is unknown, so its
        exact view is unsure for ``resync_s`` (blocks it stores from now on are known again by then)."""
        now = self.clock()
        self.states[endpoint].unsure_until = now + self.resync_s
        self._refresh(endpoint, now)

    # -- what the picker does -------------------------------------------------------------------------------

    def sent(self, endpoint: int, keys: Sequence[int]) -> None:
        """A decision sent a prompt with these keys to ``endpoint``: pending there until its server's event."""
        if not keys:
            return
        now = self.clock()
        state = self.states[endpoint]
        if state.waiting_since is None:
            state.waiting_since = now
        self._memo = None
        until = now + self.pending_s
        held, pending, holders, lapse = self._held[endpoint], self._pending[endpoint], self._holders, self._lapse
        bit = 1 << endpoint
        for key in keys:
            if key in held:
                continue
            pending[key] = until
            holders[key] = holders.get(key, 0) | bit
            lapse.append((until, endpoint, key))
        while len(lapse) > self.max_pending:
            self._lapse_one()

    def tick(self) -> None:
        """Let pending blocks lapse and recompute which endpoints are live; a few times a second."""
        now = self.clock()
        lapse = self._lapse
        while lapse and lapse[0][0] <= now:
            self._lapse_one()
        for endpoint in range(self.size):
            self._refresh(endpoint, now)

    def match_depth(self, keys: Sequence[int]) -> tuple[np.ndarray, int]:
        """(how many leading blocks of ``keys`` each endpoint holds, confirmed or pending; the largest), read-only
        and shared with the next caller asking about the same keys object."""
        memo = self._memo
        if memo is not None and memo[0] is keys:
            return memo[1]
        result = match_depth(self._holders, keys, self.size)
        result[0].setflags(write=False)
        self._memo = (keys, result)
        return result

    def held(self, endpoint: int) -> int:
        """The number of blocks ``endpoint``'s server reported it holds."""
        return len(self._by_hash[endpoint])

    def pending(self, endpoint: int) -> int:
        """The number of blocks sent to ``endpoint`` that its server has not yet reported."""
        return len(self._pending[endpoint])

    def keys_of(self, endpoint: int) -> set[int]:
        """The keys of the blocks ``endpoint``'s server reported it holds (for checks against the server)."""
        return set(self._held[endpoint])

    def moved(self, mapping: np.ndarray) -> KVBlockIndex:
        """A new index for the next pool after a membership change (see `adopt`), with the same settings."""
        index = KVBlockIndex(
            len(mapping),
            clock=self.clock,
            block_size=self.block_size,
            pending_s=self.pending_s,
            stale_s=self.stale_s,
            resync_s=self.resync_s,
            max_blocks=self.max_blocks,
            max_pending=self.max_pending,
        )
        index.adopt(self, mapping)
        return index

    def adopt(self, old: KVBlockIndex, mapping: np.ndarray) -> None:
        """Take over ``old``'s endpoints after a membership change: endpoint j here is ``mapping[j]`` there (-1:
        joined, starts empty and not subscribed). Call it before anything else. Everything is copied: ``old``'s
        collector runs on until the picker's restart stops it, and what it applies there must not reach here (it
        cleared the old index's holder bits only, so a block it removed stayed held here for good)."""
        self._memo = None
        for j, i in enumerate(mapping.tolist()):
            if i < 0 or i >= old.size:
                continue
            self._by_hash[j] = dict(old._by_hash[i])
            self._held[j] = old._held[i].copy()
            self._pending[j] = dict(old._pending[i])
            self.states[j] = replace(old.states[i])
            bit = 1 << j
            for key in set(self._held[j]) | set(self._pending[j]):
                self._holders[key] = self._holders.get(key, 0) | bit
            for key, until in self._pending[j].items():
                self._lapse.append((until, j, key))
        self.skipped.update(old.skipped)
        self.tick()

    # -- internals ------------------------------------------------------------------------------------------

    def _stored(self, endpoint: int, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            self.skipped["block_size"] += 1
            sizes = f"its server's blocks are {event.block_size} tokens, kv_events.block_size is {self.block_size}"
            self.states[endpoint].mismatch = sizes
            return
        if event.lora_id is not None:
            self.skipped["lora"] += 1
            return
        if event.medium not in (None, "GPU"):
            self.skipped["medium"] += 1
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.skipped["token_count"] += 1
            return
        seed = 0
        parent = None if event.parent_block_hash is None else self._by_hash[endpoint].get(event.parent_block_hash)
        self._reported(endpoint, len(event.block_hashes), orphan=event.parent_block_hash is not None and parent is None)
        if event.parent_block_hash is not None:
            if parent is None:
                self.skipped["orphan"] += 1
                return
            seed = parent
        keys = token_block_hashes(
            event.token_ids, block_tokens=event.block_size, max_blocks=len(event.block_hashes), seed=seed
        )
        self.store(endpoint, event.block_hashes, keys)

    def _reported(self, endpoint: int, blocks: int, *, orphan: bool) -> None:
        state = self.states[endpoint]
        keep = (1.0 - 1.0 / ORPHAN_WINDOW) ** blocks
        state.reported = state.reported * keep + blocks
        state.orphaned = state.orphaned * keep + (blocks if orphan else 0)

    def _heard(self, endpoint: int) -> None:
        """The endpoint's server spoke: its stream is not stale."""
        state = self.states[endpoint]
        state.last_event_at = self.clock()
        if state.waiting_since is not None:
            state.waiting_since = None
            self._refresh(endpoint, state.last_event_at)

    def _drop(self, endpoint: int, key: int) -> None:
        rest = self._holders.get(key, 0) & ~(1 << endpoint)
        if rest:
            self._holders[key] = rest
        else:
            self._holders.pop(key, None)

    def _lapse_one(self) -> None:
        until, endpoint, key = self._lapse.popleft()
        pending = self._pending[endpoint]
        if pending.get(key) != until:
            return  # confirmed, sent again since (a later entry lapses it), or cleared
        del pending[key]
        if key not in self._held[endpoint]:
            self._memo = None
            self._drop(endpoint, key)

    def _refresh(self, endpoint: int, now: float) -> None:
        state = self.states[endpoint]
        if state.mismatch:
            reason = state.mismatch
        elif not state.subscribed:
            reason = "not subscribed"
        elif state.overflowed:
            reason = f"more than {self.max_blocks} blocks reported"
        elif now < state.unsure_until:
            reason = "missed events, resyncing"
        elif state.orphaned >= ORPHAN_MIN and state.orphaned > ORPHAN_SHARE * state.reported:
            share = state.orphaned / state.reported
            reason = f"{share:.0%} of the blocks it reported lately continue blocks never reported here (missed events)"
        elif state.waiting_since is not None and now - state.waiting_since > self.stale_s:
            reason = f"no events for {now - state.waiting_since:.1f} s while requests were sent there"
        else:
            reason = ""
        state.reason = reason or "live"
        self.live[endpoint] = not reason
