"""Sampling a running process with Linux ``perf`` and splitting its CPU time by the library it ran in.

py-spy (`bench.pyspy`) sees Python frames only: the time a picker spends in the kernel (its sockets, epoll, the
wake-ups between gRPC's thread and the event loop), in gRPC's C core, in numpy or in the interpreter itself shows
under the last Python frame above it. perf samples the CPU wherever it is, so its split by shared object says how
much of a request's CPU is the interpreter running Python code at all. Needs ``perf`` (Debian's ``linux-perf``)
and the right to sample the kernel too (root, or ``kernel.perf_event_paranoid`` at most 1); without them the
benchmark skips this and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["PARTS", "by_part", "parse_report", "record", "shares", "unavailable"]

# The parts a picker's CPU goes to, and how each shared object perf names is recognised (by its file name's start).
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel", ("[kernel.",)),
    ("Python interpreter", ("libpython", "python3")),
    ("gRPC core", ("cygrpc.",)),
    # numpy's arrays and ufuncs, and its random generators (the max-score picker's tie-breaks).
    ("numpy", ("_multiarray_umath.", "_generator.", "bit_generator.", "_philox.", "_pcg64.", "_bounded_integers.")),
    ("protobuf", ("_message.",)),
    ("C library", ("libc.so", "libc-", "ld-linux", "libm.so", "libstdc++", "libgcc_s", "[vdso]")),
)
OTHER = "other"
PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")


def unavailable(paranoid: Path = PARANOID) -> str | None:
    """Why perf cannot profile here (not installed, or not allowed to see the kernel: not root and ``paranoid``
    above 1); None when it can."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian package linux-perf)"
    if os.geteuid() != 0:
        try:
            level = int(paranoid.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            return "kernel.perf_event_paranoid is unreadable"
        if level > 1:
            return f"perf may not sample the kernel (kernel.perf_event_paranoid is {level}; run as root or set it to 1)"
    return None


def record(pid: int, duration_s: float, out: Path, rate: int = 997) -> subprocess.Popen[bytes]:
    """Start sampling every thread of ``pid`` for ``duration_s`` seconds on the CPU clock (a software event: it
    needs no hardware counters, which virtual machines often lack) into ``out``; the caller waits for it."""
    argv = ["perf", "record", "--quiet", "-e", "cpu-clock", "-F", str(rate), "-p", str(pid), "-o", str(out)]
    argv += ["--", "sleep", f"{duration_s:g}"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def shares(data: Path) -> dict[str, float]:
    """Each shared object's share of the samples in perf's ``data`` file (0..1). Raises ``RuntimeError`` if perf
    cannot read it."""
    argv = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso", "-g", "none", "-q"]
    argv += ["-F", "sample,dso", "-t", "|"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"perf report failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return parse_report(done.stdout)


def parse_report(text: str) -> dict[str, float]:
    """Shares by shared object from ``perf report -F sample,dso -t '|'`` output: lines of ``samples|name``."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        samples, sep, name = line.partition("|")
        samples, name = samples.strip(), name.strip()
        if not sep or not samples.isdigit() or not name:
            continue  # a comment or a blank line
        counts[name] = counts.get(name, 0) + int(samples)
    total = sum(counts.values())
    return {name: count / total for name, count in counts.items()} if total else {}


def by_part(found: dict[str, float]) -> dict[str, float]:
    """``found`` (from `shares`) summed into `PARTS` and "other", in that order (every part present, maybe 0)."""
    parts = {name: 0.0 for name, _ in PARTS} | {OTHER: 0.0}
    for dso, share in found.items():
        base = dso.rsplit("/", 1)[-1]
        part = next((name for name, starts in PARTS if base.startswith(starts)), OTHER)
        parts[part] += share
    return parts
