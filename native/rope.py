"""Rotary position embedding (RoPE) as llama.cpp applies it, for rotating rows that are already rotated.

A key or query row rotated at position p, rotated again by an offset d, is the row rotated at p + d: the attention
score between a query and a key depends on their positions only through the difference. The evicted-key sketch
keeps keys rotated where they were evicted; once the cache's positions have moved down (a frame shift), the
question's query rows rotated by how far they moved score those keys at their true distance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

NORM, NEOX = 0, 2
"""llama.cpp's ``llama_rope_type`` values this module rotates (adjacent pairs; halves)."""


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates its query and key rows (its full-attention layers')."""

    kind: int
    """:data:`NORM` or :data:`NEOX`."""
    n_rot: int
    """Leading dimensions of each head that are rotated."""
    freq_base: float
    freq_scale: float = 1.0

    def angles(self, offset: int) -> NDArray[np.float64]:
        """[n_rot / 2] the rotation angle of each dimension pair for a position offset."""
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        return float(offset) * self.freq_scale * self.freq_base ** (-2.0 * i / self.n_rot)


def rotate(rows: NDArray[np.float32], head_dim: int, spec: RopeSpec, offset: int) -> NDArray[np.float32]:
    """``rows`` ([..., n_head * head_dim] or [..., head_dim]) rotated by ``offset`` more positions."""
    if offset == 0:
        return rows
    x = np.asarray(rows, dtype=np.float64)
    shape = x.shape
    heads = x.reshape(*shape[:-1], shape[-1] // head_dim, head_dim)
    theta = spec.angles(offset)
    cos, sin = np.cos(theta), np.sin(theta)
    half = spec.n_rot // 2
    out = heads.copy()
    if spec.kind == NEOX:
        a, b = heads[..., :half], heads[..., half:spec.n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:spec.n_rot] = a * sin + b * cos
    else:
        a, b = heads[..., 0:spec.n_rot:2], heads[..., 1:spec.n_rot:2]
        out[..., 0:spec.n_rot:2] = a * cos - b * sin
        out[..., 1:spec.n_rot:2] = a * sin + b * cos
    return out.reshape(shape).astype(np.float32)
