"""Tests for bench/callgrind.py: instruction counts under valgrind, and the error without it."""

from __future__ import annotations

import shutil
import sys

import pytest

from inferlb.bench import callgrind


def test_counting_instructions_without_valgrind_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(callgrind.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get install valgrind"):
        callgrind.count(sys.executable, "pass")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian package valgrind)")
def test_per_step_subtracts_the_start_up_and_scales_with_the_work() -> None:
    # A step of twice the work counts about twice the instructions; the interpreter's start-up is gone from both.
    code = "import sys\nfor _ in range(int(sys.argv[1])): sum(range(int(sys.argv[2])))"
    small = callgrind.per_step(sys.executable, code, 10, 200, "1000")
    large = callgrind.per_step(sys.executable, code, 10, 200, "2000")
    assert 5_000 < small < 1_000_000
    assert 1.8 < large / small < 2.2
