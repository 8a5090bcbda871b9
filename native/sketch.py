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

The quantisation and scoring run in ``libcertchat_core.so`` (C++); :func:`reference_score` and
:func:`reference_quantize` are the numpy references the tests hold it to.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from native import runtime

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
    """Per-channel max |k| over rows [n, width] (absent rows ignored; 1 where a channel is all zero or unseen)."""
    k = np.asarray(keys, dtype=np.float32)
    with np.errstate(all="ignore"):
        c = np.nanmax(np.abs(k), axis=0) if len(k) and not np.isnan(k).all() else np.ones(k.shape[1], np.float32)
    c = np.where(np.isfinite(c) & (c > 0), c, 1.0)
    return np.ascontiguousarray(c, dtype=np.float32)


def quantize(keys: ArrayLike, n_kv_head: int, bits: int,
             channel_scale: ArrayLike | None = None) -> tuple[NDArray[np.uint8], NDArray[np.uint16]]:
    """Rows [n, n_kv_head * head_dim] (F32, NaN rows = absent) -> (codes [n, code bytes], half scale bits [n, n_kv_head]).

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
    _check(_lib().certchat_sketch_dequantize(c.shape[0], n_kv_head, head_dim, bits, None if ch is None else ch.ctypes.data,
                                             c.ctypes.data, s.ctypes.data, out.ctypes.data))
    return out


def score_layer(codes: NDArray[np.uint8], scales: NDArray[np.uint16], n_kv_head: int, head_dim: int, bits: int,
                q: ArrayLike, lse: ArrayLike, kq_scale: float, renormalise: bool = False,
                channel_scale: ArrayLike | None = None) -> NDArray[np.float32]:
    """One layer: q [n_rows, n_head, head_dim], lse [n_rows, n_head] -> [n_head, n] mean over rows of e(r, h, i)."""
    ch = _channel(channel_scale, n_kv_head * head_dim)
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    s = np.ascontiguousarray(scales, dtype=np.uint16)
    qq = np.ascontiguousarray(q, dtype=np.float32)
    ll = np.ascontiguousarray(lse, dtype=np.float32)
    if qq.ndim != 3 or qq.shape[2] != head_dim or ll.shape != qq.shape[:2]:
        raise SketchError(f"q must be [n_rows, n_head, {head_dim}] and lse [n_rows, n_head], got {qq.shape}, {ll.shape}")
    out = np.empty((qq.shape[1], c.shape[0]), dtype=np.float32)
    _check(_lib().certchat_sketch_score(c.shape[0], n_kv_head, head_dim, bits, None if ch is None else ch.ctypes.data,
                                        c.ctypes.data, s.ctypes.data,
                                        qq.shape[0], qq.shape[1], qq.ctypes.data, ll.ctypes.data, float(kq_scale),
                                        int(bool(renormalise)), out.ctypes.data))
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
    """float64 scoring of one layer: keys [n, n_kv_head * head_dim], q [n_rows, n_head, d], lse [n_rows, n_head] -> [n_head, n]."""
    qq = np.asarray(q, dtype=np.float64)
    n_rows, n_head, d = qq.shape
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    n_kv_head = k.shape[1] // d
    kh = k.reshape(n, n_kv_head, d)
    present = ~np.isnan(k).any(axis=1)
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
        mass = np.zeros((len(self.layers), len(ids)))
        pp = self.per_position(heads)
        for li in range(len(self.layers)):
            np.add.at(mass[li], inverse, pp[li])
        return ids.astype(np.int32), mass


@dataclass
class EvictedKeySketch:
    """Quantised K rows of one conversation's evicted tokens for ``layers``; append per eviction round."""

    layers: tuple[int, ...]
    n_kv_head: int
    head_dim: int
    bits: int = 4
    channel_norm: bool = True
    """Quantise k / c with c the per-channel max |k| of the first round (per layer; kept until ``clear``)."""
    _channel: NDArray[np.float32] | None = field(default=None, repr=False)
    _codes: list[NDArray[np.uint8]] = field(default_factory=list, repr=False)
    _scales: list[NDArray[np.uint16]] = field(default_factory=list, repr=False)
    _positions: list[NDArray[np.int32]] = field(default_factory=list, repr=False)
    _messages: list[NDArray[np.int32]] = field(default_factory=list, repr=False)

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
        return int(sum(len(p) for p in self._positions))

    @property
    def positions(self) -> NDArray[np.int32]:
        """[n] every stored position, in the order appended."""
        return self._packed()[2].copy()

    @property
    def messages(self) -> NDArray[np.int32]:
        """[n] the message index of each stored position."""
        return self._packed()[3].copy()

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

    def append(self, positions: ArrayLike, messages: ArrayLike, keys: ArrayLike) -> None:
        """Add one eviction round: positions [n], message index per position [n], keys [n_layers, n, width].

        ``keys`` is ``native.patched.get_keys(ctx, sketch.layers, positions)``, read before ``seq_rm``.
        """
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        msg = np.ascontiguousarray(messages, dtype=np.int32).reshape(-1)
        k = np.asarray(keys, dtype=np.float32)
        width = self.n_kv_head * self.head_dim
        if msg.shape != pos.shape or k.shape != (len(self.layers), len(pos), width):
            raise SketchError(f"append: positions {pos.shape}, messages {msg.shape} and keys {k.shape} must be [n], [n] "
                              f"and [{len(self.layers)}, n, {width}] (layers {self.layers})")
        if not len(pos):
            return
        if self._channel is None and self.channel_norm and self.bits < 32:
            self._channel = np.stack([channel_scales(k[li]) for li in range(len(self.layers))])
        codes = np.empty((len(self.layers), len(pos), code_bytes(self.n_kv_head, self.head_dim, self.bits)), np.uint8)
        scales = np.empty((len(self.layers), len(pos), self.n_kv_head), np.uint16)
        for li in range(len(self.layers)):
            codes[li], scales[li] = quantize(k[li], self.n_kv_head, self.bits, self._channel_of(li))
        self._codes.append(codes)
        self._scales.append(scales)
        self._positions.append(pos)
        self._messages.append(msg)

    def _channel_of(self, li: int) -> NDArray[np.float32] | None:
        return None if self._channel is None else self._channel[li]

    @property
    def overhead_bytes(self) -> int:
        """Per-store bytes besides the tokens: the channel scales (F32, one per layer and channel)."""
        return 0 if self._channel is None else int(self._channel.nbytes)

    def clear(self) -> None:
        """Forget everything (a full re-read put the history back in the cache; append again from there)."""
        self._channel = None
        self._codes.clear()
        self._scales.clear()
        self._positions.clear()
        self._messages.clear()

    def drop(self, positions: ArrayLike) -> None:
        """Forget these positions (they are back in the cache, e.g. after a partial re-read)."""
        gone = np.asarray(positions, dtype=np.int32)
        for i, pos in enumerate(self._positions):
            keep = ~np.isin(pos, gone)
            if not keep.all():
                self._positions[i] = pos[keep]
                self._messages[i] = self._messages[i][keep]
                self._codes[i] = self._codes[i][:, keep]
                self._scales[i] = self._scales[i][:, keep]

    def _packed(self) -> tuple[NDArray[np.uint8], NDArray[np.uint16], NDArray[np.int32], NDArray[np.int32]]:
        if len(self._positions) > 1:
            # one array per store, so scoring never concatenates twice
            self._codes = [np.concatenate(self._codes, axis=1)]
            self._scales = [np.concatenate(self._scales, axis=1)]
            self._positions = [np.concatenate(self._positions)]
            self._messages = [np.concatenate(self._messages)]
        if not self._positions:
            cb = code_bytes(self.n_kv_head, self.head_dim, self.bits)
            return (np.empty((len(self.layers), 0, cb), np.uint8), np.empty((len(self.layers), 0, self.n_kv_head), np.uint16),
                    np.empty(0, np.int32), np.empty(0, np.int32))
        return self._codes[0], self._scales[0], self._positions[0], self._messages[0]

    def keys(self) -> NDArray[np.float32]:
        """The stored rows as scoring sees them, [n_layers, n, width] F32."""
        codes, scales, _, _ = self._packed()
        return np.stack([dequantize(codes[li], scales[li], self.n_kv_head, self.head_dim, self.bits, self._channel_of(li))
                         for li in range(len(self.layers))]) if len(self.layers) else np.empty((0, 0, 0), np.float32)

    def score(self, queries: Any, renormalise: bool = False) -> SketchScore:
        """Score against ``native.patched.get_attn_queries(ctx)`` (a ``Queries``: it must cover the sketch's layers)."""
        codes, scales, pos, msg = self._packed()
        have = {int(x): i for i, x in enumerate(np.asarray(queries.layers))}
        missing = [x for x in self.layers if x not in have]
        if missing:
            raise SketchError(f"score: the queries lack layers {missing}; call set_attn_queries with the sketch's layers "
                              f"{list(self.layers)}")
        n_head = int(queries.q.shape[2])
        out = np.zeros((len(self.layers), n_head, len(pos)), dtype=np.float32)
        for li, il in enumerate(self.layers):
            qi = have[il]
            out[li] = score_layer(codes[li], scales[li], self.n_kv_head, self.head_dim, self.bits, queries.q[qi],
                                  queries.lse[qi], float(queries.kq_scale[qi]), renormalise, self._channel_of(li))
        return SketchScore(layers=np.asarray(self.layers, dtype=np.int32), positions=pos.copy(), messages=msg.copy(),
                           per_head=out)
