"""The Endpoint Picker conformance suite (bench/conformance.py) over ext_proc: inferlb's picker passes every
scenario in both body modes, and a picker that ignores the subset hint fails the hint's MUSTs."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench import conformance
from inferlb.filter import server as filter_server
from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.filter.tls import CertificateFiles
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile

from ..conftest import self_signed

ENDPOINTS = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]


@pytest.fixture
async def picker() -> AsyncIterator[str]:
    config = parse_config({"pool": {"endpoints": [{"address": a, "models": ["m1"]} for a in ENDPOINTS]}})
    engine = Engine(Pool(config.endpoints), build_profile("least-request", np.random.default_rng(1)))
    server = PickerServer(ExtProcService(engine, max_body_bytes=1 << 20), "127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(0)


@pytest.mark.parametrize("mode", list(conformance.MODES))
async def test_inferlb_passes_every_scenario(picker: str, mode: str) -> None:
    results = await conformance.picker_scenarios(picker, "m1", mode)
    assert results and all(r.passed for r in results), [r for r in results if not r.passed]
    assert ("full-duplex-body-returned" in {r.scenario for r in results}) == (mode == "full-duplex")


async def test_a_picker_that_serves_tls_is_checked_over_tls(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (.ci/run installs it)")
    cert = self_signed(tmp_path, "picker")
    config = parse_config({"pool": {"endpoints": [{"address": a, "models": ["m1"]} for a in ENDPOINTS]}})
    engine = Engine(Pool(config.endpoints), build_profile("least-request", np.random.default_rng(1)))
    tls = CertificateFiles(str(cert), str(cert.with_suffix(".key")))
    server = PickerServer(ExtProcService(engine, max_body_bytes=1 << 20), "127.0.0.1:0", tls=tls)
    await server.start()
    try:
        results = await conformance.picker_scenarios(
            f"127.0.0.1:{server.port}", "m1", "buffered", roots=cert.read_bytes()
        )
        assert results and all(r.passed for r in results), [r for r in results if not r.passed]
        plain = await conformance.picker_scenarios(f"127.0.0.1:{server.port}", "m1", "buffered")
        assert not any(r.passed for r in plain)  # a TLS picker says nothing to a plaintext data plane
    finally:
        await server.stop(0)


async def test_a_picker_that_ignores_the_subset_hint_fails_its_musts(
    picker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filter_server, "subset_hint", lambda metadata: None)
    results = {r.scenario: r for r in await conformance.picker_scenarios(picker, "m1", "buffered")}
    assert results["routes-with-header-and-metadata"].passed
    for name in ("subset-hint-none-eligible", "subset-hint-empty"):
        assert not results[name].passed and results[name].level == "MUST"
    assert "503" in results["subset-hint-empty"].detail


@pytest.mark.envoy
def test_the_gateway_scenarios_pass_through_real_envoy_and_a_split_that_ignores_the_weights_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = conformance.gateway_scenarios(tmp_path / "gateway", "buffered")
    assert {r.scenario for r in results} == {
        "weighted-split-two-pools",
        "subset-hint-through-envoy",
        "subset-hint-none-eligible-through-envoy",
        "served-endpoint-reported",
    }
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    # A gateway that sends every request to pool A: the split's MUST fails and says so.
    real = conformance._split_bootstrap
    monkeypatch.setattr(conformance, "_split_bootstrap", lambda a, b, weights: real(a, b, (100, 0)))
    with (
        conformance._stack(tmp_path / "a", "buffered", backends=2) as a,
        conformance._stack(tmp_path / "b", "buffered", backends=2) as b,
    ):
        split = conformance._weighted_split(a, b, tmp_path / "split", "buffered")
    assert not split.passed and "pool A got 1.00" in split.detail
