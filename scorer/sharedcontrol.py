"""Experiments' control state shared by the replicas through Redis (with config ``replicas``).

Each picker runs its own copy of every experiment over the requests it routes (`scorer.experiments`): its own
outcomes, its own guard. What must not stay one copy's is what decides whether an arm takes traffic at all: an
operator's action (pause, resume, stop, start, weights), sent to one picker's admin API, and a guard's roll-back,
reached by one copy on its share. Both are published to one Redis hash per pool (``{replicas.key}:experiments``),
one field per experiment: the state the change left (running, paused, stopped, rolled back), its kind, the
weights an operator set, the arm a roll-back was about, why, and which replica made it, numbered by one counter in
the hash. Every replica reads the hash every `POLL_S` and brings its copy to each newer entry
(`RunningExperiment.follow`): a canary one guard rolled back takes no traffic from any replica, and one ``pause``
pauses the experiment everywhere. Cuts and ramp steps stay each copy's own (each guard judges its own share).

The hash outlives the pickers, so a picker that starts (a restart, a new pod) reads it before it reports ready
and takes up the state its experiments were left in: a roll-back is remembered until an operator ``start``s the
experiment again. Only the same configuration of an experiment follows an entry (its `fingerprint`): a changed
experiment is a new one, which starts from its config. With Redis out of reach a picker routes with its copies'
own state and says so, and follows the hash again once it is back.

Trust: the replicas' Redis (AUTH, TLS) as for the rest of the exchange (`scorer.replicas`); an entry is applied only
as far as it is well formed and names an experiment and arms of this picker's config, anything else is counted
(``rejected``) and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from inferlb.scorer.config import ReplicasConfig
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.experiments import Experiments, RunningExperiment, WeightChange
from inferlb.scorer.replicas import _raise_if_cancelled, connect_redis

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["POLL_S", "SHARED_KINDS", "ControlStats", "SharedControl"]

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a replica reads the hash: a roll-back reaches every replica within about this
SHARED_KINDS = frozenset({"paused", "resumed", "stopped", "started", "set", "rolled-back"})
"""The changes of weight that are published: an operator's actions and a guard's roll-back (not cuts nor ramps)."""
STATES = frozenset({"running", "paused", "stopped", "rolled back"})
MAX_ENTRY_BYTES = 16_384  # an entry is a few hundred bytes; anything this long is not one of ours
MAX_TEXT = 500  # characters of a reason or a replica's name kept
_SEQ = "#seq"  # the hash's counter (no experiment can be named so: names are checked by the config)
_RETRY_S = (0.1, 2.0)

# Numbers the entry and stores it in one step: "<n> <json>".
_PUT = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HSET', KEYS[1], ARGV[2], n .. ' ' .. ARGV[3])
return n
"""


@dataclass(slots=True)
class ControlStats:
    """Counters (event-loop owned)."""

    published: int = 0  # this replica's changes written to the hash
    applied: int = 0  # other replicas' changes this replica's copies followed
    rejected: int = 0  # entries refused: malformed, or naming arms this config does not have
    outages: int = 0  # transitions to "Redis unreachable"


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
        # (experiment, fingerprint) -> the newest entry number taken (followed, refused or our own)
        self._seen: dict[tuple[str, str], int] = {}
        # experiment -> (fingerprint, the entry) to publish: the newest change wins
        self._pending: dict[str, tuple[str, bytes]] = {}
        self._malformed: dict[str, bytes] = {}  # the malformed entry last reported, per field
        self._following = False  # while a peer's change is applied: it is not published again
        self._wake = asyncio.Event()

    def ready(self) -> bool:
        return self.read_once or self.up is False

    # ---- publishing -------------------------------------------------------------------------------------

    def changed(self, change: WeightChange) -> None:
        """An experiment's weights changed here: an operator's action or a roll-back goes out with the next
        round (a peer's change being applied does not go back)."""
        if self._following or change.kind not in SHARED_KINDS:
            return
        experiments = self._experiments()
        running = None if experiments is None else experiments.running.get(change.experiment)
        if running is None:
            return
        entry = {
            "fingerprint": running.fingerprint,
            "state": running.state,
            "kind": change.kind,
            "weights": dict(change.weights) if change.kind == "set" else None,
            "arm": change.arm,
            "reason": change.reason[:MAX_TEXT],
            "by": self.id,
            "time": change.time,
        }
        self._pending[change.experiment] = (running.fingerprint, orjson.dumps(entry))
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------------------------

    async def run(self) -> None:
        from redis.exceptions import RedisError  # with Redis only: a picker without replicas does not load it

        retry = _RETRY_S[0]
        while True:
            client = None
            try:
                client = connect_redis(self.config)
                sha = await client.script_load(_PUT)  # again on each connection: a restarted Redis forgot it
                while True:
                    _raise_if_cancelled()  # a stop that redis-py swallowed ends the loop all the same
                    await self._publish(client, sha)
                    await self._read(client)
                    self._up()
                    retry = _RETRY_S[0]
                    self._wake.clear()
                    if not self._pending:
                        with contextlib.suppress(TimeoutError):  # the poll's interval passed
                            await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except (RedisError, OSError, ConfigError) as exc:
                self._down(exc)
            finally:
                if client is not None:
                    await client.aclose()
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_S[1])

    async def _publish(self, client: aioredis.Redis, sha: str) -> None:
        while self._pending:
            name, pending = next(iter(self._pending.items()))
            fingerprint, entry = pending
            number = int(await client.evalsha(sha, 1, self.key, _SEQ, name, entry))
            if self._pending.get(name) is pending:
                del self._pending[name]
            key = (name, fingerprint)
            self._seen[key] = max(self._seen.get(key, 0), number)
            self.stats.published += 1

    async def _read(self, client: aioredis.Redis) -> None:
        fields = await client.hgetall(self.key)
        self.read_once = True
        experiments = self._experiments()
        for raw_name, value in fields.items():
            name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
            raw = value if isinstance(value, bytes) else str(value).encode()
            if name == _SEQ:
                continue
            parsed = _parse(raw)
            if parsed is None:
                if self._malformed.get(name) != raw:
                    self._malformed[name] = raw
                    self._reject(name, "not an entry of this exchange")
                continue
            number, entry = parsed
            running = None if experiments is None else experiments.running.get(name)
            if running is None or running.fingerprint != entry["fingerprint"]:
                continue  # not configured here, or configured otherwise: another experiment's entry
            key = (name, entry["fingerprint"])
            if number <= self._seen.get(key, 0):
                continue
            self._seen[key] = number
            if entry["by"] == self.id or name in self._pending:
                continue  # our own, or older than a change of ours still to go out
            self._follow(name, running, entry)

    def _follow(self, name: str, running: RunningExperiment, entry: Mapping[str, Any]) -> None:
        before = running.state, running.weights()
        self._following = True
        try:
            running.follow(
                entry["state"],
                entry["kind"],
                weights=entry["weights"],
                arm=entry["arm"],
                origin=f"replica {entry['by']}",
                reason=entry["reason"],
            )
        except ValueError as exc:
            self._reject(name, str(exc))
            return
        finally:
            self._following = False
        if (running.state, running.weights()) != before:
            self.stats.applied += 1
            logger.info(
                "experiment %r: %s by replica %s (%s); here now %s, weights %s",
                name,
                entry["kind"],
                entry["by"],
                entry["reason"],
                running.state,
                running.weights(),
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


def _parse(raw: Any) -> tuple[int, dict[str, Any]] | None:
    """``(number, entry)`` of a hash value, or None where it is not one of ours."""
    if not isinstance(raw, bytes) or len(raw) > MAX_ENTRY_BYTES:
        return None
    head, _, body = raw.partition(b" ")
    try:
        number = int(head)
        entry = orjson.loads(body)
    except ValueError:
        return None
    if number < 1 or not isinstance(entry, dict):
        return None
    weights = entry.get("weights")
    if not (
        isinstance(entry.get("fingerprint"), str)
        and entry.get("state") in STATES
        and entry.get("kind") in SHARED_KINDS
        and isinstance(entry.get("by"), str)
        and isinstance(entry.get("reason", ""), str)
        and (entry.get("arm") is None or isinstance(entry.get("arm"), str))
        and (
            weights is None
            or (
                isinstance(weights, dict)
                and all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights.values())
            )
        )
    ):
        return None
    entry["by"] = entry["by"][:MAX_TEXT]
    entry["reason"] = entry.get("reason", "")[:MAX_TEXT]
    entry["arm"] = entry.get("arm")
    entry["weights"] = weights
    return number, entry
