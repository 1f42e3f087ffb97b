"""CPU instructions counted by valgrind's callgrind: a figure that does not depend on what else the machine runs, so
a change of a few percent shows where timings' noise hides it.

A workload is Python code run by an interpreter under callgrind, twice: with a warm-up count of steps and with
that many more, so that start-up and first-call set-up subtract out. For the counts to repeat, the workload must
do the same steps every run: no real clock in its decisions (give it one of its own) and a fixed hash salt
(``PYTHONHASHSEED``, set here: prompts' prefix hashes come from Python's salted hash).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["count", "per_step"]


def count(python: str, code: str, *args: str) -> int:
    """The CPU instructions that interpreter ``python``'s main thread runs for ``code`` (``python -c code args...``,
    start-up included). Other threads are left out: a library's idle worker thread (numpy's, say) runs for as long
    as the process lives, which under valgrind varies with the machine's load (by 5 million instructions between two
    runs of the same workload, where the main thread's differed by a few thousand). Raises ``FileNotFoundError``
    when valgrind is not installed (Debian's package ``valgrind``)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise FileNotFoundError("valgrind is not installed: apt-get install valgrind (it counts the instructions)")
    with tempfile.TemporaryDirectory(prefix="inferlb-callgrind-") as out:
        # --trace-children: ``python`` may be a wrapper script that execs the interpreter (its own count is far
        # smaller: the largest main thread's is the interpreter's). --separate-threads: a file per thread, the
        # main thread's ending in -01.
        argv = [valgrind, "--tool=callgrind", "--trace-children=yes", "--separate-threads=yes"]
        argv += [f"--callgrind-out-file={out}/callgrind.%p", python, "-c", code, *args]
        done = subprocess.run(
            argv, capture_output=True, text=True, check=True, cwd="/", env={**os.environ, "PYTHONHASHSEED": "0"}
        )
        counts = [_summary(path) for path in Path(out).glob("callgrind.*-01")]
    if not counts:
        raise RuntimeError(f"callgrind wrote no count: {done.stderr[-500:]}")
    return max(counts)


def _summary(path: Path) -> int:
    """The instructions a callgrind output file counts (its header's ``summary:`` line)."""
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.startswith("summary:"):
                return int(line.split()[1])
            if line.startswith(("fn=", "fl=")):  # past the header
                break
    raise RuntimeError(f"no summary line in callgrind's {path.name}")


def per_step(python: str, code: str, warm: int, counted: int, *args: str) -> float:
    """Instructions per step of ``code``, which takes its number of steps as its first argument and ``args``
    after: runs of ``warm`` and ``warm + counted`` steps, subtracted."""
    before = count(python, code, str(warm), *args)
    return (count(python, code, str(warm + counted), *args) - before) / counted
