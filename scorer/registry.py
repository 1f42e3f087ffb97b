"""Plugin types by name, and building a `Profile` from a spec: the one place config names become objects.

The registry is built explicitly (`default_registry()`) and passed in; nothing registers itself at import time.
A spec is data (`ProfileSpec`, from a preset or the config file); `Registry.build` turns it into plugins, raising
`ConfigError` that names the plugin's place (``profiles.fast.scorers[2]``) when a type or a parameter is wrong.

Parameters: each registered type (a `Plugin`) declares the parameters a config may give it, by name, as `Param`
(a number, an integer or one of some strings, with bounds). `Registry.build` checks a spec's parameters against
that declaration before calling the factory, so every parameter error names the parameter and its place::

    profiles.default.filters[1].margin must be a number >= 1; got 'x'
    profiles.default.scorers[0]: unknown parameter 'foo' for 'queue' (accepted: none)

Booleans are never numbers, NaN never passes, infinity only where a `Param` says so. A constraint between
parameters (seed-formula's alpha, beta and gamma not all 0) stays in the plugin's constructor, which raises
``ValueError``; the registry prefixes it with the plugin's place (``profiles.default.scorers[0]: ...``). A
constructor's own checks remain for callers that build plugins in Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from inferlb.scorer.engine import Filter, Picker, Profile, Scorer, WeightedScorer
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.filters import MemoryFitFilter, SaturationFilter, StalenessFilter, TtftSloFilter
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

__all__ = ["MAX_WEIGHT", "BuildContext", "Param", "Plugin", "PluginSpec", "ProfileSpec", "Registry", "default_registry"]

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

    def prefix_index(self, capacity_blocks: int | None = None) -> PrefixIndex:
        """The profile's shared prefix index, created at the first call (``capacity_blocks``: default 65536);
        ValueError if a later call asks for another size."""
        index = self.shared.get("prefix_index")
        if index is None:
            index = self.shared["prefix_index"] = PrefixIndex(self.size, capacity_blocks or 65536)
        elif capacity_blocks is not None and capacity_blocks != index.capacity_blocks:
            raise ValueError(
                f"capacity_blocks {capacity_blocks} differs from the {index.capacity_blocks} of the profile's other "
                "prefix-affinity scorer: they share one prefix index"
            )
        return index


Factory = Callable[[Mapping[str, Any], BuildContext], Any]


@dataclass(frozen=True, slots=True)
class Param:
    """What one plugin parameter must be. ``kind``: "number" (an int or a float, not a bool, not NaN; infinity
    only if ``infinite``), "integer" (an int, not a bool) or "choice" (one of the strings ``choices``). Bounds:
    ``gt``/``ge`` below, ``lt``/``le`` above (at most one of each pair)."""

    kind: Literal["number", "integer", "choice"]
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    infinite: bool = False
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.gt is not None and self.ge is not None) or (self.lt is not None and self.le is not None):
            raise ValueError("a Param takes at most one lower bound (gt or ge) and one upper bound (lt or le)")

    def accepts(self, value: Any) -> bool:
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, int if self.kind == "integer" else int | float):
            return False
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not self.infinite)):
            return False
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def describe(self) -> str:
        """What the value must be, as an error message says it: "a number in (0, 1]", "an integer >= 1"."""
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        noun = "an integer" if self.kind == "integer" else "a number"
        signs = ((">", "(", self.gt), (">=", "[", self.ge), ("<", ")", self.lt), ("<=", "]", self.le))
        bounds = [(sign, bracket, value) for sign, bracket, value in signs if value is not None]
        if len(bounds) == 2:  # one below and one above: an interval
            (_, left, low), (_, right, high) = bounds
            text = f"{noun} in {left}{low:g}, {high:g}{right}"
        else:
            text = " ".join([noun, *(f"{sign} {value:g}" for sign, _, value in bounds)])
        return f"{text} or .inf" if self.infinite else text


@dataclass(frozen=True, slots=True)
class Plugin:
    """A registered plugin type: its factory and the parameters a config may give it (none by default)."""

    factory: Factory
    params: Mapping[str, Param] = field(default_factory=lambda: MappingProxyType({}))
    note: str = ""  # added to the message for an unknown parameter


def _plain(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(**params)


def _seeded(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(rng=ctx.rng, **params)


def _prefix_affinity(params: Mapping[str, Any], ctx: BuildContext) -> PrefixAffinityScorer:
    params = dict(params)
    index = ctx.prefix_index(params.pop("capacity_blocks", None))
    return PrefixAffinityScorer(index, **params)


def _predicted_ttft(params: Mapping[str, Any], ctx: BuildContext) -> PredictedTTFTScorer:
    return PredictedTTFTScorer(ctx.prefix_index(), **params)


def _ttft_slo(params: Mapping[str, Any], ctx: BuildContext) -> TtftSloFilter:
    return TtftSloFilter(ctx.prefix_index(), **params)


def _session_affinity(params: Mapping[str, Any], ctx: BuildContext) -> SessionAffinityScorer:
    params = dict(params)
    ring = ConsistentHashRing(ctx.size, params.pop("vnodes", 160))
    return SessionAffinityScorer(ring, **params)


@dataclass(frozen=True, slots=True)
class Registry:
    """Type name -> `Plugin`, per extension point. Read-only mappings."""

    filters: Mapping[str, Plugin]
    scorers: Mapping[str, Plugin]
    pickers: Mapping[str, Plugin]

    def build(self, spec: ProfileSpec, ctx: BuildContext) -> Profile:
        """The plugins of ``spec``, constructed; ConfigError naming the plugin on a bad type or parameter."""
        where = spec.where or f"profile {spec.name!r}"
        # Prefix-affinity scorers are built first: the prefix index they size is shared with the plugins that
        # only read it (predicted-ttft, ttft-slo), which must not create it at the default size before them.
        order = sorted(range(len(spec.scorers)), key=lambda i: spec.scorers[i].type != "prefix-affinity")
        built: dict[int, WeightedScorer] = {}
        for i in order:
            s = spec.scorers[i]
            here = f"{where}.scorers[{i}]"
            if not (isinstance(s.weight, int | float) and 0 < s.weight <= MAX_WEIGHT):
                raise ConfigError(f"{here}.weight must be > 0 and <= {MAX_WEIGHT:g}; got {s.weight!r}")
            scorer: Scorer = self._make(self.scorers, s, ctx, here)
            built[i] = WeightedScorer(scorer, float(s.weight))
        filters: list[Filter] = [
            self._make(self.filters, s, ctx, f"{where}.filters[{i}]") for i, s in enumerate(spec.filters)
        ]
        picker: Picker = self._make(self.pickers, spec.picker, ctx, f"{where}.picker")
        return Profile(spec.name, tuple(filters), tuple(built[i] for i in range(len(spec.scorers))), picker)

    @staticmethod
    def _make(table: Mapping[str, Plugin], spec: PluginSpec, ctx: BuildContext, where: str) -> Any:
        plugin = table.get(spec.type)
        if plugin is None:
            raise ConfigError(f"{where}.type: unknown type {spec.type!r} (known: {', '.join(sorted(table))})")
        declared = plugin.params
        for name, value in spec.params.items():
            param = declared.get(name)
            if param is None:
                accepted = ", ".join(sorted(declared)) or "none"
                note = f"; {plugin.note}" if plugin.note else ""
                raise ConfigError(f"{where}: unknown parameter {name!r} for {spec.type!r} (accepted: {accepted}){note}")
            if not param.accepts(value):
                raise ConfigError(f"{where}.{name} must be {param.describe()}; got {value!r}")
        try:
            return plugin.factory(spec.params, ctx)
        except ValueError as exc:  # a constraint between parameters, checked by the constructor
            raise ConfigError(f"{where}: {exc}") from None


def default_registry() -> Registry:
    """The built-in plugins and their parameters."""
    positive = Param("number", gt=0)
    at_least_0 = Param("number", ge=0)
    filters: dict[str, Plugin] = {
        "model": Plugin(_plain(ModelFilter)),
        "staleness": Plugin(_plain(StalenessFilter)),
        "ttft-slo": Plugin(
            _ttft_slo, _params(block_tokens=Param("integer", ge=1), guard=Param("number", gt=0, infinite=True))
        ),
        "saturation": Plugin(
            _plain(SaturationFilter),
            note="one rule decides when an endpoint is saturated, for this filter and admission control alike: "
            "set it in the config's admission section, e.g. admission: {max_waiting: 8, max_kv_usage: 0.9}",
        ),
        "memory-fit": Plugin(
            _plain(MemoryFitFilter),
            _params(
                bytes_per_token=positive,
                margin=Param("number", ge=1),
                default_output_tokens=Param("integer", ge=0),
            ),
        ),
    }
    scorers: dict[str, Plugin] = {
        "in-flight": Plugin(_plain(InFlightScorer)),
        "in-flight-tokens": Plugin(_plain(InFlightTokensScorer), _params(unit=positive)),
        "queue": Plugin(_plain(QueueScorer)),
        "running": Plugin(_plain(RunningScorer)),
        "kv-cache": Plugin(_plain(KVCacheScorer)),
        "gpu-util": Plugin(_plain(GpuUtilScorer)),
        "gpu-free-memory": Plugin(_plain(GpuFreeMemoryScorer)),
        "latency": Plugin(
            _plain(LatencyScorer),
            _params(signal=Param("choice", choices=("ttft_s", "e2e_s")), tolerance=Param("number", ge=0, le=10)),
        ),
        "lora-affinity": Plugin(_plain(LoraAffinityScorer)),
        "predicted-ttft": Plugin(
            _predicted_ttft, _params(block_tokens=Param("integer", ge=1), guard=Param("number", gt=0, infinite=True))
        ),
        "seed-formula": Plugin(
            _plain(SeedFormulaScorer),
            _params(
                alpha=at_least_0,
                beta=at_least_0,
                gamma=at_least_0,
                max_queue=positive,
                floor=Param("number", ge=0, lt=1),
            ),
        ),
        "prefix-affinity": Plugin(
            _prefix_affinity,
            _params(guard=Param("number", gt=0, infinite=True), capacity_blocks=Param("integer", ge=1)),
        ),
        "session-affinity": Plugin(
            _session_affinity, _params(c=Param("number", ge=1, infinite=True), vnodes=Param("integer", ge=1, le=1000))
        ),
    }
    pickers: dict[str, Plugin] = {
        "max-score": Plugin(_seeded(MaxScorePicker)),
        "round-robin": Plugin(_plain(RoundRobinPicker)),
        "weighted-random": Plugin(_seeded(WeightedRandomPicker)),
        "power-of-two": Plugin(_seeded(PowerOfTwoPicker)),
    }
    return Registry(MappingProxyType(filters), MappingProxyType(scorers), MappingProxyType(pickers))


def _params(**params: Param) -> Mapping[str, Param]:
    return MappingProxyType(params)
