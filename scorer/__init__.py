"""The scoring engine: the endpoint pool, in-flight accounting and the filters → scorers → picker pipeline."""

from __future__ import annotations

from inferlb.scorer.config import Config, EndpointConfig, load_config, parse_config
from inferlb.scorer.engine import Decision, Engine, Filter, Picker, Profile, Scorer, State, WeightedScorer
from inferlb.scorer.errors import ConfigError, NoEndpointError, RoutingError, ScorerError, UnknownModelError
from inferlb.scorer.features import RequestFeatures, estimate_tokens
from inferlb.scorer.inflight import InFlight, Lease
from inferlb.scorer.pool import Endpoint, Pool
from inferlb.scorer.presets import PRESET_NAMES, build_profile

__all__ = [
    "PRESET_NAMES",
    "Config",
    "ConfigError",
    "Decision",
    "Endpoint",
    "EndpointConfig",
    "Engine",
    "Filter",
    "InFlight",
    "Lease",
    "NoEndpointError",
    "Picker",
    "Pool",
    "Profile",
    "RequestFeatures",
    "RoutingError",
    "Scorer",
    "ScorerError",
    "State",
    "UnknownModelError",
    "WeightedScorer",
    "build_profile",
    "estimate_tokens",
    "load_config",
    "parse_config",
]
