"""Patch 0004, the evicted-key sketch's inputs, on real models: K rows read by position equal the cache's
rows (F32, F16, Q8_0 K caches), the query rows equal the graph's, the reported log-sum-exp reproduces the
graph's softmax weights (biases, holes and causal masking included), and a kept cell scored through the
sketch path gets the attention the graph gave it; Gemma 3's two caches; refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import patch_support as ps
import pytest

from native import patched, sketch

GGML_TYPE_Q8_0 = 8
QWEN_LAYERS = [2, 13, 23]


@pytest.fixture(scope="module")
def qwen(model_path: Callable[[str], Path]) -> Any:
    return ps.load_model(model_path("qwen2.5-coder-0.5b"))


def _capture(layers: list[int]) -> ps.Capture:
    """Per layer: the logits node (with its K view and the query rows it multiplies) and the weights."""

    def kq(t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k_view = ps.src(t, 0)
        if ps.GgmlTensor.from_address(k_view).type == GGML_TYPE_Q8_0:
            k_cells = _q8_0_rows(k_view)  # [kv_size, n_embd_k_gqa]
        else:
            k = ps.read_tensor(k_view)[0]  # [n_head_kv, n_kv, d]
            k_cells = k.transpose(1, 0, 2).reshape(k.shape[1], -1)
        return ps.read_tensor(t), ps.read_tensor(ps.src(t, 1)), k_cells

    reads: dict[str, Any] = {}
    for il in layers:
        reads[f"kq-{il}"] = kq
        reads[f"kq_soft_max-{il}"] = ps.read_tensor
    return ps.Capture(reads=reads)


def _q8_0_rows(k_view: int) -> np.ndarray:
    """The cache's Q8_0 K rows (every cell), decoded in numpy (blocks: half d, 32 int8)."""
    import ctypes

    from native.ggml_tensor import GgmlTensor, _ggml

    cache = GgmlTensor.from_address(GgmlTensor.from_address(k_view).view_src or k_view)
    row, n_cells = int(cache.nb[1]), int(cache.ne[1])
    raw = np.empty(row * n_cells, dtype=np.uint8)
    _ggml().ggml_backend_tensor_get(ctypes.addressof(cache), raw.ctypes.data, 0, raw.size)
    blocks = raw.reshape(n_cells, row // 34, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(n_cells, -1)


def _scene(d: ps.Driver, n: int, seed: int) -> dict[int, float]:
    """Prefill n tokens, punch holes, give Hajek biases to some survivors; returns {pos: bias} (others 0)."""
    d.decode(ps.tokens(n, seed=seed), 0)
    rng = np.random.default_rng(seed + 1)
    gone = set(rng.choice(np.arange(4, n - 10), size=n // 3, replace=False).tolist())
    d.evict(sorted(gone))
    kept = [p for p in range(n) if p not in gone]
    bias = {p: float(rng.uniform(0.05, 3.0)) for p in kept[5:-20:2]}
    patched.set_bias_pos(d.mem, 0, list(bias), list(bias.values()))
    return bias


def _run(model: Any, kv_type: int, n_new: int, window: int, seed: int) -> tuple[Any, ...]:
    cap = _capture(QWEN_LAYERS)
    d = ps.make_driver(model, kv_type=kv_type, v_type=ps.GGML_TYPE_F16, capture=cap)
    try:
        bias = _scene(d, 240, seed)
        patched.set_attn_certificate(d.ctx, True, 1)  # only for the cell -> position map
        patched.set_attn_queries(d.ctx, QWEN_LAYERS[::-1], window)
        cap.armed = True
        d.decode(ps.tokens(n_new, seed=seed + 2), 240)
        cap.armed = False
        queries = patched.get_attn_queries(d.ctx)
        cell_pos = patched.get_importance(d.ctx).cell_pos
        live = sorted(int(p) for p in cell_pos[0] if p >= 0)
        keys = patched.get_keys(d.ctx, QWEN_LAYERS, live)
    finally:
        d.close()
    return cap, bias, queries, cell_pos, live, keys


@pytest.mark.parametrize(
    ("kv_type", "n_new", "window"),
    [(ps.GGML_TYPE_F32, 12, 5), (ps.GGML_TYPE_F16, 1, 5), pytest.param(GGML_TYPE_Q8_0, 12, 5, id="q8_0")],
    ids=["f32-prefill-window", "f16-decode-row", "q8_0"],
)
def test_keys_and_queries_are_what_the_graph_used(qwen: Any, kv_type: int, n_new: int, window: int) -> None:
    cap, bias, queries, cell_pos, live, keys = _run(qwen, kv_type, n_new, window, seed=70)
    n_rows = min(window, n_new)
    np.testing.assert_array_equal(queries.layers, QWEN_LAYERS)  # ascending, whatever order was asked
    assert queries.q.shape == (3, n_rows, 14, 64) and queries.lse.shape == (3, n_rows, 14)
    np.testing.assert_allclose(queries.kq_scale, 1 / 8)  # Qwen2.5: 1/sqrt(head_dim)
    assert keys.shape == (3, len(live), 128) and not np.isnan(keys).any()
    row_of = {p: j for j, p in enumerate(live)}
    for li, il in enumerate(QWEN_LAYERS):
        logits, q_graph, k_cache = cap.values[f"kq-{il}"]  # [1, n_head, n_tok, n_kv], [1, n_head, n_tok, d]
        p_graph = cap.values[f"kq_soft_max-{il}"]
        n_kv = logits.shape[3]
        pos = cell_pos[il][:n_kv]
        cells = np.flatnonzero(pos >= 0)
        k_of_cell = keys[li][[row_of[int(pos[c])] for c in cells]]  # [n_live, 128]
        # the query rows are the graph's, bit for bit
        np.testing.assert_array_equal(queries.q[li].transpose(1, 0, 2), q_graph[0, :, -n_rows:, :])
        # the cache's rows, bit for bit (Q8_0: decoded; stored in the Hadamard-rotated basis Q shares)
        np.testing.assert_array_equal(k_of_cell, k_cache[cells])
        # q.k from what the patch returns = the graph's logits (an F16 or Q8_0 K cache rounds q to its type
        # for the product: relative 2^-11 or 1/254 per element)
        kh = k_of_cell.reshape(len(cells), 2, 64).astype(np.float64)
        tol = {ps.GGML_TYPE_F32: 1e-5, ps.GGML_TYPE_F16: 1e-3, GGML_TYPE_Q8_0: 3e-2}[kv_type]
        b = np.array([bias.get(int(pos[c]), 0.0) for c in cells])
        for h in range(14):
            for r in range(n_rows):
                t = logits.shape[2] - n_rows + r
                mine = kh[:, h // 7] @ queries.q[li, r, h].astype(np.float64)
                want = logits[0, h, t, cells]
                assert np.abs(mine - want).max() <= tol * np.abs(want).max()
                # the normaliser reproduces the graph's weights on the cells the row saw, and they sum to 1
                p = p_graph[0, h, t].astype(np.float64)
                seen = p[cells] > 0
                rebuilt = np.exp(queries.kq_scale[li] * want + b - queries.lse[li, r, h])
                np.testing.assert_allclose(rebuilt[seen], p[cells][seen], rtol=2e-4, atol=1e-9)
                assert rebuilt[seen].sum() == pytest.approx(1.0, abs=2e-4)
                assert p[cells].sum() == pytest.approx(1.0, abs=1e-5)  # every weight lies on a live cell


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_a_kept_cell_scored_through_the_sketch_gets_the_graphs_attention(qwen: Any, bits: int) -> None:
    """Nothing about the cell is evicted: the sketch's estimate of its weight is the graph's softmax weight on it
    (divided by its bias factor, which the graph added and an evicted cell would not carry), within quantisation."""
    cap, bias, queries, cell_pos, live, keys = _run(qwen, ps.GGML_TYPE_F32, 4, 4, seed=71)
    # the history before the question (the question's own tokens are causally masked row by row; evicted ones never are)
    past = [j for j, p in enumerate(live) if p < 240]
    live, keys = [live[j] for j in past], keys[:, past]
    sk = sketch.EvictedKeySketch(layers=tuple(QWEN_LAYERS), n_kv_head=2, head_dim=64, bits=bits)
    sk.append(live, np.zeros(len(live)), keys)
    got = sk.score(queries).per_head  # [3, 14, n_live], mean over the 4 rows
    for li, il in enumerate(QWEN_LAYERS):
        p_graph = cap.values[f"kq_soft_max-{il}"][0]  # [n_head, n_tok, n_kv]
        pos = cell_pos[il][: p_graph.shape[2]]
        cell_of = {int(p): c for c, p in enumerate(pos) if p >= 0}
        cells = [cell_of[p] for p in live]
        unbiased = p_graph[:, -4:, cells].astype(np.float64) * np.exp(-np.array([bias.get(p, 0.0) for p in live]))
        want = unbiased.mean(axis=1)  # [n_head, n_live]
        big = want > 1e-3
        ratio = got[li][big] / want[big]
        if bits == 32:
            np.testing.assert_allclose(ratio, 1.0, rtol=2e-4)
        else:
            # |d logit| <= kq_scale |q|_1 step/2 (channel scales only shrink the step): measured a few percent at 8 bits,
            # tens of percent at 4 bits on these keys
            q1 = np.abs(queries.q[li]).sum(axis=2).max() * queries.kq_scale[li]
            step = np.nanmax(np.abs(keys[li])) / (127 if bits == 8 else 7)
            bound = np.exp(q1 * step / 2) - 1
            assert np.abs(ratio - 1).max() <= bound
            assert np.median(np.abs(ratio - 1)) < (0.1 if bits == 8 else 0.8)
        # kept mass is 1 by construction: the graph's weights over the live cells sum to 1 per row and head
        every = [c for c, p in enumerate(pos) if p >= 0]
        np.testing.assert_allclose(p_graph[:, -4:, every].sum(axis=2), 1.0, atol=1e-5)


def test_a_model_without_a_window_has_none_in_any_layer(qwen: Any) -> None:
    assert patched.layer_windows(qwen, 24) == (0,) * 24


def test_gemma_swa_and_global_layers(model_path: Callable[[str], Path]) -> None:
    """Two caches: each layer's keys come from the cache that holds it; positions a cache lacks read NaN."""
    model = ps.load_model(model_path("gemma3-270m"))
    layers = [4, 5]  # a sliding-window layer, then a global one
    cap = _capture(layers)
    d = ps.make_driver(model, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        toks = ps.tokens(300, seed=80)
        d.decode(toks, 0)
        d.evict(range(40, 60))
        patched.set_attn_certificate(d.ctx, True, 1)
        patched.set_attn_queries(d.ctx, layers, 6)
        cap.armed = True
        d.decode(ps.tokens(6, seed=81), 300)
        queries = patched.get_attn_queries(d.ctx)
        cell_pos = patched.get_importance(d.ctx).cell_pos
        keys = patched.get_keys(d.ctx, layers, np.arange(0, 306))
    finally:
        d.close()
    assert np.isnan(keys[:, 40:60]).all() and not np.isnan(keys[:, :40]).any() and not np.isnan(keys[:, 60:]).any()
    for li, il in enumerate(layers):
        logits, _, k_cache = cap.values[f"kq-{il}"]
        p_graph = cap.values[f"kq_soft_max-{il}"][0]
        n_kv = logits.shape[3]
        pos = cell_pos[il][:n_kv]
        cells = np.flatnonzero(pos >= 0)
        k = keys[li][pos[cells]].astype(np.float64)  # one KV head of 256
        np.testing.assert_array_equal(keys[li][pos[cells]], k_cache[cells])
        for h in range(queries.q.shape[2]):
            for r in range(6):
                t = logits.shape[2] - 6 + r
                mine = k @ queries.q[li, r, h].astype(np.float64)
                np.testing.assert_allclose(mine, logits[0, h, t, cells], rtol=1e-4, atol=1e-4 * np.abs(mine).max())
                rebuilt = np.exp(queries.kq_scale[li] * logits[0, h, t, cells] - queries.lse[li, r, h])
                seen = p_graph[h, t, cells] > 0  # causal masking among the new tokens (and the window)
                np.testing.assert_allclose(rebuilt[seen], p_graph[h, t, cells][seen], rtol=2e-4, atol=1e-9)
                assert rebuilt[seen].sum() == pytest.approx(1.0, abs=2e-4)


def test_switch_and_refusals(qwen: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = ps.make_driver(qwen, n_ctx=256)
    try:
        d.decode(ps.tokens(20, seed=90), 0)
        with pytest.raises(patched.PatchError) as err:
            patched.get_attn_queries(d.ctx)
        assert err.value.code == patched.Status.ERR_NOT_ENABLED
        patched.set_attn_queries(d.ctx, [3], 4)
        with pytest.raises(patched.PatchError) as err:
            patched.get_attn_queries(d.ctx)
        assert err.value.code == patched.Status.ERR_NO_DATA
        d.decode(ps.tokens(2, seed=91), 20)
        assert patched.get_attn_queries(d.ctx).q.shape == (1, 2, 14, 64)
        patched.set_attn_queries(d.ctx, None)
        d.decode(ps.tokens(1, seed=92), 22)
        with pytest.raises(patched.PatchError) as err:
            patched.get_attn_queries(d.ctx)
        assert err.value.code == patched.Status.ERR_NOT_ENABLED
        for call, code in (
            (lambda: patched.set_attn_queries(d.ctx, [24], 4), patched.Status.ERR_ARG),
            (lambda: patched.get_keys(d.ctx, [24], [0]), patched.Status.ERR_UNSUPPORTED),
            (lambda: patched.get_keys(d.ctx, [-1], [0]), patched.Status.ERR_ARG),
        ):
            with pytest.raises(patched.PatchError) as err:
                call()
            assert err.value.code == code
        assert patched.get_keys(d.ctx, [0], [5, 999]).shape == (1, 2, 128)
        assert np.isnan(patched.get_keys(d.ctx, [0], [999])).all()
    finally:
        d.close()
    mamba = ps.make_driver(ps.load_model(ps.tiny_model("mamba", tmp_path_factory.getbasetemp())), n_ctx=256)
    try:
        mamba.decode(ps.tokens(16, low=3, high=500), 0)
        for call in (lambda: patched.get_keys(mamba.ctx, [0], [1]), lambda: patched.set_attn_queries(mamba.ctx, [0], 4)):
            with pytest.raises(patched.PatchError) as err:
                call()
            assert err.value.code == patched.Status.ERR_MEMORY
    finally:
        mamba.close()
