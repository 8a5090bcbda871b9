"""Host-side copies of evicted cells' K/V rows, every layer, so a targeted re-read can put a message back as
the cache first computed it instead of decoding it again over the evicted cache.

A cache of the cache, never the source of truth: each row is kept with the token it was computed for, and
:meth:`EvictedRows.take` hands rows back only for a run of positions whose tokens all match what the caller
(reading the log) says belongs there; anything else is decoded again. Bounded by a byte budget: past it the
rows evicted longest ago go first.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


class EvictedRows:
    """Rows by position: (token, the cell's bytes over all layers as ``native.patched.get_rows`` reads them)."""

    def __init__(self, row_bytes: int, budget_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.budget_bytes = budget_bytes
        self._rows: dict[int, tuple[int, bytes]] = {}
        self.dropped = 0
        """Rows let go to stay within the budget (their messages are decoded again if re-read)."""

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return len(self._rows) * self.row_bytes

    def put(self, positions: np.ndarray, tokens: Sequence[int] | np.ndarray, rows: np.ndarray) -> None:
        """Keep the rows of cells just evicted (a position evicted again replaces its row: a re-prefill may have
        put other tokens there since)."""
        if rows.shape != (len(positions), self.row_bytes):
            raise ValueError(f"rows of shape {rows.shape} for {len(positions)} positions of {self.row_bytes} bytes")
        for p, t, r in zip(np.asarray(positions).tolist(), np.asarray(tokens).tolist(), rows):
            self._rows.pop(p, None)
            self._rows[p] = (int(t), r.tobytes())
        self._trim()

    def resize(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._trim()

    def _trim(self) -> None:
        capacity = self.budget_bytes // self.row_bytes if self.row_bytes else 0
        while len(self._rows) > capacity:
            self._rows.pop(next(iter(self._rows)))
            self.dropped += 1

    def _kept(self, start: int, tokens: Sequence[int]) -> list[bytes] | None:
        """The kept bytes of positions [start, start + len(tokens)) when every one is kept for exactly that token."""
        out = []
        # the log's tokens come as a NumPy array: one conversion, not one int() of a NumPy scalar per token
        for i, t in enumerate(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens):
            got = self._rows.get(start + i)
            if got is None or got[0] != int(t):
                return None
            out.append(got[1])
        return out

    def covers(self, start: int, tokens: Sequence[int]) -> bool:
        """Whether :meth:`take` would give the rows of positions [start, start + len(tokens))."""
        return self._kept(start, tokens) is not None

    def take(self, start: int, tokens: Sequence[int]) -> np.ndarray | None:
        """The rows of positions [start, start + len(tokens)) if every one is kept for exactly that token, else
        None. They stay kept: a message re-read and evicted again is the same message."""
        kept = self._kept(start, tokens)
        if kept is None:
            return None
        return np.frombuffer(b"".join(kept), dtype=np.uint8).reshape(len(tokens), self.row_bytes)

    def get(self, pos: int) -> tuple[int, np.ndarray] | None:
        """The token and the row kept for position ``pos``, or None."""
        kept = self._rows.get(pos)
        return None if kept is None else (kept[0], np.frombuffer(kept[1], dtype=np.uint8))

    def positions(self) -> list[int]:
        """The positions whose rows are kept, oldest kept first."""
        return list(self._rows)

    def forget_from(self, pos: int) -> None:
        """Drop every row at ``pos`` or later: those positions are being given to new tokens."""
        for p in [p for p in self._rows if p >= pos]:
            del self._rows[p]

    def clear(self) -> None:
        self._rows.clear()

    def shift(self, low: int, cut: int, delta: int,
              rotate: Callable[[np.ndarray, int], np.ndarray | None] | None) -> None:
        """Follow the cache's frame shift (``Engine.shift_frame``): rows of positions in [low, cut) go (their
        messages have no place left), rows from ``cut`` on move down by ``delta``, their keys rotated by −delta
        (``rotate(rows, offset)``: the rows with every layer's key rotated by ``offset`` positions, or None where
        it cannot), so that a row put back at its new position is the one a cell there would hold. Without a
        rotation every row from ``low`` on goes. The oldest-first order the budget trims by is kept."""
        moved = [p for p in self._rows if p >= cut]
        rotated = None
        if moved and rotate is not None:
            rows = np.frombuffer(b"".join(self._rows[p][1] for p in moved), dtype=np.uint8)
            rotated = rotate(rows.reshape(len(moved), self.row_bytes), -delta)
        at = {p: i for i, p in enumerate(moved)}
        kept: dict[int, tuple[int, bytes]] = {}
        for p, (token, row) in self._rows.items():
            if p < low:
                kept[p] = (token, row)
            elif p >= cut and rotated is not None:
                kept[p - delta] = (token, rotated[at[p]].tobytes())
        self._rows = kept
