"""How deep each endpoint holds a chain of block hashes: the walk both prefix indices share.

``holders`` maps a block hash to the bitmask of the endpoints holding it (bit i = endpoint i): a Python int is a
compact, fast bitset here, one AND per block narrows every endpoint at once. Because block hashes are chained (a
block's hash stands for the whole prefix up to it), an endpoint's match ends at the first block it does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["match_depth"]

# Up to this many endpoints leaving a match at one depth are written one by one; more at once, with numpy.
_FEW = 12


def match_depth(holders: dict[int, int], hashes: Sequence[int], size: int) -> tuple[np.ndarray, int]:
    """(how many leading blocks of ``hashes`` each of ``size`` endpoints holds, as int64; the largest of those).

    Costs one dict lookup and one AND per block while some endpoint still holds every block so far, plus one
    write per endpoint that matched; independent of how many blocks are held."""
    counts = np.zeros(size, dtype=np.int64)
    if not hashes:
        return counts, 0
    blocks = iter(hashes)
    live = holders.get(next(blocks), 0)
    if not live:
        return counts, 0
    for depth, block in enumerate(blocks, 1):
        following = live & holders.get(block, 0)
        if following != live:
            _set(counts, live ^ following, depth, size)
            if not following:
                return counts, depth
            live = following
    _set(counts, live, len(hashes), size)
    return counts, len(hashes)


def _set(counts: np.ndarray, endpoints: int, depth: int, size: int) -> None:
    """``counts[e] = depth`` for every endpoint ``e`` in the bitmask ``endpoints``."""
    if endpoints.bit_count() <= _FEW:
        while endpoints:
            lowest = endpoints & -endpoints
            counts[lowest.bit_length() - 1] = depth
            endpoints ^= lowest
        return
    bits = np.frombuffer(endpoints.to_bytes((size + 7) // 8, "little"), dtype=np.uint8)
    counts[np.unpackbits(bits, count=size, bitorder="little").view(bool)] = depth
