"""Tenant quotas (config ``quotas``): requests and tokens per minute per tenant, with a burst, held across replicas.

Each tenant has a bucket per limit (requests, tokens) that fills at the limit's rate up to ``burst_s`` seconds of
it; a request takes 1 from the first and its tokens (prompt plus ``max_tokens``, or the assumed output) from the
second, and is refused with a `QuotaRefusal` (the filter's 429) when either lacks them. The decision is made
here, at once, with no I/O: a request never waits on Redis.

* **One picker** (no ``replicas``): the buckets are local and exact.
* **Replicas** (``replicas`` configured, Redis up): the true bucket lives in Redis, one hash per tenant and limit,
  changed only by one Lua script (`TAKE`), which refills it by Redis's clock and subtracts what a replica spent,
  atomically. Every ``sync_interval_s`` each replica sends what it spent since its last call and reads the level
  back (one script call per `CHUNK` buckets of its active tenants: one round trip for most). Between calls a
  replica may spend its share of the level it last read: the level (refilled at the full rate since) over the
  number of replicas, less what it spent since; a replica that spent nothing since its last read may also take
  one request up to the whole level (so a request larger than a share still passes when there is room). A
  request refused by that share alone, while the bucket holds enough, is told to retry after the sync interval.
* **Spending reaches Redis once**: it goes as a numbered batch per bucket, sent again unchanged until a reply
  confirms it, and the script takes each replica's batch once; so a call that failed after Redis applied it
  (a timeout) charges nothing twice. A bucket whose key holds no finite level, or is no hash, is reset to full
  (logged) and fails no other bucket; a call that Redis refuses fails only its own buckets.
* **Redis down**: each replica goes on with the same rule on its own, folding its spending into its view as if
  the others spent alike (its share of the rate), and sends what it spent once Redis answers again, also what
  buckets since dropped (a reload that changed the tenant's limits, ``max_tenants``) had spent.

How closely the limit holds across N replicas, per window: the replicas together admit at most the bucket's
level at their last reads plus one sync interval of the rate (each spends at most its share of what it read,
plus one request as above), so over a minute the excess is at most about N requests per sync interval in the
worst case (all of them at once at the edge) and none in the steady state, where each replica's share refills
at rate/N. Under-use is bounded the same way: a replica holds at most its share unspent. A replica that starts
assumes a tenant's bucket full until its first read (one sync interval). The benchmark measures the error
(``inferlb bench replicas``, quota run).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from inferlb.scorer.config import QuotasConfig, ReplicasConfig, TenantLimits
from inferlb.scorer.errors import ConfigError, shown
from inferlb.scorer.replicas import _raise_if_cancelled, connect_redis

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["TAKE", "QuotaRefusal", "QuotaStats", "Quotas"]

logger = logging.getLogger(__name__)

Limit = Literal["requests_per_minute", "tokens_per_minute"]
LIMITS: tuple[Limit, ...] = ("requests_per_minute", "tokens_per_minute")
REFRESH_S = 0.25  # an active tenant's level is read at least this often, spent or not (to see the others spend)
ACTIVE_S = 10.0  # a tenant is active this long after its last request here
_RETRY_S = (0.1, 2.0)

# KEYS: the buckets. ARGV[1]: the sending replica's id; then one per bucket: its rate per second, capacity, what was
# spent, and the batch that spending is (the replica's sequence number; 0: nothing sent, a read), separated by spaces
# (one string: encoding each argument costs the client more than parsing costs the script). Returns two values per
# bucket: the level after the spending, as a string (a Lua number would reach the client as an integer), and flags:
# REPAIRED (the key held no finite level, or was not a hash: reset to full), APPLIED_BEFORE (a batch sent again that
# the bucket had taken already: not taken twice). Each bucket keeps, per replica, the last batch it took (field
# "sent:<id>": "<batch> <time>"); a replica's first batch in a bucket drops the fields of replicas not heard from in
# KEEP_S (restarted pickers: every picker has a new id). A read alone writes nothing (the bucket expires when it
# would be full again).
TAKE = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local KEEP_S = 3600
local field = 'sent:' .. ARGV[1]
local function finite(x) return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge end
local out = {}
for i, key in ipairs(KEYS) do
  local rate, capacity, spent, batch = string.match(ARGV[i + 1], '^(%S+) (%S+) (%S+) (%d+)$')
  rate, capacity, spent = tonumber(rate), tonumber(capacity), tonumber(spent)
  local flags = 0
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'hash' and kind ~= 'none' then
    redis.call('DEL', key)
    flags = 1
  end
  local kept = redis.call('HMGET', key, 'level', 'at', field)
  local level, was, at = capacity, tonumber(kept[1]), tonumber(kept[2])
  if finite(was) and finite(at) then
    level = math.min(capacity, was + rate * math.max(0, now - at))
  elseif kept[1] or kept[2] then
    flags = 1
  end
  if batch ~= '0' then
    local last = kept[3] and tonumber(string.match(kept[3], '^(%d+)'))
    if last and tonumber(batch) <= last then
      flags = flags + 2
    else
      level = math.min(capacity, level - spent)  -- spent < 0: refunds, which never overfill it
      redis.call('HSET', key, field, batch .. ' ' .. string.format('%.17g', now))
      if not last then
        local fields = redis.call('HGETALL', key)
        for k = 1, #fields, 2 do
          if string.sub(fields[k], 1, 5) == 'sent:' then
            local seen = tonumber(string.match(fields[k + 1], ' (%S+)$'))
            if not finite(seen) or now - seen > KEEP_S then redis.call('HDEL', key, fields[k]) end
          end
        end
      end
    end
  end
  if batch ~= '0' or flags % 2 == 1 then
    redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%.17g', now))
    redis.call('PEXPIRE', key, math.ceil((capacity / rate + 60) * 1000))
  end
  out[#out + 1] = string.format('%.17g', level)
  out[#out + 1] = flags
end
return out
"""
REPAIRED, APPLIED_BEFORE = 1, 2
CHUNK = 256  # buckets per script call: Redis serves other clients between calls, the loop other tasks


@dataclass(frozen=True, slots=True)
class QuotaRefusal:
    """Why a request was refused: its tenant, the limit it is over, that limit, and when to retry."""

    tenant: str
    limit: Limit
    value: float
    retry_after_s: int
    message: str


@dataclass(slots=True)
class QuotaStats:
    admitted: Counter[str]  # tenant label -> requests admitted
    refused: Counter[tuple[str, str]]  # (tenant label, limit) -> requests refused
    tokens: Counter[str]  # tenant label -> tokens admitted
    refunded: Counter[str] = field(default_factory=Counter)  # tenant label -> admitted, then refused after all
    syncs: int = 0
    outages: int = 0
    repaired: int = 0  # buckets found holding no finite level (or not a hash) in Redis, reset to full
    applied_before: int = 0  # batches sent again after a failed call that Redis had taken already: not taken twice
    dropped: int = 0  # buckets given up with spending not yet in Redis (more tenants gone than max_tenants)


@dataclass(slots=True)
class _Bucket:
    rate: float  # per second
    capacity: float
    base: float  # the level when last read (or folded in, alone)
    base_at: float  # the local time that level holds for
    spent: float = 0.0  # spent here and not in `base`
    unsent: float = 0.0  # spent here and not yet sent to Redis
    sending: float = 0.0  # sent as batch `batch`, not yet known to be in Redis: sent again, as it is, until it is
    batch: int = 0  # its sequence number (0: none)
    used_at: float = 0.0

    def carry(self, old: _Bucket) -> None:
        """Take over what ``old`` (this tenant's bucket for the same limit, replaced) has not yet got into Redis."""
        self.unsent += old.unsent
        if old.batch:
            self.sending, self.batch = old.sending, old.batch
        old.unsent, old.sending, old.batch = 0.0, 0.0, 0

    @property
    def owes(self) -> bool:
        """Holds spending that Redis has not yet confirmed."""
        return self.batch != 0 or self.unsent != 0

    def level(self, now: float) -> float:
        return min(self.capacity, self.base + self.rate * max(now - self.base_at, 0.0))


_Due = tuple[tuple[str, Limit], _Bucket]  # a bucket to send or read, by (tenant, limit)
_NONE: dict[Limit, _Bucket] = {}


class Quotas:
    """The tenants' buckets. `charge` admits or refuses a request (event-loop owned, no I/O); with ``replicas``
    `run` keeps them in step through Redis until cancelled. ``shares`` gives the number of replicas now (this
    one and its peers) while Redis answers.

    What a replica spent reaches Redis exactly once: it goes as a numbered batch that is sent again, unchanged,
    until a reply confirms it, and the script takes a batch only once (a call that timed out may have been
    applied). A bucket that a reload or the tenant limit (``max_tenants``) drops keeps its unconfirmed spending
    to be sent (or handed to the tenant's next bucket)."""

    def __init__(
        self,
        config: QuotasConfig,
        replicas: ReplicasConfig | None = None,
        *,
        shares: Callable[[], int] = lambda: 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self._shares = shares
        self._clock = clock
        self._buckets: OrderedDict[str, dict[Limit, _Bucket]] = OrderedDict()  # by tenant, the latest used last
        self._retired: OrderedDict[tuple[str, Limit], _Bucket] = OrderedDict()  # dropped, still owing Redis
        self._id = secrets.token_hex(8)  # this replica in the buckets' records of batches taken
        self._batches = itertools.count(1)
        self._failing = False  # the last sync had calls that Redis refused (logged once)
        self._dirty: set[str] = set()  # tenants that spent since the last sync
        self._scan_at = -math.inf  # when a bucket that spent nothing may next need a read (all are looked at then)
        self.stats = QuotaStats(Counter(), Counter(), Counter())
        self.up: bool | None = None if replicas is not None else False
        self._replicas_seen = 1  # the replica count while Redis last answered: the share while it does not

    # ---- the request path -------------------------------------------------------------------------------

    def reconfigure(self, config: QuotasConfig) -> None:
        """New limits (a reload): buckets of changed limits start again, full (here: Redis's level is read at the
        next sync), and what they spent that Redis has not yet got is still sent."""
        old, self.config = self.config, config
        for tenant in [t for t in self._buckets if self._limits(t) != _limits_of(old, t)]:
            self._retire(tenant, self._buckets.pop(tenant))

    def label(self, tenant: str) -> str:
        """The tenant as a metric label: listed tenants by name, the others together."""
        return tenant if tenant in self.config.tenants else "other"

    def charge(self, tenant: str | None, tokens: int) -> QuotaRefusal | None:
        """Take one request of ``tokens`` tokens from ``tenant``'s buckets, or say why not (and take nothing)."""
        tenant = tenant or ""
        limits = self._limits(tenant)
        if limits is None:
            return None
        now = self._clock()
        shares = self._share_count()
        local = self.up is not True
        costs = {"requests_per_minute": 1.0, "tokens_per_minute": float(tokens)}
        taking = []
        buckets = self._tenant(tenant, limits, now)
        for limit, bucket in buckets.items():
            value = getattr(limits, limit)
            if local:
                _fold(bucket, now, shares)
            cost = costs[limit]
            level = bucket.level(now)
            if not (level / shares - bucket.spent >= cost or (bucket.spent == 0 and level >= cost)):
                return self._refuse(tenant, limit, value, bucket, cost, level, shares)
            taking.append((bucket, cost))
        for bucket, cost in taking:
            bucket.spent += cost
            bucket.used_at = now
            if self.replicas is not None:
                bucket.unsent += cost
                self._dirty.add(tenant)
            if local:
                _fold(bucket, now, shares)
        label = self.label(tenant)
        self.stats.admitted[label] += 1
        self.stats.tokens[label] += tokens
        return None

    def refund(self, tenant: str | None, tokens: int) -> None:
        """Give back what `charge` took for a request that was refused after all (it reached no server)."""
        tenant = tenant or ""
        buckets = self._buckets.get(tenant)
        if buckets is None:
            return
        for limit, bucket in buckets.items():
            cost = 1.0 if limit == "requests_per_minute" else float(tokens)
            if self.up is True or bucket.spent >= cost:
                bucket.spent -= cost
            else:  # folded in already (alone): give it back to the level, as each replica's share
                bucket.base += self._share_count() * cost
            if self.replicas is not None:
                bucket.unsent -= cost
                self._dirty.add(tenant)
        self.stats.refunded[self.label(tenant)] += 1

    def _limits(self, tenant: str) -> TenantLimits | None:
        return _limits_of(self.config, tenant)

    def _share_count(self) -> int:
        if self.up:
            self._replicas_seen = max(1, self._shares())
        return self._replicas_seen if self.replicas is not None else 1

    def _tenant(self, tenant: str, limits: TenantLimits, now: float) -> dict[Limit, _Bucket]:
        buckets = self._buckets.get(tenant)
        if buckets is not None:
            self._buckets.move_to_end(tenant)
            return buckets
        buckets = self._buckets[tenant] = {}
        for limit in LIMITS:
            value = getattr(limits, limit)
            if value is not None:
                rate = value / 60.0
                bucket = buckets[limit] = _Bucket(rate, rate * limits.burst_s, rate * limits.burst_s, now, used_at=now)
                old = self._retired.pop((tenant, limit), None)
                if old is not None:
                    bucket.carry(old)
        while len(self._buckets) > self.config.max_tenants:
            self._retire(*self._buckets.popitem(last=False))  # the least recently used
        return buckets

    def _retire(self, tenant: str, buckets: dict[Limit, _Bucket]) -> None:
        """Keep what dropped buckets owe Redis, to send it (or hand it to the tenant's next bucket)."""
        for limit, bucket in buckets.items():
            if self.replicas is not None and bucket.owes:
                self._retired[(tenant, limit)] = bucket
        while len(self._retired) > len(LIMITS) * self.config.max_tenants:  # memory stays bounded in a long outage
            self._retired.popitem(last=False)
            self.stats.dropped += 1

    def _refuse(
        self, tenant: str, limit: Limit, value: float, bucket: _Bucket, cost: float, level: float, shares: int
    ) -> QuotaRefusal:
        self.stats.refused[(self.label(tenant), limit)] += 1
        noun = "request" if limit == "requests_per_minute" else f"{cost:.0f} tokens"
        if cost > bucket.capacity:
            wait_s = bucket.capacity / bucket.rate  # never, as things stand: say when the bucket is full at least
            why = f"this request's {noun} exceed the tenant's burst of {bucket.capacity:.0f} tokens"
        elif level - bucket.spent >= cost:  # the bucket has room, only this replica's share of it not: it may
            wait_s = self.config.sync_interval_s  # take the request once it has read the level again
            why = f"it is over its {limit.replace('_', ' ')} quota ({value:g})"
        else:
            missing = max(cost - (level / shares - bucket.spent), cost - level, 0.0)
            wait_s = missing * shares / bucket.rate
            why = f"it is over its {limit.replace('_', ' ')} quota ({value:g})"
        retry = max(1, math.ceil(wait_s))
        message = f"tenant {shown(tenant or '(none)')}: {why}; retry after {retry} s"
        return QuotaRefusal(tenant, limit, value, retry, message)

    # ---- sharing the buckets through Redis --------------------------------------------------------------

    async def run(self) -> None:
        """Keep the buckets in step with the replicas' shared ones in Redis (cancel to stop)."""
        assert self.replicas is not None, "run() shares buckets through replicas.url"
        from redis.exceptions import RedisError  # with Redis only: a picker without replicas does not load it

        retry = _RETRY_S[0]
        while True:
            client = None
            try:
                client = connect_redis(self.replicas)
                # Loaded on every connection: a Redis that restarted has forgotten it (NOSCRIPT: a new session).
                sha = await client.script_load(TAKE)
                while True:
                    _raise_if_cancelled()  # a stop that redis-py swallowed ends the loop all the same
                    await self._sync(client, sha)
                    if not self.up:
                        self.up = True
                        logger.info("quotas: in step with the replicas' buckets in Redis")
                    retry = _RETRY_S[0]
                    await asyncio.sleep(self.config.sync_interval_s)
            except (RedisError, OSError, ConfigError) as exc:
                if self.up is not False:
                    self.stats.outages += 1
                    logger.warning(
                        "quotas: %s (%s: %s); each replica enforces its share of the limits alone",
                        _problem(exc),
                        type(exc).__name__,
                        exc,
                    )
                self.up = False
            finally:
                if client is not None:
                    await client.aclose()
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_S[1])

    async def _sync(self, client: aioredis.Redis, sha: str) -> None:
        """Send what was spent and read the levels back, one script call per `CHUNK` buckets (one round trip for
        up to that many; the loop runs between calls, and between every `CHUNK` tenants looked at). Due: buckets
        that owe Redis spending, and active ones whose level is `REFRESH_S` old; between the times one of these
        may come due, only tenants that spent are looked at. A call that fails leaves its batches to be sent
        again as they are and raises; a call that Redis refuses fails only its buckets, unless it refuses all."""
        now = self._clock()
        scan = now >= self._scan_at
        if scan:
            self._scan_at = now + REFRESH_S
        tenants = list(self._buckets) if scan else list(self._dirty)  # names only: few objects live across awaits
        self._dirty = set()
        retired = list(self._retired)
        chunk: list[_Due] = []
        calls: list[Exception | None] = []
        try:
            for n, tenant in enumerate(tenants, 1):
                for limit, bucket in self._buckets.get(tenant, _NONE).items():
                    active = now - bucket.used_at < ACTIVE_S
                    if bucket.owes or (active and now - bucket.base_at >= REFRESH_S):
                        chunk.append(((tenant, limit), bucket))
                    elif scan and active:
                        self._scan_at = min(self._scan_at, bucket.base_at + REFRESH_S)
                if len(chunk) >= CHUNK:
                    calls.append(await self._call(client, sha, chunk, now))
                    chunk = []
                elif n % CHUNK == 0:
                    await asyncio.sleep(0)
            for key in retired:
                owing = self._retired.get(key)
                if owing is not None:
                    chunk.append((key, owing))
                if len(chunk) >= CHUNK:
                    calls.append(await self._call(client, sha, chunk, now))
                    chunk = []
            if chunk:
                calls.append(await self._call(client, sha, chunk, now))
        except BaseException:
            self._scan_at = -math.inf  # what was not read is read next time
            raise
        refused = [exc for exc in calls if exc is not None]
        if refused:
            self._scan_at = -math.inf
            if len(refused) == len(calls):
                raise refused[0]
            if not self._failing:
                logger.warning(
                    "quotas: Redis refused the buckets of %d of %d calls (%s); their spending is sent again",
                    len(refused),
                    len(calls),
                    refused[0],
                )
        self._failing = bool(refused)
        if calls:
            self.stats.syncs += 1

    async def _call(self, client: aioredis.Redis, sha: str, chunk: list[_Due], now: float) -> Exception | None:
        """One script call for ``chunk``: None when it was taken, the error when Redis refused it (its batches
        are sent again); raises when it failed otherwise (Redis may have taken its batches: they go again as
        they are, and the script takes each only once)."""
        from redis.exceptions import NoScriptError, ResponseError

        assert self.replicas is not None
        prefix = f"{self.replicas.key}:quota:"
        keys, args = [], [self._id]
        for (tenant, limit), bucket in chunk:
            if not bucket.batch and bucket.unsent:
                bucket.batch, bucket.sending, bucket.unsent = next(self._batches), bucket.unsent, 0.0
            keys.append(f"{prefix}{limit}:{tenant}")
            args.append(f"{bucket.rate!r} {bucket.capacity!r} {bucket.sending!r} {bucket.batch}")
        try:
            reply = await client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            raise  # flushed: loaded again on a new connection
        except ResponseError as exc:
            return exc
        self._took(chunk, reply, now, prefix)
        return None

    def _took(self, chunk: list[_Due], reply: list[bytes | int], now: float, prefix: str) -> None:
        """Redis's reply for ``chunk``: each bucket's level, and what the script did."""
        for ((tenant, limit), bucket), level, flags in zip(chunk, reply[::2], reply[1::2], strict=True):
            if int(flags) & REPAIRED:
                self.stats.repaired += 1
                logger.warning(
                    "quotas: Redis's bucket %r held no finite level (or was no hash); reset to full",
                    f"{prefix}{limit}:{tenant}",
                )
            if int(flags) & APPLIED_BEFORE:
                self.stats.applied_before += 1
            bucket.base = float(level)
            bucket.base_at = now
            bucket.spent = bucket.unsent  # what was spent while the call was under way is not in the level yet
            bucket.sending, bucket.batch = 0.0, 0
            if not bucket.owes and self._retired.get((tenant, limit)) is bucket:
                del self._retired[(tenant, limit)]


def _problem(exc: BaseException) -> str:
    """What the exception ``run`` caught says about Redis, for the log."""
    from redis.exceptions import ResponseError

    if isinstance(exc, ResponseError):
        return "Redis answered with an error"
    if isinstance(exc, ConfigError):
        return "cannot connect to Redis"
    return "Redis unreachable"


def _limits_of(config: QuotasConfig, tenant: str) -> TenantLimits | None:
    return config.tenants.get(tenant, config.default)


def _fold(bucket: _Bucket, now: float, shares: int) -> None:
    """Alone (no Redis): put what this replica spent into its view of the bucket, as if each of ``shares``
    replicas spent alike (one picker: the exact bucket)."""
    bucket.base = bucket.level(now) - shares * bucket.spent
    bucket.base_at = now
    bucket.spent = 0.0
