"""Which stretch of a trace a benchmark replays: a fixed start, or the window where prefixes repeat most.

The first requests of the Mooncake traces are mostly first turns: their prompts share little beyond the system
prefix, so a replay of them says little about cache-aware routing. `reuse_window` scans a trace for the run of
``requests`` consecutive requests with the largest *reuse share*: of all the prompt blocks the window's requests
carry, the fraction that an earlier request in the same window also carried (`reuse_share`). Only the Mooncake
traces name their blocks (``hash_ids``); the Azure traces have no prefix information, so their window is the
given start and their share None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferlb.sim.traces import load_trace

__all__ = ["Window", "choose_window", "parse_start", "reuse_share", "reuse_window"]

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Window:
    """Requests ``start`` .. ``start + requests`` of a trace (row order, after sorting by time). ``reuse`` is the
    window's reuse share in [0, 1], None where the trace has no block ids; ``auto`` says whether it was chosen by
    `reuse_window` rather than given."""

    start: int
    requests: int
    reuse: float | None
    auto: bool


def parse_start(text: str) -> int | str:
    """``--start``'s value: ``auto`` or a count of requests to skip (>= 0). ValueError, naming the fix, else."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--start takes a number of requests to skip or 'auto'; got {text!r}") from None
    if value < 0:
        raise ValueError(f"--start must be >= 0 (requests to skip); got {value}")
    return value


def reuse_share(blocks: Sequence[Sequence[int]]) -> float | None:
    """Of all the block ids in ``blocks`` (one sequence per request, in arrival order), the fraction that an
    earlier request of the same sequence also had; None where there are no ids at all."""
    seen: set[int] = set()
    hits = total = 0
    for ids in blocks:
        total += len(ids)
        hits += sum(1 for h in ids if h in seen)
        seen.update(ids)
    return hits / total if total else None


def reuse_window(blocks: Sequence[Sequence[int]], requests: int, step: int | None = None) -> tuple[int, float | None]:
    """The start of the ``requests``-long window of ``blocks`` with the largest `reuse_share`, and that share.

    Starts are tried every ``step`` requests (default: a tenth of ``requests``, at least 1) and at the last
    possible start; the earliest wins a tie. A trace no longer than ``requests`` gives start 0. ``(0, None)``
    where no request has block ids. ValueError for ``requests`` or ``step`` below 1.
    """
    if requests < 1:
        raise ValueError(f"a window holds at least 1 request; got {requests}")
    step = step if step is not None else max(1, requests // 10)
    if step < 1:
        raise ValueError(f"the scan's step must be >= 1; got {step}")
    last = max(0, len(blocks) - requests)
    starts = sorted({*range(0, last + 1, step), last})
    best: tuple[int, float | None] = (0, None)
    for start in starts:
        share = reuse_share(blocks[start : start + requests])
        if share is not None and (best[1] is None or share > best[1]):
            best = (start, share)
    return best


def choose_window(path: str | Path, requests: int, start: int | str) -> Window:
    """The window of the trace at ``path`` that ``--start`` (``start``: a number or ``auto``) and ``--requests``
    describe. A numeric start past the trace's end is a ValueError naming its length; errors reading the trace
    propagate (`inferlb.sim.traces.load_trace`)."""
    trace = load_trace(path)
    blocks = [r.hash_ids for r in trace.requests]
    if start == AUTO:
        first, share = reuse_window(blocks, requests)
        return Window(first, requests, share, auto=share is not None)
    first = int(start)
    if first >= len(blocks):
        raise ValueError(f"--start {first} is past the end of {Path(path).name} ({len(blocks)} requests)")
    return Window(first, requests, reuse_share(blocks[first : first + requests]), auto=False)
