"""What many test modules share: a clock the test moves by hand."""

from __future__ import annotations

import pytest


class ManualClock:
    """A clock (seconds) that moves only when told: ``clock()`` reads it, ``advance`` moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
