"""Tenant quotas: exact buckets in one picker, limits held across two replicas through a real Redis (Debian's
redis-server, with a password), and each replica going on with its share while Redis is away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from inferlb.bench.redisserver import REDIS, RedisServer, redis_server
from inferlb.scorer.config import QuotasConfig, ReplicasConfig, parse_config
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.quotas import TAKE, Quotas
from inferlb.scorer.replicas import connect_redis

from ..conftest import ManualClock, until

needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")


def _configs(quotas: dict, replicas: dict | None = None) -> tuple[QuotasConfig, ReplicasConfig | None]:
    document: dict = {"pool": {"endpoints": [{"address": "127.0.0.1:9101"}]}, "quotas": {"source": "gateway", **quotas}}
    if replicas is not None:
        document["replicas"] = replicas
    config = parse_config(document)
    assert config.quotas is not None
    return config.quotas, config.replicas


def _quotas(clock: ManualClock, **tenants: dict) -> Quotas:
    config, _ = _configs({"header": "x-tenant", "tenants": tenants})
    return Quotas(config, clock=clock)


def test_one_picker_keeps_an_exact_token_bucket_per_tenant(clock: ManualClock) -> None:
    quotas = _quotas(clock, a={"tokens_per_minute": 600, "burst_s": 6})  # 10 tokens/s, 60 at once
    assert [quotas.charge("a", 20) for _ in range(3)] == [None, None, None]
    refusal = quotas.charge("a", 20)
    assert refusal is not None and refusal.limit == "tokens_per_minute" and refusal.value == 600
    assert refusal.retry_after_s == 2  # 20 tokens at 10 a second
    assert refusal.message == "tenant 'a': it is over its tokens per minute quota (600); retry after 2 s"
    clock.advance(1.9)
    assert quotas.charge("a", 20) is not None
    clock.advance(0.1)
    assert quotas.charge("a", 20) is None
    assert quotas.stats.admitted["a"] == 4 and quotas.stats.tokens["a"] == 80
    assert quotas.stats.refused[("a", "tokens_per_minute")] == 2


def test_a_refused_request_takes_nothing_from_any_bucket(clock: ManualClock) -> None:
    quotas = _quotas(clock, a={"requests_per_minute": 120, "tokens_per_minute": 60, "burst_s": 1})
    assert quotas.charge("a", 1) is None  # 2 requests and 1 token a second, at most that at once
    assert quotas.charge("a", 1) is not None  # over tokens: the request is not counted against requests either
    clock.advance(1.0)
    assert quotas.charge("a", 0) is None and quotas.charge("a", 0) is None
    refusal = quotas.charge("a", 0)
    assert refusal is not None and refusal.limit == "requests_per_minute"


def test_a_request_refused_after_its_charge_gets_its_tokens_back(clock: ManualClock) -> None:
    quotas = _quotas(clock, a={"tokens_per_minute": 600, "requests_per_minute": 60, "burst_s": 6})
    assert quotas.charge("a", 60) is None  # the whole burst of tokens
    assert quotas.charge("a", 1) is not None
    quotas.refund("a", 60)  # admission shed it, or no endpoint served its model: it reached no server
    assert quotas.charge("a", 60) is None
    assert quotas.stats.refunded["a"] == 1 and quotas.stats.admitted["a"] == 2
    quotas.refund("nobody", 5)  # a tenant with no buckets: nothing to give back


def test_a_request_larger_than_the_burst_is_told_so(clock: ManualClock) -> None:
    quotas = _quotas(clock, a={"tokens_per_minute": 600, "burst_s": 6})
    refusal = quotas.charge("a", 61)
    assert refusal is not None and "exceed the tenant's burst of 60 tokens" in refusal.message


def test_other_tenants_have_the_default_each_or_no_limit(clock: ManualClock) -> None:
    config, _ = _configs({"header": "x-t", "tenants": {"a": {"requests_per_minute": 60, "burst_s": 1}}})
    unlimited = Quotas(config, clock=clock)
    assert all(unlimited.charge("b", 10**6) is None for _ in range(100))
    assert unlimited.charge("a", 0) is None and unlimited.charge("a", 0) is not None
    config, _ = _configs({"header": "x-t", "default": {"requests_per_minute": 60, "burst_s": 1}})
    limited = Quotas(config, clock=clock)
    assert limited.charge("b", 0) is None and limited.charge("b", 0) is not None
    assert limited.charge("c", 0) is None  # a bucket of its own
    assert limited.charge(None, 0) is None and limited.charge("", 0) is not None  # no header: the tenant ""
    assert dict(limited.stats.admitted) == {"other": 3} and limited.label("b") == "other"


def test_new_limits_on_reload_start_their_buckets_again(clock: ManualClock) -> None:
    quotas = _quotas(clock, a={"requests_per_minute": 60, "burst_s": 1}, b={"requests_per_minute": 60, "burst_s": 1})
    assert quotas.charge("a", 0) is None and quotas.charge("b", 0) is None
    config, _ = _configs(
        {
            "header": "x-tenant",
            "tenants": {
                "a": {"requests_per_minute": 120, "burst_s": 1},
                "b": {"requests_per_minute": 60, "burst_s": 1},
            },
        }
    )
    quotas.reconfigure(config)
    assert quotas.charge("a", 0) is None  # a fresh bucket of 2
    assert quotas.charge("b", 0) is not None  # unchanged: still empty


def test_at_most_max_tenants_buckets_are_kept(clock: ManualClock) -> None:
    config, _ = _configs({"header": "x-t", "default": {"requests_per_minute": 60}, "max_tenants": 3})
    quotas = Quotas(config, clock=clock)
    for i in range(10):
        assert quotas.charge(f"t{i}", 0) is None
    assert len(quotas._buckets) == 3


@pytest.mark.parametrize(
    ("quotas", "says"),
    [
        ({"tenants": {"a": {"requests_per_minute": 1}}}, "quotas.header is needed"),
        ({"header": "x-t"}, "quotas limits nothing"),
        ({"header": "Authorization", "default": {"tokens_per_minute": 5}}, "quotas.header cannot be 'authorization'"),
        ({"header": "x-request-id", "default": {"tokens_per_minute": 5}}, "quotas.header cannot be 'x-request-id'"),
        ({"header": "x-t", "source": None, "default": {"tokens_per_minute": 5}}, "quotas.source must be jwt or"),
        (
            {"header": "x-t", "source": "client", "default": {"tokens_per_minute": 5}},
            "quotas.source must be jwt or gateway",
        ),
        ({"header": "x-t", "source": "jwt", "default": {"tokens_per_minute": 5}}, "quotas.jwt is needed with source"),
        (
            {
                "header": "x-t",
                "default": {"tokens_per_minute": 5},
                "jwt": {"issuer": "i", "jwks_file": "f", "claim": "c"},
            },
            "quotas.jwt is for source 'jwt' only",
        ),
        (
            {
                "header": "x-t",
                "source": "jwt",
                "default": {"tokens_per_minute": 5},
                "jwt": {"issuer": "i", "claim": "c"},
            },
            "quotas.jwt.jwks_file",
        ),
        ({"header": "x-t", "tenants": {"a": {}}}, "quotas.tenants.a needs requests_per_minute or tokens_per_minute"),
        ({"header": "x-t", "default": {"tokens_per_minute": 0}}, "quotas.default.tokens_per_minute"),
        ({"header": "x-t", "default": {"tokens_per_minute": 5, "burst_s": 0.5}}, "quotas.default.burst_s"),
        ({"header": "x-t", "default": {"tokens_per_minute": 5}, "extra": 1}, "quotas: unknown key 'extra'"),
    ],
)
def test_a_bad_quotas_section_is_refused_naming_the_field(quotas: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _configs(quotas)


def test_quotas_without_a_source_are_refused_with_the_choices() -> None:
    quotas = {"header": "x-t", "default": {"tokens_per_minute": 5}}
    with pytest.raises(
        ConfigError, match=r"quotas\.source is needed: who sets the tenant header, so that no client can"
    ):
        parse_config({"pool": {"endpoints": [{"address": "127.0.0.1:9101"}]}, "quotas": quotas})


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    with redis_server(tmp_path / "redis") as running:
        yield running


def _shared(
    server: RedisServer, tmp_path: Path, tenants: dict, **quotas: object
) -> tuple[QuotasConfig, ReplicasConfig | None]:
    secret = tmp_path / "redis-password"
    secret.write_text(server.password + "\n")
    return _configs(
        {"header": "x-tenant", "tenants": tenants, "sync_interval_s": 0.01, **quotas},
        {"url": server.url, "password": {"token_file": str(secret)}, "key": "inferlb:quota-test"},
    )


@contextlib.asynccontextmanager
async def _running(*quotas: Quotas):  # type: ignore[no-untyped-def]
    tasks = [asyncio.create_task(q.run()) for q in quotas]
    try:
        await until(lambda: all(q.up for q in quotas), "in step through Redis")
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _demand(quotas: Quotas, tenant: str, tokens: int, seconds: float, every_s: float = 0.002) -> int:
    """Ask for ``tokens`` every ``every_s`` for ``seconds`` (a bounded loop); the tokens admitted."""
    admitted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if quotas.charge(tenant, tokens) is None:
            admitted += tokens
        await asyncio.sleep(every_s)
    return admitted


@needs_redis
async def test_two_replicas_hold_one_tenants_limit_together(server: RedisServer, tmp_path: Path) -> None:
    # 6,000 tokens a minute (100 a second), a burst of 1 s; each replica asks for ~5,000 a second.
    quotas_config, replicas = _shared(server, tmp_path, {"a": {"tokens_per_minute": 6000, "burst_s": 1}})
    pair = [Quotas(quotas_config, replicas, shares=lambda: 2) for _ in range(2)]
    async with _running(*pair):
        started = time.monotonic()
        admitted = await asyncio.gather(*(_demand(q, "a", 10, 3.0) for q in pair))
        elapsed = time.monotonic() - started
    allowed = 100 + 100 * elapsed  # the burst, then the rate
    assert 0.85 * allowed <= sum(admitted) <= 1.1 * allowed, (admitted, allowed)
    assert all(n > 0.25 * allowed for n in admitted)  # both replicas had their share


@needs_redis
async def test_a_tenant_on_one_replica_only_gets_the_whole_limit(server: RedisServer, tmp_path: Path) -> None:
    quotas_config, replicas = _shared(server, tmp_path, {"a": {"tokens_per_minute": 6000, "burst_s": 1}})
    busy, idle = (Quotas(quotas_config, replicas, shares=lambda: 2) for _ in range(2))
    async with _running(busy, idle):
        started = time.monotonic()
        admitted = await _demand(busy, "a", 10, 3.0)
        elapsed = time.monotonic() - started
    allowed = 100 + 100 * elapsed
    assert 0.8 * allowed <= admitted <= 1.1 * allowed, (admitted, allowed)


@needs_redis
async def test_redis_away_each_replica_keeps_its_share_and_reports_its_spending_after(
    server: RedisServer, tmp_path: Path
) -> None:
    quotas_config, replicas = _shared(server, tmp_path, {"a": {"tokens_per_minute": 6000, "burst_s": 1}})
    quotas = Quotas(quotas_config, replicas, shares=lambda: 2)
    async with _running(quotas):
        assert quotas.charge("a", 10) is None
        await until(lambda: quotas.stats.syncs > 2, "synced")
        server.stop()
        await until(lambda: quotas.up is False, "Redis seen gone")
        admitted = await _demand(quotas, "a", 10, 2.0)
        # Its share of two: half the rate (the level it last saw is shared too).
        assert 0.3 * (100 + 200) <= admitted <= 0.6 * (100 + 200), admitted
        assert quotas.stats.outages == 1
        server.start()
        await until(lambda: quotas.up, "in step again", timeout=30)
        client = aioredis.Redis.from_url(server.url, password=server.password)
        level = float(await client.hget("inferlb:quota-test:quota:tokens_per_minute:a", "level"))
        await client.aclose()
        # Redis came back empty: the bucket starts full, less what this replica spent while it was away.
        assert level <= 100 - admitted + 100 * 2.0
        assert level < 100


def _level_of(client: aioredis.Redis, limit: str, tenant: str):  # type: ignore[no-untyped-def]
    """The level in Redis of ``tenant``'s bucket for ``limit`` (None: no bucket, or none that holds a number)."""

    async def read() -> float | None:
        try:
            level = await client.hget(f"inferlb:quota-test:quota:{limit}:{tenant}", "level")
        except ResponseError:  # not a hash
            return None
        try:
            return float(level) if level is not None else None
        except ValueError:
            return None

    return read()


def _settled(quotas: Quotas, tenant: str) -> bool:
    """Everything ``tenant`` spent on this replica is in Redis (and was read back after)."""
    buckets = quotas._buckets.get(tenant, {})
    return all(b.unsent == 0 and b.sending == 0 and getattr(b, "batch", 0) == 0 for b in buckets.values())


@needs_redis
async def test_a_sync_whose_reply_is_lost_after_redis_took_it_charges_the_tenant_once(
    server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 60 tokens a minute (1 a second), a burst of 3,600: what a charge took stays visible in the level.
    quotas_config, replicas = _shared(server, tmp_path, {"a": {"tokens_per_minute": 60, "burst_s": 3600}})
    quotas = Quotas(quotas_config, replicas)
    client = aioredis.Redis.from_url(server.url, password=server.password)
    lost: list[object] = []
    read_response = Connection.read_response

    async def reply_lost(self: Connection, *args: object, **kwargs: object) -> object:
        reply = await read_response(self, *args, **kwargs)
        bucket = quotas._buckets.get("a", {}).get("tokens_per_minute")
        if not lost and bucket is not None and bucket.sending == 1000:  # the call that carries the 1,000 tokens
            lost.append(reply)
            raise RedisTimeoutError("Timeout reading from the test's Redis")  # taken, but the reply never came
        return reply

    try:
        async with _running(quotas):
            assert quotas.charge("a", 10) is None
            await until(lambda: quotas.stats.syncs > 2 and _settled(quotas, "a"), "the first charge in Redis")
            before = await _level_of(client, "tokens_per_minute", "a")
            monkeypatch.setattr(Connection, "read_response", reply_lost)
            assert quotas.charge("a", 1000) is None
            await until(lambda: lost, "the reply lost")
            outages = quotas.stats.outages
            await until(lambda: quotas.up and _settled(quotas, "a"), "the spending in Redis after all")
            monkeypatch.undo()
            after = await _level_of(client, "tokens_per_minute", "a")
        assert before is not None and after is not None
        # Refilling at 1 token a second can only make the charge look smaller; sent twice, it would be 2,000.
        assert 500 < before - after <= 1000, (before, after)
        assert outages == 1 and quotas.stats.applied_before == 1
    finally:
        monkeypatch.undo()
        await client.aclose()


@needs_redis
@pytest.mark.parametrize("forged", ["-inf", "not a number", "a string key"])
async def test_a_bucket_someone_else_wrote_is_reset_to_full_and_fails_no_other(
    server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, forged: str
) -> None:
    tenants = {t: {"tokens_per_minute": 60, "burst_s": 3600} for t in ("a", "b")}
    quotas_config, replicas = _shared(server, tmp_path, tenants)
    quotas = Quotas(quotas_config, replicas, shares=lambda: 2)
    forged_key = "inferlb:quota-test:quota:tokens_per_minute:b"
    client = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        async with _running(quotas):
            assert quotas.charge("a", 10) is None and quotas.charge("b", 10) is None
            await until(lambda: quotas.stats.syncs > 1 and _settled(quotas, "a"), "synced")
            before = await _level_of(client, "tokens_per_minute", "a")
            if forged == "a string key":
                await client.delete(forged_key)
                await client.set(forged_key, "garbage")
            else:
                await client.hset(forged_key, mapping={"level": forged, "at": "0"})
            for _ in range(5):  # a keeps spending while b's bucket holds garbage
                assert quotas.charge("a", 20) is None
                syncs = quotas.stats.syncs
                await until(lambda: quotas.stats.syncs > syncs + 1, "synced on")  # noqa: B023
            await until(lambda: _level_of(client, "tokens_per_minute", "b"), "b's bucket reset")
            await until(lambda: _settled(quotas, "a"), "a's spending in Redis")
            after = await _level_of(client, "tokens_per_minute", "a")
            assert quotas.up is True and quotas.stats.outages == 0
            assert quotas.stats.repaired == 1
            assert await _level_of(client, "tokens_per_minute", "b") > 3000  # full again (less what refilled)
        assert before is not None and after is not None
        assert 50 < before - after <= 100, (before, after)  # a charged its 100 tokens once
        said = [r.getMessage() for r in caplog.records if r.name == "inferlb.scorer.quotas"]
        assert any("tokens_per_minute:b' held no finite level" in m and "reset to full" in m for m in said), said
        assert not any("unreachable" in m for m in said), said
    finally:
        await client.aclose()


@needs_redis
async def test_redis_that_answers_with_errors_is_not_called_unreachable(
    server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quotas_config, replicas = _shared(server, tmp_path, {"a": {"tokens_per_minute": 60, "burst_s": 3600}})
    quotas = Quotas(quotas_config, replicas)
    client = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        async with _running(quotas):
            await client.config_set("maxmemory", "1")  # every write refused (OOM)
            assert quotas.charge("a", 100) is None
            await until(lambda: quotas.up is False, "the refusal seen")
            await client.config_set("maxmemory", "0")
            await until(lambda: quotas.up and _settled(quotas, "a"), "in step again")
            assert await _level_of(client, "tokens_per_minute", "a") <= 3500  # its 100 tokens, once
        said = [r.getMessage() for r in caplog.records if r.name == "inferlb.scorer.quotas"]
        assert any("Redis answered with an error (OutOfMemoryError" in m for m in said), said
        assert not any("unreachable" in m for m in said), said
    finally:
        await client.aclose()


@needs_redis
@pytest.mark.parametrize("dropped_by", ["reload", "eviction"])
async def test_spending_of_dropped_buckets_still_reaches_redis(
    server: RedisServer, tmp_path: Path, dropped_by: str
) -> None:
    limits = {"tokens_per_minute": 60, "burst_s": 3600}
    quotas_config, replicas = _shared(server, tmp_path, {"a": limits}, max_tenants=1, default=limits)
    quotas = Quotas(quotas_config, replicas)
    async with _running(quotas):
        assert quotas.charge("a", 10) is None
        await until(lambda: quotas.stats.syncs > 1 and _settled(quotas, "a"), "synced")
        server.stop()
        await until(lambda: quotas.up is False, "Redis seen gone")
        assert all(quotas.charge("a", 100) is None for _ in range(10))  # 1,000 tokens while Redis is away
        if dropped_by == "reload":
            changed, _ = _shared(server, tmp_path, {"a": {**limits, "tokens_per_minute": 61}}, max_tenants=1)
            quotas.reconfigure(changed)  # a's buckets start again
        else:
            assert quotas.charge("b", 1) is None  # one tenant kept: a's buckets go
            assert "a" not in quotas._buckets
        server.start()
        await until(lambda: quotas.up and quotas.stats.syncs > 0, "in step again", timeout=30)
        client = aioredis.Redis.from_url(server.url, password=server.password)
        try:
            level = await until(lambda: _level_of(client, "tokens_per_minute", "a"), "a's bucket in Redis")
        finally:
            await client.aclose()
    # Redis came back empty: a's bucket starts full (3,600), less the 1,000 tokens (plus a token a second refilled).
    assert level < 3000, level


async def test_a_refusal_by_this_replicas_share_alone_says_retry_at_its_next_read(clock: ManualClock) -> None:
    # 1,000 tokens a second, a burst of 60,000; two replicas, each spending at most half of what it last read.
    config, replicas = _configs(
        {"header": "x-t", "tenants": {"a": {"tokens_per_minute": 60000, "burst_s": 60}}, "sync_interval_s": 0.5},
        {"url": "redis://127.0.0.1:1", "key": "inferlb:quota-test"},
    )
    quotas = Quotas(config, replicas, shares=lambda: 2, clock=clock)
    quotas.up = True  # in step with Redis (its bucket full, as first assumed)
    assert [quotas.charge("a", 8000) for _ in range(3)] == [None, None, None]
    refusal = quotas.charge("a", 8000)  # 24,000 spent of its share of 30,000: the bucket holds 60,000
    assert refusal is not None and refusal.retry_after_s == 1  # its next read (0.5 s), in whole seconds
    refusal = quotas.charge("a", 40000)  # more than the bucket will hold at the next read (36,000)
    assert refusal is not None and refusal.retry_after_s > 1  # then the rate says when


@needs_redis
async def test_reading_many_tenants_back_lets_the_loop_run_between_script_calls(
    server: RedisServer, tmp_path: Path
) -> None:
    default = {"requests_per_minute": 600, "tokens_per_minute": 10**5}
    quotas_config, replicas = _shared(server, tmp_path, {}, default=default, max_tenants=5000)
    assert replicas is not None
    quotas = Quotas(quotas_config, replicas)
    tenants = 2000
    for i in range(tenants):
        assert quotas.charge(f"t{i}", 10) is None
    client = connect_redis(replicas)
    evalsha, made, seen = client.evalsha, 0, set()

    async def counted(*args: object) -> object:
        nonlocal made
        made += 1
        return await evalsha(*args)

    async def watch() -> None:
        while True:
            seen.add(made)  # the calls made by the time the loop gave this task a turn
            await asyncio.sleep(0)

    client.evalsha = counted  # type: ignore[method-assign]
    watcher = asyncio.create_task(watch())
    try:
        sha = await client.script_load(TAKE)
        await quotas._sync(client, sha)  # the first: every tenant's two buckets
        assert all(_settled(quotas, f"t{i}") for i in range(tenants))
    finally:
        watcher.cancel()
        await client.aclose()
    assert 2 * tenants / 300 <= made <= 2 * tenants / 200  # some 256 buckets a call, not one call for each
    assert seen >= set(range(made + 1))  # the loop ran during every call
