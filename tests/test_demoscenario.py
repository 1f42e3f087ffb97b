"""The demo's workload: seeded, open loop, bounded, shared prefixes; cold caches across runs."""

from __future__ import annotations

import pytest

from inferlb.demoscenario import MAX_REQUESTS, ScenarioOptions, system_prompt, workload


def test_the_workload_is_the_same_for_a_seed_and_bounded_in_time_and_count() -> None:
    options = ScenarioOptions(duration_s=20, rate=10, prefixes=4, seed=5)
    arrivals = workload(options)
    assert arrivals == workload(options)
    assert arrivals != workload(ScenarioOptions(duration_s=20, rate=10, prefixes=4, seed=6))
    times = [a.at for a in arrivals]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 20
    assert 100 < len(arrivals) < 300  # Poisson at 10/s over 20 s: 200 expected
    assert {a.family for a in arrivals} == {0, 1, 2, 3}
    assert all(32 <= a.max_tokens < 160 for a in arrivals)
    assert len(workload(ScenarioOptions(duration_s=600, rate=200))) == MAX_REQUESTS


def test_each_run_salts_its_system_prompts_so_no_prefix_is_shared_across_runs() -> None:
    first, second = system_prompt(3, "run 1", 18), system_prompt(3, "run 2", 18)
    assert first != second and len(first) == len(second)
    # In the first cached block (16 tokens of four characters, after the chat template's role tag): no block of
    # one run's prompts can be found in a cache that the other run filled.
    assert first[:32] != second[:32]
    assert system_prompt(3, "run 1", 18) == first
    assert 4_000 < len(first) < 16_000  # 1-4k tokens at four characters a token


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"duration_s": 0}, "--duration", id="duration"),
        pytest.param({"rate": 0}, "--rate", id="rate"),
        pytest.param({"slow_at_s": 30}, "--slow-at", id="slow-at-after-the-end"),
        pytest.param({"slowdown": 0.5}, "--slowdown", id="slowdown"),
        pytest.param({"prefixes": 0}, "--prefixes", id="prefixes"),
        pytest.param({"heatmap_bucket_s": 0}, "bucket", id="bucket"),
    ],
)
def test_options_out_of_range_are_named(change: dict[str, float], message: str) -> None:
    options = ScenarioOptions(**change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        options.check()
