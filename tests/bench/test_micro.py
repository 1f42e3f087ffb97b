"""Tests for bench/micro.py's counted figure: one request through the stream handler, in CPU instructions."""

from __future__ import annotations

import shutil

import pytest

from inferlb.bench import micro


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian package valgrind)")
def test_the_handlers_instructions_are_the_same_on_every_run_and_the_floor_is_the_least() -> None:
    # What the count is for: a figure the machine's load does not move, which orders the pickers by their work.
    default = micro.handler_instructions("default", True, 100)
    again = micro.handler_instructions("default", True, 100)
    floor = micro.handler_instructions("noop", True, 100)
    assert abs(default - again) / default < 0.02
    assert 0 < floor < default
