"""The in-graph attention certificate and importance of the llama.cpp patch, checked against numpy
computed from captured tensors (attention weights, V cache, attention output) with holes, biases and
causal masking in the batch; the on/off switch; refusals.

Real patched library and models (SmolLM2-135M, Qwen2.5-Coder-0.5B for grouped-query attention).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import numpy as np
import patch_support as ps
import pytest

from native import patched


@pytest.fixture(scope="module")
def smol(small_model: Path) -> Any:
    return ps.load_model(small_model)


def _capture(layers: list[int]) -> ps.Capture:
    def kqv(t: int) -> tuple[np.ndarray, np.ndarray]:
        product = ps.GgmlTensor.from_address(t).view_src or t
        return ps.read_tensor(t), ps.read_tensor(ps.src(product, 0))  # attention output, V view

    reads: dict[str, Any] = {}
    for il in layers:
        reads[f"kq_soft_max-{il}"] = ps.read_tensor
        reads[f"kqv-{il}"] = kqv
    return ps.Capture(reads=reads)


def _reference(cap: ps.Capture, il: int, cell_pos: np.ndarray, bias: dict[int, float], n_rows: int) -> tuple[np.ndarray, ...]:
    """numpy's V_hat, |o|^2 [n_head, n_rows] and importance [n_kv] from the captured tensors."""
    p_all = cap.values[f"kq_soft_max-{il}"]  # [1, n_head, n_tokens, n_kv]
    out, v = cap.values[f"kqv-{il}"]  # [1, n_head, n_tokens, d], [1, n_head_kv, d, n_kv]
    n_head, n_tok, n_kv = p_all.shape[1:]
    n_head_kv = v.shape[1]
    b = np.array([bias.get(int(q), 0.0) if q >= 0 else 0.0 for q in cell_pos[:n_kv]])
    one_minus_pi = np.where(b > 0, 1.0 - np.exp(-b), 0.0)
    v_hat = np.zeros((n_head, n_rows))
    o_norm2 = np.zeros((n_head, n_rows))
    imp = np.zeros(n_kv)
    for h in range(n_head):
        vh = v[0, h // (n_head // n_head_kv)].astype(np.float64)  # [d, n_kv]
        for r in range(n_rows):
            t = n_tok - n_rows + r
            p = p_all[0, h, t].astype(np.float64)
            o = out[0, h, t].astype(np.float64)
            v_hat[h, r] = np.sum(one_minus_pi * p * p * np.sum((vh - o[:, None]) ** 2, axis=0))
            o_norm2[h, r] = o @ o
            imp += p
    return v_hat, o_norm2, imp


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _scene(d: ps.Driver, n: int, seed: int) -> dict[int, float]:
    """Prefill n tokens, punch 150 holes, give a Hajek bias to 190 survivors; returns {pos: bias}."""
    toks = ps.tokens(n, seed=seed)
    d.decode(toks, 0)
    rng = np.random.default_rng(seed + 1)
    gone = set(rng.choice(np.arange(4, n - 10), size=150, replace=False).tolist())
    d.evict(sorted(gone))
    kept = [p for p in range(n) if p not in gone]
    bias = {p: float(rng.uniform(0.05, 3.0)) for p in kept[10:200]}
    patched.set_bias_pos(d.mem, 0, list(bias), list(bias.values()))
    return bias


@pytest.mark.parametrize(
    ("n_new", "window", "expect_rows"),
    [(1, 8, 1), (20, 8, 8), pytest.param(8, 8, 8, marks=pytest.mark.slow)],
    ids=["decode-row", "prefill-window-of-a-batch", "window-is-the-whole-batch"],
)
def test_certificate_and_importance_match_numpy(smol: Any, n_new: int, window: int, expect_rows: int) -> None:
    layers = [0, 13, 29]
    cap = _capture(layers)
    d = ps.make_driver(smol, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        bias = _scene(d, 300, seed=31)
        patched.set_attn_certificate(d.ctx, True, window)
        cap.armed = True
        d.decode(ps.tokens(n_new, seed=33), 300)  # refills holes: causal masking inside the batch
        dims = patched.certificate_dims(d.ctx)
        cert = patched.get_certificate(d.ctx)
        imp = patched.get_importance(d.ctx)
    finally:
        d.close()
    assert (dims.n_layer, dims.n_head, dims.n_rows) == (30, 9, expect_rows)
    assert dims.n_cells == 512
    for il in layers:
        v_hat, o_norm2, mass = _reference(cap, il, imp.cell_pos[il], bias, dims.n_rows)
        assert _rel(cert.v_hat[il], v_hat) <= 1e-4
        assert _rel(cert.o_norm2[il], o_norm2) <= 1e-4
        assert _rel(imp.mass[il, : len(mass)], mass) <= 1e-4
    assert np.all(cert.v_hat > 0)
    # the map covers the survivors and the new tokens, nothing else
    live = imp.cell_pos[0][imp.cell_pos[0] >= 0]
    assert len(live) == 300 - 150 + n_new and live.max() == 300 + n_new - 1


@pytest.mark.parametrize(("n_new", "window"), [(1, 4), pytest.param(9, 4, marks=pytest.mark.slow)])
def test_grouped_query_attention_model(model_path: Any, n_new: int, window: int) -> None:
    """Qwen2.5 (14 query heads on 2 KV heads) takes the grouped products of the patch."""
    model = ps.load_model(model_path("qwen2.5-coder-0.5b"))
    layers = [0, 23]
    cap = _capture(layers)
    d = ps.make_driver(model, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        bias = _scene(d, 300, seed=35)
        patched.set_attn_certificate(d.ctx, True, window)
        cap.armed = True
        d.decode(ps.tokens(n_new, seed=36), 300)
        dims = patched.certificate_dims(d.ctx)
        cert, imp = patched.get_certificate(d.ctx), patched.get_importance(d.ctx)
    finally:
        d.close()
    assert dims.n_head == 14 and dims.n_rows == min(window, n_new)
    for il in layers:
        v_hat, o_norm2, mass = _reference(cap, il, imp.cell_pos[il], bias, dims.n_rows)
        assert _rel(cert.v_hat[il], v_hat) <= 1e-4
        assert _rel(cert.o_norm2[il], o_norm2) <= 1e-4
        assert _rel(imp.mass[il, : len(mass)], mass) <= 1e-4


def test_f16_cache_rounds_the_weights_but_stays_close(smol: Any) -> None:
    """With the default F16 V cache the weights meet V in F16: documented tolerance 5e-3."""
    cap = _capture([5])
    d = ps.make_driver(smol, kv_type=ps.GGML_TYPE_F16, capture=cap)
    try:
        bias = _scene(d, 300, seed=37)
        patched.set_attn_certificate(d.ctx, True, 8)
        cap.armed = True
        d.decode(ps.tokens(1, seed=38), 300)
        cert, imp = patched.get_certificate(d.ctx), patched.get_importance(d.ctx)
    finally:
        d.close()
    v_hat, o_norm2, mass = _reference(cap, 5, imp.cell_pos[5], bias, 1)
    assert _rel(cert.v_hat[5], v_hat) <= 5e-3
    assert _rel(cert.o_norm2[5], o_norm2) <= 1e-4
    assert _rel(imp.mass[5, : len(mass)], mass) <= 1e-4


def test_without_biases_the_certificate_is_zero(smol: Any) -> None:
    d = ps.make_driver(smol)
    try:
        d.decode(ps.tokens(100, seed=39), 0)
        patched.set_attn_certificate(d.ctx, True, 1)
        d.decode(ps.tokens(1, seed=40), 100)
        cert = patched.get_certificate(d.ctx)
        imp = patched.get_importance(d.ctx)
    finally:
        d.close()
    assert np.all(cert.v_hat == 0.0)  # every cell has pi = 1
    assert np.all(cert.o_norm2 > 0.0)
    # each head's weights sum to one over the cells: mass sums to n_head per layer
    np.testing.assert_allclose(imp.mass.sum(axis=1), 9.0, rtol=1e-4)


def test_switch_on_and_off(smol: Any) -> None:
    toks = ps.tokens(81, seed=41)
    d = ps.make_driver(smol)
    try:
        d.decode(toks[:80], 0)
        patched.set_bias(d.mem, 0, 5, 60, 1.0)
        with pytest.raises(patched.PatchError) as err:
            patched.certificate_dims(d.ctx)
        assert err.value.code == patched.Status.ERR_NOT_ENABLED
        off = d.step(toks[80], 80)
        d.seq_rm(0, 80, -1)

        patched.set_attn_certificate(d.ctx, True, 4)
        with pytest.raises(patched.PatchError) as err:
            patched.certificate_dims(d.ctx)
        assert err.value.code == patched.Status.ERR_NO_DATA
        on = d.step(toks[80], 80)
        assert patched.get_certificate(d.ctx).v_hat.shape == (30, 9, 1)
        # the certificate shares the product with V: same logits up to the order of summation
        np.testing.assert_allclose(on, off, rtol=0, atol=1e-3 * np.abs(off).max())

        # cells written while the certificate was off get their |v|^2 when it is turned on again
        patched.set_attn_certificate(d.ctx, False, 4)
        d.decode(toks[:8], 81)
        patched.set_attn_certificate(d.ctx, True, 4)
        d.decode(toks[8:9], 89)
        assert np.isfinite(patched.get_certificate(d.ctx).v_hat).all()

        with pytest.raises(ValueError):
            patched.set_attn_certificate(d.ctx, True, 0)
        with pytest.raises(ValueError):
            patched.set_attn_certificate(d.ctx, True, patched.MAX_WINDOW + 1)
        raw = patched.lib().llama_set_attn_certificate(d.ctx, True, patched.MAX_WINDOW + 1)
        assert raw == patched.Status.ERR_ARG
    finally:
        d.close()


def test_flash_attention_is_turned_off(smol: Any) -> None:
    cap = _capture([3])
    d = ps.make_driver(smol, flash_attn=True, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        bias = _scene(d, 300, seed=43)
        patched.set_attn_certificate(d.ctx, True, 1)  # warns and turns flash attention off
        cap.armed = True
        d.decode(ps.tokens(1, seed=44), 300)
        cert, imp = patched.get_certificate(d.ctx), patched.get_importance(d.ctx)
    finally:
        d.close()
    v_hat, o_norm2, _ = _reference(cap, 3, imp.cell_pos[3], bias, 1)
    assert _rel(cert.v_hat[3], v_hat) <= 1e-4
    assert _rel(cert.o_norm2[3], o_norm2) <= 1e-4


def test_state_restore_refills_the_value_norms(smol: Any) -> None:
    """A restored sequence gets its |v|^2 from the restored V cache (state files carry no bias)."""
    toks = ps.tokens(121, seed=45)
    lc = ps.llama()
    src = ps.make_driver(smol)
    dst = ps.make_driver(smol)
    try:
        src.decode(toks[:120], 0)
        patched.set_bias(src.mem, 0, 10, 100, 1.25)
        size = lc.llama_state_seq_get_size(src.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        assert lc.llama_state_seq_get_data(src.ctx, buf, size, 0) == size
        patched.set_attn_certificate(dst.ctx, True, 1)
        assert lc.llama_state_seq_set_data(dst.ctx, buf, size, 0) == size
        assert np.all(patched.get_bias(dst.mem, 0)[1] == 0.0)
        pos, val = patched.get_bias(src.mem, 0)
        patched.set_bias_pos(dst.mem, 0, pos, val)
        patched.set_attn_certificate(src.ctx, True, 1)
        a = src.step(toks[120], 120)
        b = dst.step(toks[120], 120)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
        ca, cb = patched.get_certificate(src.ctx), patched.get_certificate(dst.ctx)
        np.testing.assert_allclose(cb.v_hat, ca.v_hat, rtol=1e-4, atol=1e-9)
        assert math.isfinite(float(cb.v_hat.sum())) and cb.v_hat.max() > 0
    finally:
        src.close()
        dst.close()
