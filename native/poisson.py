"""The Poisson design core's Python API: numpy arrays in and out, C++ (or CUDA) underneath.

One eviction round turns per-token importance scores into a keep set: protected tokens
stay, a deterministic top slice of the best-scoring units stays, the rest is sampled
with inclusion probabilities found by water-filling, every survivor carries a logit bias
of -(cumulative log pi), and the deterministic baselines (top-k, window, uniform) run
through the same call. On the estimator side: the Hajek estimate with its token- and
cluster-form variance, certificates at confidence 1 - delta, and the turn-level
aggregates a gate can be calibrated on. docs/POISSON.md has the maths and the
measurements.

The work happens in ``libcertchat_core.so`` (or ``libcertchat_core_cuda.so`` with
``device="cuda"``), located by :func:`native.runtime.load_core`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from native import runtime

Device = Literal["cpu", "cuda"]
Method = Literal["poisson", "topk", "window", "uniform"]

METHODS: tuple[str, ...] = ("poisson", "topk", "window", "uniform")
DEFAULT_PI_MIN = 1e-3
"""Lowest inclusion probability of an unprotected unit: bias <= -log(1e-3) ~ 6.9 per round."""

_OK = 0
_WARN_INFEASIBLE = 1
_ERR_NO_DEVICE = -3


class DesignError(ValueError):
    """Bad input to the design core (the message says which argument and why)."""


class BudgetInfeasible(DesignError):
    """The budget is below what the protected tokens plus pi_min on the rest need."""


class DeviceUnavailable(RuntimeError):
    """``device="cuda"`` was asked for but no CUDA library or device is usable."""


class Kind(IntEnum):
    """What decided a token's fate in a round (``EvictionPlan.kind``)."""

    SAMPLED = 0
    PROTECTED = 1
    TOP = 2
    CERTAIN = 3
    DROPPED = 4


class _Design(ctypes.Structure):
    _fields_ = [
        ("budget", ctypes.c_double),
        ("floor", ctypes.c_double),
        ("pi_min", ctypes.c_double),
        ("top_share", ctypes.c_double),
        ("seed", ctypes.c_uint64),
        ("round", ctypes.c_uint64),
        ("method", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_U64 = ctypes.c_uint64
_D = ctypes.c_double

_PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "certchat_core_version": (ctypes.c_char_p, []),
    "certchat_core_last_error": (ctypes.c_char_p, []),
    "certchat_uniforms": (ctypes.c_int, [_I64, _P, _U64, _U64, _P]),
    "certchat_draw": (ctypes.c_int, [_I64, _P, _P, _U64, _U64, _P]),
    "certchat_inclusion_probabilities": (ctypes.c_int, [_I64, _P, _P, _P, _I64, ctypes.POINTER(_Design), _P, _P]),
    "certchat_update_log_pi": (ctypes.c_int, [_I64, _P, _P, _P, _P, _P]),
    "certchat_plan_eviction": (
        ctypes.c_int,
        [_I64, _P, _P, _P, _I64, _P, _P, ctypes.POINTER(_Design), _P, _P, _P, _P, _P],
    ),
}
_CPU_ONLY: dict[str, tuple[type | None, list[type]]] = {
    "certchat_philox4x32_10": (None, [_P, _P, _P]),
    "certchat_size_budget": (ctypes.c_int, [_I64, _P, _P, _P, _I64, ctypes.POINTER(_Design), _D, _D, _P]),
    "certchat_hajek": (ctypes.c_int, [_I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P]),
    "certchat_certificate": (ctypes.c_int, [_I64, _P, _P, _D, _P, _P, _P, _P]),
    "certchat_f_quantile": (_D, [_D, _D, _D]),
    "certchat_normal_quantile": (_D, [_D]),
    "certchat_chi2_quantile": (_D, [_D, _D]),
}
_CUDA_ONLY: dict[str, tuple[type | None, list[type]]] = {
    "certchat_cuda_device_count": (ctypes.c_int, []),
    "certchat_cuda_last_timing": (ctypes.c_int, [_P, _P, _P]),
}


@cache
def _lib(device: Device = "cpu") -> ctypes.CDLL:
    if device not in ("cpu", "cuda"):
        raise DesignError(f"device must be 'cpu' or 'cuda', got {device!r}")
    cuda = device == "cuda"
    try:
        lib = runtime.load_core(cuda)
    except (runtime.NativeNotBuilt, OSError) as exc:
        if cuda:
            raise DeviceUnavailable(f"the CUDA design core is not available: {exc}") from exc
        raise
    protos = {**_PROTOTYPES, **(_CUDA_ONLY if cuda else _CPU_ONLY)}
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def cuda_available() -> bool:
    """True when the CUDA design core is built and sees at least one device."""
    try:
        return _lib("cuda").certchat_cuda_device_count() > 0
    except (DeviceUnavailable, runtime.NativeNotBuilt, OSError, AttributeError):
        return False


def core_version(device: Device = "cpu") -> str:
    """Version string of the loaded core library."""
    return _lib(device).certchat_core_version().decode()


def last_cuda_timing() -> dict[str, float]:
    """Host-to-device, kernel and device-to-host milliseconds of this thread's last CUDA call."""
    h2d, ker, d2h = _D(), _D(), _D()
    lib = _lib("cuda")
    _check(lib, lib.certchat_cuda_last_timing(ctypes.byref(h2d), ctypes.byref(ker), ctypes.byref(d2h)))
    return {"h2d_ms": h2d.value, "kernel_ms": ker.value, "d2h_ms": d2h.value}


def _check(lib: ctypes.CDLL, rc: int, *, strict: bool = True) -> bool:
    """Raise on an error status; return False for the infeasible-budget warning."""
    if rc == _OK:
        return True
    message = (lib.certchat_core_last_error() or b"").decode() or f"status {rc}"
    if rc == _WARN_INFEASIBLE:
        if strict:
            raise BudgetInfeasible(message)
        return False
    if rc == _ERR_NO_DEVICE:
        raise DeviceUnavailable(message)
    if rc in (-1, -2):
        raise DesignError(message)
    raise RuntimeError(f"certchat core: {message}")


def _ptr(a: NDArray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _as(a: ArrayLike, dtype: type, name: str, n: int | None = None) -> NDArray:
    arr = np.ascontiguousarray(a)
    if dtype is np.uint8 and arr.dtype == np.bool_:
        arr = arr.view(np.uint8)
    elif np.issubdtype(dtype, np.integer) and arr.size and not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype != np.bool_:
            raise DesignError(f"{name} must be an integer array, got {arr.dtype}")
    if arr.dtype != dtype:
        if np.issubdtype(dtype, np.integer) and arr.size:
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise DesignError(f"{name} does not fit {np.dtype(dtype).name}")
        arr = np.ascontiguousarray(arr, dtype=dtype)
    if n is not None and arr.shape != (n,):
        raise DesignError(f"{name} must have shape ({n},), got {arr.shape}")
    return arr


def _scores(scores: ArrayLike) -> NDArray[np.float64]:
    arr = _as(scores, np.float64, "scores")
    if arr.ndim != 1:
        raise DesignError(f"scores must be one-dimensional, got shape {arr.shape}")
    return arr


def _mask(mask: ArrayLike | None, n: int, name: str) -> NDArray[np.uint8] | None:
    if mask is None:
        return None
    arr = np.ascontiguousarray(mask)
    if arr.dtype != np.bool_:
        if not np.isin(arr, (0, 1)).all():
            raise DesignError(f"{name} must be boolean (0/1)")
        arr = arr.astype(np.bool_)
    return _as(arr, np.uint8, name, n)


def _units(unit_ids: ArrayLike | None, n: int) -> tuple[NDArray[np.int32] | None, int]:
    if unit_ids is None:
        return None, n
    ids = _as(unit_ids, np.int32, "unit_ids", n)
    if n and ids.min() < 0:
        raise DesignError("unit_ids must be >= 0")
    return ids, (int(ids.max()) + 1 if n else 0)


def _method_code(method: str) -> int:
    try:
        return METHODS.index(method)
    except ValueError:
        raise DesignError(f"method must be one of {', '.join(METHODS)}; got {method!r}") from None


def _check_key(seed: int, rnd: int) -> None:
    if not 0 <= int(seed) < 2**64 or not 0 <= int(rnd) < 2**64:
        raise DesignError(f"seed and round must be integers in [0, 2**64), got {seed}, {rnd}")


def _design(method: str, budget: float, floor: float, pi_min: float, top_share: float, seed: int, rnd: int) -> _Design:
    _check_key(seed, rnd)
    return _Design(
        float(budget), float(floor), float(pi_min), float(top_share), int(seed), int(rnd), _method_code(method), 0
    )


# ---------------------------------------------------------------- units


def make_units(
    n: int,
    page_size: int = 1,
    message_ids: ArrayLike | None = None,
    protected: ArrayLike | None = None,
) -> NDArray[np.int32]:
    """Unit id per token: pages of ``page_size`` contiguous tokens that never cross a message
    boundary (a change in ``message_ids``) nor the edge of the protected set.

    Ids are consecutive from 0 in token order; the last page of a run may be shorter.
    """
    if n < 0:
        raise DesignError(f"n must be >= 0, got {n}")
    if int(page_size) < 1:
        raise DesignError(f"page_size must be >= 1, got {page_size}")
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    run_start = np.zeros(n, dtype=bool)
    run_start[0] = True
    if message_ids is not None:
        msg = np.asarray(message_ids)
        if msg.shape != (n,):
            raise DesignError(f"message_ids must have shape ({n},), got {msg.shape}")
        run_start[1:] |= msg[1:] != msg[:-1]
    if protected is not None:
        prot = np.asarray(protected, dtype=bool)
        if prot.shape != (n,):
            raise DesignError(f"protected must have shape ({n},), got {prot.shape}")
        run_start[1:] |= prot[1:] != prot[:-1]
    run_id = np.cumsum(run_start) - 1
    starts = np.flatnonzero(run_start)
    offset = np.arange(n) - starts[run_id]
    page_start = run_start | (offset % int(page_size) == 0)
    return (np.cumsum(page_start) - 1).astype(np.int32)


def unit_sizes(unit_ids: ArrayLike) -> NDArray[np.int64]:
    """Number of tokens in each unit."""
    ids = np.asarray(unit_ids)
    return np.bincount(ids, minlength=int(ids.max()) + 1 if ids.size else 0)


# ---------------------------------------------------------------- design


def inclusion_probabilities(
    scores: ArrayLike,
    protected: ArrayLike | None,
    budget: float,
    floor: float = 0.0,
    *,
    pi_min: float = DEFAULT_PI_MIN,
    top_share: float = 0.0,
    unit_ids: ArrayLike | None = None,
    method: Method = "poisson",
    strict: bool = True,
    device: Device = "cpu",
) -> NDArray[np.float64]:
    """Inclusion probability of every token for an expected budget of ``budget`` tokens.

    Protected tokens get 1; with ``top_share`` > 0 that share of the remaining budget goes to
    the best-scoring units deterministically (pi = 1); the rest get
    ``clamp(c * (score + floor), pi_min, 1)`` with ``c`` water-filled so that the probabilities
    sum to ``budget``. With ``unit_ids`` all tokens of a unit share one probability (unit
    weight: summed floored score / sqrt(size)). ``budget >= n`` keeps everything.
    Raises :class:`BudgetInfeasible` when ``budget < protected + pi_min * rest`` unless
    ``strict=False``, which then returns the minimum design (pi_min on every other unit).
    """
    s = _scores(scores)
    n = s.size
    prot = _mask(protected, n, "protected")
    ids, n_units = _units(unit_ids, n)
    design = _design(method, budget, floor, pi_min, top_share, 0, 0)
    pi = np.empty(n, dtype=np.float64)
    lib = _lib(device)
    rc = lib.certchat_inclusion_probabilities(
        n, _ptr(s), _ptr(prot), _ptr(ids), n_units, ctypes.byref(design), _ptr(pi), None
    )
    _check(lib, rc, strict=strict)
    return pi


def uniforms(
    seed: int, round: int, positions: ArrayLike, *, device: Device = "cpu"  # noqa: A002
) -> NDArray[np.float64]:
    """The uniforms in [0, 1) the draws compare against, one per position (Philox4x32-10)."""
    pos = _as(positions, np.int64, "positions")
    if pos.ndim != 1:
        raise DesignError("positions must be one-dimensional")
    _check_key(seed, round)
    u = np.empty(pos.size, dtype=np.float64)
    lib = _lib(device)
    _check(lib, lib.certchat_uniforms(pos.size, _ptr(pos), int(seed), int(round), _ptr(u)))
    return u


def draw(
    pi: ArrayLike, seed: int, round: int, positions: ArrayLike, *, device: Device = "cpu"  # noqa: A002
) -> NDArray[np.bool_]:
    """Keep mask: token i is kept iff uniform(seed, round, positions[i]) < pi[i]."""
    p = _as(pi, np.float64, "pi")
    if p.ndim != 1:
        raise DesignError("pi must be one-dimensional")
    pos = _as(positions, np.int64, "positions", p.size)
    _check_key(seed, round)
    keep = np.empty(p.size, dtype=np.uint8)
    lib = _lib(device)
    _check(lib, lib.certchat_draw(p.size, _ptr(p), _ptr(pos), int(seed), int(round), _ptr(keep)))
    return keep.view(np.bool_)


def update_log_pi(
    pi: ArrayLike, keep: ArrayLike, prev_cum_logpi: ArrayLike | None = None, *, device: Device = "cpu"
) -> tuple[NDArray[np.float64], NDArray[np.float32]]:
    """Streaming bookkeeping of one round: (cumulative log pi, bias to write).

    Kept tokens: cum = prev + log pi, bias = -cum >= 0. Evicted tokens: cum = -inf, bias = 0.
    """
    p = _as(pi, np.float64, "pi")
    n = p.size
    k = _mask(keep, n, "keep")
    prev = None if prev_cum_logpi is None else _as(prev_cum_logpi, np.float64, "prev_cum_logpi", n)
    cum = np.empty(n, dtype=np.float64)
    bias = np.empty(n, dtype=np.float32)
    lib = _lib(device)
    _check(lib, lib.certchat_update_log_pi(n, _ptr(p), _ptr(k), _ptr(prev), _ptr(cum), _ptr(bias)))
    return cum, bias


@dataclass(frozen=True)
class EvictionPlan:
    """The outcome of one eviction round, one entry per token."""

    keep: NDArray[np.bool_]
    pi: NDArray[np.float64]
    """This round's inclusion probability (0/1 for the deterministic methods)."""
    kind: NDArray[np.uint8]
    """:class:`Kind` codes."""
    cum_logpi: NDArray[np.float64]
    """Cumulative log inclusion probability after this round (-inf for evicted tokens)."""
    bias: NDArray[np.float32]
    """Logit bias to write for each survivor, -cum_logpi (0 for evicted tokens)."""
    unit_ids: NDArray[np.int32] | None
    method: str
    budget: float
    feasible: bool
    """False when the budget could not be met (protected tokens plus pi_min on the rest exceed it)."""

    @property
    def expected_kept(self) -> float:
        """Expected number of kept tokens, sum of pi."""
        return float(self.pi.sum())

    @property
    def n_kept(self) -> int:
        return int(self.keep.sum())


def plan_eviction(
    scores: ArrayLike,
    protected: ArrayLike | None,
    budget: float,
    *,
    method: Method = "poisson",
    unit_ids: ArrayLike | None = None,
    page_size: int = 1,
    message_ids: ArrayLike | None = None,
    top_share: float = 0.0,
    floor: float = 0.0,
    pi_min: float = DEFAULT_PI_MIN,
    seed: int = 0,
    round: int = 0,  # noqa: A002
    positions: ArrayLike | None = None,
    prev_cum_logpi: ArrayLike | None = None,
    strict: bool = False,
    device: Device = "cpu",
) -> EvictionPlan:
    """One eviction round: probabilities, draws, cumulative log pi and the bias vector.

    ``method``: ``poisson`` (protected + top slice + water-filled Poisson tail), ``topk``
    (highest scores that fit), ``window`` (protected sinks + most recent units that fit) or
    ``uniform`` (equal probabilities, same expected budget). Units come from ``unit_ids``, or
    from ``page_size``/``message_ids`` via :func:`make_units` (pages never straddle a message
    or the protected edge). Each unit's draw is keyed by (seed, round, its smallest position);
    ``positions`` defaults to 0..n-1. With ``strict=False`` an infeasible budget yields the
    minimum design and ``feasible=False`` instead of an exception.
    """
    s = _scores(scores)
    n = s.size
    prot = _mask(protected, n, "protected")
    if unit_ids is None and (int(page_size) != 1 or message_ids is not None):
        unit_ids = make_units(n, page_size, message_ids, None if prot is None else prot.view(np.bool_))
    ids, n_units = _units(unit_ids, n)
    pos = np.arange(n, dtype=np.int64) if positions is None else _as(positions, np.int64, "positions", n)
    prev = None if prev_cum_logpi is None else _as(prev_cum_logpi, np.float64, "prev_cum_logpi", n)
    design = _design(method, budget, floor, pi_min, top_share, seed, round)
    keep = np.empty(n, dtype=np.uint8)
    pi = np.empty(n, dtype=np.float64)
    kind = np.empty(n, dtype=np.uint8)
    cum = np.empty(n, dtype=np.float64)
    bias = np.empty(n, dtype=np.float32)
    lib = _lib(device)
    rc = lib.certchat_plan_eviction(
        n, _ptr(s), _ptr(prot), _ptr(ids), n_units, _ptr(pos), _ptr(prev), ctypes.byref(design),
        _ptr(keep), _ptr(pi), _ptr(kind), _ptr(cum), _ptr(bias),
    )  # fmt: skip
    feasible = _check(lib, rc, strict=strict)
    return EvictionPlan(
        keep=keep.view(np.bool_), pi=pi, kind=kind, cum_logpi=cum, bias=bias, unit_ids=ids,
        method=method, budget=float(budget), feasible=feasible,
    )  # fmt: skip


def size_budget(
    scores: ArrayLike,
    protected: ArrayLike | None,
    capacity: float,
    *,
    z: float = 3.0,
    method: Method = "poisson",
    unit_ids: ArrayLike | None = None,
    top_share: float = 0.0,
    floor: float = 0.0,
    pi_min: float = DEFAULT_PI_MIN,
    strict: bool = True,
) -> float:
    """Largest expected budget B whose realized count fits ``capacity`` cells:
    B + z * sqrt(sum_u size_u^2 pi_u (1 - pi_u)) <= capacity (the sd of a Poisson design's count)."""
    s = _scores(scores)
    n = s.size
    prot = _mask(protected, n, "protected")
    ids, n_units = _units(unit_ids, n)
    design = _design(method, 0.0, floor, pi_min, top_share, 0, 0)
    out = _D()
    lib = _lib("cpu")
    rc = lib.certchat_size_budget(
        n, _ptr(s), _ptr(prot), _ptr(ids), n_units, ctypes.byref(design), float(capacity), float(z), ctypes.byref(out)
    )
    _check(lib, rc, strict=strict)
    return out.value


def philox4x32_10(counter: ArrayLike, key: ArrayLike) -> NDArray[np.uint32]:
    """The raw Philox4x32-10 block (Random123's definition), for known-answer checks."""
    ctr = _as(counter, np.uint32, "counter", 4)
    k = _as(key, np.uint32, "key", 2)
    out = np.empty(4, dtype=np.uint32)
    _lib("cpu").certchat_philox4x32_10(_ptr(ctr), _ptr(k), _ptr(out))
    return out


# ---------------------------------------------------------------- estimator and certificates


@dataclass(frozen=True)
class HajekEstimate:
    """Hajek estimate of one attention output per retained set (leading axis: draws)."""

    o_hat: NDArray[np.float64]
    v_hat_token: NDArray[np.float64]
    """sum_S (1 - pi_i) p_i^2 |v_i - o_hat|^2: the form the patched graph computes."""
    v_hat_cluster: NDArray[np.float64]
    """sum_units (1 - pi_u) |sum_{i in u} p_i (v_i - o_hat)|^2: the exact form for units."""
    dof: NDArray[np.float64]
    """Effective dimension h of the error (Satterthwaite), in [1, d]."""
    dof_var: NDArray[np.float64]
    """Degrees of freedom m of the variance estimate itself (>= 2; +inf with nothing sampled)."""


def hajek_estimate(
    logits: ArrayLike,
    values: ArrayLike,
    pi: ArrayLike,
    keep: ArrayLike,
    unit_ids: ArrayLike | None = None,
    *,
    with_dof: bool = True,
) -> HajekEstimate:
    """Hajek estimate o_hat = softmax_S(logit - log pi) @ V over each retained set and its
    variance estimates. ``keep`` is (n,) or (draws, n); outputs drop the draw axis for (n,).
    ``with_dof=False`` skips the O(|S| d^2) effective-dimension computation (dof is NaN)."""
    lg = _as(logits, np.float64, "logits")
    n = lg.size
    vals = np.ascontiguousarray(values, dtype=np.float64)
    if vals.ndim != 2 or vals.shape[0] != n:
        raise DesignError(f"values must have shape ({n}, d), got {vals.shape}")
    d = vals.shape[1]
    p = _as(pi, np.float64, "pi", n)
    k = np.ascontiguousarray(keep)
    single = k.ndim == 1
    k2 = k.reshape(1, -1) if single else k
    if k2.ndim != 2 or k2.shape[1] != n:
        raise DesignError(f"keep must have shape ({n},) or (draws, {n}), got {k.shape}")
    k2 = np.ascontiguousarray(k2.astype(np.bool_, copy=False)).view(np.uint8)
    ids, n_units = _units(unit_ids, n)
    r = k2.shape[0]
    o = np.empty((r, d))
    vt, vc, m = np.empty(r), np.empty(r), np.empty(r)
    dof = np.empty(r) if with_dof else None
    lib = _lib("cpu")
    rc = lib.certchat_hajek(
        n, d, r, _ptr(lg), _ptr(vals), _ptr(p), _ptr(k2), _ptr(ids), n_units,
        _ptr(o), _ptr(vt), _ptr(vc), _ptr(dof), _ptr(m),
    )  # fmt: skip
    _check(lib, rc)
    if dof is None:
        dof = np.full(r, np.nan)
    if single:
        return HajekEstimate(o[0], vt[0], vc[0], dof[0], m[0])
    return HajekEstimate(o, vt, vc, dof, m)


def normal_quantile(p: float) -> float:
    """Standard normal quantile."""
    if not 0.0 < p < 1.0:
        raise DesignError(f"p must be in (0, 1), got {p}")
    return float(_lib("cpu").certchat_normal_quantile(float(p)))


def chi2_quantile(p: float, dof: float) -> float:
    """Chi-square quantile with ``dof`` degrees of freedom."""
    if not 0.0 < p < 1.0 or not dof > 0:
        raise DesignError(f"need p in (0, 1) and dof > 0, got p={p}, dof={dof}")
    return float(_lib("cpu").certchat_chi2_quantile(float(p), float(dof)))


def f_quantile(p: float, dof1: float, dof2: float) -> float:
    """F-distribution quantile with (``dof1``, ``dof2``) degrees of freedom (dof2 may be inf)."""
    if not 0.0 < p < 1.0 or not dof1 > 0 or not dof2 > 0 or np.isinf(dof1):
        raise DesignError(f"need p in (0, 1) and dof > 0, got p={p}, dof=({dof1}, {dof2})")
    return float(_lib("cpu").certchat_f_quantile(float(p), float(dof1), float(dof2)))


def certificate(
    v_hat: ArrayLike,
    o_norm2: ArrayLike,
    delta: float,
    *,
    dof: ArrayLike | None = None,
    dof_var: ArrayLike | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(absolute, relative) certificates at confidence 1 - delta, shaped like ``v_hat``.

    absolute = k * sqrt(max(v_hat, 0)); relative = absolute / sqrt(o_norm2), where
      - k = z_{1-delta} without ``dof`` (DESIGN.md's form: over-covers a many-dimensional error);
      - k = sqrt(chi2_{h,1-delta} / h) with the error's effective dimension ``dof`` = h;
      - k = sqrt(F_{h,m;1-delta}) with also ``dof_var`` = m, the degrees of freedom of v_hat
        itself (small samples), which is the form that measured nominal coverage
        (docs/POISSON.md).
    ``o_norm2``, ``dof`` and ``dof_var`` broadcast to ``v_hat``'s shape.
    """
    v = np.asarray(v_hat, dtype=np.float64)
    shape = v.shape
    try:
        o2 = np.broadcast_to(np.asarray(o_norm2, dtype=np.float64), shape)
        dd = None if dof is None else np.broadcast_to(np.asarray(dof, dtype=np.float64), shape)
        mm = None if dof_var is None else np.broadcast_to(np.asarray(dof_var, dtype=np.float64), shape)
    except ValueError as exc:
        raise DesignError(f"o_norm2/dof/dof_var do not broadcast to v_hat's shape {shape}") from exc
    flat = [None if x is None else np.ascontiguousarray(x.reshape(-1)) for x in (v, o2, dd, mm)]
    a = np.empty(v.size)
    rel = np.empty(v.size)
    lib = _lib("cpu")
    rc = lib.certchat_certificate(
        v.size, _ptr(flat[0]), _ptr(flat[1]), float(delta), _ptr(flat[2]), _ptr(flat[3]), _ptr(a), _ptr(rel)
    )
    _check(lib, rc)
    return a.reshape(shape), rel.reshape(shape)


# ---------------------------------------------------------------- turn-level aggregates


def _cert_array(cert: ArrayLike, name: str) -> NDArray[np.float64]:
    c = np.asarray(cert, dtype=np.float64)
    if c.ndim != 3:
        raise DesignError(f"{name} must have shape (steps, layers, heads), got {c.shape}")
    if np.isnan(c).any():
        raise DesignError(f"{name} contains NaN")
    return c


def step_statistics(cert: ArrayLike, quantile: float = 0.95) -> dict[str, NDArray[np.float64]]:
    """Per-step aggregates of a (steps, layers, heads) certificate array, each of shape (steps,):
    ``layer_max_head_mean`` (max over layers of the mean over heads), ``q`` (the ``quantile``
    over layers x heads), ``mean`` and ``max``."""
    c = _cert_array(cert, "cert")
    if not 0.0 <= quantile <= 1.0:
        raise DesignError(f"quantile must be in [0, 1], got {quantile}")
    flat = c.reshape(c.shape[0], -1)
    return {
        "layer_max_head_mean": c.mean(axis=2).max(axis=1),
        "q": np.quantile(flat, quantile, axis=1),
        "mean": flat.mean(axis=1),
        "max": flat.max(axis=1),
    }


def window_statistics(cert: ArrayLike, quantile: float = 0.95) -> dict[str, float]:
    """Aggregates of one window of steps (the question's last rows, or the answer steps):
    pooled over steps — ``layer_max_head_mean`` (max over layers of the mean over steps and
    heads), ``q`` (quantile over steps x layers x heads), ``mean``, ``max`` — and running
    maxima over steps of the per-step statistics, ``step_max_layer_max_head_mean`` and
    ``step_max_q``."""
    c = _cert_array(cert, "cert")
    if c.shape[0] == 0:
        raise DesignError("the window has no steps")
    per_step = step_statistics(c, quantile)
    return {
        "layer_max_head_mean": float(c.mean(axis=(0, 2)).max()),
        "q": float(np.quantile(c, quantile)),
        "mean": float(c.mean()),
        "max": float(c.max()),
        "step_max_layer_max_head_mean": float(per_step["layer_max_head_mean"].max()),
        "step_max_q": float(per_step["q"].max()),
    }


def turn_statistics(
    question: ArrayLike | None = None,
    answer: ArrayLike | None = None,
    quantile: float = 0.95,
) -> dict[str, float]:
    """Every candidate gate statistic of a turn, keyed ``question.<stat>`` / ``answer.<stat>``
    (see :func:`window_statistics`; ``q`` is the ``quantile``). Windows left out are skipped."""
    out: dict[str, float] = {}
    windows: Mapping[str, ArrayLike | None] = {"question": question, "answer": answer}
    for label, cert in windows.items():
        if cert is None:
            continue
        for key, value in window_statistics(cert, quantile).items():
            out[f"{label}.{key}"] = value
    return out


# ---------------------------------------------------------------- the page-form (cluster) variance, multi-round


@dataclass(frozen=True)
class Stages:
    """The design a set of kept cells went through, one row per eviction round, cells in cache order.

    ``cluster[r, i]``: the cells drawn as one unit in round r *and in every earlier round* share an id (ids
    of a round need only be distinct between clusters; rounds refine each other). ``pi[r, i]``: the
    inclusion probability of cell i's unit in round r (1 where the cell was protected, in the top slice,
    or not yet in the cache). The product over rounds is the cell's cumulative π (the −log π bias)."""

    cluster: NDArray[np.int64]
    pi: NDArray[np.float64]

    @classmethod
    def from_rounds(cls, rounds: list[tuple[NDArray[np.int64], NDArray[np.float64]]]) -> "Stages":
        """From per-round (unit id, π) of each cell (unit id −1 and π 1 where the cell missed the round): the
        stage-r cluster is the tuple of unit ids of rounds 0…r."""
        if not rounds:
            return cls(np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0)))
        n = len(rounds[0][0])
        cluster = np.empty((len(rounds), n), dtype=np.int64)
        key = np.zeros(n, dtype=np.int64)
        for r, (units, _) in enumerate(rounds):
            # refine the previous stage's clusters by this round's units (renumbered densely)
            pairs = np.stack([key, np.asarray(units, dtype=np.int64)], axis=1)
            _, key = np.unique(pairs, axis=0, return_inverse=True)
            key = key.reshape(-1).astype(np.int64)
            cluster[r] = key
        pi = np.stack([np.asarray(p, dtype=np.float64) for _, p in rounds])
        return cls(cluster, pi)

    @classmethod
    def single(cls, unit_ids: ArrayLike, pi: ArrayLike) -> "Stages":
        """One round (the one-shot protocol): the units as drawn, their π."""
        return cls(np.asarray(unit_ids, dtype=np.int64)[None, :], np.asarray(pi, dtype=np.float64)[None, :])


def page_variance(weights: ArrayLike, values: ArrayLike, o_hat: ArrayLike, stages: Stages) -> NDArray[np.float64]:
    """Linearised design variance of the Hájek attention output when whole pages are drawn, over rounds.

    The numpy reference of the page (cluster) form. ``weights`` (m, n): the attention weights the graph
    computed over the kept cells (bias included, summing to 1 per row); ``values`` (n, d); ``o_hat`` (m, d)
    the outputs. With z_i = p_i (v_i − ô) (the linearised residual, already divided by the cell's cumulative
    π through the bias) and the rounds of ``stages``:

        V̂ = Σ_r Σ_{clusters c of stage r} (Π_{r'<r} π_{r'}(c)) (1 − π_r(c)) ‖Σ_{i∈c} z_i‖².

    This is the multi-stage Poisson variance estimator (each round samples the survivors of the previous
    one): a page that stays whole contributes (1 − Π_r π_r) ‖Σ z‖², the one-round cluster form with the
    cumulative π; a page later split into smaller units adds the new units' own terms. Protected and
    top-slice units (π = 1) add nothing (take-all strata). With one round and single-cell units it is the
    token form Σ (1 − π_i) ‖z_i‖²."""
    p = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    v = np.asarray(values, dtype=np.float64)
    o = np.atleast_2d(np.asarray(o_hat, dtype=np.float64))
    m, n = p.shape
    if v.shape[0] != n or o.shape != (m, v.shape[1]):
        raise DesignError(f"weights {p.shape}, values {v.shape} and o_hat {o.shape} do not fit")
    cl, pis = np.asarray(stages.cluster), np.asarray(stages.pi, dtype=np.float64)
    if cl.shape != pis.shape or (cl.size and cl.shape[1] != n):
        raise DesignError(f"stages of shape {cl.shape} / {pis.shape} for {n} cells")
    out = np.zeros(m)
    if cl.size == 0:
        return out
    z = p[:, :, None] * (v[None, :, :] - o[:, None, :])  # (m, n, d)
    # the last stage refines every earlier one: sum z over its clusters once, then coarser stages sum those
    order = np.lexsort(cl[::-1])  # cells grouped by cluster at every stage (a no-op for cache order)
    fine = cl[:, order]
    change = np.zeros(n, dtype=bool)
    change[0] = True
    change[1:] = (fine[:, 1:] != fine[:, :-1]).any(axis=0)
    bounds = np.flatnonzero(change)
    sums_fine = np.add.reduceat(z[:, order], bounds, axis=1)  # (m, finest clusters, d)
    carried = np.ones(n)  # Π_{r'<r} π_{r'} of each cell's cluster
    for r in range(cl.shape[0]):
        w = (carried * (1.0 - pis[r]))[order][bounds]  # one value per finest cluster (its cells share it)
        if np.any(w > 0):
            ids = fine[r, bounds]
            starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
            sums = np.add.reduceat(sums_fine, starts, axis=1)
            out += np.einsum("c,mcd->m", w[starts], sums * sums)
        carried = carried * pis[r]
    return out
