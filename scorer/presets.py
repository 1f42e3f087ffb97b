"""Named policies as data: each preset is a `ProfileSpec` that `build_profile` turns into a fresh `Profile`.

| preset | filters | scorers (weight) | picker |
|---|---|---|---|
| round-robin | model, staleness | - | round-robin |
| least-request | model, staleness | in-flight | max-score |
| kv-aware | model, staleness, saturation | kv-cache 1, queue 1, in-flight 1 | max-score |
| prefix-aware | model, staleness, saturation | prefix-affinity 2, queue 1, in-flight 1, kv-cache 0.5 | max-score |
| seed-formula | model, staleness | seed-formula | max-score |
| default | model, staleness, ttft-gap, | in-flight 0.25, queue 1, kv-cache 0.5, prefix-affinity 1, | max-score |
|  | saturation, ttft-slo | predicted-ttft 2, in-flight-tokens 1, latency 0.5, |  |
|  |  | lora-affinity 1 |  |
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from inferlb.scorer.engine import Profile
from inferlb.scorer.registry import BuildContext, PluginSpec, ProfileSpec, Registry, default_registry

__all__ = ["PRESETS", "PRESET_NAMES", "build_profile"]


def _spec(name: str, filters: tuple[str, ...], scorers: tuple[tuple[str, float], ...], picker: str) -> ProfileSpec:
    return ProfileSpec(
        name,
        tuple(PluginSpec(f) for f in filters),
        tuple(PluginSpec(s, weight=w) for s, w in scorers),
        PluginSpec(picker),
        where=f"preset {name!r}",
    )


_GUARDED = ("model", "staleness", "saturation")

PRESETS: Mapping[str, ProfileSpec] = MappingProxyType(
    {
        # Even the policies that read no metrics skip an endpoint whose scrapes fail or lag (a stale endpoint
        # counts as saturated), unless every endpoint is stale; without a scraper nothing changes.
        "round-robin": _spec("round-robin", ("model", "staleness"), (), "round-robin"),
        "least-request": _spec("least-request", ("model", "staleness"), (("in-flight", 1.0),), "max-score"),
        "kv-aware": _spec("kv-aware", _GUARDED, (("kv-cache", 1.0), ("queue", 1.0), ("in-flight", 1.0)), "max-score"),
        "prefix-aware": _spec(
            "prefix-aware",
            _GUARDED,
            (("prefix-affinity", 2.0), ("queue", 1.0), ("in-flight", 1.0), ("kv-cache", 0.5)),
            "max-score",
        ),
        "seed-formula": _spec("seed-formula", ("model", "staleness"), (("seed-formula", 1.0),), "max-score"),
        "default": _spec(
            "default",
            # ttft-gap: no endpoint predicted to take over 2x and 1 s longer than the best to the first token (on
            # a mixed fleet, the slow servers that the load scorers favour for holding fewer requests;
            # bench/results/quality/fleets). Before saturation: when the fast servers are saturated, the saturation
            # filter alone would leave a slow one under its threshold as the only candidate, and herd every request
            # onto it until the next scrape. speed-class: on a mixed fleet, for a request predicted to wait 0.75 s or
            # more even at best, only the kind of server predicted soonest, among the unsaturated
            # (bench/results/quality/fleets).
            # ttft-slo: a no-op for requests whose class has no TTFT objective.
            ("model", "staleness", "ttft-gap", "saturation", "speed-class", "ttft-slo"),
            (
                # 0.25, not 1: a count weighs a 100-token request like an 8,000-token one, and at 1 it outvoted the
                # token-aware scorers below (TTFT p99 up to 1.35x the oracle's on the Azure traces, where prompts
                # vary most; bench/results/quality/fleets). It stays as the tie-breaker that spreads requests whose
                # prompt the picker does not read (a headers-only route), which the token scorers cannot tell apart.
                # Where prefix affinity holds traffic on a server that turns slow (the demo), the count at 1 pushed
                # the traffic off sooner; at 0.25 the imbalance guard does (`scorer.inflight.overloaded`: more than
                # twice the other candidates' mean in-flight requests ends the cache credit).
                ("in-flight", 0.25),
                ("queue", 1.0),
                ("kv-cache", 0.5),
                ("prefix-affinity", 1.0),
                # 2, not 1: tuned in the simulator on the Mooncake conversation trace (bench/results/quality/). It
                # also charges the wait a prompt adds to one already waiting there (delay_to_waiting: prompts that
                # wait are prefilled together; bench/results/quality/fleets, "Prompts that wait together").
                ("predicted-ttft", 2.0),
                # Prompt tokens until their requests end: what predicted-ttft no longer counts once prefilled,
                # but what a slow server shows first (its requests stay in flight longer).
                ("in-flight-tokens", 1.0),
                # Not recent-prefill (the prompt tokens sent in the last seconds): it helps equal servers on the
                # Azure traces, but pulls traffic back onto a server that turned slow, or onto slower hardware whose
                # speed is not declared, because they are given fewer tokens (bench/results/quality/fleets).
                ("latency", 0.5),
                ("lora-affinity", 1.0),
            ),
            "max-score",
        ),
    }
)
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def build_profile(
    name: str | ProfileSpec,
    rng: np.random.Generator | None = None,
    *,
    size: int = 0,
    registry: Registry | None = None,
    speeds: np.ndarray | None = None,
    addresses: tuple[str, ...] | None = None,
) -> Profile:
    """A fresh profile for the preset ``name`` (or a spec) over a pool of ``size`` endpoints (plugins that keep
    per-endpoint state need it), whose declared relative speeds are ``speeds`` (`SpeedHints.of`; None: none
    differ) and addresses ``addresses`` (where given, plugins key what they keep by address, as the session ring
    does). Raises ``KeyError`` naming the known presets, ``ConfigError`` for a bad spec."""
    if isinstance(name, ProfileSpec):
        spec = name
    else:
        try:
            spec = PRESETS[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {', '.join(PRESET_NAMES)}") from None
    context = BuildContext(size=size, rng=rng, speeds=speeds, addresses=addresses)
    return (registry or default_registry()).build(spec, context)
