"""Splitting a process's CPU by library with perf: the report's parsing, the parts, when perf cannot, and a real
sample of a busy interpreter where perf may run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inferlb.bench import perfprof

# `perf report -F sample,dso -t '|' -q` as perf 6.1 prints it: counts and names padded, a blank line after.
SAMPLES = (
    (7412, "[kernel.kallsyms]"),
    (5902, "/usr/lib/libpython3.11.so.1.0"),
    (2757, "cygrpc.cpython-311-x86_64-linux-gnu.so"),
    (565, "_multiarray_umath.cpython-311-x86_64-linux-gnu.so"),
    (12, "_generator.cpython-311-x86_64-linux-gnu.so"),
    (301, "_message.abi3.so"),
    (764, "libc.so.6"),
    (33, "[vdso]"),
    (98, "_asyncio.cpython-311-x86_64-linux-gnu.so"),
)
REPORT = "".join(f" {count:<11}|{name:<49}\n" for count, name in SAMPLES) + "\n"


def test_the_report_gives_each_shared_objects_share_of_the_samples() -> None:
    shares = perfprof.parse_report("# a comment\n" + REPORT)

    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["[kernel.kallsyms]"] == pytest.approx(7412 / 17844)
    assert shares["/usr/lib/libpython3.11.so.1.0"] == pytest.approx(5902 / 17844)
    assert perfprof.parse_report("") == {}


def test_shared_objects_are_summed_into_the_parts_by_name() -> None:
    parts = perfprof.by_part(perfprof.parse_report(REPORT))

    assert list(parts) == [name for name, _ in perfprof.PARTS] + [perfprof.OTHER]
    total = 17844
    assert parts["kernel"] == pytest.approx(7412 / total)
    assert parts["Python interpreter"] == pytest.approx(5902 / total)  # by its file name, wherever it lies
    assert parts["gRPC core"] == pytest.approx(2757 / total)
    assert parts["numpy"] == pytest.approx((565 + 12) / total)  # arrays and the random generators
    assert parts["protobuf"] == pytest.approx(301 / total)
    assert parts["C library"] == pytest.approx((764 + 33) / total)
    assert parts[perfprof.OTHER] == pytest.approx(98 / total)
    assert perfprof.by_part({})["kernel"] == 0.0


def test_without_perf_the_reason_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert perfprof.unavailable() == "perf is not installed (Debian package linux-perf)"


def test_a_user_who_may_not_sample_the_kernel_is_told_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "perf").write_text("#!/bin/sh\n", encoding="ascii")
    (tmp_path / "perf").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(perfprof.os, "geteuid", lambda: 1000)
    paranoid = tmp_path / "perf_event_paranoid"
    paranoid.write_text("2\n", encoding="ascii")

    assert "perf_event_paranoid is 2" in (perfprof.unavailable(paranoid) or "")
    paranoid.write_text("1\n", encoding="ascii")
    assert perfprof.unavailable(paranoid) is None
    monkeypatch.setattr(perfprof.os, "geteuid", lambda: 0)
    paranoid.write_text("3\n", encoding="ascii")
    assert perfprof.unavailable(paranoid) is None  # root sees the kernel whatever the level


def test_a_busy_interpreter_is_sampled_in_the_interpreter(tmp_path: Path) -> None:
    why = perfprof.unavailable()
    if why is not None:
        pytest.skip(why)
    spin = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end:\n    sum(range(1000))\n"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        data = tmp_path / "perf.data"
        sampler = perfprof.record(busy.pid, 1.0, data)
        assert sampler.wait(60) == 0
    finally:
        busy.kill()
        busy.wait()
    parts = perfprof.by_part(perfprof.shares(data))

    assert parts["Python interpreter"] > 0.5
    assert sum(parts.values()) == pytest.approx(1.0)
