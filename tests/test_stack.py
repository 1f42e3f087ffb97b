"""The local stack's picker config (inferlb/stack.py): what the benchmarks and the demo tell the picker."""

from __future__ import annotations

from pathlib import Path

from inferlb.bench.policies import PROFILE_LABEL, declared_hints
from inferlb.sim.profiles import fleet_of
from inferlb.stack import LocalStack, StackOptions


def test_a_mixed_fleets_stack_labels_each_server_by_profile_and_declares_their_speeds(tmp_path: Path) -> None:
    fleet = fleet_of("h100-llama3.1-8b:1,l4-llama3.2-3b:1", 2)
    hints = declared_hints(fleet)
    options = StackOptions(
        backends=2,
        profile="h100-llama3.1-8b:1,l4-llama3.2-3b:1",
        endpoint_labels=tuple({PROFILE_LABEL: p.name} for p in fleet),
        speeds={"label": hints.label, "relative": dict(hints.relative)},
    )
    config = LocalStack(options, tmp_path).config
    assert config.speeds == hints
    relative = config.speeds.of([e.labels for e in config.endpoints])
    assert relative is not None and 3 < relative[0] / relative[1] < 4  # an H100 prefills Llama-8B ~3.4x an L4 3B
    assert LocalStack(StackOptions(backends=2), tmp_path).config.speeds is None
