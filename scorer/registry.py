"""Plugin types by name, and building a `Profile` from a spec: the one place config names become objects.

The registry is built explicitly (`default_registry()`) and passed in; nothing registers itself at import time.
A spec is data (`ProfileSpec`, from a preset or the config file); `Registry.build` turns it into plugins, raising
`ConfigError` that names the plugin's place (``profiles.fast.scorers[2]``) when a type or a parameter is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from inferlb.scorer.engine import Filter, Picker, Profile, Scorer, WeightedScorer
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.filters import MemoryFitFilter, SaturationFilter, StalenessFilter
from inferlb.scorer.loadscorers import (
    GpuFreeMemoryScorer,
    GpuUtilScorer,
    InFlightTokensScorer,
    KVCacheScorer,
    LatencyScorer,
    LoraAffinityScorer,
    PredictedTTFTScorer,
    QueueScorer,
    RunningScorer,
    SeedFormulaScorer,
)
from inferlb.scorer.pickers import PowerOfTwoPicker, WeightedRandomPicker
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker, ModelFilter, RoundRobinPicker
from inferlb.scorer.prefix import PrefixAffinityScorer, PrefixIndex
from inferlb.scorer.session import ConsistentHashRing, SessionAffinityScorer

__all__ = ["MAX_WEIGHT", "BuildContext", "PluginSpec", "ProfileSpec", "Registry", "default_registry"]

# Bounds every weight so that totals stay far below where MaxScorePicker's tie-break jitter would be lost.
MAX_WEIGHT = 100.0


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One plugin: its registered type, constructor parameters and (scorers only) its weight."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """A profile as data: filters, weighted scorers, one picker. ``where`` names it in error messages."""

    name: str
    filters: tuple[PluginSpec, ...]
    scorers: tuple[PluginSpec, ...]
    picker: PluginSpec
    where: str = ""


@dataclass(slots=True)
class BuildContext:
    """What factories may need: the pool size, a random generator, and objects shared by plugins of one profile
    (the prefix index, used by both the prefix-affinity and the predicted-TTFT scorers)."""

    size: int
    rng: np.random.Generator | None = None
    shared: dict[str, Any] = field(default_factory=dict)

    def prefix_index(self, capacity_blocks: int = 65536) -> PrefixIndex:
        index = self.shared.get("prefix_index")
        if index is None:
            index = self.shared["prefix_index"] = PrefixIndex(self.size, capacity_blocks)
        return index


Factory = Callable[[Mapping[str, Any], BuildContext], Any]


def _plain(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(**params)


def _seeded(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(rng=ctx.rng, **params)


def _prefix_affinity(params: Mapping[str, Any], ctx: BuildContext) -> PrefixAffinityScorer:
    params = dict(params)
    index = ctx.prefix_index(params.pop("capacity_blocks", 65536))
    return PrefixAffinityScorer(index, **params)


def _predicted_ttft(params: Mapping[str, Any], ctx: BuildContext) -> PredictedTTFTScorer:
    return PredictedTTFTScorer(ctx.prefix_index(), **params)


def _session_affinity(params: Mapping[str, Any], ctx: BuildContext) -> SessionAffinityScorer:
    params = dict(params)
    ring = ConsistentHashRing(ctx.size, params.pop("vnodes", 160))
    return SessionAffinityScorer(ring, **params)


@dataclass(frozen=True, slots=True)
class Registry:
    """Type name -> factory, per extension point. Read-only mappings."""

    filters: Mapping[str, Factory]
    scorers: Mapping[str, Factory]
    pickers: Mapping[str, Factory]

    def build(self, spec: ProfileSpec, ctx: BuildContext) -> Profile:
        """The plugins of ``spec``, constructed; ConfigError naming the plugin on a bad type or parameter."""
        where = spec.where or f"profile {spec.name!r}"
        filters: list[Filter] = [
            self._make(self.filters, s, ctx, f"{where}.filters[{i}]") for i, s in enumerate(spec.filters)
        ]
        scorers: list[WeightedScorer] = []
        for i, s in enumerate(spec.scorers):
            here = f"{where}.scorers[{i}]"
            if not (isinstance(s.weight, int | float) and 0 < s.weight <= MAX_WEIGHT):
                raise ConfigError(f"{here}.weight must be > 0 and <= {MAX_WEIGHT:g}; got {s.weight!r}")
            scorer: Scorer = self._make(self.scorers, s, ctx, here)
            scorers.append(WeightedScorer(scorer, float(s.weight)))
        picker: Picker = self._make(self.pickers, spec.picker, ctx, f"{where}.picker")
        return Profile(spec.name, tuple(filters), tuple(scorers), picker)

    @staticmethod
    def _make(table: Mapping[str, Factory], spec: PluginSpec, ctx: BuildContext, where: str) -> Any:
        factory = table.get(spec.type)
        if factory is None:
            raise ConfigError(f"{where}.type: unknown type {spec.type!r} (known: {', '.join(sorted(table))})")
        try:
            return factory(spec.params, ctx)
        except TypeError as exc:
            raise ConfigError(f"{where}: bad parameters for {spec.type!r}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def default_registry() -> Registry:
    """The built-in plugins."""
    filters: dict[str, Factory] = {
        "model": _plain(ModelFilter),
        "staleness": _plain(StalenessFilter),
        "saturation": _plain(SaturationFilter),
        "memory-fit": _plain(MemoryFitFilter),
    }
    scorers: dict[str, Factory] = {
        "in-flight": _plain(InFlightScorer),
        "in-flight-tokens": _plain(InFlightTokensScorer),
        "queue": _plain(QueueScorer),
        "running": _plain(RunningScorer),
        "kv-cache": _plain(KVCacheScorer),
        "gpu-util": _plain(GpuUtilScorer),
        "gpu-free-memory": _plain(GpuFreeMemoryScorer),
        "latency": _plain(LatencyScorer),
        "lora-affinity": _plain(LoraAffinityScorer),
        "predicted-ttft": _predicted_ttft,
        "seed-formula": _plain(SeedFormulaScorer),
        "prefix-affinity": _prefix_affinity,
        "session-affinity": _session_affinity,
    }
    pickers: dict[str, Factory] = {
        "max-score": _seeded(MaxScorePicker),
        "round-robin": _plain(RoundRobinPicker),
        "weighted-random": _seeded(WeightedRandomPicker),
        "power-of-two": _seeded(PowerOfTwoPicker),
    }
    return Registry(MappingProxyType(filters), MappingProxyType(scorers), MappingProxyType(pickers))
