"""Experiments' control state shared by replicas through a real Redis (Debian's redis-server, with a password): a
guard's roll-back and an operator's action reach every replica, and a replica that starts takes them up."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis

from inferlb.bench.redisserver import REDIS, RedisServer, redis_server
from inferlb.scorer.config import ReplicasConfig, parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.experiments import (
    ArmSpec,
    ControlState,
    Experiments,
    ExperimentSpec,
    GuardSpec,
    RunningExperiment,
    spec_fingerprint,
)
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.router import Router
from inferlb.scorer.sharedcontrol import REPUBLISH, SharedControl, decode_state, encode_state

from ..conftest import until

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")

LABELS = [{"version": "stable"}] * 3 + [{"version": "canary"}]
POOL = {
    "endpoints": [
        {"address": f"10.0.0.{i + 1}:8000", "models": ["m"], "labels": labels} for i, labels in enumerate(LABELS)
    ]
}
POLL_S = 0.05


def _canary(weight: float = 0.5, **kw: object) -> ExperimentSpec:
    arms = (
        ArmSpec("stable", "least-request", round(1 - weight, 6)),
        ArmSpec("canary", "least-request", weight, {"version": "canary"}),
    )
    return ExperimentSpec("release", arms, guard=GuardSpec(min_requests=20, check_s=0.0), **kw)


def _router(spec: ExperimentSpec) -> Router:
    config = parse_config({"policy": "least-request", "pool": POOL})
    engine = Engine(Pool(config.endpoints), build_profile("least-request", np.random.default_rng(0), size=4))
    experiments = Experiments.over(engine, [spec], config.profile_spec, np.random.default_rng(0))
    return Router(engine, experiments=experiments)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@pytest.fixture
def config(server: RedisServer, tmp_path: Path) -> ReplicasConfig:
    secret = tmp_path / "redis-password"
    secret.write_text(server.password + "\n")
    document = {"url": server.url, "password": {"token_file": str(secret)}, "key": "inferlb:shared-test"}
    replicas = parse_config({"pool": POOL, "replicas": document}).replicas
    assert replicas is not None
    return replicas


class Replica:
    """One picker's experiments and its side of the shared control, running."""

    def __init__(self, config: ReplicasConfig, name: str, spec: ExperimentSpec) -> None:
        self.router = _router(spec)
        self.control = SharedControl(config, lambda: self.router.experiments, replica_id=name, poll_s=POLL_S)
        assert self.router.experiments is not None
        self.router.experiments.listeners.append(self.control.changed)
        self.task: asyncio.Task[None] | None = None

    @property
    def release(self) -> RunningExperiment:
        assert self.router.experiments is not None
        return self.router.experiments.running["release"]

    async def start(self) -> Replica:
        self.task = asyncio.create_task(self.control.run())
        await until(self.control.ready, "the shared state read")
        return self

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def replicas(config: ReplicasConfig) -> AsyncIterator[Callable[..., asyncio.Future[Replica]]]:
    started: list[Replica] = []

    async def start(name: str, spec: ExperimentSpec | None = None) -> Replica:
        replica = await Replica(config, name, spec or _canary()).start()
        started.append(replica)
        return replica

    yield start  # type: ignore[misc]
    for replica in started:
        await replica.stop()


def _fail_canary(router: Router, n: int = 200) -> None:
    """Route ``n`` requests; every canary request fails, every stable one succeeds (the guard judges each)."""
    experiments = router.experiments
    assert experiments is not None
    for i in range(n):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=f"f{i}")).request)
        routed.lease.release()
        failed = routed.arm is not None and routed.arm.name == "canary"
        if not failed:
            experiments.first_token(f"f{i}", 0.1)
        experiments.outcome(f"f{i}", failed=failed, e2e_s=None if failed else 0.2)


def _canary_share(router: Router, n: int = 400) -> float:
    arms = []
    for i in range(n):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=f"s{i}")).request)
        routed.lease.release()
        arms.append(routed.arm.name if routed.arm is not None else None)
    return arms.count("canary") / n


async def test_a_roll_back_by_one_replicas_guard_takes_the_canary_out_of_every_replica_and_a_new_one(
    replicas: Callable[..., asyncio.Future[Replica]],
) -> None:
    a, b = await replicas("a"), await replicas("b")
    assert _canary_share(b.router) > 0.3
    applied_before = b.control.stats.applied
    # b's copy sees no failure of its own; a's guard, on a's share, rolls the canary back.
    while not a.release.rolled_back:
        _fail_canary(a.router)
    await until(lambda: b.release.rolled_back, "b follows a's roll-back")
    assert b.release.weights() == {"stable": 1.0, "canary": 0.0}
    assert _canary_share(b.router) == 0.0
    history = b.release.describe()["history"]
    assert history[-1]["kind"] == "rolled-back" and history[-1]["reason"].startswith("rolled back by replica a: ")
    assert "failed" in history[-1]["reason"]  # the guard's own reason travels with it
    assert b.control.stats.applied == applied_before + 1
    published = b.control.stats.published
    await asyncio.sleep(5 * POLL_S)
    assert b.control.stats.published == published  # a change followed is not published again
    # A replica that starts later (a restart: a new id) takes the roll-back up before it is ready.
    c = await replicas("c")
    assert c.release.rolled_back and _canary_share(c.router) == 0.0
    # The operator starts it again on one replica: every replica's canary takes its share once more.
    c.release.control("start")
    await until(lambda: not a.release.rolled_back and not b.release.rolled_back, "a and b follow c's start")
    assert a.release.weights() == b.release.weights() == {"stable": 0.5, "canary": 0.5}
    assert _canary_share(a.router) > 0.3
    assert a.release.starts == b.release.starts == c.release.starts == 1  # one start, not one per replica


async def test_an_operators_action_on_one_replica_reaches_the_others_and_outlives_them(
    replicas: Callable[..., asyncio.Future[Replica]],
) -> None:
    a, b = await replicas("a"), await replicas("b")
    a.release.control("weights", {"stable": 0.9, "canary": 0.1})
    await until(lambda: b.release.weights() == {"stable": 0.9, "canary": 0.1}, "b takes a's weights")
    b.release.control("pause")
    await until(lambda: a.release.paused, "a takes b's pause")
    assert a.release.weights() == {"stable": 0.9, "canary": 0.1}  # a pause keeps the weights
    assert a.release.describe()["history"][-1]["reason"] == "paused by replica b"
    b.release.control("resume")
    await until(lambda: not a.release.paused, "a takes b's resume")
    await b.stop()
    # A replica that starts now learns the weights set before the pause and the resume, not only the last action.
    restarted = await replicas("b2")
    assert restarted.release.state == "running" and restarted.release.weights() == {"stable": 0.9, "canary": 0.1}
    a.release.control("stop")
    await until(lambda: restarted.release.state == "stopped", "the restarted replica takes a's stop")
    # A pause on a stopped experiment keeps its weights where it was made; so it does where it is followed.
    restarted.release.control("pause")
    await until(lambda: a.release.state == "paused", "a takes the pause")
    assert a.release.weights() == restarted.release.weights() == {"stable": 0.9, "canary": 0.1}


async def test_two_replicas_acting_at_once_both_count(replicas: Callable[..., asyncio.Future[Replica]]) -> None:
    a, b = await replicas("a"), await replicas("b")
    # Within one round (neither has read the other's change): a's guard rolls back, b's operator pauses.
    while not a.release.rolled_back:
        _fail_canary(a.router)
    b.release.control("pause")
    await until(lambda: a.release.paused and b.release.rolled_back, "each takes the other's change")
    for copy in (a.release, b.release):
        assert copy.state == "rolled back" and copy.paused and copy.weights() == {"stable": 1.0, "canary": 0.0}
    b.release.control("resume")  # a resume does not undo the roll-back: only a start does
    await until(lambda: not a.release.paused, "a takes b's resume")
    assert a.release.rolled_back and _canary_share(a.router) == 0.0
    # Weights and a pause at once: both hold everywhere.
    a.release.control("start")
    await until(lambda: not b.release.rolled_back, "b takes a's start")
    a.release.control("weights", {"stable": 0.8, "canary": 0.2})
    b.release.control("pause")
    await until(
        lambda: a.release.paused and b.release.weights() == {"stable": 0.8, "canary": 0.2}, "both changes everywhere"
    )
    assert a.release.weights() == {"stable": 0.8, "canary": 0.2} and b.release.paused


async def test_a_redis_that_restarted_empty_gets_every_replicas_state_back(
    replicas: Callable[..., asyncio.Future[Replica]], server: RedisServer
) -> None:
    a, b = await replicas("a"), await replicas("b")
    while not a.release.rolled_back:
        _fail_canary(a.router)
    await until(lambda: b.release.rolled_back, "b follows a's roll-back")
    server.stop()
    server.start()  # empty
    c = await replicas("c")  # starts after the restart: the others put the roll-back in the hash again
    await until(lambda: c.release.rolled_back, "c learns the roll-back from a Redis that lost it")
    c.release.control("start")  # and a start made now reaches the others (numbers did not go back for good)
    await until(lambda: not a.release.rolled_back and not b.release.rolled_back, "a and b follow the start")


async def test_another_configuration_of_the_experiment_starts_from_its_own(
    replicas: Callable[..., asyncio.Future[Replica]],
) -> None:
    a = await replicas("a")
    a.release.control("stop")
    await until(lambda: a.control.stats.published >= 1 and not a.control._pending, "a's stop published")
    # The same name, another ramp: a new experiment, which the old one's stop does not reach.
    other = await replicas("b", _canary(ramp=(0.6, 0.7)))
    assert other.release.state == "running"
    same = await replicas("c")
    assert same.release.state == "stopped"
    # A copy replaced by a reload to another configuration and back takes the shared state up again.
    assert same.router.experiments is not None
    engine = same.router.engine
    for spec in (_canary(ramp=(0.6, 0.7)), _canary()):
        config = parse_config({"policy": "least-request", "pool": POOL})
        same.router.experiments = Experiments.over(engine, [spec], config.profile_spec, np.random.default_rng(0))
        same.router.experiments.listeners.append(same.control.changed)
        await asyncio.sleep(3 * POLL_S)
    await until(lambda: same.release.state == "stopped", "the new copy of the first configuration stopped")


def test_the_fingerprint_is_the_same_in_every_process_whatever_its_hash_seed() -> None:
    script = (
        "from inferlb.scorer.experiments import ArmSpec, ExperimentSpec, spec_fingerprint\n"
        "arms = (ArmSpec('a', 'default', 0.5), ArmSpec('b', 'default', 0.5, {'v': '2', 'tier': 'x'}))\n"
        "print(spec_fingerprint(ExperimentSpec('e', arms, models=frozenset({'m1', 'm2', 'm3', 'm4'}),"
        " classes=frozenset({'c1', 'c2', 'c3'}))))\n"
    )
    found = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in (1, 2, 3, 4)
    }
    assert len(found) == 1
    # The order of a mapping's keys in the config says nothing: the same fingerprint.
    flipped = (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5, {"tier": "x", "v": "2"}))
    ordered = (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5, {"v": "2", "tier": "x"}))
    assert spec_fingerprint(ExperimentSpec("e", flipped)) == spec_fingerprint(ExperimentSpec("e", ordered))


async def test_forged_or_mismatched_entries_change_nothing_and_stop_nothing(
    replicas: Callable[..., asyncio.Future[Replica]], config: ReplicasConfig, server: RedisServer
) -> None:
    a = await replicas("a")
    key = f"{config.key}:experiments"
    client = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        fingerprint = a.release.fingerprint
        good = {
            "fingerprint": fingerprint,
            "starts": 0,
            "weight_sets": 0,
            "weights": None,
            "rolled": None,
            "paused": False,
            "stopped": False,
            "by": "x",
            "reason": "",
        }
        forged = [
            b"not json",
            b"[1, 2]",
            orjson.dumps({**good, "paused": ["unhashable"]}),
            orjson.dumps({**good, "starts": True}),
            orjson.dumps({**good, "rolled": {"arm": "canary"}}),
            orjson.dumps({**good, "weights": {"stable": "1"}}),
            b"x" * 20_000,
        ]
        for count, raw in enumerate(forged, 1):
            await client.hset(key, "release", raw)
            await until(lambda n=count: a.control.stats.rejected == n, f"{raw[:30]!r} refused")
        # Well formed, but weights for arms this config does not have.
        await client.hset(key, "release", orjson.dumps({**good, "weight_sets": 5, "weights": {"other": 1.0}}))
        await until(lambda: a.control.stats.rejected == len(forged) + 1, "weights for unknown arms refused")
        assert a.release.state == "running" and a.release.weights() == {"stable": 0.5, "canary": 0.5}
        # The loop lives on: a real change still reaches the replica.
        await client.hset(key, "release", orjson.dumps({**good, "paused": True, "by": "replica z"}))
        await until(lambda: a.release.paused, "a valid entry followed after the forged ones")
        assert a.control.ready() and a.control.up
    finally:
        await client.aclose()


async def test_a_replica_that_cannot_reach_redis_routes_with_its_own_state_and_is_ready(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("nobody")
    document = {"url": "redis://127.0.0.1:1", "password": {"token_file": str(secret)}, "timeout_s": 0.2}
    config = parse_config({"pool": POOL, "replicas": document}).replicas
    assert config is not None
    replica = await Replica(config, "alone", _canary()).start()
    try:
        assert replica.control.up is False and replica.control.stats.outages == 1
        replica.release.control("pause")  # kept here, and published once Redis is back
        assert replica.release.paused and replica.control._pending
    finally:
        await replica.stop()


async def test_an_operators_action_made_while_a_change_is_on_its_way_to_redis_is_not_lost(
    replicas: Callable[..., asyncio.Future[Replica]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await replicas("a")
    await until(lambda: not a.control._pending, "a's first round done")
    snapshot = RunningExperiment.control_state
    raced: list[bool] = []

    def racing(self: RunningExperiment, by: str = "", reason: str = "") -> ControlState:
        state = snapshot(self, by, reason)
        if by and not raced:  # the state a write takes: the operator stops the experiment just after
            raced.append(True)
            self.control("stop")
        return state

    monkeypatch.setattr(RunningExperiment, "control_state", racing)
    a.release.control("pause")
    await until(lambda: raced and not a.control._pending, "both changes written")
    await asyncio.sleep(3 * POLL_S)
    assert a.release.state == "stopped"  # not taken back to the paused state the first write carried
    b = await replicas("b")
    assert b.release.state == "stopped"


async def test_a_state_put_back_is_not_merged_into_another_configurations_entry(
    config: ReplicasConfig, server: RedisServer
) -> None:
    # A's read found the field gone (Redis restarted empty); before A wrote, a replica running another configuration
    # of the experiment put its own back: A merged its roll-back into that entry, and the other configuration's
    # replicas rolled their experiment back.
    a, b = Replica(config, "a", _canary(0.5)), Replica(config, "b", _canary(0.3))
    assert a.release.fingerprint != b.release.fingerprint
    client = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        await client.hset(a.control.key, "release", encode_state(b.release.control_state(by="replica b")))
        a.release.roll_back("canary", "a's guard", "")
        await a.control._write(client, "release", a.release, {REPUBLISH}, "")
        stored = decode_state(await client.hget(a.control.key, "release"))
        assert stored is not None and stored.fingerprint == b.release.fingerprint and stored.rolled is None
        await b.control._read(client)
        assert b.release.state == "running"
    finally:
        await client.aclose()
