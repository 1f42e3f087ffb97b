"""Plugin types by name, and building a `Profile` from a spec: the one place config names become objects.

The registry is built explicitly (`default_registry()`) and passed in; nothing registers itself at import time.
A spec is data (`ProfileSpec`, from a preset or the config file); `Registry.build` turns it into plugins, raising
`ConfigError` that names the plugin's place (``profiles.fast.scorers[2]``) when a type or a parameter is wrong.

Parameters: each registered type (a `Plugin`) has a parameter model, a ``TypedDict`` whose fields carry the
rules of scorer/validation.py (a scorer's also holds its ``weight``). `Registry.build` validates a spec's
parameters through it before calling the factory, so every parameter error names the parameter and its place::

    profiles.default.filters[1].margin must be a number >= 1; got 'x'
    profiles.default.scorers[0]: unknown parameter 'foo' for 'queue' (accepted: none)

Booleans are never numbers, NaN never passes, infinity only where a field says so. The model holds only the
parameters given, so the constructors' defaults apply to the rest. A constraint between parameters
(seed-formula's alpha, beta and gamma not all 0) stays in the plugin's constructor, which raises ``ValueError``;
the registry prefixes it with the plugin's place (``profiles.default.scorers[0]: ...``). Plugins built in Python
are not validated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any

import numpy as np
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict

from inferlb.scorer.engine import Filter, Picker, Profile, Scorer, WeightedScorer
from inferlb.scorer.errors import ConfigError, shown
from inferlb.scorer.filters import (
    MemoryFitFilter,
    SaturationFilter,
    SpeedClassFilter,
    StalenessFilter,
    TtftGapFilter,
    TtftSloFilter,
)
from inferlb.scorer.loadscorers import (
    ATTENTION_TOKENS,
    GpuFreeMemoryScorer,
    GpuUtilScorer,
    InFlightTokensScorer,
    KVCacheScorer,
    LatencyScorer,
    LoraAffinityScorer,
    PredictedTTFTScorer,
    QueueScorer,
    RecentPrefillScorer,
    RunningScorer,
    SeedFormulaScorer,
    TtftPredictor,
)
from inferlb.scorer.pickers import PowerOfTwoPicker, WeightedRandomPicker
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker, ModelFilter, RoundRobinPicker
from inferlb.scorer.prefix import PrefixAffinityScorer, PrefixIndex
from inferlb.scorer.session import ConsistentHashRing, SessionAffinityScorer
from inferlb.scorer.validation import config_error, integer, number, one_of

__all__ = [
    "MAX_WEIGHT",
    "BuildContext",
    "NoParams",
    "Plugin",
    "PluginSpec",
    "ProfileSpec",
    "Registry",
    "checked_weight",
    "default_registry",
    "unknown_type",
]

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
    # The endpoints' declared relative speeds (``pool.speeds``, `SpeedHints.of`); None where none differ.
    speeds: np.ndarray | None = None
    # The endpoints' addresses, in the pool's order (None: not known; plugins then key what they keep by index).
    addresses: tuple[str, ...] | None = None

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

    def ttft_predictor(self, params: Mapping[str, Any]) -> TtftPredictor:
        """The profile's TTFT predictor for these parameters (``block_tokens``, ``guard``, ``attention_tokens``;
        others are ignored),
        shared by the ``ttft-gap`` filter and the ``predicted-ttft`` scorer: one prediction per decision serves
        both."""
        block_tokens, guard = params.get("block_tokens", 64), params.get("guard", 2.0)
        attention = float(params.get("attention_tokens", ATTENTION_TOKENS))
        key = f"ttft_predictor/{block_tokens}/{guard}/{attention}"
        predictor = self.shared.get(key)
        if predictor is None:
            predictor = self.shared[key] = TtftPredictor(self.prefix_index(), block_tokens, guard, attention)
        return predictor


Factory = Callable[[Mapping[str, Any], BuildContext], Any]


class NoParams(TypedDict, total=False):
    """The parameter model of a plugin that takes none."""


class _Weight(TypedDict):
    weight: Annotated[float, number(gt=0, le=MAX_WEIGHT)]


_POSITIVE = number(gt=0)
_AT_LEAST_0 = number(ge=0)
_GUARD = number(gt=0, inf=True)  # the imbalance guard; .inf turns it off


class _Predictor(TypedDict, total=False):  # predicted-ttft, ttft-slo
    block_tokens: Annotated[int, integer(ge=1)]
    guard: Annotated[float, _GUARD]
    attention_tokens: Annotated[float, number(ge=0)]  # 0: a prompt's work is its tokens alone


class _PredictedTtft(_Predictor, total=False):
    delay_to_waiting: Annotated[float, number(ge=0)]  # 0: the request's own wait alone


class _TtftGap(_Predictor, total=False):
    factor: Annotated[float, number(ge=1)]
    seconds: Annotated[float, number(ge=0)]
    slower: Annotated[float, number(gt=0, le=1)]


class _SpeedClass(_Predictor, total=False):
    min_wait_s: Annotated[float, number(ge=0)]


class _MemoryFit(TypedDict, total=False):
    bytes_per_token: Annotated[float, _POSITIVE]
    margin: Annotated[float, number(ge=1)]
    default_output_tokens: Annotated[int, integer(ge=0)]


class _InFlightTokens(TypedDict, total=False):
    unit: Annotated[float, _POSITIVE]


class _RecentPrefill(TypedDict, total=False):
    unit: Annotated[float, _POSITIVE]


class _Latency(TypedDict, total=False):
    signal: Annotated[str, one_of("ttft_s", "e2e_s")]
    tolerance: Annotated[float, number(ge=0, le=10)]


class _SeedFormula(TypedDict, total=False):
    alpha: Annotated[float, _AT_LEAST_0]
    beta: Annotated[float, _AT_LEAST_0]
    gamma: Annotated[float, _AT_LEAST_0]
    max_queue: Annotated[float, _POSITIVE]
    floor: Annotated[float, number(ge=0, lt=1)]


class _PrefixAffinity(TypedDict, total=False):
    guard: Annotated[float, _GUARD]
    capacity_blocks: Annotated[int, integer(ge=1)]


class _SessionAffinity(TypedDict, total=False):
    c: Annotated[float, number(ge=1, inf=True)]  # the load bound is c x (mean + 1)
    vnodes: Annotated[int, integer(ge=1, le=1000)]


@functools.cache
def _adapter(model: Any) -> TypeAdapter[Any]:
    return TypeAdapter(model)


def unknown_type(table: Mapping[str, Plugin], name: str) -> str:
    """What to say of a type name that ``table`` does not hold."""
    return f"unknown type {shown(name)} (known: {', '.join(sorted(table))})"


def checked_weight(value: Any) -> float:
    """A scorer's weight as a float; pydantic's ``ValidationError`` (at ``weight``) unless it is a number in
    (0, `MAX_WEIGHT`]."""
    weight: float = _adapter(_Weight).validate_python({"weight": value})["weight"]
    return weight


@dataclass(frozen=True, slots=True)
class Plugin:
    """A registered plugin type: its factory and its parameter model (a ``TypedDict`` of the parameters a config may
    give it, each field annotated with its rule; none by default). The factory gets the validated parameters."""

    factory: Factory
    params: type = NoParams
    note: str = ""  # added to the message for an unknown parameter

    def parameters(self) -> tuple[str, ...]:
        """The names of the parameters, in name order."""
        return tuple(sorted(self.params.__annotations__))


def _plain(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(**params)


def _seeded(cls: Callable[..., Any]) -> Factory:
    return lambda params, ctx: cls(rng=ctx.rng, **params)


def _prefix_affinity(params: Mapping[str, Any], ctx: BuildContext) -> PrefixAffinityScorer:
    params = dict(params)
    index = ctx.prefix_index(params.pop("capacity_blocks", None))
    return PrefixAffinityScorer(index, **params)


def _recent_prefill(params: Mapping[str, Any], ctx: BuildContext) -> RecentPrefillScorer:
    return RecentPrefillScorer(**params, speeds=ctx.speeds)


def _predicted_ttft(params: Mapping[str, Any], ctx: BuildContext) -> PredictedTTFTScorer:
    return PredictedTTFTScorer(ctx.prefix_index(), **params, predictor=ctx.ttft_predictor(params))


def _ttft_slo(params: Mapping[str, Any], ctx: BuildContext) -> TtftSloFilter:
    # Its own predictor: it predicts for requests with an objective only, before the filters after it narrow the
    # candidates, and the decision's prefill estimate comes from its prediction for those.
    return TtftSloFilter(ctx.prefix_index(), **params)


def _ttft_gap(params: Mapping[str, Any], ctx: BuildContext) -> TtftGapFilter:
    return TtftGapFilter(ctx.prefix_index(), **params, predictor=ctx.ttft_predictor(params))


def _speed_class(params: Mapping[str, Any], ctx: BuildContext) -> SpeedClassFilter:
    return SpeedClassFilter(ctx.prefix_index(), **params, predictor=ctx.ttft_predictor(params), speeds=ctx.speeds)


def _session_affinity(params: Mapping[str, Any], ctx: BuildContext) -> SessionAffinityScorer:
    params = dict(params)
    ring = ConsistentHashRing(ctx.size, params.pop("vnodes", 160), names=ctx.addresses)
    return SessionAffinityScorer(ring, **params)


@dataclass(frozen=True, slots=True)
class Registry:
    """Type name -> `Plugin`, per extension point. Read-only mappings."""

    filters: Mapping[str, Plugin]
    scorers: Mapping[str, Plugin]
    pickers: Mapping[str, Plugin]

    def entry_schema(self, kind: str) -> dict[str, Any]:
        """The JSON Schema of a profile's entry under ``kind`` ("filters", "scorers" or "pickers"): a type's name, or
        a mapping with ``type``, the type's parameters and (scorers) ``weight``."""
        table: Mapping[str, Plugin] = getattr(self, kind)
        weight = _adapter(_Weight).json_schema()["properties"] if kind == "scorers" else {}
        entries = [
            {
                "type": "object",
                "properties": {"type": {"const": name}, **weight, **_adapter(p.params).json_schema()["properties"]},
                "required": ["type"],
                "additionalProperties": False,
            }
            for name, p in sorted(table.items())
        ]
        return {"anyOf": [{"enum": sorted(table)}, *entries]}

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
            try:
                weight = checked_weight(s.weight)
            except ValidationError as exc:
                raise config_error(exc, here) from None
            scorer: Scorer = self._make(self.scorers, s, ctx, here)
            built[i] = WeightedScorer(scorer, weight)
        filters: list[Filter] = [
            self._make(self.filters, s, ctx, f"{where}.filters[{i}]") for i, s in enumerate(spec.filters)
        ]
        picker: Picker = self._make(self.pickers, spec.picker, ctx, f"{where}.picker")
        return Profile(spec.name, tuple(filters), tuple(built[i] for i in range(len(spec.scorers))), picker)

    @staticmethod
    def _make(table: Mapping[str, Plugin], spec: PluginSpec, ctx: BuildContext, where: str) -> Any:
        plugin = table.get(spec.type)
        if plugin is None:
            raise ConfigError(f"{where}.type: {unknown_type(table, spec.type)}")
        declared = plugin.parameters()
        for name in spec.params:
            if name not in declared:
                accepted = ", ".join(declared) or "none"
                note = f"; {plugin.note}" if plugin.note else ""
                raise ConfigError(f"{where}: unknown parameter {name!r} for {spec.type!r} (accepted: {accepted}){note}")
        try:
            params = _adapter(plugin.params).validate_python(dict(spec.params))
        except ValidationError as exc:
            raise config_error(exc, where) from None
        try:
            return plugin.factory(params, ctx)
        except ValueError as exc:  # a constraint between parameters, checked by the constructor
            raise ConfigError(f"{where}: {exc}") from None


def default_registry() -> Registry:
    """The built-in plugins and their parameters."""
    filters: dict[str, Plugin] = {
        "model": Plugin(_plain(ModelFilter)),
        "staleness": Plugin(_plain(StalenessFilter)),
        "ttft-slo": Plugin(_ttft_slo, _Predictor),
        "ttft-gap": Plugin(_ttft_gap, _TtftGap),
        "speed-class": Plugin(_speed_class, _SpeedClass),
        "saturation": Plugin(
            _plain(SaturationFilter),
            note="one rule decides when an endpoint is saturated, for this filter and admission control alike: "
            "set it in the config's admission section, e.g. admission: {max_waiting: 8, max_kv_usage: 0.9}",
        ),
        "memory-fit": Plugin(_plain(MemoryFitFilter), _MemoryFit),
    }
    scorers: dict[str, Plugin] = {
        "in-flight": Plugin(_plain(InFlightScorer)),
        "in-flight-tokens": Plugin(_plain(InFlightTokensScorer), _InFlightTokens),
        "recent-prefill": Plugin(_recent_prefill, _RecentPrefill),
        "queue": Plugin(_plain(QueueScorer)),
        "running": Plugin(_plain(RunningScorer)),
        "kv-cache": Plugin(_plain(KVCacheScorer)),
        "gpu-util": Plugin(_plain(GpuUtilScorer)),
        "gpu-free-memory": Plugin(_plain(GpuFreeMemoryScorer)),
        "latency": Plugin(_plain(LatencyScorer), _Latency),
        "lora-affinity": Plugin(_plain(LoraAffinityScorer)),
        "predicted-ttft": Plugin(_predicted_ttft, _PredictedTtft),
        "seed-formula": Plugin(_plain(SeedFormulaScorer), _SeedFormula),
        "prefix-affinity": Plugin(_prefix_affinity, _PrefixAffinity),
        "session-affinity": Plugin(_session_affinity, _SessionAffinity),
    }
    pickers: dict[str, Plugin] = {
        "max-score": Plugin(_seeded(MaxScorePicker)),
        "round-robin": Plugin(_plain(RoundRobinPicker)),
        "weighted-random": Plugin(_seeded(WeightedRandomPicker)),
        "power-of-two": Plugin(_seeded(PowerOfTwoPicker)),
    }
    return Registry(MappingProxyType(filters), MappingProxyType(scorers), MappingProxyType(pickers))
