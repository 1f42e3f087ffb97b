"""Sampling a running picker with py-spy and summarising where its CPU time goes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Where a sampled leaf frame's file lives decides its bucket; the first match wins.
CATEGORIES = (
    ("inferlb", ("/filter/", "/scorer/", "/inferlb/")),
    ("grpc", ("grpc/", "grpc_health", "_cython", "cygrpc")),
    ("protobuf", ("google/protobuf",)),
    ("asyncio", ("asyncio/",)),
)


def start(pid: int, duration_s: float, out: Path, rate: int = 500) -> subprocess.Popen[bytes] | None:
    """Start sampling ``pid``; None if py-spy is not installed (the benchmark then skips the profile)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return None
    argv = [exe, "record", "--pid", str(pid), "--duration", f"{duration_s:g}", "--rate", str(rate)]
    argv += ["--format", "raw", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarise(raw: Path, top: int = 12) -> dict[str, object]:
    """Sample counts by category and the functions with the most self time, from py-spy's raw output."""
    leaves: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    inclusive_ours: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        leaf = frames[-1]
        leaves[leaf] += count
        categories[_category(leaf)] += count
        # A frame of ours anywhere on the stack: time spent in our code or in what it calls.
        ours = {f.split(" (")[0] for f in frames if _category(f) == "inferlb"}
        for name in ours:
            inclusive_ours[name] += count
    return {
        "samples": total,
        "by_category": {k: v / total for k, v in categories.most_common()} if total else {},
        "top_self": [(f, c / total) for f, c in leaves.most_common(top)] if total else [],
        "top_inferlb_inclusive": [(f, c / total) for f, c in inclusive_ours.most_common(top)] if total else [],
    }


def _category(frame: str) -> str:
    for name, needles in CATEGORIES:
        if any(n in frame for n in needles):
            return name
    return "other"
