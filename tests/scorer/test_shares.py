"""The share line: who changes arms when the weights change."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from inferlb.scorer.shares import UNITS, ShareLine


def _owners(line: ShareLine) -> list[int]:
    """The arm of each unit of the line."""
    return [line.arm_at((i + 0.5) / UNITS) for i in range(UNITS)]


def test_the_first_layout_is_the_arms_in_order() -> None:
    line = ShareLine([500, 250, 250])
    assert _owners(line) == [0] * 500 + [1] * 250 + [2] * 250
    assert line.arm_at(0.0) == 0 and line.arm_at(1.0) == 2  # a hash over 2**64 can round to 1.0


@pytest.mark.parametrize(
    ("before", "after", "moves"),
    [
        pytest.param([500, 250, 250], [675, 250, 75], {(2, 0): 175}, id="a-cut-moves-the-cut-arm-only"),
        pytest.param([990, 10], [950, 50], {(0, 1): 40}, id="a-ramp-step-moves-control-users-only"),
        pytest.param([500, 500], [1000, 0], {(1, 0): 500}, id="a-roll-back"),
        pytest.param([400, 300, 300], [400, 100, 500], {(1, 2): 200}, id="between-two-treatments"),
    ],
)
def test_only_the_shares_an_arm_gives_up_move(
    before: list[int], after: list[int], moves: dict[tuple[int, int], int]
) -> None:
    line = ShareLine(before)
    old = _owners(line)
    line.move_to(after)
    new = _owners(line)
    assert Counter((a, b) for a, b in zip(old, new, strict=True) if a != b) == moves
    assert line.units(len(after)) == after


def test_any_sequence_of_changes_moves_only_from_arms_that_shrink_to_arms_that_grow() -> None:
    rng = np.random.default_rng(0)
    arms = 4
    line = ShareLine([UNITS] + [0] * (arms - 1))
    for _ in range(300):
        cuts = np.sort(rng.integers(0, UNITS + 1, arms - 1))
        wanted = np.diff(np.concatenate(([0], cuts, [UNITS]))).tolist()
        held = line.units(arms)
        old = _owners(line)
        line.move_to(wanted)
        new = _owners(line)
        assert line.units(arms) == wanted
        for a, b in zip(old, new, strict=True):
            if a != b:
                assert held[a] > wanted[a] and held[b] < wanted[b]
        moved = sum(a != b for a, b in zip(old, new, strict=True))
        assert moved == sum(max(h - w, 0) for h, w in zip(held, wanted, strict=True))  # no more than must


def test_shares_must_fill_the_line() -> None:
    with pytest.raises(ValueError, match="1000 units in all"):
        ShareLine([500, 400])
    with pytest.raises(ValueError, match="none negative"):
        ShareLine([1100, -100])
