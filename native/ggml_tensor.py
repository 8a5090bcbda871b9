"""Reading ggml graph tensors from Python: the ``struct ggml_tensor`` layout and a float32 copy.

For ``cb_eval`` callbacks (the coverage study and the patch tests capture Q, K, V and the
attention output of a layer). The layout is the vendored ggml's (ggml/include/ggml.h).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the vendored ggml."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


@lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    from native import runtime  # noqa: PLC0415

    lib = ctypes.CDLL(str(runtime.built_libs().lib_dir / "libggml-base.so"))
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    return lib


def read(ptr: int) -> np.ndarray:
    """A float32 copy of an F32/F16 tensor (views and permutations included), indexed [i3, i2, i1, i0];
    works on any backend's buffer (the copy goes through ggml_backend_tensor_get)."""
    t = GgmlTensor.from_address(ptr)
    dtype = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16}[t.type]
    lib = _ggml()
    nbytes = int(lib.ggml_nbytes(ptr))
    raw = np.empty(nbytes + 16, dtype=np.uint8)
    lib.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, nbytes)
    base = raw[: nbytes - nbytes % np.dtype(dtype).itemsize].view(dtype)
    shape = tuple(int(t.ne[i]) for i in (3, 2, 1, 0))
    strides = tuple(int(t.nb[i]) for i in (3, 2, 1, 0))
    return np.array(np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides), dtype=np.float32)


def src(ptr: int, i: int) -> int:
    """Pointer of source ``i`` of a tensor."""
    return int(GgmlTensor.from_address(ptr).src[i])


__all__ = ["GgmlTensor", "GGML_TYPE_F16", "GGML_TYPE_F32", "read", "src"]
