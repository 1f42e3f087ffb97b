"""Sampling a running picker with py-spy and summarising where its CPU time goes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# A frame of the request path's code, in filter/ or scorer/ (py-spy prints paths relative to the sys.path
# entry, e.g. "ExtProcService.Process (filter/server.py:72)"). inferlb/ holds only the frames that start the
# event loop, which sit under every stack.
_OURS = re.compile(r"\((?:.*/)?(?:filter|scorer)/[^/]+\.py:\d+\)$")
# Leaf frames whose self time is native code: py-spy shows the last Python frame above it. The event loop's
# callbacks and the extra thread are gRPC's (its Cython/C core); the selector wait is the loop's epoll.
_LEAVES = (
    ("gRPC core, called from event-loop callbacks", "Handle._run (asyncio/events.py"),
    ("gRPC core, in its own thread", "Thread.run (threading.py"),
    ("event loop waiting in epoll", "EpollSelector.select (selectors.py"),
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
    """Shares of samples: by where the time went, our functions inclusive, and the top leaf functions.

    A stack with any frame of ours counts as inferlb's (with the protobuf and numpy calls it makes); the
    others are classified by their leaf frame.
    """
    leaves: Counter[str] = Counter()
    where: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        leaves[frames[-1]] += count
        own = {f.split(" (")[0] for f in frames if _OURS.search(f)}
        for name in own:
            ours[name] += count
        where[_where(frames[-1]) if not own else "inferlb (with the protobuf and numpy it calls)"] += count
    if not total:
        return {"samples": 0, "by_category": {}, "top_self": [], "top_inferlb_inclusive": []}
    return {
        "samples": total,
        "by_category": {k: v / total for k, v in where.most_common()},
        "top_self": [(f, c / total) for f, c in leaves.most_common(top)],
        "top_inferlb_inclusive": [(f, c / total) for f, c in ours.most_common(top)],
    }


def _where(leaf: str) -> str:
    for name, prefix in _LEAVES:
        if leaf.startswith(prefix):
            return name
    if "(asyncio/" in leaf:
        return "asyncio (Python)"
    return "other Python"
