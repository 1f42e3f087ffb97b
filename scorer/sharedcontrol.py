"""Experiments' control state shared by the replicas through Redis (with config ``replicas``).

Each picker runs its own copy of every experiment over the requests it routes (`scorer.experiments`): its own
outcomes, its own guard. What must not stay one copy's is what decides whether an arm takes traffic at all: an
operator's action (pause, resume, stop, start, weights), sent to one picker's admin API, and a guard's roll-back,
reached by one copy on its share. That is an experiment's `ControlState`: how many times it was started, the
weights an operator set since, the roll-back, paused or stopped. It lives in one Redis hash per pool
(``{replicas.key}:experiments``), one field per experiment, the whole state in each. A replica that changes it
merges its change into the field under WATCH (`ControlState.merged`: a start supersedes what came before, a
roll-back stays until a start, weights and pause, resume or stop are the latest operator's), so two replicas that
act at once both count; every replica reads the hash every `POLL_S` and brings its copy to it
(`RunningExperiment.follow`): a canary one guard rolled back takes no traffic from any replica, and one ``pause``
pauses the experiment everywhere. Cuts and ramp steps stay each copy's own (each guard judges its own share).

The hash outlives the pickers, so a picker that starts (a restart, a new pod) reads it before it reports ready
and takes up the state its experiments were left in: a roll-back is remembered until an operator ``start``s the
experiment again. A Redis that lost the hash (restarted empty) gets each replica's state again at their next read,
merged so that a roll-back or a pause any of them holds is kept. Only the same configuration of an experiment
follows an entry (its `fingerprint`, the same in every process): a changed experiment is a new one, which starts
from its config. With Redis out of reach a picker routes with its copies' own state and says so, and publishes
what changed meanwhile once Redis is back.

Trust: the replicas' Redis (AUTH, TLS) as for the rest of the exchange (`scorer.replicas`); an entry is applied
only as far as it is well formed and names arms of this picker's config, anything else is counted
(``rejected``) and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from inferlb.scorer.config import ReplicasConfig
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.experiments import ControlState, Experiments, RunningExperiment, WeightChange
from inferlb.scorer.replicas import _raise_if_cancelled, connect_redis

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["POLL_S", "SHARED_KINDS", "ControlStats", "SharedControl", "decode_state", "encode_state"]

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a replica reads the hash: a roll-back reaches every replica within about this
SHARED_KINDS = frozenset({"paused", "resumed", "stopped", "started", "set", "rolled-back"})
"""The changes of weight that are shared: an operator's actions and a guard's roll-back (not cuts nor ramps)."""
REPUBLISH = "republish"  # a replica's whole state, for a hash that lost its field
MAX_ENTRY_BYTES = 16_384  # an entry is a few hundred bytes; anything this long is not one of ours
MAX_TEXT = 500  # characters of a reason or a replica's name kept
MAX_ARMS = 64
MAX_COUNT = 1 << 31
WRITE_TRIES = 10  # merges retried when another replica wrote the hash meanwhile (WATCH)
_RETRY_S = (0.1, 2.0)


@dataclass(slots=True)
class ControlStats:
    """Counters (event-loop owned)."""

    published: int = 0  # this replica's changes merged into the hash
    applied: int = 0  # times this replica's copies changed to follow the hash
    rejected: int = 0  # entries refused: malformed, or naming arms this config does not have
    outages: int = 0  # transitions to "Redis unreachable"
    conflicts: int = 0  # merges written again because another replica wrote the hash meanwhile


class SharedControl:
    """This replica's side of the shared control state. ``experiments()`` gives the experiments in force (a reload
    replaces them); `changed` is their listener (the picker attaches it to each `Experiments`); `run` until
    cancelled; `ready` once the hash was read (or Redis is known to be out of reach). One event loop."""

    def __init__(
        self,
        config: ReplicasConfig,
        experiments: Callable[[], Experiments | None],
        *,
        replica_id: str,
        poll_s: float = POLL_S,
    ) -> None:
        self.config = config
        self.key = f"{config.key}:experiments"
        self.id = replica_id
        self._experiments = experiments
        self.poll_s = poll_s
        self.stats = ControlStats()
        self.up: bool | None = None  # None: not tried yet
        self.read_once = False
        # experiment -> (the copy, the entry) last followed: the same entry is followed again by a new copy only
        self._seen: dict[str, tuple[RunningExperiment, bytes]] = {}
        # experiment -> (kinds of change, the last one's reason) to merge into the hash
        self._pending: dict[str, tuple[set[str], str]] = {}
        self._malformed: dict[str, bytes] = {}  # per field, the malformed entry last reported
        self._following = False  # while the hash's state is applied: the changes it makes are not published
        self._wake = asyncio.Event()

    def ready(self) -> bool:
        return self.read_once or self.up is False

    # ---- changes made here ------------------------------------------------------------------------------

    def changed(self, change: WeightChange) -> None:
        """An experiment's weights changed here: an operator's action or a roll-back is merged into the hash at the
        next round (what following the hash changed does not go back)."""
        if self._following or change.kind not in SHARED_KINDS:
            return
        kinds, _ = self._pending.get(change.experiment, (set(), ""))
        # A new set: one being merged into the hash now stays as it was read (and this change goes out next).
        self._pending[change.experiment] = (kinds | {change.kind}, change.reason[:MAX_TEXT])
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------------------------

    async def run(self) -> None:
        from redis.exceptions import RedisError  # with Redis only: a picker without replicas does not load it

        retry = _RETRY_S[0]
        while True:
            client = None
            try:
                client = connect_redis(self.config)
                while True:
                    _raise_if_cancelled()  # a stop that redis-py swallowed ends the loop all the same
                    await self._read(client)
                    await self._publish(client)
                    self._up()
                    retry = _RETRY_S[0]
                    self._wake.clear()
                    if not self._pending:
                        with contextlib.suppress(TimeoutError):  # the poll's interval passed
                            await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except (RedisError, OSError, ConfigError) as exc:
                self._down(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: logged, and the loop goes on (it must not die quietly)
                logger.exception("experiments: sharing the control state failed; trying again")
                self._down(exc)
            finally:
                if client is not None:
                    await client.aclose()
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_S[1])

    async def _read(self, client: aioredis.Redis) -> None:
        fields = await client.hgetall(self.key)
        experiments = self._experiments()
        running = {} if experiments is None else experiments.running
        present = set()
        for raw_name, value in fields.items():
            name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
            raw = value if isinstance(value, bytes) else str(value).encode()
            present.add(name)
            state = decode_state(raw)
            if state is None:
                if self._malformed.get(name) != raw:
                    self._malformed[name] = raw
                    self._reject(name, "not an entry of this exchange")
                continue
            self._malformed.pop(name, None)
            copy = running.get(name)
            if copy is None or state.fingerprint != copy.fingerprint:
                continue  # not configured here, or configured otherwise: another experiment's entry
            seen = self._seen.get(name)
            if seen is not None and seen[0] is copy and seen[1] == raw:
                continue
            self._seen[name] = (copy, raw)
            if name not in self._pending:  # a change made here goes out first, merged with this
                self._follow(name, copy, state)
        for name in list(self._malformed):
            if name not in present:
                del self._malformed[name]
        for name in list(self._seen):
            if name not in running:
                del self._seen[name]
        # A hash that lost an experiment's field (Redis restarted empty) gets this replica's state again.
        for name in running:
            if name not in present and name not in self._pending:
                self._pending[name] = ({REPUBLISH}, "")
        self.read_once = True

    async def _publish(self, client: aioredis.Redis) -> None:
        experiments = self._experiments()
        while self._pending:
            name, (kinds, reason) = next(iter(self._pending.items()))
            copy = None if experiments is None else experiments.running.get(name)
            if copy is not None:
                await self._write(client, name, copy, kinds, reason)
            if self._pending.get(name, (None,))[0] is kinds:
                del self._pending[name]

    async def _write(
        self, client: aioredis.Redis, name: str, copy: RunningExperiment, kinds: set[str], reason: str
    ) -> None:
        from redis.exceptions import RedisError, WatchError

        mine = copy.control_state(by=f"replica {self.id}", reason=reason)
        for _ in range(WRITE_TRIES):
            async with client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.key)
                    raw = await pipe.hget(self.key, name)
                    shared = decode_state(raw) if isinstance(raw, bytes) else None
                    changes = kinds - {REPUBLISH}
                    if shared is not None and shared.fingerprint != mine.fingerprint and not changes:
                        return  # put back meanwhile by a replica that runs another configuration: left to it
                    if shared is None or shared.fingerprint != mine.fingerprint:
                        merged = mine  # none, or another configuration's: a change made here replaces it
                    elif changes:
                        merged = shared.merged(mine, changes)
                    else:
                        merged = _filled(shared, mine)
                        if merged == shared:
                            return  # another replica put it back already
                    entry = encode_state(merged)
                    pipe.multi()
                    pipe.hset(self.key, name, entry)
                    await pipe.execute()
                except WatchError:
                    self.stats.conflicts += 1
                    continue
            break
        else:
            raise RedisError(f"the shared entry of {name!r} changed {WRITE_TRIES} times while it was merged")
        self.stats.published += 1
        if "started" in kinds:
            copy.starts = merged.starts  # this start's number: following it is no second start
        self._seen[name] = (copy, entry)
        pending = self._pending.get(name)
        if pending is None or pending[0] is kinds:  # no change made here since: take what others changed meanwhile
            self._follow(name, copy, merged)

    def _follow(self, name: str, copy: RunningExperiment, state: ControlState) -> None:
        before = copy.control_state()
        self._following = True
        try:
            copy.follow(state, state.by or "another replica")
        except ValueError as exc:
            self._reject(name, str(exc))
            return
        finally:
            self._following = False
        after = copy.control_state()
        if after != before:
            self.stats.applied += 1
            logger.info(
                "experiment %r follows %s (%s): now %s, weights %s",
                name,
                state.by or "another replica",
                state.reason or "no reason given",
                copy.state,
                copy.weights(),
            )

    def _reject(self, name: str, why: str) -> None:
        self.stats.rejected += 1
        logger.warning("experiments: the shared entry of %r in Redis is refused (%s)", name[:MAX_TEXT], why)

    # ---- transitions ----------------------------------------------------------------------------------------

    def _up(self) -> None:
        if self.up is not True:
            logger.info("experiments: control state shared through Redis (%s)", self.key)
        self.up = True

    def _down(self, exc: BaseException) -> None:
        if self.up is not False:
            self.stats.outages += 1
            logger.warning(
                "experiments: Redis is out of reach (%s: %s); each experiment keeps this picker's own state until it"
                " is back",
                type(exc).__name__,
                exc,
            )
        self.up = False


def _filled(shared: ControlState, mine: ControlState) -> ControlState:
    """``shared`` with what a replica that found the hash without the entry holds (it had vanished: Redis restarted
    empty, and another replica put it back first): its start if newer; at the same start its roll-back, its
    weights if set later, and a pause or stop (what takes traffic off the arms is kept)."""
    if mine.starts > shared.starts:
        return mine
    if mine.starts < shared.starts:
        return shared
    out = shared
    if out.rolled is None and mine.rolled is not None:
        out = replace(out, rolled=mine.rolled)
    if mine.weight_sets > out.weight_sets:
        out = replace(out, weights=mine.weights, weight_sets=mine.weight_sets)
    if (mine.paused and not out.paused) or (mine.stopped and not out.stopped):
        out = replace(out, paused=out.paused or mine.paused, stopped=out.stopped or mine.stopped)
    return out


def encode_state(state: ControlState) -> bytes:
    """A `ControlState` as the hash keeps it (JSON)."""
    return orjson.dumps(
        {
            "fingerprint": state.fingerprint,
            "starts": state.starts,
            "weight_sets": state.weight_sets,
            "weights": None if state.weights is None else dict(state.weights),
            "rolled": None if state.rolled is None else list(state.rolled),
            "paused": state.paused,
            "stopped": state.stopped,
            "by": state.by,
            "reason": state.reason,
        }
    )


def decode_state(raw: bytes) -> ControlState | None:
    """The `ControlState` of a hash value, or None where it is not one of ours (the wrong type anywhere, out of
    bounds, or too long)."""
    if len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        entry = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(entry, dict):
        return None
    fingerprint, weights, rolled = entry.get("fingerprint"), entry.get("weights"), entry.get("rolled")
    starts, weight_sets = entry.get("starts"), entry.get("weight_sets")
    paused, stopped, by, reason = entry.get("paused"), entry.get("stopped"), entry.get("by"), entry.get("reason")
    if not (
        isinstance(fingerprint, str)
        and len(fingerprint) <= 64
        and _count(starts)
        and _count(weight_sets)
        and isinstance(paused, bool)
        and isinstance(stopped, bool)
        and isinstance(by, str)
        and isinstance(reason, str)
    ):
        return None
    if weights is not None and not (
        isinstance(weights, dict)
        and len(weights) <= MAX_ARMS
        and all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) for w in weights.values())
    ):
        return None
    if rolled is not None and not (
        isinstance(rolled, list)
        and len(rolled) == 3
        and (rolled[0] is None or isinstance(rolled[0], str))
        and isinstance(rolled[1], str)
        and isinstance(rolled[2], str)
    ):
        return None
    return ControlState(
        fingerprint,
        starts,
        weight_sets,
        None if weights is None else {str(k): float(v) for k, v in weights.items()},
        None if rolled is None else (rolled[0], rolled[1][:MAX_TEXT], rolled[2][:MAX_TEXT]),
        paused or stopped,
        stopped,
        by[:MAX_TEXT],
        reason[:MAX_TEXT],
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT
