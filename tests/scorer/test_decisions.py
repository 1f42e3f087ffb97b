"""Tests for scorer/decisions.py: the decision log keeps a bounded head of what a client sent."""

from __future__ import annotations

from inferlb.scorer.decisions import MAX_KEPT_CHARS, DecisionLog


def test_a_refused_clients_model_and_request_id_are_kept_cut() -> None:
    log = DecisionLog(capacity=4)
    for _ in range(10):  # a flood of 4 MiB model names held whole would be capacity * 4 MiB
        log.record_refusal("r" * 100_000, "m" * (4 << 20), 404)
    entries = log.recent(4)
    assert len(entries) == 4
    assert all(len(e["model"]) == MAX_KEPT_CHARS and len(e["request_id"]) == MAX_KEPT_CHARS for e in entries)
    assert log.refused[404] == 10
