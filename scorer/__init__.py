"""The routing core: the endpoint pool, in-flight accounting, the filters → scorers → picker pipeline, and the
routing unit (`Router`: class and admission, the decision, the in-flight lease) that Envoy's requests and the
simulator go through."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferlb.scorer.lazy import lazy_exports

if TYPE_CHECKING:
    from inferlb.scorer.classes import Classifier, RequestClass
    from inferlb.scorer.config import Config, EndpointConfig, load_config, parse_config
    from inferlb.scorer.engine import Decision, Engine, Filter, Picker, Profile, Scorer, State, WeightedScorer
    from inferlb.scorer.errors import ConfigError, NoEndpointError, RoutingError, ScorerError, UnknownModelError
    from inferlb.scorer.features import RequestFeatures, estimate_tokens
    from inferlb.scorer.gpustate import GpuInfo, GpuReport, parse_gpu_report
    from inferlb.scorer.inflight import InFlight, Lease
    from inferlb.scorer.pool import Endpoint, Pool
    from inferlb.scorer.presets import PRESET_NAMES, build_profile
    from inferlb.scorer.promtext import PICKER_METRICS, VllmSnapshot, read_vllm
    from inferlb.scorer.registry import PluginSpec, ProfileSpec, Registry, default_registry
    from inferlb.scorer.router import Admit, Routed, Router
    from inferlb.scorer.saturation import Saturation
    from inferlb.scorer.signals import Signals, Snapshot

__all__ = [
    "PICKER_METRICS",
    "PRESET_NAMES",
    "Admit",
    "Classifier",
    "Config",
    "ConfigError",
    "Decision",
    "Endpoint",
    "EndpointConfig",
    "Engine",
    "Filter",
    "GpuInfo",
    "GpuReport",
    "InFlight",
    "Lease",
    "NoEndpointError",
    "Picker",
    "PluginSpec",
    "Pool",
    "Profile",
    "ProfileSpec",
    "Registry",
    "RequestClass",
    "RequestFeatures",
    "Routed",
    "Router",
    "RoutingError",
    "Saturation",
    "Scorer",
    "ScorerError",
    "Signals",
    "Snapshot",
    "State",
    "UnknownModelError",
    "VllmSnapshot",
    "WeightedScorer",
    "build_profile",
    "default_registry",
    "estimate_tokens",
    "load_config",
    "parse_config",
    "parse_gpu_report",
    "read_vllm",
]

# Each name above is imported when first used (scorer/lazy.py says why).
__getattr__, __dir__ = lazy_exports(globals())
