"""Experiments in the picker: what a reload or a membership change keeps, and the config errors it refuses."""

from __future__ import annotations

from typing import Any

from inferlb.picker import PickerProcess, create_picker
from inferlb.scorer.config import EndpointConfig, parse_config
from inferlb.scorer.engine import Engine, _prefix_indices
from inferlb.scorer.features import RequestFeatures

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
