"""Tests for scorer/pickers.py: what each picker chooses, and how often, over many draws from a seeded generator.

The frequency bound is five standard deviations wide (a share over DRAWS draws has a standard deviation of at
most 0.5 / sqrt(DRAWS) = 0.005), and the generators are seeded, so the tests are deterministic."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pickers import PowerOfTwoPicker, WeightedRandomPicker

REQUEST = RequestFeatures(model="m")
DRAWS = 10_000
TOLERANCE = 0.025


def shares(picker: WeightedRandomPicker | PowerOfTwoPicker, totals: list[float]) -> np.ndarray:
    """How often each candidate was picked over DRAWS picks, as fractions; every pick a valid position."""
    n = len(totals)
    candidates, array = np.arange(10, 10 + n), np.array(totals, dtype=float)
    picks = [picker.pick(REQUEST, candidates, array) for _ in range(DRAWS)]
    assert all(type(p) is int and 0 <= p < n for p in picks)
    return np.bincount(picks, minlength=n) / DRAWS


# ---------------------------------------------------------------- weighted random


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4], id="proportional"),
        pytest.param([0, 1, 3], [0, 0.25, 0.75], id="zero-never-picked"),
        pytest.param([2, 2, 2, 2], [0.25] * 4, id="all-equal"),
        pytest.param([0, 0, 0], [1 / 3] * 3, id="all-zero-uniform"),
        pytest.param([-1, 1, 1], [0, 0.5, 0.5], id="negative-counts-as-zero"),
        pytest.param([-1, -2], [0.5, 0.5], id="all-negative-uniform"),
        pytest.param([0.001, 100], [0.00001, 0.99999], id="tiny-against-large"),
        pytest.param([5, 0], [1, 0], id="two-one-zero"),
    ],
)
def test_weighted_random_frequencies_follow_the_scores(totals: list[float], expected: list[float]) -> None:
    got = shares(WeightedRandomPicker(np.random.default_rng(1)), totals)
    assert got == pytest.approx(expected, abs=TOLERANCE)
    for position, total in enumerate(totals):
        if total <= 0 and max(totals) > 0:
            assert got[position] == 0  # exactly: a zero weight is never drawn


# ---------------------------------------------------------------- power of two


def two_choices(totals: list[float]) -> np.ndarray:
    """The exact pick probabilities: every ordered pair of distinct candidates is equally likely, and the first
    of the pair wins a tie."""
    n = len(totals)
    wins = np.zeros(n)
    for a, b in itertools.permutations(range(n), 2):
        wins[a if totals[a] >= totals[b] else b] += 1
    return wins / (n * (n - 1))


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([1.0, 0.0, 0.9], [2 / 3, 0, 1 / 3], id="three"),
        pytest.param([4, 3, 2, 1], [1 / 2, 1 / 3, 1 / 6, 0], id="ranked"),
        pytest.param([0.2, 0.7], [0, 1], id="two-always-the-better"),
        pytest.param([1, 1, 1, 1], [0.25] * 4, id="all-equal-uniform"),
        pytest.param([0, 0, 0], [1 / 3] * 3, id="all-zero-uniform"),
        pytest.param([1, 1, 0], [1 / 2, 1 / 2, 0], id="tied-best"),
        pytest.param([-5, -1, -3], [0, 2 / 3, 1 / 3], id="negative"),
    ],
)
def test_power_of_two_frequencies(totals: list[float], expected: list[float]) -> None:
    assert two_choices(totals) == pytest.approx(expected)  # the oracle agrees with the table
    got = shares(PowerOfTwoPicker(np.random.default_rng(2)), totals)
    assert got == pytest.approx(expected, abs=TOLERANCE)
    worst = min(totals)
    if totals.count(worst) == 1:
        assert got[totals.index(worst)] == 0  # exactly: the unique worst loses every pair


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in (0, 1, 7)])
def test_power_of_two_never_picks_the_worse_of_the_two_it_drew(seed: int) -> None:
    # A second generator with the same seed replays the picker's draws.
    picker, replay = PowerOfTwoPicker(np.random.default_rng(seed)), np.random.default_rng(seed)
    totals = np.array([0.3, 0.9, 0.1, 0.5, 0.7, 0.2])
    for _ in range(2000):
        a, b = replay.choice(len(totals), size=2, replace=False)
        picked = picker.pick(REQUEST, np.arange(len(totals)), totals)
        assert picked in (a, b)
        assert totals[picked] == max(totals[a], totals[b])


# ---------------------------------------------------------------- both


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: WeightedRandomPicker(np.random.default_rng(3)), id="weighted-random"),
        pytest.param(lambda: PowerOfTwoPicker(np.random.default_rng(3)), id="power-of-two"),
    ],
)
@pytest.mark.parametrize("total", [pytest.param(t, id=f"total-{t}") for t in (0.0, -1.0, 0.3, 100.0)])
def test_a_single_candidate_is_always_picked(
    make: Callable[[], WeightedRandomPicker | PowerOfTwoPicker], total: float
) -> None:
    picker = make()
    assert {picker.pick(REQUEST, np.array([7]), np.array([total])) for _ in range(50)} == {0}


@pytest.mark.parametrize(
    ("picker", "name"),
    [
        pytest.param(WeightedRandomPicker(), "weighted-random", id="weighted-random"),
        pytest.param(PowerOfTwoPicker(), "power-of-two", id="power-of-two"),
    ],
)
def test_pickers_without_a_generator_make_their_own(picker: WeightedRandomPicker | PowerOfTwoPicker, name: str) -> None:
    assert picker.name == name
    assert picker.pick(REQUEST, np.arange(3), np.array([0.0, 1.0, 0.0])) in (0, 1, 2)


def test_the_same_seed_gives_the_same_picks() -> None:
    totals = np.array([0.1, 0.5, 0.2, 0.9])

    def run(picker: WeightedRandomPicker | PowerOfTwoPicker) -> list[int]:
        return [picker.pick(REQUEST, np.arange(4), totals) for _ in range(100)]

    assert run(WeightedRandomPicker(np.random.default_rng(5))) == run(WeightedRandomPicker(np.random.default_rng(5)))
    assert run(PowerOfTwoPicker(np.random.default_rng(5))) == run(PowerOfTwoPicker(np.random.default_rng(5)))
