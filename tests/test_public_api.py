"""Pins the public names of the scorer, filter and sim packages: a change to either list must be deliberate."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "inferlb.scorer": [
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
    ],
    "inferlb.filter": [
        "DESTINATION_HEADER",
        "EXT_PROC_SERVICE",
        "METADATA_NAMESPACE",
        "ExtProcService",
        "FilterStats",
        "MalformedRequestError",
        "ModelNotFoundError",
        "NoEndpointAvailableError",
        "PayloadTooLargeError",
        "PickerServer",
        "RequestError",
        "RouteReplies",
        "apply_body",
        "error_reply",
        "features_from_headers",
    ],
    "inferlb.sim": [
        "PROFILES",
        "Arrival",
        "EmulatedServer",
        "EngineModel",
        "EngineOptions",
        "FaultEvent",
        "FleetView",
        "RequestRecord",
        "ServerOptions",
        "ServerProfile",
        "ServerSnapshot",
        "SimRequest",
        "SimResult",
        "Trace",
        "TraceError",
        "TraceRequest",
        "block_keys",
        "get_profile",
        "load_trace",
        "prompt_text",
        "simulate",
    ],
}


def _isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


@pytest.mark.parametrize(("package", "names"), [pytest.param(p, n, id=p) for p, n in PUBLIC.items()])
def test_all_is_pinned_and_sorted(package: str, names: list[str]) -> None:
    module = importlib.import_module(package)
    assert module.__all__ == names
    assert names == sorted(names, key=_isort_key)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    ("package", "name"), [pytest.param(p, n, id=f"{p}.{n}") for p, names in PUBLIC.items() for n in names]
)
def test_each_public_name_is_importable(package: str, name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {package} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(package), name)


@pytest.mark.parametrize(("package", "names"), [pytest.param(p, n, id=p) for p, n in PUBLIC.items()])
def test_every_public_name_is_the_object_its_module_defines(package: str, names: list[str]) -> None:
    # The names load on first use (scorer/lazy.py): each must resolve, to the same object as in its module.
    module = importlib.import_module(package)
    for name in names:
        value = getattr(module, name)
        home = getattr(value, "__module__", None)
        if home is not None and home.startswith(f"{package}."):
            assert getattr(importlib.import_module(home), name) is value, name
