"""Named policies: each name maps to a factory that builds a fresh ``Profile``.

The mapping is read-only; build what you need at start-up and pass it down (no module-global state changes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from inferlb.scorer.engine import Profile, WeightedScorer
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker, ModelFilter, RoundRobinPicker


def round_robin(rng: np.random.Generator | None = None) -> Profile:
    """Envoy-style rotation over the endpoints that serve the model; the baseline to beat."""
    return Profile("round-robin", filters=(ModelFilter(),), scorers=(), picker=RoundRobinPicker())


def least_request(rng: np.random.Generator | None = None) -> Profile:
    """Fewest in-flight requests sent by this picker, random among equals."""
    return Profile(
        "least-request",
        filters=(ModelFilter(),),
        scorers=(WeightedScorer(InFlightScorer(), 1.0),),
        picker=MaxScorePicker(rng),
    )


PRESETS: Mapping[str, Callable[[np.random.Generator | None], Profile]] = MappingProxyType(
    {"round-robin": round_robin, "least-request": least_request}
)
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def build_profile(name: str, rng: np.random.Generator | None = None) -> Profile:
    """A fresh profile for the preset ``name``; raises ``KeyError`` naming the known presets."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(PRESET_NAMES)}") from None
    return factory(rng)
