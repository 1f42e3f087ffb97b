"""Experiments in the picker: what a reload or a membership change keeps, and the config errors it refuses."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferlb.admin import create_admin_app
from inferlb.bench.redisserver import REDIS, redis_server
from inferlb.picker import PickerProcess, create_picker
from inferlb.scorer.config import ConfigError, EndpointConfig, parse_config
from inferlb.scorer.engine import Engine, _prefix_indices
from inferlb.scorer.features import RequestFeatures

from .conftest import until

ENDPOINTS = [{"address": f"10.0.0.{i}:8000"} for i in (1, 2, 3, 4)]


def _doc(policy: str, **extra: Any) -> dict[str, Any]:
    arms = [
        {"name": "control", "profile": "round-robin", "weight": 0.5},
        {"name": "treatment", "profile": "default", "weight": 0.5},
    ]
    return {
        "admin": None,
        "policy": policy,
        "pool": {"endpoints": ENDPOINTS, "allowed_networks": ["10.0.0.0/8"]},
        "experiments": [{"name": "ab", "arms": arms}],
        **extra,
    }


def _route(picker: PickerProcess, n: int) -> None:
    router = picker.service.router
    for i in range(n):
        request = RequestFeatures(
            model="m", request_id=f"r{i}", prefix_hashes=tuple(range(i * 10, i * 10 + 8)), prompt_tokens=128
        )
        router.route(router.admit(request).request).lease.release()


def _blocks(engine: Engine) -> list[int]:
    return [len(index) for index in _prefix_indices(engine)]


def _treatment(picker: PickerProcess) -> Engine:
    experiments = picker.service.router.experiments
    assert experiments is not None
    return experiments.running["ab"].arms[1].engine


async def test_a_reload_keeps_what_an_arms_own_engine_learned() -> None:
    picker = create_picker(parse_config(_doc("round-robin")))
    _route(picker, 200)
    learned = _blocks(_treatment(picker))
    assert learned == [1600]
    picker.reload_document(_doc("round-robin"))
    assert _blocks(_treatment(picker)) == learned


async def test_a_membership_change_carries_an_arms_prefix_index_to_the_new_pool() -> None:
    doc = _doc("round-robin")
    doc["pool"] = {
        "endpoints": [],
        "allowed_networks": ["10.0.0.0/8"],
        "discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/"}},
    }
    first = tuple(EndpointConfig(address=e["address"]) for e in ENDPOINTS)
    picker = create_picker(parse_config(doc), discovered=first)
    _route(picker, 200)
    index = _prefix_indices(_treatment(picker))[0]
    held = {e.address: len(index._lru[e.index]) for e in picker.engine.pool}  # type: ignore[attr-defined]
    picker.discovered_endpoints(first[1:])  # 10.0.0.1 leaves
    index = _prefix_indices(_treatment(picker))[0]
    after = {e.address: len(index._lru[e.index]) for e in picker.engine.pool}  # type: ignore[attr-defined]
    assert after == {address: blocks for address, blocks in held.items() if address != "10.0.0.1:8000"}
    assert sum(after.values()) > 0


async def test_a_policy_that_was_an_arms_profile_keeps_what_that_arm_learned() -> None:
    picker = create_picker(parse_config(_doc("round-robin")))
    _route(picker, 200)
    picker.reload_document(_doc("default"))
    assert _blocks(picker.engine) == [1600]
    assert _treatment(picker) is picker.engine


def _discovering(experiments: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    etcd = {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/"}
    pool = {"endpoints": [], "allowed_networks": ["10.0.0.0/8"], "discovery": {"etcd": etcd}}
    return {"admin": None, "policy": "least-request", "pool": pool, "experiments": experiments, **extra}


RELEASE = {
    "name": "rollout",
    "arms": [
        {"name": "stable", "profile": "default", "weight": 0.9},
        {"name": "canary", "profile": "default", "weight": 0.1, "endpoints": {"version": "beta"}},
    ],
}


def _member(address: str, version: str) -> EndpointConfig:
    return EndpointConfig(address=address, labels={"version": version})


async def test_a_release_arm_whose_endpoints_left_is_vacant_and_its_requests_go_to_the_control() -> None:
    # Refusing such a membership froze it whole: the departed canary kept its share of the traffic and newcomers
    # never joined. It applies now; the arm is vacant until an endpoint with its labels is back.
    first = (_member("10.0.0.1:8000", "v1"), _member("10.0.0.2:8000", "v1"), _member("10.0.0.3:8000", "beta"))
    picker = create_picker(parse_config(_discovering([RELEASE])), discovered=first)
    later = (*first[:2], _member("10.0.0.4:8000", "v1"))
    picker.discovered_endpoints(later)  # the canary's pod left, another stable one came
    assert picker.membership_refusals == 0
    serving = [e.address for e in picker.engine.pool if not e.draining]
    assert serving == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000"]
    router = picker.service.router
    experiment = router.experiments.running["rollout"]  # type: ignore[union-attr]
    experiment.control("weights", {"stable": 0.5, "canary": 0.5})
    arms, served = Counter(), Counter()
    for i in range(200):
        request = router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request
        routed = router.route(request)
        arms[request.arm.name if request.arm is not None else None] += 1
        served[routed.decision.endpoint.address] += 1
        routed.lease.release()
    assert arms == {"stable": 200} and "10.0.0.3:8000" not in served
    # A config that names labels no endpoint has is a mistake: refused.
    with pytest.raises(ConfigError, match=r"^experiments: experiment 'rollout': arm 'canary': no endpoint"):
        picker.reload_document(_discovering([RELEASE]))
    picker.discovered_endpoints((*later, _member("10.0.0.5:8000", "beta")))  # a canary is back
    assert not picker.service.router.experiments.running["rollout"].arms[1].vacant  # type: ignore[union-attr]


async def test_posting_a_config_with_a_bad_experiment_answers_400_naming_the_field(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-1234567890")
    token.chmod(0o600)
    doc = _discovering([], admin="127.0.0.1:19557", admin_auth={"token_file": str(token)})
    picker = create_picker(parse_config(doc), discovered=(_member("10.0.0.1:8000", "v1"),))
    bad = {
        **RELEASE,
        "arms": [{**RELEASE["arms"][0], "weight": 0.9}, {"name": "t", "profile": "default", "weight": 0.3}],
    }  # type: ignore[dict-item]
    transport = httpx.ASGITransport(app=create_admin_app(picker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:19557") as client:
        response = await client.post(
            "/config", json={**doc, "experiments": [bad]}, headers={"authorization": f"Bearer {token.read_text()}"}
        )
    assert response.status_code == 400
    assert "experiments[0].arms: experiment 'rollout': the arms' weights sum to 1.2, not 1" in response.text


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
async def test_an_outcome_that_reaches_another_replica_counts_for_the_arm_where_the_request_was_routed(
    tmp_path: Path,
) -> None:
    # Envoy spreads its streams over the replicas: a request's timed response, or its failure in the access log,
    # often reaches another replica than the one that routed it, which holds no arm for it. Before, the outcome
    # was counted there as unattributed and the arm never saw it: a canary failing every request ran on.
    with redis_server(tmp_path / "redis") as redis:
        secret = tmp_path / "redis-password"
        secret.write_text(redis.password)
        doc = _doc(
            "round-robin",
            otel={"latency_source": "stream"},
            replicas={"url": redis.url, "password": {"token_file": str(secret)}},
        )
        routing, observing = create_picker(parse_config(doc)), create_picker(parse_config(doc))
        tasks = [asyncio.create_task(p.replicas.run()) for p in (routing, observing) if p.replicas is not None]
        try:
            await until(lambda: routing.replicas.ready() and observing.replicas.ready(), "both in touch")  # type: ignore[union-attr]
            router = routing.service.router
            arms = {}
            for i in range(40):
                request = router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request
                router.route(request)
                arms[f"r{i}"] = request.arm.name if request.arm is not None else None
            for i in range(40):
                if i % 2:
                    observing.service._timed(f"r{i}", 0.2, None, False)  # the first token of a streamed response
                else:
                    tell = observing.service.failure_listener()
                    assert tell is not None
                    tell(f"r{i}")  # Envoy's access log: a 5xx
            experiments = router.experiments
            assert experiments is not None
            outcomes = {arm.name: arm.outcomes for arm in experiments.running["ab"].arms}
            await until(lambda: sum(o.finished for o in outcomes.values()) == 40, "every outcome counted where routed")
            for name, o in outcomes.items():
                assert o.failed == sum(1 for i in range(0, 40, 2) if arms[f"r{i}"] == name)
                assert o.finished == sum(1 for arm in arms.values() if arm == name)
            elsewhere = observing.service.router.experiments
            assert elsewhere is not None and elsewhere.unattributed == 0
            assert all(o.finished == 0 for o in (a.outcomes for a in elsewhere.running["ab"].arms))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for picker in (routing, observing):
                if picker.replicas is not None:
                    await picker.replicas.close()


async def test_a_picker_that_starts_before_its_canary_is_discovered_starts_with_the_arm_vacant() -> None:
    # With discovery, the first membership may not hold the canary's pod yet: a start that refused it crash-looped.
    first = (_member("10.0.0.1:8000", "v1"), _member("10.0.0.2:8000", "v1"))
    picker = create_picker(parse_config(_discovering([RELEASE])), discovered=first)
    experiments = picker.service.router.experiments
    assert experiments is not None and experiments.running["rollout"].arms[1].vacant
    picker.discovered_endpoints((*first, _member("10.0.0.3:8000", "beta")))
    experiments = picker.service.router.experiments
    assert experiments is not None and not experiments.running["rollout"].arms[1].vacant


BLUE_GREEN = {
    "name": "rollout",
    "arms": [
        {"name": "stable", "profile": "default", "weight": 0.9, "endpoints": {"version": "v1"}},
        {"name": "canary", "profile": "default", "weight": 0.1, "endpoints": {"version": "beta"}},
    ],
}


async def test_a_control_arm_is_never_vacant_a_membership_without_it_is_refused() -> None:
    # A vacant arm's requests go to the control: a vacant control sent most requests to an arm with no endpoint
    # (43 of 50 answered 503). Such a membership is refused (the pool in force serves on), and a start without the
    # control's endpoints is a config error that says why.
    first = (_member("10.0.0.1:8000", "v1"), _member("10.0.0.3:8000", "beta"))
    picker = create_picker(parse_config(_discovering([BLUE_GREEN])), discovered=first)
    picker.discovered_endpoints((first[1], _member("10.0.0.4:8000", "beta")))  # the stable pod left
    assert picker.membership_refusals == 1
    assert [e.address for e in picker.engine.pool] == ["10.0.0.1:8000", "10.0.0.3:8000"]
    router = picker.service.router
    for i in range(20):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request)
        routed.lease.release()
    with pytest.raises(ConfigError, match=r"^experiments: experiment 'rollout': arm 'stable': no endpoint"):
        create_picker(parse_config(_discovering([BLUE_GREEN])), discovered=first[1:])
