"""Phase 1 of the two-phase design: a compact store of one conversation's evicted keys, and its scoring.

The certificate sums over the kept cells, so it cannot see a needed cell the Poisson sample dropped.
The sketch keeps, for every evicted position, a quantised copy of its K rows for a few chosen layers
(int8 or int4 with a half-precision scale per row and KV head, or plain F32), the position and the
message it belongs to. Scoring puts the question's query rows (``native.patched.get_attn_queries``)
against it on the scale of the graph's own softmax over the kept cells:

    e_l(r, h, i) = exp(kq_scale_l * q_l(r, h) . k_l,i(h // (n_head / n_kv_head)) - lse_l(r, h))

is cell i's estimated weight in row r, head h of layer l, in units where the kept cells' weights sum
to 1 (with Poisson biases, the kept softmax is itself the Horvitz-Thompson estimate of the whole
history's, so e is then directly i's estimated share of the full attention; ``renormalise=True``
divides by 1 + sum_i e instead, for a kept part that does not stand for the evicted one).
docs/POISSON.md ("Phase 1") has the maths, the storage sizes and the error bounds.

The quantisation and scoring run in ``libcertchat_core.so`` (C++, one call per eviction round and one per
question for all layers, split over ``threads``); :func:`reference_score`, :func:`reference_quantize` and
:func:`channel_scales` are the numpy references the tests hold it to.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from native import runtime
from native.rope import RopeSpec, rotate

BITS = (32, 8, 4)
"""Storage widths: F32 rows (exact), int8, int4 (both with a half scale per row and KV head)."""

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "certchat_core_last_error": (ctypes.c_char_p, []),
    "certchat_sketch_quantize": (ctypes.c_int, [_I64, _I64, _I64, _I32, _P, _P, _P, _P]),
    "certchat_sketch_dequantize": (ctypes.c_int, [_I64, _I64, _I64, _I32, _P, _P, _P, _P]),
    "certchat_sketch_score": (ctypes.c_int, [_I64, _I64, _I64, _I32, _P, _P, _P, _I64, _I64, _P, _P, ctypes.c_float,
                                             _I32, _P]),
    "certchat_sketch_channel_scales": (ctypes.c_int, [_I64, _I64, _I64, _P, _P]),
    "certchat_sketch_quantize_layers": (ctypes.c_int, [_I64, _I64, _I64, _I64, _I32, _P, _P, _P, _P, _I64, _I32]),
    "certchat_sketch_score_layers": (ctypes.c_int, [_I64, _I64, _I64, _I64, _I32, _P, _P, _P, _I64, _I64, _I64, _P, _P,
                                                    _P, _I32, _I32, _P]),
}


class SketchError(ValueError):
    """Bad input to the sketch (the message names the argument and what to do)."""


@cache
def _lib() -> ctypes.CDLL:
    lib = runtime.load_core(False)
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _check(rc: int) -> None:
    if rc != 0:
        message = (_lib().certchat_core_last_error() or b"").decode() or f"status {rc}"
        raise SketchError(message)


def code_bytes(n_kv_head: int, head_dim: int, bits: int) -> int:
    """Bytes of one layer's codes for one token."""
    return n_kv_head * head_dim * bits // 8


def bytes_per_token(n_layers: int, n_kv_head: int, head_dim: int, bits: int) -> int:
    """Storage per evicted token: codes and half scales of every kept layer, plus position and message (int32 each)."""
    scales = 2 * n_kv_head if bits < 32 else 0
    return n_layers * (code_bytes(n_kv_head, head_dim, bits) + scales) + 8


def _channel(channel_scale: ArrayLike | None, width: int) -> NDArray[np.float32] | None:
    if channel_scale is None:
        return None
    c = np.ascontiguousarray(channel_scale, dtype=np.float32)
    if c.shape != (width,):
        raise SketchError(f"channel_scale must have shape ({width},), got {c.shape}")
    return c


def channel_scales(keys: ArrayLike) -> NDArray[np.float32]:
    """Per-channel max |k| over rows [n, width] (absent rows ignored; 1 where a channel is all zero or unseen).

    The numpy reference of :func:`channel_scales_layers`, which the store uses."""
    k = np.asarray(keys, dtype=np.float32)
    with np.errstate(all="ignore"):
        c = np.nanmax(np.abs(k), axis=0) if len(k) and not np.isnan(k).all() else np.ones(k.shape[1], np.float32)
    c = np.where(np.isfinite(c) & (c > 0), c, 1.0)
    return np.ascontiguousarray(c, dtype=np.float32)


def channel_scales_layers(keys: NDArray[np.float32]) -> NDArray[np.float32]:
    """:func:`channel_scales` of each layer of keys [n_layers, n, width] at once (C++) -> [n_layers, width]."""
    k = np.ascontiguousarray(keys, dtype=np.float32)
    if k.ndim != 3:
        raise SketchError(f"keys must be [n_layers, n, width], got {k.shape}")
    out = np.empty((k.shape[0], k.shape[2]), dtype=np.float32)
    _check(_lib().certchat_sketch_channel_scales(k.shape[0], k.shape[1], k.shape[2], k.ctypes.data, out.ctypes.data))
    return out


def quantize(keys: ArrayLike, n_kv_head: int, bits: int,
             channel_scale: ArrayLike | None = None) -> tuple[NDArray[np.uint8], NDArray[np.uint16]]:
    """Rows [n, n_kv_head * head_dim] (F32, NaN rows = absent) -> (codes [n, code bytes], half scale bits
    [n, n_kv_head]).

    With ``channel_scale`` [width] the rows quantised are k / channel_scale (pass the same to dequantize/score).
    """
    k = np.ascontiguousarray(keys, dtype=np.float32)
    if k.ndim != 2 or k.shape[1] % n_kv_head:
        raise SketchError(f"keys must be [n, n_kv_head * head_dim] with n_kv_head = {n_kv_head}, got {k.shape}")
    head_dim = k.shape[1] // n_kv_head
    c = _channel(channel_scale, k.shape[1])
    codes = np.zeros((k.shape[0], code_bytes(n_kv_head, head_dim, bits)), dtype=np.uint8)
    scales = np.zeros((k.shape[0], n_kv_head), dtype=np.uint16)
    _check(_lib().certchat_sketch_quantize(k.shape[0], n_kv_head, head_dim, bits, None if c is None else c.ctypes.data,
                                           k.ctypes.data, codes.ctypes.data, scales.ctypes.data))
    return codes, scales


def dequantize(codes: NDArray[np.uint8], scales: NDArray[np.uint16], n_kv_head: int, head_dim: int,
               bits: int, channel_scale: ArrayLike | None = None) -> NDArray[np.float32]:
    """The F32 rows the scoring sees [n, n_kv_head * head_dim] (NaN for absent rows)."""
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    s = np.ascontiguousarray(scales, dtype=np.uint16)
    ch = _channel(channel_scale, n_kv_head * head_dim)
    out = np.empty((c.shape[0], n_kv_head * head_dim), dtype=np.float32)
    _check(_lib().certchat_sketch_dequantize(c.shape[0], n_kv_head, head_dim, bits,
                                             None if ch is None else ch.ctypes.data,
                                             c.ctypes.data, s.ctypes.data, out.ctypes.data))
    return out


def score_layer(codes: NDArray[np.uint8], scales: NDArray[np.uint16], n_kv_head: int, head_dim: int, bits: int,
                q: ArrayLike, lse: ArrayLike, kq_scale: float, renormalise: bool = False,
                channel_scale: ArrayLike | None = None, threads: int = 1) -> NDArray[np.float32]:
    """One layer: q [n_rows, n_head, head_dim], lse [n_rows, n_head] -> [n_head, n] mean over rows of e(r, h, i)."""
    ch = _channel(channel_scale, n_kv_head * head_dim)
    qq = np.asarray(q, dtype=np.float32)
    ll = np.asarray(lse, dtype=np.float32)
    if qq.ndim != 3 or qq.shape[2] != head_dim or ll.shape != qq.shape[:2]:
        raise SketchError(f"q must be [n_rows, n_head, {head_dim}] and lse [n_rows, n_head], "
                          f"got {qq.shape}, {ll.shape}")
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    return score_layers(c[None], np.ascontiguousarray(scales, dtype=np.uint16)[None], c.shape[0], n_kv_head, head_dim,
                        bits, qq[None], ll[None], np.asarray([kq_scale], np.float32), renormalise,
                        None if ch is None else ch[None], threads)[0]


def score_layers(codes: NDArray[np.uint8], scales: NDArray[np.uint16], n: int, n_kv_head: int, head_dim: int,
                 bits: int, q: ArrayLike, lse: ArrayLike, kq_scale: ArrayLike, renormalise: bool = False,
                 channel_scale: ArrayLike | None = None, threads: int = 1) -> NDArray[np.float32]:
    """Several layers in one call, split over ``threads`` (0: all the hardware's): the first ``n`` tokens of codes
    [n_layers, ≥ n, code bytes] and scales [n_layers, ≥ n, n_kv_head] (each layer's rows contiguous, e.g. a store's
    buffers), q [n_layers, n_rows, n_head, head_dim], lse [n_layers, n_rows, n_head], kq_scale [n_layers], channel
    scales [n_layers, width] or None -> [n_layers, n_head, n], as :func:`score_layer` per layer."""
    qq = np.ascontiguousarray(q, dtype=np.float32)
    ll = np.ascontiguousarray(lse, dtype=np.float32)
    kq = np.ascontiguousarray(kq_scale, dtype=np.float32).reshape(-1)
    if qq.ndim != 4 or qq.shape[3] != head_dim or ll.shape != qq.shape[:3] or kq.shape != qq.shape[:1]:
        raise SketchError(f"q must be [n_layers, n_rows, n_head, {head_dim}], lse [n_layers, n_rows, n_head] and "
                          f"kq_scale [n_layers], got {qq.shape}, {ll.shape}, {kq.shape}")
    n_layers = qq.shape[0]
    width = n_kv_head * head_dim
    cb = code_bytes(n_kv_head, head_dim, bits)
    if (codes.dtype != np.uint8 or scales.dtype != np.uint16 or codes.ndim != 3 or scales.ndim != 3
            or codes.shape[0] != n_layers or scales.shape[:2] != codes.shape[:2] or codes.shape[2] != cb
            or scales.shape[2] != n_kv_head or codes.shape[1] < n or not codes.flags.c_contiguous
            or not scales.flags.c_contiguous):
        raise SketchError(f"codes and scales must be C-contiguous uint8 [{n_layers}, ≥{n}, {cb}] and uint16 "
                          f"[{n_layers}, ≥{n}, {n_kv_head}], got {codes.dtype} {codes.shape}, "
                          f"{scales.dtype} {scales.shape}")
    ch = None
    if channel_scale is not None:
        ch = np.ascontiguousarray(channel_scale, dtype=np.float32)
        if ch.shape != (n_layers, width):
            raise SketchError(f"channel_scale must have shape ({n_layers}, {width}), got {ch.shape}")
    out = np.empty((n_layers, qq.shape[2], n), dtype=np.float32)
    _check(_lib().certchat_sketch_score_layers(n_layers, n, n_kv_head, head_dim, bits,
                                               None if ch is None else ch.ctypes.data, codes.ctypes.data,
                                               scales.ctypes.data, codes.shape[1], qq.shape[1], qq.shape[2],
                                               qq.ctypes.data, ll.ctypes.data, kq.ctypes.data, int(bool(renormalise)),
                                               int(threads), out.ctypes.data))
    return out


# -- numpy references --------------------------------------------------------------------------


def reference_quantize(keys: ArrayLike, n_kv_head: int, bits: int,
                       channel_scale: ArrayLike | None = None) -> NDArray[np.float32]:
    """numpy's int8/int4 round trip of rows [n, n_kv_head * head_dim] (the same half scales and rounding)."""
    k = np.asarray(keys, dtype=np.float32)
    if bits == 32:
        return k.copy()
    ch = None if channel_scale is None else np.asarray(channel_scale, dtype=np.float32)
    if ch is not None:
        k = (k / ch).astype(np.float32)
    n, w = k.shape
    x = k.reshape(n, n_kv_head, w // n_kv_head)
    qmax = np.float32(127 if bits == 8 else 7)
    absent = np.isnan(k).any(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = (np.abs(np.nan_to_num(x)).max(axis=2) / qmax).astype(np.float16).astype(np.float32)
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        codes = np.clip(np.rint(np.nan_to_num(x) * inv[:, :, None]), -qmax, qmax)
    out = (codes * scale[:, :, None]).reshape(n, w).astype(np.float32)
    if ch is not None:
        out = (out * ch).astype(np.float32)
    out[absent] = np.nan
    return out


def reference_score(keys: ArrayLike, q: ArrayLike, lse: ArrayLike, kq_scale: float,
                    renormalise: bool = False) -> NDArray[np.float64]:
    """float64 scoring of one layer: keys [n, n_kv_head * head_dim], q [n_rows, n_head, d], lse [n_rows, n_head]
    -> [n_head, n]."""
    qq = np.asarray(q, dtype=np.float64)
    n_rows, n_head, d = qq.shape
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    n_kv_head = k.shape[1] // d
    kh = k.reshape(n, n_kv_head, d)
    present = np.asarray(~np.isnan(k).any(axis=1))
    kh = np.where(present[:, None, None], kh, 0.0)
    ll = np.asarray(lse, dtype=np.float64)
    out = np.zeros((n_head, n))
    for h in range(n_head):
        valid = [r for r in range(n_rows) if np.isfinite(ll[r, h]) and np.isfinite(qq[r, h]).all()]
        for r in valid:
            e = np.where(present, np.exp(kq_scale * (kh[:, h // (n_head // n_kv_head)] @ qq[r, h]) - ll[r, h]), 0.0)
            out[h] += e / (1.0 + e.sum()) if renormalise else e
        if valid:
            out[h] /= len(valid)
    return out


# -- the per-conversation store ----------------------------------------------------------------


@dataclass(frozen=True)
class SketchScore:
    """The question's estimated attention on every evicted token, per layer and query head."""

    layers: NDArray[np.int32]
    """[n_layers] model layers scored."""
    positions: NDArray[np.int32]
    """[n] evicted positions, in the order they were appended."""
    messages: NDArray[np.int32]
    """[n] the message index of each position."""
    per_head: NDArray[np.float32]
    """[n_layers, n_head, n] mean over the question's rows of each head's estimated weight on the token."""

    def per_position(self, heads: Sequence[int] | None = None) -> NDArray[np.float64]:
        """[n_layers, n]: summed over ``heads`` (all by default)."""
        sel = self.per_head if heads is None else self.per_head[:, list(heads), :]
        return sel.sum(axis=1, dtype=np.float64)

    def per_message(self, heads: Sequence[int] | None = None) -> tuple[NDArray[np.int32], NDArray[np.float64]]:
        """(message ids ascending [m], mass [n_layers, m]): per_position summed over each message's evicted tokens."""
        ids, inverse = np.unique(self.messages, return_inverse=True)
        pp = self.per_position(heads)
        m = len(ids)
        # one bincount over (layer, message) pairs
        flat = (inverse[None, :] + m * np.arange(len(self.layers))[:, None]).ravel()
        mass = np.bincount(flat, weights=pp.ravel(), minlength=m * len(self.layers)).reshape(len(self.layers), m)
        return ids.astype(np.int32), np.asarray(mass, dtype=np.float64)


@dataclass
class SketchTiming:
    """Where the sketch's time went since it was made (cumulative wall-clock milliseconds and counts)."""

    append_ms: float = 0.0
    """Quantisation and storing of eviction rounds (the keys' read from the cache is the engine's)."""
    append_rounds: int = 0
    append_tokens: int = 0
    score_ms: float = 0.0
    """Scoring the question's query rows against every stored token, all layers."""
    score_calls: int = 0


@dataclass(frozen=True)
class SketchRows:
    """Some positions' rows exactly as a sketch stores them (codes, scales, position, message), taken out with
    :meth:`EvictedKeySketch.take` to be put back unchanged with :meth:`EvictedKeySketch.put`."""

    codes: NDArray[np.uint8]
    """[n_layers, n, code bytes]"""
    scales: NDArray[np.uint16]
    """[n_layers, n, n_kv_head]"""
    positions: NDArray[np.int32]
    messages: NDArray[np.int32]
    lags: NDArray[np.int32] | None = None
    """How far the cache's positions moved down since each row's key was rotated (None: not at all)."""

    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    @property
    def lag_array(self) -> NDArray[np.int32]:
        return np.zeros(len(self.positions), np.int32) if self.lags is None else self.lags

    def split(self, positions: ArrayLike) -> tuple["SketchRows", "SketchRows"]:
        """(the rows of ``positions``, the rest)."""
        hit = np.isin(self.positions, np.asarray(positions, dtype=np.int32))
        return self._subset(hit), self._subset(~hit)

    def _subset(self, mask: NDArray[np.bool_]) -> "SketchRows":
        return SketchRows(self.codes[:, mask], self.scales[:, mask], self.positions[mask], self.messages[mask],
                          None if self.lags is None else self.lags[mask])

    def shifted(self, positions: NDArray[np.int32], delta: int) -> "SketchRows":
        """These rows at new ``positions``, their keys rotated ``delta`` positions further than the new ones say."""
        return SketchRows(self.codes, self.scales, np.asarray(positions, np.int32), self.messages,
                          (self.lag_array + delta).astype(np.int32))

    @staticmethod
    def join(a: "SketchRows | None", b: "SketchRows") -> "SketchRows":
        if a is None or not a.n_tokens:
            return b
        lags = None if a.lags is None and b.lags is None else np.concatenate([a.lag_array, b.lag_array])
        return SketchRows(np.concatenate([a.codes, b.codes], axis=1), np.concatenate([a.scales, b.scales], axis=1),
                          np.concatenate([a.positions, b.positions]), np.concatenate([a.messages, b.messages]), lags)


@dataclass
class EvictedKeySketch:
    """Quantised K rows of one conversation's evicted tokens for ``layers``; append per eviction round."""

    layers: tuple[int, ...]
    n_kv_head: int
    head_dim: int
    bits: int = 4
    channel_norm: bool = True
    """Quantise k / c with c the per-channel max |k| of the first round (per layer; kept until ``clear``)."""
    threads: int = 0
    """Threads for quantisation and scoring (the engine passes its own count; 0: all the hardware's)."""
    rope: RopeSpec | None = None
    """How the model rotates query rows, for scoring keys rotated before a frame shift (:meth:`shift`)."""
    timing: SketchTiming = field(default_factory=SketchTiming, repr=False)
    _channel: NDArray[np.float32] | None = field(default=None, repr=False)
    # Buffers with room to grow (doubling), so a round appends in place and scoring reads each layer's rows
    # where they lie: codes [n_layers, capacity, code bytes], scales [n_layers, capacity, n_kv_head].
    _codes: NDArray[np.uint8] | None = field(default=None, repr=False)
    _scales: NDArray[np.uint16] | None = field(default=None, repr=False)
    _positions: NDArray[np.int32] = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _messages: NDArray[np.int32] = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _lags: NDArray[np.int32] = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _n: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.layers = tuple(int(x) for x in self.layers)
        if self.bits not in BITS:
            raise SketchError(f"bits = {self.bits}: use one of {BITS}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise SketchError(f"layers {self.layers}: give at least one layer, each once")
        if self.n_kv_head < 1 or self.head_dim < 1 or (self.bits == 4 and self.head_dim % 2):
            raise SketchError(f"n_kv_head = {self.n_kv_head}, head_dim = {self.head_dim}: need positive sizes "
                              "(and an even head_dim for 4 bits)")

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def positions(self) -> NDArray[np.int32]:
        """[n] every stored position, in the order appended."""
        return self._positions[:self._n].copy()

    @property
    def messages(self) -> NDArray[np.int32]:
        """[n] the message index of each stored position."""
        return self._messages[:self._n].copy()

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(len(self.layers), self.n_kv_head, self.head_dim, self.bits)

    @property
    def nbytes(self) -> int:
        return self.n_tokens * self.bytes_per_token + self.overhead_bytes

    @property
    def channel_scale(self) -> NDArray[np.float32] | None:
        """[n_layers, width] the channel scales in use (None before the first append, or without channel_norm)."""
        return self._channel

    @property
    def overhead_bytes(self) -> int:
        """Per-store bytes besides the tokens: the channel scales (F32, one per layer and channel)."""
        return 0 if self._channel is None else int(self._channel.nbytes)

    def _reserve(self, n: int) -> None:
        capacity = 0 if self._codes is None else self._codes.shape[1]
        if n <= capacity:
            return
        capacity = max(n, 2 * capacity, 256)
        cb = code_bytes(self.n_kv_head, self.head_dim, self.bits)
        codes = np.empty((len(self.layers), capacity, cb), np.uint8)
        scales = np.empty((len(self.layers), capacity, self.n_kv_head), np.uint16)
        positions = np.empty(capacity, np.int32)
        messages = np.empty(capacity, np.int32)
        lags = np.zeros(capacity, np.int32)
        if self._codes is not None and self._scales is not None:
            codes[:, :self._n] = self._codes[:, :self._n]
            scales[:, :self._n] = self._scales[:, :self._n]
        positions[:self._n] = self._positions[:self._n]
        messages[:self._n] = self._messages[:self._n]
        lags[:self._n] = self._lags[:self._n]
        self._codes, self._scales, self._positions, self._messages = codes, scales, positions, messages
        self._lags = lags

    def append(self, positions: ArrayLike, messages: ArrayLike, keys: ArrayLike) -> None:
        """Add one eviction round: positions [n], message index per position [n], keys [n_layers, n, width].

        ``keys`` is ``native.patched.get_keys(ctx, sketch.layers, positions)``, read before ``seq_rm``.
        """
        start = time.perf_counter()
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        msg = np.ascontiguousarray(messages, dtype=np.int32).reshape(-1)
        k = np.ascontiguousarray(keys, dtype=np.float32)
        width = self.n_kv_head * self.head_dim
        if msg.shape != pos.shape or k.shape != (len(self.layers), len(pos), width):
            raise SketchError(f"append: positions {pos.shape}, messages {msg.shape} and keys {k.shape} must be "
                              f"[n], [n] and [{len(self.layers)}, n, {width}] (layers {self.layers})")
        if not len(pos):
            return
        if self._channel is None and self.channel_norm and self.bits < 32:
            self._channel = channel_scales_layers(k)
        n0, m = self._n, len(pos)
        self._reserve(n0 + m)
        assert self._codes is not None and self._scales is not None
        capacity = self._codes.shape[1]
        ch = self._channel
        # each layer's new rows go straight into the buffers at row n0 (layers capacity rows apart)
        _check(_lib().certchat_sketch_quantize_layers(
            len(self.layers), m, self.n_kv_head, self.head_dim, self.bits, None if ch is None else ch.ctypes.data,
            k.ctypes.data, self._codes[:, n0:].ctypes.data, self._scales[:, n0:].ctypes.data, capacity,
            int(self.threads)))
        self._positions[n0:n0 + m] = pos
        self._messages[n0:n0 + m] = msg
        self._lags[n0:n0 + m] = 0
        self._n = n0 + m
        self.timing.append_ms += (time.perf_counter() - start) * 1000.0
        self.timing.append_rounds += 1
        self.timing.append_tokens += m

    def _channel_of(self, li: int) -> NDArray[np.float32] | None:
        return None if self._channel is None else self._channel[li]

    def clear(self) -> None:
        """Forget everything (a full re-read put the history back in the cache; append again from there)."""
        self._channel = None
        self._codes = self._scales = None
        self._positions = np.empty(0, np.int32)
        self._messages = np.empty(0, np.int32)
        self._lags = np.empty(0, np.int32)
        self._n = 0

    def shift(self, positions: ArrayLike, delta: int) -> None:
        """The cache's positions moved down by ``delta``: every stored row now has the new position in
        ``positions`` (one per row, in stored order) and its key, rotated where it was evicted, lies ``delta``
        further than that (:meth:`score` rotates the question's rows to match)."""
        pos = np.asarray(positions, dtype=np.int32).reshape(-1)
        if pos.shape != (self._n,):
            raise SketchError(f"shift: {pos.shape[0]} positions for {self._n} stored rows")
        if self._n and delta and self.rope is None:
            raise SketchError("shift: this sketch does not know the model's RoPE and cannot follow a frame shift")
        self._positions[:self._n] = pos
        self._lags[:self._n] += int(delta)

    @property
    def lags(self) -> NDArray[np.int32]:
        """[n] how far the cache's positions moved since each stored key was rotated."""
        return self._lags[:self._n].copy()

    def drop(self, positions: ArrayLike) -> None:
        """Forget these positions (they are back in the cache, e.g. after a partial re-read)."""
        n = self._n
        keep = ~np.isin(self._positions[:n], np.asarray(positions, dtype=np.int32))
        if keep.all() or self._codes is None or self._scales is None:
            return
        m = int(keep.sum())
        self._codes[:, :m] = self._codes[:, :n][:, keep]
        self._scales[:, :m] = self._scales[:, :n][:, keep]
        self._positions[:m] = self._positions[:n][keep]
        self._messages[:m] = self._messages[:n][keep]
        self._lags[:m] = self._lags[:n][keep]
        self._n = m

    def take(self, positions: ArrayLike) -> SketchRows:
        """Forget these positions and return their rows as stored, for :meth:`put` to bring back unchanged."""
        n = self._n
        if self._codes is None or self._scales is None:
            cb = code_bytes(self.n_kv_head, self.head_dim, self.bits)
            return SketchRows(np.empty((len(self.layers), 0, cb), np.uint8),
                              np.empty((len(self.layers), 0, self.n_kv_head), np.uint16),
                              np.empty(0, np.int32), np.empty(0, np.int32))
        hit = np.isin(self._positions[:n], np.asarray(positions, dtype=np.int32))
        rows = SketchRows(self._codes[:, :n][:, hit].copy(), self._scales[:, :n][:, hit].copy(),
                          self._positions[:n][hit].copy(), self._messages[:n][hit].copy(), self._lags[:n][hit].copy())
        self.drop(rows.positions)
        return rows

    def put(self, rows: SketchRows) -> None:
        """Add rows :meth:`take` returned (quantised on this sketch's channel scales, which stay until ``clear``)."""
        m = rows.n_tokens
        if not m:
            return
        cb = code_bytes(self.n_kv_head, self.head_dim, self.bits)
        if rows.codes.shape != (len(self.layers), m, cb) or rows.scales.shape != (len(self.layers), m, self.n_kv_head):
            raise SketchError(f"put: rows of shape {rows.codes.shape} / {rows.scales.shape} are not this sketch's")
        n0 = self._n
        self._reserve(n0 + m)
        assert self._codes is not None and self._scales is not None
        self._codes[:, n0:n0 + m] = rows.codes
        self._scales[:, n0:n0 + m] = rows.scales
        self._positions[n0:n0 + m] = rows.positions
        self._messages[n0:n0 + m] = rows.messages
        self._lags[n0:n0 + m] = rows.lag_array
        self._n = n0 + m

    def rows(self) -> SketchRows:
        """Every stored row as it is stored (a copy), in the order appended: with :attr:`channel_scale`, all
        :meth:`from_rows` needs to rebuild this sketch exactly (a saved chat state)."""
        if self._codes is None or self._scales is None:
            return self.take(np.empty(0, np.int32))
        n = self._n
        return SketchRows(self._codes[:, :n].copy(), self._scales[:, :n].copy(), self._positions[:n].copy(),
                          self._messages[:n].copy(), self._lags[:n].copy())

    @classmethod
    def from_rows(cls, layers: Sequence[int], n_kv_head: int, head_dim: int, bits: int, channel_norm: bool,
                  channel: NDArray[np.float32] | None, rows: SketchRows, threads: int = 0,
                  rope: RopeSpec | None = None) -> "EvictedKeySketch":
        """A sketch holding ``rows`` on the channel scales ``channel`` (what :meth:`rows` and
        :attr:`channel_scale` returned), so it scores and appends as the one they came from."""
        sketch = cls(tuple(layers), n_kv_head, head_dim, bits, channel_norm=channel_norm, threads=threads, rope=rope)
        if channel is not None:
            width = n_kv_head * head_dim
            channel = np.ascontiguousarray(channel, dtype=np.float32)
            if channel.shape != (len(sketch.layers), width):
                raise SketchError(f"from_rows: channel scales of shape {channel.shape}, not "
                                  f"[{len(sketch.layers)}, {width}]")
            sketch._channel = channel
        sketch.put(rows)
        return sketch

    def keys(self) -> NDArray[np.float32]:
        """The stored rows as scoring sees them, [n_layers, n, width] F32."""
        n, width = self._n, self.n_kv_head * self.head_dim
        if self._codes is None or self._scales is None:
            return np.empty((len(self.layers), 0, width), np.float32)
        return np.stack([dequantize(self._codes[li, :n], self._scales[li, :n], self.n_kv_head, self.head_dim, self.bits,
                                    self._channel_of(li)) for li in range(len(self.layers))])

    def score(self, queries: Any, renormalise: bool = False) -> SketchScore:
        """Score against ``native.patched.get_attn_queries(ctx)`` (a ``Queries``: it must cover the sketch's layers)."""
        start = time.perf_counter()
        have = {int(x): i for i, x in enumerate(np.asarray(queries.layers))}
        missing = [x for x in self.layers if x not in have]
        if missing:
            raise SketchError(f"score: the queries lack layers {missing}; call set_attn_queries with the sketch's "
                              f"layers {list(self.layers)}")
        n = self._n
        idx = [have[x] for x in self.layers]
        q = np.asarray(queries.q)
        n_head = int(q.shape[2])
        pos, msg = self._positions[:n].copy(), self._messages[:n].copy()
        if self._codes is None or self._scales is None or n == 0:
            out = np.zeros((len(self.layers), n_head, n), dtype=np.float32)
        else:
            lags = self._lags[:n]
            out = np.empty((len(self.layers), n_head, n), dtype=np.float32)
            for lag in np.unique(lags):
                # a key rotated `lag` positions before the frame moved is scored at its true distance by the
                # question's rows rotated as far (RoPE depends on the difference of positions only); each row is
                # scored once, with its own lag's rows
                hit = lags == lag
                codes, scales, m = ((self._codes, self._scales, n) if hit.all() else
                                    (np.ascontiguousarray(self._codes[:, :n][:, hit]),
                                     np.ascontiguousarray(self._scales[:, :n][:, hit]), int(hit.sum())))
                rows = q[idx] if lag == 0 or self.rope is None else rotate(q[idx], self.head_dim, self.rope, int(lag))
                out[:, :, hit] = score_layers(codes, scales, m, self.n_kv_head, self.head_dim, self.bits, rows,
                                              np.asarray(queries.lse)[idx], np.asarray(queries.kq_scale)[idx],
                                              renormalise, self._channel, self.threads)
        self.timing.score_ms += (time.perf_counter() - start) * 1000.0
        self.timing.score_calls += 1
        return SketchScore(layers=np.asarray(self.layers, dtype=np.int32), positions=pos, messages=msg, per_head=out)
