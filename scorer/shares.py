"""The share line of an experiment: [0, 1) cut into segments, each an arm's, that a request's draw or hash falls in.

With hash assignment a user's place on the line is fixed, so the layout decides who changes arms when the weights
change. `ShareLine.move_to` moves as few shares as it can: an arm that shrinks gives up shares of its own, and only
those go to the arms that grow. A cut of one arm (the control taking up the difference) moves that arm's users
only, and only to the control; a ramp step moves control users only, and only to the treatment.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["UNITS", "ShareLine"]

UNITS = 1000  # the line's resolution: a share is a step of 0.1%


class ShareLine:
    """Which arm (by index) each share of [0, 1) goes to, in steps of 1/`UNITS`; starts with the arms' ``units`` laid
    out in order. One event loop; not thread-safe. `arm_at` is O(log segments); the segments grow by at most one per
    arm at each change."""

    __slots__ = ("_edges", "_owners")

    def __init__(self, units: Sequence[int]) -> None:
        self._edges: list[int] = []  # the segments' upper bounds, increasing; the last is UNITS
        self._owners: list[int] = []  # each segment's arm
        segments = []
        low = 0
        for arm, size in enumerate(_checked(units)):
            segments.append((low, low + size, arm))
            low += size
        self._lay(segments)

    def arm_at(self, u: float) -> int:
        """The arm of share ``u`` in [0, 1] (1, which a 64-bit hash over 2**64 can round to, is the last share's)."""
        index = bisect.bisect_right(self._edges, u * UNITS)
        return self._owners[min(index, len(self._owners) - 1)]

    def units(self, arms: int) -> list[int]:
        """The shares each of ``arms`` arms holds, in units."""
        out = [0] * arms
        low = 0
        for edge, owner in zip(self._edges, self._owners, strict=True):
            out[owner] += edge - low
            low = edge
        return out

    def move_to(self, units: Sequence[int]) -> None:
        """Give each arm ``units[i]`` shares: every arm that holds more gives up the difference from its last
        segments on the line, and the arms that hold fewer take those pieces, in order."""
        wanted = _checked(units)
        held = self.units(len(wanted))
        segments: list[tuple[int, int, int]] = []
        low = 0
        for edge, owner in zip(self._edges, self._owners, strict=True):
            segments.append((low, edge, owner))
            low = edge
        freed: list[tuple[int, int]] = []
        for arm, (have, want) in enumerate(zip(held, wanted, strict=True)):
            excess = have - want
            for i in range(len(segments) - 1, -1, -1):
                if excess <= 0:
                    break
                lo, hi, owner = segments[i]
                if owner != arm:
                    continue
                give = min(excess, hi - lo)
                segments[i] = (lo, hi - give, owner)
                freed.append((hi - give, hi))
                excess -= give
        freed.sort()
        for arm, (have, want) in enumerate(zip(held, wanted, strict=True)):
            short = want - have
            while short > 0:
                lo, hi = freed.pop(0)
                take = min(short, hi - lo)
                segments.append((lo, lo + take, arm))
                if take < hi - lo:
                    freed.insert(0, (lo + take, hi))
                short -= take
        self._lay(segments)

    def copy(self) -> ShareLine:
        line = ShareLine.__new__(ShareLine)
        line._edges, line._owners = self._edges[:], self._owners[:]
        return line

    def _lay(self, segments: list[tuple[int, int, int]]) -> None:
        """Keep ``segments`` (low, high, arm) that are not empty, in order, neighbours of one arm merged."""
        edges: list[int] = []
        owners: list[int] = []
        for _, high, owner in sorted(s for s in segments if s[1] > s[0]):
            if owners and owners[-1] == owner:
                edges[-1] = high
            else:
                edges.append(high)
                owners.append(owner)
        self._edges, self._owners = edges, owners


def _checked(units: Sequence[int]) -> list[int]:
    out = list(units)
    if any(u < 0 for u in out) or sum(out) != UNITS:
        raise ValueError(f"shares must be {UNITS} units in all, none negative; got {out}")
    return out
