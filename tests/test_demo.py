"""``inferlb demo`` end to end: the README's first command, on a smaller burst."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from inferlb.demo import DemoOptions, run_demo

pytestmark = pytest.mark.envoy


def test_demo_routes_every_request_through_the_picker(tmp_path: Path) -> None:
    out = io.StringIO()
    code = run_demo(DemoOptions(backends=3, requests=30, concurrency=4), tmp_path, stream=out)
    text = out.getvalue()
    assert code == 0, text
    assert "routed by the picker through Envoy's ORIGINAL_DST cluster: 30/30" in text
    assert "sent to the fallback cluster: 0" in text
    assert "HTTP 400" in text and "HTTP 404" in text
    assert (tmp_path / "envoy.yaml").exists() and (tmp_path / "picker.yaml").exists()
