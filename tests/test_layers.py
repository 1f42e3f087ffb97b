"""The product's commands never load the simulator or the benchmarks (DESIGN.md, "Layers"): `inferlb serve --help`,
the other product subcommands' help, and a running picker, each in a fresh interpreter. `make lint` (lint-imports)
holds the same rule for the imports written in the code; these tests catch what a static check cannot see, such
as a module imported by name at run time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inferlb.procs import free_port

from .conftest import probe_running_picker

RUN_TIMEOUT_S = 60.0

# Runs `inferlb ARGS...` in this interpreter and writes the inferlb.sim and inferlb.bench modules it loaded to OUT.
HELP = """
import json, sys
from inferlb.cli import main
out, argv = sys.argv[1], sys.argv[2:]
try:
    main(argv)
except SystemExit:
    pass
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in (["inferlb", "sim"], ["inferlb", "bench"]))
with open(out, "w") as f:
    json.dump(loaded, f)
"""

# Inside a running picker: the inferlb.sim and inferlb.bench modules loaded so far.
LOADED = """
    loaded = sorted(m for m in sys.modules if m.split(".")[:2] in (["inferlb", "sim"], ["inferlb", "bench"]))
    with open(out, "w") as f:
        json.dump(loaded, f)
"""


def _loaded(script: str, out: Path, *args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", script, str(out), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.exists(), f"the command wrote no module list; its log:\n{done.stderr[-4000:]}"
    loaded: list[str] = json.loads(out.read_text())
    return loaded


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="inferlb"),
        pytest.param(["serve", "--help"], id="serve"),
        pytest.param(["envoy-config", "--help"], id="envoy-config"),
        pytest.param(["demo", "--help"], id="demo"),
        pytest.param(["gpu-agent", "--help"], id="gpu-agent"),
        pytest.param(["heatmap", "--help"], id="heatmap"),
    ],
)
def test_product_commands_load_no_simulator_or_benchmark_module(argv: list[str], tmp_path: Path) -> None:
    assert _loaded(HELP, tmp_path / "loaded.json", *argv) == []


def test_the_sim_command_loads_its_arguments_from_the_simulator(tmp_path: Path) -> None:
    # The other side of the tests above: the probe sees a lazily loaded subcommand.
    assert "inferlb.sim.cli" in _loaded(HELP, tmp_path / "loaded.json", "sim", "--help")


# Imports MODULE in this interpreter and writes the inferlb modules it loaded to OUT.
IMPORTS = """
import importlib, json, sys
out, module = sys.argv[1], sys.argv[2]
importlib.import_module(module)
loaded = sorted(m for m in sys.modules if m.startswith("inferlb."))
with open(out, "w") as f:
    json.dump(loaded, f)
"""


def test_the_gpu_agent_loads_only_its_own_small_module_set(tmp_path: Path) -> None:
    # A daemon on every GPU node: the GPU report's schema and the HTTP server, not the routing core's config models
    # or the routing unit (the scorer package's names load on first use, scorer/lazy.py).
    assert _loaded(IMPORTS, tmp_path / "loaded.json", "inferlb.gpuagent") == [
        "inferlb.gpuagent",
        "inferlb.scorer",
        "inferlb.scorer.address",
        "inferlb.scorer.gpustate",
        "inferlb.scorer.lazy",
        "inferlb.serving",
    ]


@pytest.mark.parametrize("module", ["inferlb.cli", "inferlb.sim.cli"])
def test_the_cli_and_the_emulated_servers_load_neither_the_config_models_nor_the_filter(
    module: str, tmp_path: Path
) -> None:
    # Every `inferlb` command builds the parser first, and `inferlb sim` (a test starts dozens) then the emulator:
    # neither needs the picker's config models, its routing unit or its filter, which the commands that use them
    # import.
    loaded = _loaded(IMPORTS, tmp_path / "loaded.json", module)
    assert not {"inferlb.scorer.config", "inferlb.scorer.router", "inferlb.scorer.engine"} & set(loaded), loaded
    assert not [m for m in loaded if m.startswith("inferlb.filter")], loaded


def test_a_running_picker_loads_no_simulator_or_benchmark_module(tmp_path: Path) -> None:
    # Every optional part that loads code of its own is on: the admin API, the span receiver (its own process),
    # the OTLP exporter of the route spans, GPU reports. Nothing listens at the endpoint; the picker runs anyway.
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "drain_s": 0,
        "otel": {
            "receiver": f"127.0.0.1:{free_port()}",
            "exporter": "otlp-grpc",
            "export_endpoint": f"127.0.0.1:{free_port()}",
        },
        "pool": {"endpoints": [{"address": f"127.0.0.1:{free_port()}", "gpu": {"url": "http://127.0.0.1:9/gpu"}}]},
    }
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(config))
    assert probe_running_picker(path, tmp_path / "loaded.json", LOADED) == []


# Inside a running picker: which of the optional features' modules and libraries it loaded.
OPTIONAL = """
    wanted = ("redis", "zmq", "inferlb.scorer.etcd", "inferlb.scorer.kubernetes", "inferlb.scorer.kvsubscriber")
    with open(out, "w") as f:
        json.dump([m for m in wanted if m in sys.modules], f)
"""


def test_a_picker_loads_the_modules_of_optional_features_only_when_its_config_uses_them(tmp_path: Path) -> None:
    # Redis (replicas, shared quotas), ZMQ (KV events), etcd and Kubernetes (discovery): about 0.2 s of imports that
    # every restart of a picker that uses none of them would pay while Envoy fails open or closed.
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "drain_s": 0,
        "quotas": {"header": "x-tenant", "source": "gateway", "tenants": {"a": {"requests_per_minute": 60}}},
        "pool": {"endpoints": [{"address": f"127.0.0.1:{free_port()}"}]},
    }
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(config))
    assert probe_running_picker(path, tmp_path / "loaded.json", OPTIONAL) == []
