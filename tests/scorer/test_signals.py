"""Tests for scorer/signals.py: the immutable snapshot and its holder. The scorers, filters and pickers that read
it are tested in test_loadscorers.py, test_filters.py and test_pickers.py."""

from __future__ import annotations

import numpy as np
import pytest

from inferlb.scorer.signals import Signals, Snapshot


def test_an_empty_snapshot_knows_nothing():
    snapshot = Snapshot.empty(3)
    assert np.isnan(snapshot.running).all() and snapshot.up.all()
    assert np.isinf(snapshot.age()).all()
    with pytest.raises(ValueError):
        snapshot.running[0] = 1  # read-only
    with pytest.raises(ValueError, match="shape"):
        snapshot.with_values(running=[1, 2])


def test_signals_publish_swaps_and_checks_the_size():
    signals = Signals(2)
    new = signals.snapshot.with_values(running=[1, 2])
    signals.publish(new)
    assert signals.snapshot is new and signals.published == 1
    with pytest.raises(ValueError, match="pool of 2"):
        signals.publish(Snapshot.empty(3))
    with pytest.raises(ValueError, match="stale_after_s"):
        Signals(2, stale_after_s=0)
