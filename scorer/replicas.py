"""Picker replicas that share routing state through Redis (config ``replicas``).

Several pickers serve one pool at once (processes on a node, pods behind a Service). Each counts what it routed
itself; to route as one picker would, each must also see what the others have in flight. They exchange it
through one Redis stream per pool (``replicas.key``), off the hot path:

* **Publishing.** Every ``publish_interval_s`` a replica appends one entry with its own load on the endpoints
  whose load changed since its last entry (`InFlight.own`, as absolute values): requests and tokens in flight,
  requests sent so far, the estimated prefill backlog with its age (peers drain it as their own, `InFlight`)
  and the exact one, which waits for first tokens (``otel.latency_source: stream``); once a second, all of
  them (a full snapshot, which is also its heartbeat). While nothing changes it waits for its next decision
  (``IDLE_TICK_S`` at most) instead of ticking. The tick's entries go in one pipelined round trip. A decision
  never waits on Redis: it changes the local counters only, and the next tick reads them.
* **What that gives.** Every scorer reads in-flight counts that include the peers'; the saturation rule (one
  for admission and the filter) adds to a scraped queue the growth of what *every* replica has in flight since the
  scrape, so an endpoint one replica filled is saturated for all (global admission); the predicted TTFT counts the
  peers' prefill backlog. Session affinity needs no exchange: its ring is the same in every process (BLAKE2b), and
  the loads that bound it are the shared counts.
* **Ends and first tokens.** Envoy's access-log stream, and a response's observing stream (``otel.latency_source:
  stream``), reach one replica each, not necessarily the one that routed the request: a request's end, or its
  first token, that a replica holds no lease for goes out with its next entry, and the replica that holds the
  lease releases it, or takes its prompt out of its exact prefill backlog (`InFlight.first_tokens`). So does an
  experiment's outcome (a response's timing, or a failure in Envoy's access log) of a request whose arm a replica
  does not hold: the replica that routed it counts it for the arm.
* **Prefixes.** Each decision's prompt blocks (its prefix hashes) are published with the next tick, and peers
  record them in their prefix index as if they had made the decision: a prompt's prefix is found on the
  endpoint any replica sent it to. Prefix hashes are Python's ``hash``, salted per process: replicas agree on
  them only with the same ``PYTHONHASHSEED`` (a secret number, the same on every replica, and the same Python),
  which each entry's fingerprint checks; without it, only in-flight counts are shared (`hash_seed_problem`).
* **Following.** A background task reads the others' entries as they come (``XREAD BLOCK``) and sets what each
  peer has per endpoint; the sum over peers goes into the engine's counters (`InFlight.set_peers`), which every
  scorer reads as one view. A replica that starts late or restarts first replays the stream (bounded: the newest
  ``STREAM_MAXLEN`` entries), its warm start, so it is caught up before it reports ready. One that reconnects (a
  blip, a failover, a timeout) reads only the entries after the last one it applied, if the stream still holds
  that one; if not (trimmed, or Redis lost the stream), it replays what the stream holds. Each entry is aged by
  Redis's clock, and ends and first tokens in a replay older than ``peer_ttl_s`` are ignored. A replay reads
  ``CATCH_UP_COUNT`` entries at a time and gives the event loop a turn after each such slice, so that a long
  one (entries with prompts cost the most to apply) delays routing by one slice at most, never by the whole.

Consistency: each replica's counts are its own truth, sent as absolute values, so an entry lost or applied twice
costs nothing once the next one (at most a second later) arrives; a replica sees its peers' counts as they were
one publishing interval plus a Redis round trip ago (a few ms). Routing needs no more: a decision weighs load
that changes on that scale anyway, and each replica's own decisions count at once. A peer not heard from for
``peer_ttl_s`` (it died, or Redis is down) counts no more, so a lost peer's requests do not weigh forever.

Trust: Redis AUTH (``username``, ``password`` from a file or variable) and TLS (``rediss://``). An entry is
applied only as far as it is well formed and names members of this replica's own pool; anything else is
counted (``rejected``) and changes nothing. Without Redis (unreachable, refusing the credentials, slow) every
replica routes on its own view and says so: a log line per transition, `problem`, and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from inferlb.scorer.config import ReplicasConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.features import MAX_PREFIX_BLOCKS, RequestFeatures
from inferlb.scorer.inflight import InFlight, Load

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["FULL_EVERY_S", "STREAM_MAXLEN", "ReplicaStats", "Replicas", "connect_redis", "hash_seed_problem"]

logger = logging.getLogger(__name__)

STREAM_MAXLEN = 20_000  # entries kept in the stream (trimmed approximately): the replay of a replica that starts
CATCH_UP_COUNT = 100  # entries a replay reads (and applies) between two turns of the event loop
FULL_EVERY_S = 1.0  # a full snapshot (and heartbeat) this often
MAX_PEERS = 1024  # more writers than this are refused: no real fleet has them, and each costs memory
MAX_COUNT = 1 << 40  # a count beyond this is not a count (sent: cumulative)
MAX_AGE_MS = 3_600_000  # a prefill backlog older than this has drained anyway
MAX_PENDING_PREFIXES = 10_000  # decisions waiting to be published (Redis down: the oldest are dropped)
MAX_PREFIXES_PER_ENTRY = 1_000
MAX_PENDING_ENDS = 100_000  # request ends waiting to be passed on (Redis down: the oldest are dropped)
MAX_ENDS_PER_ENTRY = 5_000
MAX_REQUEST_ID_CHARS = 256
MAX_OUTCOME_S = 86_400.0  # a latency beyond this in a peer's outcome is not one
FINGERPRINT_TEXT = "inferlb: prefix block hashes"
IDLE_TICK_S = 0.05  # the publishing tick while nothing changes
BLOCK_S = 0.1  # how long one read of the stream waits for entries (expiry runs between reads)
_RETRY_S = (0.1, 2.0)  # reconnecting: the first wait and the longest
_HASH_MIN, _HASH_MAX = -(1 << 63), (1 << 63) - 1  # what hash() gives on a 64-bit build


@dataclass(slots=True)
class ReplicaStats:
    """Counters (event-loop owned)."""

    published: int = 0  # entries this replica appended
    applied: int = 0  # peers' entries applied
    rejected: int = 0  # peers' entries (or parts of them) refused: malformed, or naming no member of the pool
    outages: int = 0  # transitions to "Redis unreachable"
    caught_up: int = 0  # replays of the stream (at start and after each outage)
    prefixes_published: int = 0  # decisions whose prompt blocks this replica published
    prefixes_applied: int = 0  # peers' decisions recorded in the prefix index
    ends_passed: int = 0  # ends of requests this replica did not hold, passed on to the others
    ends_taken: int = 0  # ends passed on by a peer that released a lease held here
    first_tokens_passed: int = 0  # first tokens of requests this replica did not hold, passed on to the others
    first_tokens_taken: int = 0  # first tokens passed on by a peer for a lease held here
    outcomes_passed: int = 0  # experiment outcomes of requests whose arm this replica did not hold, passed on
    outcomes_taken: int = 0  # experiment outcomes passed on by a peer for an arm held here


@dataclass(slots=True)
class _Peer:
    seen: float  # monotonic time of its newest entry
    # address -> (requests, tokens, sent since first heard of, estimated prefill backlog, its time on this replica's
    # clock, exact prefill backlog)
    counts: dict[str, tuple[int, int, int, int, float, int]] = field(default_factory=dict)
    sent_base: dict[str, int] = field(default_factory=dict)  # address -> its sent count when first heard of


class Replicas:
    """This replica's side of the exchange. ``engine`` gives the engine in force (it changes on a reload or a
    membership change). `run` until cancelled; `ready` once caught up (or once Redis is known to be down: the
    replica then routes alone). One event loop; not thread-safe."""

    def __init__(
        self,
        config: ReplicasConfig,
        engine: Callable[[], Engine],
        *,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.id = replica_id or uuid.uuid4().hex[:12]
        self._engine = engine
        self._clock = clock
        self.stats = ReplicaStats()
        self.up: bool | None = None  # None: not tried yet
        # Peers that went silent so far: the ends of requests routed here that reached one of them may be lost
        # (Envoy's access-log stream to it, and what it had not passed on yet).
        self.peers_gone = 0
        self.caught_up = False
        self.problem: str | None = None
        self._peers: dict[str, _Peer] = {}
        self._applied_to: InFlight | None = None  # the counters the peers' sum was last put into
        self._last_id: str | None = None  # the newest stream entry read (a peer's or its own), across sessions
        self._dirty = False
        self._sent: dict[str, tuple[int, ...]] = {}
        # (pool, requests, sent, backlog) last read
        self._sent_arrays: tuple[Any, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._full_at = -FULL_EVERY_S
        self._client: aioredis.Redis | None = None
        # Prefix block hashes are Python's hash(), salted per process: replicas agree on them only with the same
        # PYTHONHASHSEED (and Python). The fingerprint, one such hash, tells whether a peer's agree with ours.
        self.hash_problem = hash_seed_problem()
        self.share_prefixes = self.hash_problem is None
        self.fingerprint = str(hash(FINGERPRINT_TEXT))
        self._pending: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MAX_PENDING_PREFIXES)
        self._told_fingerprint = False
        self._busy = True  # whether the last tick or a decision since had something to publish
        self._waker: asyncio.Future[None] | None = None  # an idle publisher waits on it
        self._ends: deque[str] = deque(maxlen=MAX_PENDING_ENDS)
        self._first_tokens: deque[str] = deque(maxlen=MAX_PENDING_ENDS)
        self._outcomes: deque[tuple[str, float | None, float | None, bool]] = deque(maxlen=MAX_PENDING_ENDS)
        # Releases this replica's lease of a request id, if it holds one (True then): set by the picker.
        self.finish: Callable[[str], bool] | None = None
        # Tells this replica's lease of a request id of its first token, if it holds one (True then): set by the
        # picker where the prefill backlog is exact (`InFlight.first_tokens`).
        self.first_token: Callable[[str], bool] | None = None
        # Counts a peer's experiment outcome (request id, TTFT, E2E, failed) where this replica holds the request's
        # arm (True then): set by the picker.
        self.take_outcome: Callable[[str, float | None, float | None, bool], bool] | None = None

    # ---- state for the picker ---------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.caught_up or self.up is False

    def peers(self) -> int:
        return len(self._peers)

    def ended_elsewhere(self, request_id: str) -> None:
        """Envoy reported the end of a request this replica holds no lease for: another replica routed it (Envoy's
        access-log stream reached this one). Passed on with the next tick."""
        self._ends.append(request_id)
        self._nudge()

    def first_token_elsewhere(self, request_id: str) -> None:
        """The filter saw the first token of a request this replica holds no lease for (its observing stream
        reached this one): passed on with the next tick, for the exact prefill backlog of the replica that holds
        it."""
        self._first_tokens.append(request_id)
        self._nudge()

    def outcome_elsewhere(self, request_id: str, ttft_s: float | None, e2e_s: float | None, failed: bool) -> None:
        """An experiment outcome of a request whose arm this replica does not hold (the response's timing, or Envoy's
        access log, reached this one): passed on with the next tick, for the replica that routed it."""
        self._outcomes.append((request_id, ttft_s, e2e_s, failed))
        self._nudge()

    def _nudge(self) -> None:
        """Something to publish: an idle publisher wakes now."""
        self._busy = True
        waker = self._waker
        if waker is not None:
            _wake(waker)

    def routed(self, address: str, hashes: tuple[int, ...]) -> None:
        """A decision of this replica: its prompt's blocks went to ``address`` (published with the next tick)."""
        self._nudge()
        if hashes and self.share_prefixes:
            self._pending.append((address, hashes))

    # ---- the exchange -----------------------------------------------------------------------------------

    async def run(self) -> None:
        from redis.exceptions import RedisError  # with Redis only: a picker without replicas does not load it

        if self.hash_problem is not None:
            logger.warning("replicas: the prefix index is not shared (%s); in-flight counts are", self.hash_problem)
        retry = _RETRY_S[0]
        while True:
            _raise_if_cancelled()
            replays = self.stats.caught_up
            try:
                await self._session()
            except (RedisError, OSError, ValueError, ConfigError) as exc:
                self._down(exc)
            if self.stats.caught_up > replays:
                retry = _RETRY_S[0]  # it was in touch: the outage starts now
            # Peers expire on schedule while Redis is away, so that their counts stop weighing.
            deadline = self._clock() + retry
            while self._clock() < deadline:
                self._expire()
                await asyncio.sleep(min(0.25, retry))
            retry = min(retry * 2, _RETRY_S[1])

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _session(self) -> None:
        await self.close()
        client = self._client = connect_redis(self.config)
        last_id = await self._catch_up(client)
        _raise_if_cancelled()  # a stop that came during the catch-up, which redis-py may have swallowed
        self._sent, self._full_at = {}, -FULL_EVERY_S  # the first entry after a (re)connection is a full one
        self._sent_arrays = None
        tasks = {
            asyncio.create_task(self._publish(client), name="replicas-publish"),
            asyncio.create_task(self._follow(client, last_id), name="replicas-follow"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()  # the error that ended the session

    async def _catch_up(self, client: aioredis.Redis) -> str:
        """Replay the stream from just after the entry last read, or from its start (`_replay_from`): every peer's
        newest counts, aged by Redis's clock, ``CATCH_UP_COUNT`` entries at a time with a turn of the event loop
        after each (a serving replica routes meanwhile). The id to follow from."""
        now_s, now_us = await client.time()
        redis_ms = int(now_s) * 1000 + int(now_us) // 1000
        local = self._clock()  # this replica's clock when Redis's read redis_ms, give or take a round trip
        start = await self._replay_from(client)
        while True:
            _raise_if_cancelled()
            entries: Any = await client.xrange(self.config.key, start, "+", count=CATCH_UP_COUNT)
            now = self._clock()
            now_ms = redis_ms + (now - local) * 1000  # Redis's clock now, as far as this one tells
            for entry_id, fields in entries:
                last = self._last_id = _text(entry_id)
                age_s = max(now_ms - _entry_ms(entry_id), 0) / 1000
                self._apply(fields, now - age_s)
            if len(entries) < CATCH_UP_COUNT:
                break
            start = _after(last)
            await asyncio.sleep(0)  # routing goes on between slices
        self._expire()
        self._put()
        self.stats.caught_up += 1
        self.caught_up = True
        self._up()
        return self._last_id or "0-0"

    async def _replay_from(self, client: aioredis.Redis) -> str:
        """Where a replay starts: just after the entry last read, if the stream still holds it (a reconnection);
        else its start (a fresh replica, or the entry is gone: trimmed away, so all the stream holds is newer, or
        Redis lost the stream and its new ids may be behind this one's, which following from it would skip)."""
        last = self._last_id
        if last is not None:
            held: Any = await client.xrange(self.config.key, last, last, count=1)
            if held:
                return _after(last)
            self._last_id = None
        return "-"

    async def _publish(self, client: aioredis.Redis) -> None:
        interval = self.config.publish_interval_s
        while True:
            _raise_if_cancelled()
            # Every interval while requests come. When nothing has changed, it waits for the next decision (or a
            # request's end passed on), or IDLE_TICK_S at most: each wake-up of the event loop costs ~0.15 ms of
            # CPU here. After a wake-up it waits the interval, so that the decisions around it go in one entry.
            if not self._busy:
                await self._idle()
            await asyncio.sleep(interval)
            self._busy = False
            engine = self._engine()
            load = engine.inflight.own()
            now = self._clock()
            full = now - self._full_at >= FULL_EVERY_S
            last = self._sent_arrays
            # Every change of the load comes with a decision or an end, which moves `sent` or `requests`, or with a
            # first token, which moves the exact backlog. The estimated backlog drains on the peers' side: it
            # changes here only with a decision.
            unchanged = (
                last is not None
                and last[0] is engine.pool
                and np.array_equal(last[1], load.requests)
                and np.array_equal(last[2], load.sent)
                and np.array_equal(last[3], load.exact)
            )
            self._sent_arrays = (engine.pool, load.requests, load.sent, load.exact)
            if (
                unchanged
                and not full
                and not self._ends
                and not self._pending
                and not self._first_tokens
                and not self._outcomes
            ):
                continue  # most ticks: nothing to say
            self._busy = True
            current = _load_values(engine.pool, load, engine.inflight.clock())
            if full:
                kind, payload = "full", current
                self._full_at = now
            else:
                kind = "changes"
                # The backlog's age (the fifth) moves on its own: an endpoint whose load is unchanged is left out.
                payload = {
                    a: v
                    for a, v in current.items()
                    if (old := self._sent.get(a)) is None or old[:4] != v[:4] or old[5:] != v[5:]
                }
                payload.update({a: (0, 0, 0, 0, 0) for a in self._sent.keys() - current.keys()})  # left the pool
            self._sent = current
            ends, pending, firsts, outcomes = self._ends, self._pending, self._first_tokens, self._outcomes
            end_ids = [ends.popleft() for _ in range(min(len(ends), MAX_ENDS_PER_ENTRY))]
            first_ids = [firsts.popleft() for _ in range(min(len(firsts), MAX_ENDS_PER_ENTRY))]
            told = [outcomes.popleft() for _ in range(min(len(outcomes), MAX_ENDS_PER_ENTRY))]
            prompts = [pending.popleft() for _ in range(min(len(pending), MAX_PREFIXES_PER_ENTRY))]
            if not (payload or end_ids or first_ids or told or prompts):
                continue
            # One entry per tick, whatever it carries: the Redis client's work per command is most of the cost,
            # on both sides (one XADD here, one entry to parse in each peer).
            fields: dict[str, Any] = {"r": self.id, "k": kind if payload else "tick"}
            if payload:
                fields["d"] = orjson.dumps(payload)
            if end_ids:
                fields["e"] = orjson.dumps(end_ids)
            if first_ids:
                fields["f"] = orjson.dumps(first_ids)
            if told:
                fields["o"] = orjson.dumps(told)
            if prompts:
                fields["h"] = self.fingerprint
                fields["p"] = orjson.dumps(prompts)
            try:
                await client.xadd(self.config.key, fields, maxlen=STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
            except BaseException:
                ends.extendleft(reversed(end_ids))  # kept for the next attempt (within the pending bounds)
                firsts.extendleft(reversed(first_ids))
                outcomes.extendleft(reversed(told))
                pending.extendleft(reversed(prompts))
                raise
            self.stats.published += 1
            self.stats.ends_passed += len(end_ids)
            self.stats.first_tokens_passed += len(first_ids)
            self.stats.outcomes_passed += len(told)
            self.stats.prefixes_published += len(prompts)

    async def _idle(self) -> None:
        loop = asyncio.get_running_loop()
        waker = self._waker = loop.create_future()
        timer = loop.call_later(IDLE_TICK_S, _wake, waker)
        try:
            await waker
        finally:
            timer.cancel()
            self._waker = None

    async def _follow(self, client: aioredis.Redis, last_id: str) -> None:
        block_ms = int(BLOCK_S * 1000)
        while True:
            _raise_if_cancelled()
            reply: Any = await client.xread({self.config.key: last_id}, count=1000, block=block_ms)
            now = self._clock()
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last_id = self._last_id = _text(entry_id)
                    self._apply(fields, now)
            self._expire()  # and puts the peers' sum into the counters, if anything changed

    # ---- applying peers' entries ------------------------------------------------------------------------

    def _apply(self, fields: dict[Any, Any], seen: float) -> None:
        replica = _text(fields.get(b"r", b""))
        if replica == self.id:
            return
        kind = _text(fields.get(b"k", b""))
        payload = _json(fields.get(b"d", b""))
        if kind == "prefix":  # an entry of its own (replicas of an earlier version)
            self._apply_prefixes(_text(fields.get(b"h", b"")), payload)
            return
        if kind == "ends":
            self._apply_ends(payload, seen)
            return
        if b"p" in fields:
            self._apply_prefixes(_text(fields.get(b"h", b"")), _json(fields[b"p"]))
        if b"e" in fields:
            self._apply_ends(_json(fields[b"e"]), seen)
        if b"f" in fields:
            self._apply_first_tokens(_json(fields[b"f"]), seen)
        if b"o" in fields:
            self._apply_outcomes(_json(fields[b"o"]), seen)
        if kind == "tick" and replica:  # decisions, ends and first tokens only: its load was unchanged
            return
        if not replica or kind not in ("full", "changes") or not isinstance(payload, dict):
            self.stats.rejected += 1
            return
        engine = self._engine()
        if len(payload) > len(engine.pool):  # more endpoints than this pool has: not a peer of this pool
            self.stats.rejected += 1
            return
        pool, local = engine.pool, engine.inflight.clock()
        # Only members of this pool, with counts, count: this replica's pool is its own. A writer that names none (a
        # picker of another pool under the same key) is no peer: it would count in `peers`, which divides quotas.
        members = {
            address: value
            for address, value in payload.items()
            if pool.find(address) is not None
            and isinstance(value, list)
            and len(value) in (2, 5, 6)
            and all(isinstance(v, int) and 0 <= v <= MAX_COUNT for v in value)
        }
        if not members:
            self.stats.rejected += 1
            return
        peer = self._peers.get(replica)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self.stats.rejected += 1
                return
            peer = self._peers[replica] = _Peer(seen)
        counts = {} if kind == "full" else peer.counts
        for address, value in members.items():
            if len(value) == 2:  # in flight only (an older replica)
                counts[address] = (value[0], value[1], 0, 0, 0.0, 0)
            else:
                requests, tokens, sent, backlog, age_ms, *exact = value  # no exact backlog: none, or an older replica
                # What it sent before this replica first heard of it is no news: only what it sends from then on
                # adds to a scraped queue (else a peer that joins would saturate every endpoint until the scrape).
                base = peer.sent_base.setdefault(address, sent)
                if sent < base:
                    base = peer.sent_base[address] = sent
                at = local - min(age_ms, MAX_AGE_MS) / 1000
                counts[address] = (requests, tokens, sent - base, backlog, at, exact[0] if exact else 0)
        peer.counts = counts
        peer.seen = max(peer.seen, seen)
        self.stats.applied += 1
        self.stats.rejected += len(members) < len(payload)
        self._dirty = True

    def _apply_prefixes(self, fingerprint: str, payload: Any) -> None:
        """A peer's decisions: its prompts' blocks went to those endpoints; the prefix index records them as if
        this replica had sent them."""
        if not self.share_prefixes:
            return
        if fingerprint != self.fingerprint:
            self.stats.rejected += 1
            if not self._told_fingerprint:
                self._told_fingerprint = True
                logger.warning(
                    "replicas: a peer's prefix hashes do not agree with this replica's (another PYTHONHASHSEED or "
                    "Python build): its prompts do not count in this prefix index; give every replica the same"
                )
            return
        if not isinstance(payload, list) or len(payload) > MAX_PREFIXES_PER_ENTRY:  # the sender's own bound
            self.stats.rejected += 1
            return
        engine = self._engine()
        pool = engine.pool
        for item in payload:
            if not (
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)
            ):
                self.stats.rejected += 1
                continue
            address, hashes = item
            index = pool.find(address)
            if (
                index is None
                or len(hashes) > MAX_PREFIX_BLOCKS
                or not all(type(h) is int and _HASH_MIN <= h <= _HASH_MAX for h in hashes)
            ):
                self.stats.rejected += 1
                continue
            engine.observe_pick(RequestFeatures(prefix_hashes=tuple(hashes)), index)
            self.stats.prefixes_applied += 1
        self.stats.applied += 1

    def _apply_ends(self, payload: Any, seen: float) -> None:
        """Ends a peer received for requests it did not hold: each releases this replica's lease, if it holds one.
        Only live ones count: a replay at start does not end requests routed since."""
        self.stats.ends_taken += self._apply_ids(payload, seen, self.finish)

    def _apply_first_tokens(self, payload: Any, seen: float) -> None:
        """First tokens a peer saw of requests it did not hold: each tells this replica's lease, if it holds one."""
        self.stats.first_tokens_taken += self._apply_ids(payload, seen, self.first_token)

    def _apply_outcomes(self, payload: Any, seen: float) -> None:
        """Experiment outcomes a peer saw of requests whose arm it did not hold: each counts here if this replica holds
        the arm (live ones only, not a replay's)."""
        if (
            not isinstance(payload, list)
            or len(payload) > MAX_ENDS_PER_ENTRY  # the sender's own bound
            or not all(_is_outcome(item) for item in payload)
        ):
            self.stats.rejected += 1
            return
        self.stats.applied += 1
        take = self.take_outcome
        if take is None or self._clock() - seen >= self.config.peer_ttl_s:
            return
        self.stats.outcomes_taken += sum(take(rid, ttft, e2e, failed) for rid, ttft, e2e, failed in payload)

    def _apply_ids(self, payload: Any, seen: float, take: Callable[[str], bool] | None) -> int:
        """``take`` each request id of a peer's list (live ones only, not a replay's); how many it took."""
        if (
            not isinstance(payload, list)
            or len(payload) > MAX_ENDS_PER_ENTRY  # the sender's own bound
            or not all(isinstance(r, str) and len(r) <= MAX_REQUEST_ID_CHARS for r in payload)
        ):
            self.stats.rejected += 1
            return 0
        self.stats.applied += 1
        if take is None or self._clock() - seen >= self.config.peer_ttl_s:
            return 0
        return sum(map(take, payload))

    def _expire(self) -> None:
        limit = self._clock() - self.config.peer_ttl_s
        gone = [replica for replica, peer in self._peers.items() if peer.seen < limit]
        for replica in gone:
            del self._peers[replica]
        self.peers_gone += len(gone)
        if gone:
            logger.info(
                "replicas: %d peer(s) not heard from for %.1f s no longer count", len(gone), self.config.peer_ttl_s
            )
            self._dirty = True
        if self._dirty or self._engine().inflight is not self._applied_to:
            self._put()

    def _put(self) -> None:
        """Put the peers' sum into the engine's counters (the pool's order)."""
        engine = self._engine()
        pool = engine.pool
        loads = []
        for peer in self._peers.values():
            values = np.zeros((6, len(pool)))
            for address, value in peer.counts.items():
                index = pool.find(address)
                if index is not None:
                    values[:, index] = value
            loads.append(Load(*values[:3].astype(np.int64), values[3], values[4], values[5]))
        engine.inflight.set_peers(Load.sum(loads, len(pool)))
        self._applied_to = engine.inflight
        self._dirty = False

    # ---- transitions ------------------------------------------------------------------------------------

    def _up(self) -> None:
        if self.up is not True:
            logger.info(
                "replicas: in touch with Redis at %s as replica %s; %d peer(s)",
                self._where(),
                self.id,
                len(self._peers),
            )
        self.up, self.problem = True, None

    def _down(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        if self.up is not False:
            self.stats.outages += 1
            logger.warning(
                "replicas: Redis at %s is out of reach (%s): routing on this replica's own view until it is back",
                self._where(),
                reason,
            )
        self.up, self.problem = False, f"Redis at {self._where()} is out of reach ({reason}): routing alone"

    def _where(self) -> str:
        url = self.config.url
        return url.split("://", 1)[-1]


def _load_values(pool: Any, load: Load, now: float) -> dict[str, tuple[int, ...]]:
    """Per address: requests, tokens, sent, estimated prefill backlog (tokens), the backlog's age (ms) and, where
    it is not zero, the exact prefill backlog (tokens): what an entry says. Five values where there is no exact
    backlog (always, with spans), as replicas before it sent, which read only five."""
    ages = np.clip((now - load.backlog_at) * 1000, 0, MAX_AGE_MS)
    columns = zip(
        load.requests.tolist(),
        load.tokens.tolist(),
        load.sent.tolist(),
        np.rint(load.backlog).astype(np.int64).tolist(),
        np.rint(ages).astype(np.int64).tolist(),
        np.rint(load.exact).astype(np.int64).tolist(),
        strict=True,
    )
    return {e.address: value if value[5] else value[:5] for e, value in zip(pool.endpoints, columns, strict=True)}


def connect_redis(config: ReplicasConfig) -> aioredis.Redis:
    """A client of the replicas' Redis, with their credentials (read now) and timeouts; it connects on first use."""
    import redis.asyncio as aioredis  # with Redis only: a picker without replicas does not load it

    password = config.password.read("replicas.password").reveal().decode() if config.password else None
    extra: dict[str, Any] = {}
    if config.ca_file is not None:
        extra["ssl_ca_certs"] = config.ca_file
    return aioredis.Redis.from_url(
        config.url,
        username=config.username,
        password=password,
        socket_timeout=config.timeout_s + BLOCK_S,
        socket_connect_timeout=config.timeout_s,
        retry_on_timeout=False,
        **extra,
    )


def hash_seed_problem(seed: str | None = None) -> str | None:
    """Why this process's prefix hashes (or a process's under PYTHONHASHSEED ``seed``) cannot agree with other
    replicas' (None: they can): Python salts ``hash`` per process unless PYTHONHASHSEED fixes it, and 0 turns the
    salt off altogether (predictable hashes let a client flood the picker's dicts), so it must be the same secret
    number on every replica."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", "")
    if not seed or seed == "random":
        return "PYTHONHASHSEED is not set, so Python salts hashes per process"
    if not seed.isdigit() or not 0 < int(seed) <= 4294967295:
        return f"PYTHONHASHSEED must be a secret number 1..4294967295 (0 turns the salt off); got {seed!r}"
    return None


def _wake(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)


def _raise_if_cancelled() -> None:
    """A loop around redis-py calls checks this: a cancellation that reaches a call at the wrong moment may come
    back as an ordinary return, and the loop must still end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _is_outcome(item: Any) -> bool:
    """Whether ``item`` is an outcome as `Replicas.outcome_elsewhere` sends it: [request id, TTFT, E2E, failed], each
    latency a positive number of seconds within `MAX_OUTCOME_S`, or null."""
    return (
        isinstance(item, list)
        and len(item) == 4
        and isinstance(item[0], str)
        and 0 < len(item[0]) <= MAX_REQUEST_ID_CHARS
        and all(v is None or (type(v) in (int, float) and 0 < v <= MAX_OUTCOME_S) for v in item[1:3])
        and type(item[3]) is bool
    )


def _json(value: Any) -> Any:
    """A field's JSON, or None where it is none."""
    try:
        return orjson.loads(value)
    except (orjson.JSONDecodeError, TypeError):
        return None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entry_ms(entry_id: Any) -> int:
    head = _text(entry_id).partition("-")[0]
    return int(head) if head.isdigit() else 0


def _after(entry_id: str) -> str:
    """The smallest stream id after ``entry_id`` (``ms-seq``): where a read that must not repeat it starts (Redis
    before 6.2 knows no exclusive ranges)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq) + 1}" if int(seq) < (1 << 64) - 1 else f"{int(ms) + 1}-0"
