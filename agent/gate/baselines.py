"""Running medians of each message's earlier attention shares: the sketch's baselines, read every turn.

A message's baseline is the median, per sketch layer, of the shares every earlier question paid it. Sorting the whole
list again each turn costs a chat of n turns and m messages O(n·m) work a turn; the lists only grow (a turn's shares
are appended when the next begins), so each message keeps its shares sorted per layer and a turn inserts only what is
new. The values equal ``np.median(np.stack(shares), axis=0)`` exactly (the middle value, or the mean of the two).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np


class RunningMedians:
    """Per key (a message index), the per-layer median of an append-only list of share vectors."""

    def __init__(self) -> None:
        self._sorted: dict[int, tuple[int, list[list[float]]]] = {}

    def clear(self) -> None:
        """Forget every list (the owner replaced them, not appended to them)."""
        self._sorted.clear()

    def median(self, key: int, values: Sequence[np.ndarray]) -> np.ndarray:
        """``np.median(np.stack(values), axis=0)`` for ``values``, the list held for ``key``, which since the last
        call may only have grown at its end; a shorter or reshaped list is read afresh."""
        n = len(values)
        if n == 0:
            raise ValueError("the median of no shares")
        width = int(np.size(values[0]))
        held = self._sorted.get(key)
        if held is None or held[0] > n or len(held[1]) != width:
            held = (0, [[] for _ in range(width)])
        count, columns = held
        for share in values[count:]:
            row = np.asarray(share, dtype=np.float64).ravel().tolist()
            if len(row) != width or not all(math.isfinite(x) for x in row):
                # NaN has no place in a sorted list; NumPy's own median says what such a list's median is
                self._sorted.pop(key, None)
                return np.median(np.stack([np.asarray(v, dtype=np.float64) for v in values]), axis=0)
            for column, x in zip(columns, row):
                bisect.insort(column, x)
        self._sorted[key] = (n, columns)
        mid = n // 2
        if n % 2:
            return np.array([column[mid] for column in columns], dtype=np.float64)
        return np.array([(column[mid - 1] + column[mid]) / 2 for column in columns], dtype=np.float64)
