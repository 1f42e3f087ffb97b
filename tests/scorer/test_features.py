"""Tests for RequestFeatures' builders (scorer/features.py): each gives what the constructor or
`dataclasses.replace` gives, and what it gives is as frozen."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from inferlb.scorer.features import RequestFeatures

# Every field set, and set apart from its default and from every other field.
FULL = RequestFeatures(
    path="/v1/completions",
    method="POST",
    request_id="r1",
    model="m",
    stream=True,
    max_tokens=7,
    prompt_chars=11,
    prompt_tokens=3,
    prefix_hashes=(5, 6),
    session_key="s",
    class_hint="hint",
    traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    request_class="old",
    pool_mask=np.array([True, False]),
    priority=4,
    ttft_slo_s=0.25,
)


def _fields(features: RequestFeatures) -> dict[str, object]:
    return {f.name: getattr(features, f.name) for f in dataclasses.fields(features)}


def test_with_body_sets_the_body_fields_and_keeps_the_rest() -> None:
    got = FULL.with_body("other", False, None, 99, 25, (1, 2, 3))
    expected = dataclasses.replace(
        FULL, model="other", stream=False, max_tokens=None, prompt_chars=99, prompt_tokens=25, prefix_hashes=(1, 2, 3)
    )
    assert _fields(got) == _fields(expected)


def test_classified_sets_the_class_fields_and_keeps_the_rest() -> None:
    mask = np.array([False, True])
    got = FULL.classified("interactive", 2, None, mask)
    expected = dataclasses.replace(FULL, request_class="interactive", priority=2, ttft_slo_s=None, pool_mask=mask)
    assert _fields(got) == _fields(expected)


def test_of_gives_what_the_constructor_gives() -> None:
    fields = {"path": "/v1/embeddings", "request_id": "r2", "session_key": "s"}
    assert _fields(RequestFeatures.of(fields)) == _fields(RequestFeatures(**fields))
    assert _fields(RequestFeatures.of({})) == _fields(RequestFeatures())


@pytest.mark.parametrize(
    "built",
    [
        pytest.param(lambda: RequestFeatures.of({"path": "/p"}), id="of"),
        pytest.param(lambda: FULL.with_body("m", False, None, 1, 1, ()), id="with_body"),
        pytest.param(lambda: FULL.classified("c", 0, None, None), id="classified"),
        pytest.param(lambda: FULL.assigned(None, None), id="assigned"),
    ],
)
def test_what_the_builders_give_is_frozen_and_replaceable(built: object) -> None:
    features = built()  # type: ignore[operator]
    with pytest.raises(dataclasses.FrozenInstanceError):
        features.path = "/other"
    assert dataclasses.replace(features, path="/other").path == "/other"
    assert features == dataclasses.replace(features)


def test_the_builders_know_every_field() -> None:
    """A field added to RequestFeatures needs a default (`of` fills the rest from the defaults), and the two
    updates set the fields listed here."""
    assert [f.name for f in dataclasses.fields(RequestFeatures)] == [
        "path",
        "method",
        "request_id",
        "model",
        "stream",
        "max_tokens",
        "prompt_chars",
        "prompt_tokens",
        "prefix_hashes",
        "session_key",
        "class_hint",
        "objective",
        "traceparent",
        "request_class",
        "pool_mask",
        "priority",
        "ttft_slo_s",
        "headers",
        "arm",
        "subset",
        "cache_keys",
        "keying",
        "output_copies",
    ]
