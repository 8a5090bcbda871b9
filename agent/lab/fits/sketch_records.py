"""A turn's recorded ``sketch.messages`` read back: the per-layer shares and ratios ``sketch.max`` ranges over.

The gate records every message with evicted cells in the turn's detail (``agent.gate.decision.Gate.read_sketch``);
the fits and ``certchat calibrate`` recompute ``sketch.max`` from it for another subset of the recorded layers.
"""

from __future__ import annotations

from typing import Any, Collection

import numpy as np

from agent.gate.decision import SHARE_FLOOR


def recorded_shares(messages: dict[str, dict[str, Any]],
                    skip: Collection[int] = ()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per message more than half evicted with a baseline, not a question the turn repeats and not in ``skip`` —
    the messages ``sketch.max`` ranges over — its share and its baseline in each sketch layer."""
    return {int(m): (np.asarray(v["share"], float), np.asarray(v["base"], float))
            for m, v in messages.items()
            if v["base"] is not None and v["evicted"] > v["live"] and not v.get("repeat") and int(m) not in skip}


def recorded_ratios(messages: dict[str, dict[str, Any]], skip: Collection[int] = ()) -> dict[int, np.ndarray]:
    """Per message of :func:`recorded_shares`, its ratio share / max(base, SHARE_FLOOR) in each sketch layer —
    what ``sketch.max`` takes the largest of."""
    return {m: share / np.maximum(base, SHARE_FLOOR) for m, (share, base) in recorded_shares(messages, skip).items()}


__all__ = ["recorded_ratios", "recorded_shares"]
