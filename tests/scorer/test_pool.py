"""Tests for scorer/pool.py: endpoints, per-model masks, wildcard endpoints and unknown models."""

from __future__ import annotations

import contextlib
import random
import string

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.errors import ConfigError, RoutingError, UnknownModelError
from inferlb.scorer.pool import Endpoint, Pool


def _ep(address: str, *models: str, **labels: str) -> EndpointConfig:
    return EndpointConfig(address=address, models=frozenset(models) if models else None, labels=labels)


# Three endpoints serving named models only.
NAMED = (_ep("10.0.0.1:8000", "a"), _ep("10.0.0.2:8000", "a", "b"), _ep("10.0.0.3:8000", "c"))
# The same plus a wildcard endpoint (no `models`: it accepts any model name).
MIXED = (*NAMED, _ep("[fd00::4]:8000"))


def test_endpoints_keep_order_index_address_and_labels() -> None:
    pool = Pool((_ep("10.0.0.1:8000", "a", zone="x"), _ep("[::1]:9000")))
    assert len(pool) == 2
    assert (
        list(pool)
        == list(pool.endpoints)
        == [
            Endpoint(0, "10.0.0.1:8000", "10.0.0.1", 8000, frozenset({"a"}), {"zone": "x"}),
            Endpoint(1, "[::1]:9000", "::1", 9000, None, {}),
        ]
    )
    assert pool.all_indices.tolist() == [0, 1]


def test_served_models_is_the_union_of_named_models() -> None:
    assert Pool(MIXED).served_models == frozenset({"a", "b", "c"})
    assert Pool((_ep("10.0.0.1:1"),)).served_models == frozenset()


@pytest.mark.parametrize(
    ("endpoint", "model", "expected"),
    [
        pytest.param(Endpoint(0, "10.0.0.1:1", "10.0.0.1", 1, frozenset({"a"}), {}), "a", True, id="listed"),
        pytest.param(Endpoint(0, "10.0.0.1:1", "10.0.0.1", 1, frozenset({"a"}), {}), "b", False, id="not-listed"),
        pytest.param(Endpoint(0, "10.0.0.1:1", "10.0.0.1", 1, None, {}), "anything", True, id="wildcard"),
    ],
)
def test_endpoint_serves(endpoint: Endpoint, model: str, expected: bool) -> None:
    assert endpoint.serves(model) is expected


@pytest.mark.parametrize(
    ("endpoints", "model", "expected"),
    [
        pytest.param(NAMED, "a", [True, True, False], id="named-a"),
        pytest.param(NAMED, "b", [False, True, False], id="named-b"),
        pytest.param(NAMED, "c", [False, False, True], id="named-c"),
        pytest.param(NAMED, None, [True, True, True], id="named-none-is-all"),
        pytest.param(MIXED, "a", [True, True, False, True], id="mixed-a-plus-wildcard"),
        pytest.param(MIXED, "c", [False, False, True, True], id="mixed-c-plus-wildcard"),
        pytest.param(MIXED, "unlisted", [False, False, False, True], id="mixed-unknown-goes-to-wildcard"),
        pytest.param(MIXED, None, [True, True, True, True], id="mixed-none-is-all"),
        pytest.param((_ep("10.0.0.1:1"), _ep("10.0.0.2:1")), "x", [True, True], id="all-wildcard"),
    ],
)
def test_model_mask(endpoints: tuple[EndpointConfig, ...], model: str | None, expected: list[bool]) -> None:
    mask = Pool(endpoints).model_mask(model)
    assert mask.dtype == np.bool_
    assert mask.tolist() == expected


@pytest.mark.parametrize(
    ("endpoints", "model", "served"),
    [
        pytest.param(NAMED, "d", "served: a, b, c", id="named"),
        pytest.param(NAMED, "", "served: a, b, c", id="empty-name"),
        pytest.param(NAMED, "A", "served: a, b, c", id="case-sensitive"),
        pytest.param((_ep("10.0.0.1:1", "z", "m"),), "a", "served: m, z", id="sorted"),
    ],
)
def test_unknown_model_without_wildcard_lists_served_models(
    endpoints: tuple[EndpointConfig, ...], model: str, served: str
) -> None:
    pool = Pool(endpoints)
    with pytest.raises(UnknownModelError) as info:
        pool.model_mask(model)
    assert isinstance(info.value, RoutingError)
    assert info.value.model == model
    assert info.value.served == pool.served_models
    assert str(info.value) == f"model {model!r} is not served by this pool ({served})"


def test_unknown_model_error_with_no_served_models_says_none() -> None:
    assert str(UnknownModelError("m", frozenset())) == "model 'm' is not served by this pool (served: none)"


def _random_names(count: int) -> list[str]:
    rng = random.Random(1234)
    return ["".join(rng.choices(string.ascii_letters, k=24)) for _ in range(count)]


@pytest.mark.parametrize(
    "endpoints",
    [pytest.param(NAMED, id="raises-unknown"), pytest.param(MIXED, id="wildcard-fallback")],
)
def test_unknown_model_names_are_never_cached(endpoints: tuple[EndpointConfig, ...]) -> None:
    pool = Pool(endpoints)
    before = dict(pool._masks)
    for name in _random_names(2000):
        with contextlib.suppress(UnknownModelError):
            pool.model_mask(name)
    assert len(pool._masks) == len(before) == 3
    assert pool._masks.keys() == before.keys()


def test_empty_pool_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="at least one endpoint"):
        Pool(())


@pytest.mark.parametrize(
    "address",
    [pytest.param("vllm:8000", id="hostname"), pytest.param("10.0.0.1", id="no-port")],
)
def test_invalid_address_is_refused(address: str) -> None:
    with pytest.raises(ValueError):
        Pool((_ep(address),))


def test_two_pools_are_independent() -> None:
    first, second = Pool(NAMED), Pool(MIXED)
    with pytest.raises(UnknownModelError):
        first.model_mask("unlisted")
    assert second.model_mask("unlisted").tolist() == [False, False, False, True]


def test_shared_arrays_are_read_only() -> None:
    pool = Pool(MIXED)
    assert not pool.model_mask("a").flags.writeable
    assert not pool.model_mask(None).flags.writeable
    assert not pool.all_indices.flags.writeable
