"""The GPU x model profiles and their calibration against published figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from inferlb.sim import profiles as profiles_module
from inferlb.sim.calibration import (
    DECODE_BATCHES,
    DECODE_CONTEXT_TOKENS,
    ROOFLINE_EXCESS,
    TOLERANCE,
    CalibrationRow,
    calibration_rows,
    calibration_table,
    decode_step_seconds,
    markdown_table,
    prefill_seconds,
)
from inferlb.sim.profiles import (
    MEMORY_PLANS,
    PROFILES,
    MemoryPlan,
    ServerProfile,
    fleet_name,
    get_profile,
    parse_fleet,
)

NAMES = ("h100-llama3.1-8b", "a100-llama3.1-8b", "l4-llama3.2-3b", "h100x4-llama3.1-70b")
ALL = [pytest.param(PROFILES[name], id=name) for name in NAMES]
ROWS = [
    pytest.param(row, id=f"{row.profile}-{row.quantity}-{row.conditions}")
    for name in NAMES
    for row in calibration_rows(PROFILES[name])
]


def test_profile_names() -> None:
    assert sorted(PROFILES) == sorted(NAMES)
    assert sorted(MEMORY_PLANS) == sorted(NAMES)


@pytest.mark.parametrize("profile", ALL)
def test_constants_positive(profile: ServerProfile) -> None:
    for field in dataclasses.fields(profile):
        value = getattr(profile, field.name)
        if isinstance(value, int | float):
            assert value > 0, field.name
    assert profile.gpu_memory_utilization <= 1
    assert profile.max_num_seqs <= profile.num_gpu_blocks


@pytest.mark.parametrize("profile", ALL)
def test_sources_cite_urls(profile: ServerProfile) -> None:
    assert profile.sources
    for source in profile.sources:
        assert source.startswith("https://"), source
        assert " — " in source, source


@pytest.mark.parametrize("profile", ALL)
def test_kv_blocks_fit_memory(profile: ServerProfile) -> None:
    plan = MEMORY_PLANS[profile.name]
    used = (
        plan.weight_bytes + plan.reserve_bytes + profile.num_gpu_blocks * profile.block_size * plan.kv_bytes_per_token
    )
    budget = profile.gpu_memory_utilization * profile.gpu_memory_bytes
    assert used <= budget
    # vLLM computes the largest count that fits: one more block would not.
    assert used + profile.block_size * plan.kv_bytes_per_token > budget
    # vLLM refuses to start unless one max_model_len sequence fits in the cache.
    assert profile.max_model_len <= profile.num_gpu_blocks * profile.block_size


def test_gpu_blocks_rejects_a_model_that_does_not_fit() -> None:
    plan = MemoryPlan(weight_bytes=80 << 30, kv_bytes_per_token=131_072, reserve_bytes=1 << 30)
    with pytest.raises(ValueError, match="no KV blocks fit"):
        plan.gpu_blocks(80 << 30, 0.9, 16)


@pytest.mark.parametrize("row", ROWS)
def test_calibration_within_tolerance(row: CalibrationRow) -> None:
    low, high = row.bounds
    assert low <= row.relative_difference <= high, (row.emulated, row.reference)
    assert row.kind in {"measured", "scaled", "roofline"}
    assert row.source.startswith("https://")


def test_bounds_per_kind() -> None:
    # A published figure is matched both ways; a roofline is a lower bound that real steps exceed as batches grow.
    row = calibration_rows(PROFILES["l4-llama3.2-3b"])[0]
    assert row.kind == "roofline"
    assert row.bounds == (-TOLERANCE, ROOFLINE_EXCESS)
    assert dataclasses.replace(row, kind="measured").bounds == (-TOLERANCE, TOLERANCE)


@pytest.mark.parametrize("profile", ALL)
def test_calibration_covers_prefill_and_decode(profile: ServerProfile) -> None:
    quantities = [row.quantity for row in calibration_rows(profile)]
    assert quantities.count("prefill throughput") == 1
    assert quantities.count("decode step") >= 3


def _decode_batches(rows: list[CalibrationRow], *, roofline: bool) -> set[int]:
    """The batch sizes of the decode rows in ``rows`` whose reference is (or is not) a roofline."""
    return {
        int(row.conditions.split(",")[0].removeprefix("batch "))
        for row in rows
        if row.quantity == "decode step" and (row.kind == "roofline") == roofline
    }


@pytest.mark.parametrize("name", ["h100-llama3.1-8b", "a100-llama3.1-8b", "h100x4-llama3.1-70b"])
def test_measurements_back_the_decode_of_measured_pairs(name: str) -> None:
    published = _decode_batches(calibration_rows(PROFILES[name]), roofline=False)
    assert 1 in published
    assert max(published) >= 32


@pytest.mark.parametrize("profile", ALL)
def test_roofline_rows_fill_only_uncovered_batches(profile: ServerProfile) -> None:
    rows = calibration_rows(profile)
    published = _decode_batches(rows, roofline=False)
    roofline = _decode_batches(rows, roofline=True)
    for batch in DECODE_BATCHES:
        covered = any(batch / 2 < b <= 2 * batch for b in published)
        assert (batch in roofline) != covered, batch


def test_readme_carries_the_generated_table() -> None:
    readme = Path(__file__).resolve().parents[2] / "sim" / "README.md"
    section = readme.read_text(encoding="utf-8").split("\n## Calibration\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert "\n".join(table) == calibration_table(), "regenerate it with `python -m inferlb.sim.calibration`"


@pytest.mark.parametrize("profile", ALL)
def test_decode_step_grows_with_batch(profile: ServerProfile) -> None:
    times = [decode_step_seconds(profile, batch, DECODE_CONTEXT_TOKENS) for batch in (1, 2, 8, 32, 128, 256)]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


@pytest.mark.parametrize("profile", ALL)
def test_decode_step_grows_with_context(profile: ServerProfile) -> None:
    assert decode_step_seconds(profile, 8, 4096) > decode_step_seconds(profile, 8, 1024)


@pytest.mark.parametrize("profile", ALL)
def test_prefill_is_chunked_by_the_token_budget(profile: ServerProfile) -> None:
    budget = profile.max_num_batched_tokens
    first = profile.step_time(budget, budget * ((budget + 1) // 2), 0, 0)
    second = profile.step_time(10, 10 * (budget + 5), 0, 0)
    assert prefill_seconds(profile, budget + 10) == pytest.approx(first + second)


def test_get_profile() -> None:
    assert get_profile("l4-llama3.2-3b") is PROFILES["l4-llama3.2-3b"]


def test_get_profile_unknown_names_the_known_profiles() -> None:
    with pytest.raises(ValueError, match="unknown profile 'b200-llama'") as info:
        get_profile("b200-llama")
    for name in NAMES:
        assert name in str(info.value)


def test_calibration_rows_unknown_profile() -> None:
    profile = dataclasses.replace(PROFILES["h100-llama3.1-8b"], name="custom")
    with pytest.raises(ValueError, match="no calibration data for profile 'custom'"):
        calibration_rows(profile)


def test_markdown_table_has_one_line_per_row() -> None:
    rows = calibration_rows(PROFILES["a100-llama3.1-8b"])
    lines = markdown_table(rows).splitlines()
    assert len(lines) == len(rows) + 2
    assert all(line.startswith("| ") for line in lines)


def test_a_fleet_is_one_profile_per_server_in_order_and_its_name_reads_back() -> None:
    fleet = parse_fleet("h100-llama3.1-8b:2, l4-llama3.2-3b:1,h100-llama3.1-8b")
    assert [p.name for p in fleet] == ["h100-llama3.1-8b"] * 2 + ["l4-llama3.2-3b", "h100-llama3.1-8b"]
    assert fleet_name(fleet) == "h100-llama3.1-8b:2,l4-llama3.2-3b:1,h100-llama3.1-8b:1"
    assert parse_fleet(fleet_name(fleet)) == fleet
    assert fleet_name(parse_fleet("a100-llama3.1-8b:3")) == "a100-llama3.1-8b"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope:2", "unknown profile 'nope'"),
        ("h100-llama3.1-8b:0", "'0' is not a positive server count"),
        ("h100-llama3.1-8b:x", "'x' is not a positive server count"),
        ("h100-llama3.1-8b:2,", "an empty entry"),
    ],
)
def test_a_bad_fleet_is_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fleet(text)


def test_profiles_whose_blocks_differ_cannot_share_a_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    odd = dataclasses.replace(get_profile("l4-llama3.2-3b"), name="odd", block_size=32)
    monkeypatch.setattr(profiles_module, "PROFILES", {**PROFILES, "odd": odd})
    with pytest.raises(ValueError, match=r"KV blocks of \[16, 32\] tokens"):
        parse_fleet("h100-llama3.1-8b:1,odd:1")
