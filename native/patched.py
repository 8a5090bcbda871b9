"""Bindings for certchat's patch to llama.cpp: per-cell logit bias, KV compaction, attention certificate,
K rows by position and the question's query rows (the evicted-key sketch's inputs), re-insertion at old
positions and each layer's attention window.

The patch (``native/patches/*.patch``, documented in docs/PATCH.md) adds C functions to
libllama; this module declares them with ctypes on the library handle that
``native.runtime.llama_cpp()`` loaded, and wraps each in a typed function that takes and
returns numpy arrays and raises :class:`PatchError` (with the C status code) on failure.

Handles are llama.cpp's own: ``ctx`` is a ``llama_context *`` and ``mem`` a
``llama_memory_t`` as returned by ``llama_init_from_model`` / ``llama_get_memory``
(plain ints or ``ctypes.c_void_p``).
"""

from __future__ import annotations

import ctypes
import enum
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from native import runtime

MIN_PATCH_VERSION = 7
"""The patch level these bindings need (0001 bias, 0002 compaction, 0003 certificate, 0004 keys and queries,
0005 re-insertion at old positions, 0006 each layer's attention window)."""

MAX_WINDOW = 64
"""Most query rows the certificate reports per ubatch (LLAMA_ATTN_CERT_MAX_WINDOW)."""

MAX_QUERY_WINDOW = 256
"""Most query rows ``set_attn_queries`` reports per ubatch (LLAMA_ATTN_Q_MAX_WINDOW)."""


class Status(enum.IntEnum):
    """``enum llama_certchat_status`` of the patched llama.h."""

    OK = 0
    ERR_MEMORY = -1
    ERR_ALIBI = -2
    ERR_ARG = -3
    ERR_NOT_ENABLED = -4
    ERR_NO_DATA = -5
    ERR_CAPACITY = -6
    ERR_UNSUPPORTED = -7


class NotPatched(RuntimeError):
    """The loaded libllama lacks certchat's patch (or has an older one)."""


class PatchError(RuntimeError):
    """A patched function returned an error status; ``code`` is the :class:`Status`."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what}: {message} (status {code})")
        self.code = code


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_f32 = ctypes.c_float
_pi32 = ctypes.POINTER(ctypes.c_int32)
_pf32 = ctypes.POINTER(ctypes.c_float)

# name -> (argtypes, restype)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "llama_certchat_patch_version": ([], _i32),
    "llama_certchat_strerror": ([_i32], ctypes.c_char_p),
    "llama_memory_seq_set_bias": ([_p, _i32, _i32, _i32, _f32], _i32),
    "llama_memory_seq_set_bias_pos": ([_p, _i32, _pi32, _pf32, _i32], _i32),
    "llama_memory_seq_get_bias": ([_p, _i32, _pi32, _pf32, _i32], _i32),
    "llama_kv_seq_compact": ([_p, _i32], _i32),
    "llama_memory_seq_extent": ([_p, _i32], _i32),
    "llama_set_attn_certificate": ([_p, ctypes.c_bool, _i32], _i32),
    "llama_get_attn_certificate_dims": ([_p, _pi32, _pi32, _pi32, _pi32], _i32),
    "llama_get_attn_certificate": ([_p, _pf32, _pf32, _i32], _i32),
    "llama_get_attn_importance": ([_p, _pf32, _pi32, _i32], _i32),
    "llama_kv_seq_get_keys": ([_p, _i32, _pi32, _i32, _pi32, _i32, _pf32, ctypes.c_size_t], _i32),
    "llama_set_attn_queries": ([_p, _pi32, _i32, _i32], _i32),
    "llama_get_attn_queries_dims": ([_p, _pi32, _pi32, _pi32, _pi32], _i32),
    "llama_get_attn_queries": ([_p, _pi32, _pf32, _pf32, _pf32, ctypes.c_size_t], _i32),
    "llama_set_reinsert": ([_p, ctypes.c_bool], _i32),
    "llama_model_layer_n_swa": ([_p, _i32], _i32),
    "llama_kv_seq_rows_size": ([_p, _i32], ctypes.c_int64),
    "llama_kv_seq_get_rows": ([_p, _i32, _pi32, _i32, _p, ctypes.c_size_t], _i32),
    "llama_kv_seq_put_rows": ([_p, _i32, _pi32, _i32, _p, ctypes.c_size_t], _i32),
}


def _raw_library() -> ctypes.CDLL:
    return runtime.llama_cpp().llama_cpp._lib  # type: ignore[no-any-return]


def patch_version() -> int | None:
    """The patch level of the loaded libllama, or None for a stock build."""
    raw = _raw_library()
    try:
        fn = raw.llama_certchat_patch_version
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], _i32
    return int(fn())


def lib() -> ctypes.CDLL:
    """The patched libllama with the certchat functions declared; raises :class:`NotPatched`."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        version = patch_version()
        if version is None or version < MIN_PATCH_VERSION:
            found = "a stock build" if version is None else f"patch level {version}"
            raise NotPatched(
                f"libllama is {found}, certchat needs patch level >= {MIN_PATCH_VERSION}: rebuild with `certchat build`"
            )
        raw = _raw_library()
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(raw, name)
            fn.argtypes, fn.restype = argtypes, restype
        _lib = raw
        return raw


def strerror(code: int) -> str:
    """The library's one-line description of a status code."""
    text = lib().llama_certchat_strerror(code)
    return text.decode() if text else f"status {code}"


def _check(what: str, rc: int) -> int:
    if rc < 0:
        raise PatchError(what, rc, strerror(rc))
    return rc


def _i32_array(values: ArrayLike) -> NDArray[np.int32]:
    return np.ascontiguousarray(values, dtype=np.int32)


def _f32_array(values: ArrayLike) -> NDArray[np.float32]:
    return np.ascontiguousarray(values, dtype=np.float32)


# -- per-cell logit bias ---------------------------------------------------------------------


def set_bias(mem: Any, seq_id: int, p0: int, p1: int, bias: float) -> int:
    """Give every cell of ``seq_id`` with position in [p0, p1) the logit bias ``bias`` (-1 = open end).

    Pass -log(pi) for a token kept with inclusion probability pi. Returns the cells updated
    (both caches counted for sliding-window models).
    """
    return _check("set_bias", lib().llama_memory_seq_set_bias(mem, seq_id, p0, p1, float(bias)))


def set_bias_pos(mem: Any, seq_id: int, positions: ArrayLike, biases: ArrayLike) -> int:
    """Set the bias of the cells at ``positions`` (one value each); returns how many positions were present."""
    pos = _i32_array(positions)
    val = _f32_array(biases)
    if pos.shape != val.shape or pos.ndim != 1:
        raise ValueError(f"positions {pos.shape} and biases {val.shape} must be 1-D of equal length")
    if np.isnan(val).any():
        raise ValueError("a bias is NaN")
    return _check(
        "set_bias_pos",
        lib().llama_memory_seq_set_bias_pos(mem, seq_id, pos.ctypes.data_as(_pi32), val.ctypes.data_as(_pf32),
                                            len(pos)),
    )


def get_bias(mem: Any, seq_id: int) -> tuple[NDArray[np.int32], NDArray[np.float32]]:
    """(positions, biases) of the cells of ``seq_id``, ordered by position (base cache for sliding-window models)."""
    raw = lib()
    n = _check("get_bias", raw.llama_memory_seq_get_bias(mem, seq_id, None, None, 0))
    pos = np.empty(n, dtype=np.int32)
    val = np.empty(n, dtype=np.float32)
    m = _check("get_bias", raw.llama_memory_seq_get_bias(mem, seq_id, pos.ctypes.data_as(_pi32),
                                                         val.ctypes.data_as(_pf32), n))
    if m != n:
        raise PatchError("get_bias", int(Status.ERR_CAPACITY), f"the sequence changed size ({n} -> {m}) while reading")
    return pos, val


# -- compaction ------------------------------------------------------------------------------


def compact(ctx: Any, seq_id: int = 0) -> int:
    """Move the live cells of ``seq_id``'s stream to the lowest indices; returns the new used extent."""
    return _check("compact", lib().llama_kv_seq_compact(ctx, seq_id))


def layer_windows(model: Any, n_layer: int) -> tuple[int, ...]:
    """The attention window of each of the model's ``n_layer`` layers in tokens: 0 for a layer that sees every
    earlier position, the window for a sliding-window layer (Gemma 2/3), which never attends to a position
    outside it, evicted or not."""
    fn = lib().llama_model_layer_n_swa
    windows = tuple(int(fn(model, il)) for il in range(n_layer))
    if any(w < 0 for w in windows):
        raise PatchError("llama_model_layer_n_swa", Status.ERR_ARG, f"the model has fewer than {n_layer} layers")
    return windows


def set_reinsert(ctx: Any, on: bool) -> None:
    """Let decodes place tokens below a sequence's largest position, in free positions (re-inserting evicted
    tokens where they were), or stop; refused for recurrent and hybrid memory."""
    _check("set_reinsert", lib().llama_set_reinsert(ctx, bool(on)))


def extent(mem: Any, seq_id: int = 0) -> int:
    """Highest used cell + 1 of ``seq_id``'s stream: the next ubatch attends over PAD(extent, 256) cells."""
    return _check("extent", lib().llama_memory_seq_extent(mem, seq_id))


# -- attention certificate and importance ----------------------------------------------------


@dataclass(frozen=True)
class CertDims:
    """Shape of the certificate data of the last ubatch."""

    n_layer: int
    """Model layers (layers without attention data read NaN / importance 0)."""
    n_head: int
    """Query heads."""
    n_rows: int
    """Query rows reported: the last min(n_window, n_tokens) tokens of the ubatch."""
    n_cells: int
    """Attention width n_kv of the ubatch (max over caches)."""


@dataclass(frozen=True)
class Certificate:
    """Per layer, query head and row: the variance estimate and the squared output norm."""

    v_hat: NDArray[np.float32]
    """[n_layer, n_head, n_rows] V_hat = sum_i (1 - pi_i) p_i^2 |v_i - o|^2."""
    o_norm2: NDArray[np.float32]
    """[n_layer, n_head, n_rows] |o|^2."""

    def relative(self) -> NDArray[np.float32]:
        """sqrt(V_hat) / |o|: the scale-free certificate (times z_(1-delta) for a bound)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return (np.sqrt(self.v_hat) / np.sqrt(self.o_norm2)).astype(np.float32, copy=False)


@dataclass(frozen=True)
class Importance:
    """Per layer and cell: attention mass from the reported rows (summed over heads), and the cell's position."""

    mass: NDArray[np.float32]
    """[n_layer, n_cells]."""
    cell_pos: NDArray[np.int32]
    """[n_layer, n_cells] position held by the cell when the ubatch ran; -1 for empty cells."""

    def per_position(self, positions: ArrayLike) -> NDArray[np.float64]:
        """Mass per requested position, summed over layers (0 where no layer saw the position)."""
        want = np.asarray(positions, dtype=np.int64)
        order = np.argsort(want, kind="stable")
        sorted_want = want[order]
        out_sorted = np.zeros(len(want), dtype=np.float64)
        live = self.cell_pos >= 0
        pos = self.cell_pos[live].astype(np.int64)
        mass = self.mass[live].astype(np.float64)
        idx = np.searchsorted(sorted_want, pos)
        hit = idx < len(sorted_want)
        hit[hit] = sorted_want[idx[hit]] == pos[hit]
        np.add.at(out_sorted, idx[hit], mass[hit])
        out = np.empty_like(out_sorted)
        out[order] = out_sorted
        return out


def set_attn_certificate(ctx: Any, on: bool, n_window: int = 1) -> None:
    """Turn the in-graph certificate and importance on (reporting ``n_window`` last rows) or off.

    Turns flash attention off with a warning if the context had it; refused for recurrent
    and hybrid models, ALiBi models and quantized V caches.
    """
    if on and not 1 <= n_window <= MAX_WINDOW:
        raise ValueError(f"n_window must be in [1, {MAX_WINDOW}], got {n_window}")
    _check("set_attn_certificate", lib().llama_set_attn_certificate(ctx, bool(on), int(n_window)))


def certificate_dims(ctx: Any) -> CertDims:
    """Dimensions of the last ubatch's certificate data; raises if none exists."""
    dims = [ctypes.c_int32() for _ in range(4)]
    _check("certificate_dims", lib().llama_get_attn_certificate_dims(ctx, *(ctypes.byref(d) for d in dims)))
    return CertDims(*(int(d.value) for d in dims))


def get_certificate(ctx: Any) -> Certificate:
    """The certificate terms of the last ubatch, [n_layer, n_head, n_rows]."""
    d = certificate_dims(ctx)
    shape = (d.n_layer, d.n_head, d.n_rows)
    v_hat = np.empty(shape, dtype=np.float32)
    o_norm2 = np.empty(shape, dtype=np.float32)
    _check(
        "get_certificate",
        lib().llama_get_attn_certificate(ctx, v_hat.ctypes.data_as(_pf32), o_norm2.ctypes.data_as(_pf32), v_hat.size),
    )
    return Certificate(v_hat=v_hat, o_norm2=o_norm2)


def get_importance(ctx: Any) -> Importance:
    """Per-cell attention mass of the last ubatch's reported rows, with the cell -> position map per layer."""
    d = certificate_dims(ctx)
    mass = np.empty((d.n_layer, d.n_cells), dtype=np.float32)
    pos = np.empty((d.n_layer, d.n_cells), dtype=np.int32)
    _check(
        "get_importance",
        lib().llama_get_attn_importance(ctx, mass.ctypes.data_as(_pf32), pos.ctypes.data_as(_pi32), mass.size),
    )
    return Importance(mass=mass, cell_pos=pos)


# -- K rows by position and the question's query rows (patch 0004) ------------------------------


def get_keys(ctx: Any, layers: ArrayLike, positions: ArrayLike, seq_id: int = 0) -> NDArray[np.float32]:
    """The K rows of ``seq_id`` at ``positions`` for model ``layers``, as the cache holds them (after RoPE), in F32.

    Returns [n_layers, n_pos, n_head_kv * head_dim]; rows of positions a layer's cache does not hold are NaN
    (e.g. outside a sliding window). Read them before ``seq_rm`` removes the cells: one call per eviction round.
    """
    lay = _i32_array(layers).reshape(-1)
    pos = _i32_array(positions).reshape(-1)
    raw = lib()
    width = _check("get_keys", raw.llama_kv_seq_get_keys(ctx, seq_id, lay.ctypes.data_as(_pi32), len(lay),
                                                         pos.ctypes.data_as(_pi32), len(pos), None, 0))
    out = np.empty((len(lay), len(pos), width), dtype=np.float32)
    if out.size:
        _check("get_keys", raw.llama_kv_seq_get_keys(ctx, seq_id, lay.ctypes.data_as(_pi32), len(lay),
                                                     pos.ctypes.data_as(_pi32), len(pos),
                                                     out.ctypes.data_as(_pf32), out.size))
    return out


# -- every layer's K/V rows by position, kept and put back (patch 0007) -----------------------------


def rows_size(ctx: Any, seq_id: int = 0) -> int:
    """The bytes of one cell's K/V row over all layers; raises :class:`PatchError` where the memory cannot give
    them (iSWA, recurrent or hybrid memory; shared, M-RoPE or PLE cells)."""
    return _check("rows_size", int(lib().llama_kv_seq_rows_size(ctx, seq_id)))


def get_rows(ctx: Any, positions: ArrayLike, seq_id: int = 0) -> NDArray[np.uint8]:
    """Every layer's K and V bytes of the cells of ``seq_id`` at ``positions``, as the cache holds them:
    [n_pos, rows_size]. Each position must be in the cache: read them before ``seq_rm``."""
    pos = _i32_array(positions).reshape(-1)
    out = np.empty((len(pos), rows_size(ctx, seq_id)), dtype=np.uint8)
    if len(pos):
        _check("get_rows", lib().llama_kv_seq_get_rows(ctx, seq_id, pos.ctypes.data_as(_pi32), len(pos),
                                                        out.ctypes.data_as(_p), out.nbytes))
    return out


def put_rows(ctx: Any, positions: ArrayLike, rows: NDArray[np.uint8], seq_id: int = 0) -> None:
    """Put rows read by :func:`get_rows` back at ``positions`` (new to the sequence), in empty cells with bias 0.
    Nothing changes when it fails."""
    pos = _i32_array(positions).reshape(-1)
    data = np.ascontiguousarray(rows, dtype=np.uint8)
    if len(pos):
        _check("put_rows", lib().llama_kv_seq_put_rows(ctx, seq_id, pos.ctypes.data_as(_pi32), len(pos),
                                                        data.ctypes.data_as(_p), data.nbytes))


@dataclass(frozen=True)
class Queries:
    """The last ubatch's query rows for the listed layers, with the log-sum-exp of their attention logits."""

    layers: NDArray[np.int32]
    """[n_layers] model layers, ascending."""
    kq_scale: NDArray[np.float32]
    """[n_layers] the scale of q.k in the logit (1/sqrt(head_dim) for most models; 1 where q is pre-scaled)."""
    q: NDArray[np.float32]
    """[n_layers, n_rows, n_head, head_dim] query rows as they enter the attention (after RoPE); row -1 = last token."""
    lse: NDArray[np.float32]
    """[n_layers, n_rows, n_head] log sum_i exp(kq_scale q.k_i + bias_i) over the cells the row saw (its softmax)."""


def set_attn_queries(ctx: Any, layers: ArrayLike | None, n_window: int = 32) -> None:
    """Report the query rows of ``layers`` for the last ``n_window`` tokens of each ubatch (None or [] = off).

    Turns flash attention off with a warning if the context had it; refused for recurrent and hybrid
    models and ALiBi models. Costs nothing while off.
    """
    lay = _i32_array([] if layers is None else layers).reshape(-1)
    if len(lay) and not 1 <= n_window <= MAX_QUERY_WINDOW:
        raise ValueError(f"n_window must be in [1, {MAX_QUERY_WINDOW}], got {n_window}")
    _check("set_attn_queries", lib().llama_set_attn_queries(ctx, lay.ctypes.data_as(_pi32), len(lay), int(n_window)))


def get_attn_queries(ctx: Any) -> Queries:
    """The query rows and normalisers of the last ubatch; raises :class:`PatchError` if none exist."""
    raw = lib()
    dims = [ctypes.c_int32() for _ in range(4)]
    _check("get_attn_queries", raw.llama_get_attn_queries_dims(ctx, *(ctypes.byref(d) for d in dims)))
    n_layers, n_rows, n_head, head_dim = (int(d.value) for d in dims)
    layers = np.empty(n_layers, dtype=np.int32)
    scale = np.empty(n_layers, dtype=np.float32)
    q = np.empty((n_layers, n_rows, n_head, head_dim), dtype=np.float32)
    lse = np.empty((n_layers, n_rows, n_head), dtype=np.float32)
    _check("get_attn_queries", raw.llama_get_attn_queries(ctx, layers.ctypes.data_as(_pi32),
                                                          scale.ctypes.data_as(_pf32), q.ctypes.data_as(_pf32),
                                                          lse.ctypes.data_as(_pf32), q.size))
    return Queries(layers=layers, kq_scale=scale, q=q, lse=lse)
