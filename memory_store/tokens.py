"""Token ids on disk: a BLOB of little-endian int32, exact both ways.

llama.cpp's ``llama_token`` and ``llama_pos`` are int32, so int32 is lossless;
a 30k-token history is 120 kB instead of ~200 kB of JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
_INT32_MAX = 2**31 - 1


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate ids (integers in [0, 2^31)) and return them as a contiguous int32 array."""
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > _INT32_MAX:
        raise ValueError(f"token ids must lie in [0, 2^31), got a value of {low if low < 0 else high}")
    return np.ascontiguousarray(array, dtype=np.int32)


def pack(tokens: Sequence[int] | np.ndarray) -> bytes:
    return as_token_array(tokens).astype(TOKEN_DTYPE, copy=False).tobytes()


def unpack(blob: bytes | None) -> np.ndarray | None:
    """The stored ids as a read-only int32 array (None when never recorded)."""
    if blob is None:
        return None
    if len(blob) % TOKEN_DTYPE.itemsize:
        raise ValueError(f"token blob of {len(blob)} bytes is not a whole number of int32")
    array = np.frombuffer(blob, dtype=TOKEN_DTYPE).astype(np.int32)
    array.flags.writeable = False
    return array
