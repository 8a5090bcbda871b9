"""The patch on a sliding-window model (Gemma 3 270M, two KV caches): the bias reaches both caches,
eviction outside the window, biasing and compaction keep decoding correct, and the certificate
matches numpy on SWA and global layers alike.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import patch_support as ps
import pytest

from native import patched

N_SWA = 512
SWA_LAYER, GLOBAL_LAYER = 4, 5  # Gemma 3: five sliding-window layers, then one global


@pytest.fixture(scope="module")
def gemma(model_path: Callable[[str], Path]) -> Any:
    model = ps.load_model(model_path("gemma3-270m"))
    assert ps.llama().llama_model_n_swa(model) == N_SWA
    return model


def test_layer_windows(gemma: Any) -> None:
    """Patch 0006: which layers attend through the window (every sixth layer of Gemma 3 sees everything)."""
    n_layer = ps.llama().llama_model_n_layer(gemma)
    windows = patched.layer_windows(gemma, n_layer)
    assert windows == tuple(0 if (il + 1) % 6 == 0 else N_SWA for il in range(n_layer))
    assert windows[SWA_LAYER] == N_SWA and windows[GLOBAL_LAYER] == 0
    assert patched.lib().llama_model_layer_n_swa(gemma, n_layer) == -1
    assert patched.lib().llama_model_layer_n_swa(gemma, -1) == -1
    with pytest.raises(patched.PatchError, match="fewer than"):
        patched.layer_windows(gemma, n_layer + 1)


@pytest.fixture
def drivers(gemma: Any) -> Iterator[Callable[..., ps.Driver]]:
    made: list[ps.Driver] = []

    def make(**kw: Any) -> ps.Driver:
        d = ps.make_driver(gemma, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.mark.parametrize("value", [-math.inf, pytest.param(-1e4, marks=pytest.mark.slow)])
def test_bias_reaches_both_caches(drivers: Callable[..., ps.Driver], value: float) -> None:
    """Removed and biased caches keep the same layout (a second sequence holds the removed cells)."""
    toks = ps.tokens(561, seed=51)
    lc = ps.llama()
    removed, biased = drivers(n_seq_max=2), drivers(n_seq_max=2)
    for d in (removed, biased):
        d.decode(toks[:512], 0)
        d.decode(toks[512:560], 512)
        lc.llama_memory_seq_cp(d.mem, 0, 1, -1, -1)
    gone = [5, 6, 30, 31, 40, 300, 301, 302, 550, 558]  # outside and inside the window of the next token
    removed.evict(gone, seq_id=0)
    n_set = sum(patched.set_bias(biased.mem, 0, p, p + 1, value) for p in gone)
    assert n_set == 2 * len(gone)  # both caches (full-size SWA cache)
    np.testing.assert_allclose(biased.step(toks[560], 560), removed.step(toks[560], 560), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "swa_full", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["full-swa-cache", "small-swa-cache"]
)
def test_evict_outside_window_bias_and_compact(drivers: Callable[..., ps.Driver], swa_full: bool) -> None:
    layers = [SWA_LAYER, GLOBAL_LAYER]
    n = 600
    toks = ps.tokens(n + 6, seed=52)
    caps = {"plain": ps.kv_capture(layers), "packed": ps.kv_capture(layers)}
    plain, packed = (drivers(swa_full=swa_full, capture=caps[k]) for k in ("plain", "packed"))
    rng = np.random.default_rng(53)
    gone = rng.choice(np.arange(4, n - N_SWA), size=60, replace=False)  # never inside the window
    kept = np.setdiff1d(np.arange(n), gone)
    biased = kept[rng.random(len(kept)) < 0.4]
    bias = rng.uniform(0.1, 3.0, size=len(biased))
    for d in (plain, packed):
        d.decode(toks[:512], 0)
        d.decode(toks[512:n], 512)
        d.evict(gone)
        patched.set_bias_pos(d.mem, 0, biased, bias)
        patched.set_attn_certificate(d.ctx, True, 1)  # cell -> position maps of both caches
    extent = patched.compact(packed.ctx, 0)
    assert extent == len(kept)
    assert patched.extent(packed.mem, 0) == len(kept)
    np.testing.assert_array_equal(patched.get_bias(packed.mem, 0)[1], patched.get_bias(plain.mem, 0)[1])

    caps["plain"].armed = caps["packed"].armed = True
    a = plain.step(toks[n], n)
    b = packed.step(toks[n], n)
    caps["plain"].armed = caps["packed"].armed = False
    maps = {k: patched.get_importance(d.ctx).cell_pos for k, d in (("plain", plain), ("packed", packed))}
    for il in layers:
        rows_a = ps.kv_by_position(caps["plain"], il, maps["plain"][il])
        rows_b = ps.kv_by_position(caps["packed"], il, maps["packed"][il])
        assert sorted(rows_a) == sorted(rows_b)
        for pos in kept.tolist():
            if pos in rows_a:  # a small SWA cache no longer holds the oldest positions
                np.testing.assert_array_equal(rows_b[pos][0], rows_a[pos][0])
                np.testing.assert_array_equal(rows_b[pos][1], rows_a[pos][1])
    assert patched.certificate_dims(packed.ctx).n_cells <= patched.certificate_dims(plain.ctx).n_cells

    # decoding continues (Q4 weights: compare by direction, and by the greedy choice)
    assert ps.cosine(a, b) > 0.999
    for i in range(4):
        tok = int(np.argmax(a))
        assert tok == int(np.argmax(b))
        a, b = plain.step(tok, n + 1 + i), packed.step(tok, n + 1 + i)
        assert ps.cosine(a, b) > 0.999


@pytest.mark.parametrize(("n_new", "window"), [(1, 8), (12, 8)], ids=["decode-row", "prefill-window"])
def test_certificate_on_swa_and_global_layers(gemma: Any, n_new: int, window: int) -> None:
    layers = [SWA_LAYER, GLOBAL_LAYER]
    reads: dict[str, Any] = {}

    def kqv(t: int) -> tuple[np.ndarray, np.ndarray]:
        product = ps.GgmlTensor.from_address(t).view_src or t
        return ps.read_tensor(t), ps.read_tensor(ps.src(product, 0))

    for il in layers:
        reads[f"kq_soft_max-{il}"] = ps.read_tensor
        reads[f"kqv-{il}"] = kqv
    cap = ps.Capture(reads=reads)
    d = ps.make_driver(gemma, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        toks = ps.tokens(600, seed=54)
        d.decode(toks[:512], 0)
        d.decode(toks[512:600], 512)
        rng = np.random.default_rng(55)
        d.evict(rng.choice(np.arange(4, 590), size=150, replace=False))
        kept, _ = patched.get_bias(d.mem, 0)
        bias = {int(p): float(x) for p, x in zip(kept, rng.uniform(0.05, 3.0, size=len(kept))) if p % 3}
        patched.set_bias_pos(d.mem, 0, list(bias), list(bias.values()))
        patched.set_attn_certificate(d.ctx, True, window)
        cap.armed = True
        d.decode(ps.tokens(n_new, seed=56), 600)
        cert, imp, dims = patched.get_certificate(d.ctx), patched.get_importance(d.ctx), patched.certificate_dims(d.ctx)
    finally:
        d.close()
    assert dims.n_layer == 18 and dims.n_head == 4 and dims.n_rows == min(n_new, window)
    for il in layers:
        p_all = cap.values[f"kq_soft_max-{il}"]
        out, v = cap.values[f"kqv-{il}"]
        n_head, n_tok, n_kv = p_all.shape[1:]
        pos = imp.cell_pos[il][:n_kv]
        b = np.array([bias.get(int(q), 0.0) for q in pos])
        w_base = np.where(b > 0, 1.0 - np.exp(-b), 0.0)
        mass = np.zeros(n_kv)
        for h in range(n_head):
            vh = v[0, 0].astype(np.float64)  # one KV head
            for r in range(dims.n_rows):
                t = n_tok - dims.n_rows + r
                p = p_all[0, h, t].astype(np.float64)
                o = out[0, h, t].astype(np.float64)
                want = np.sum(w_base * p * p * np.sum((vh - o[:, None]) ** 2, axis=0))
                assert cert.v_hat[il, h, r] == pytest.approx(want, rel=1e-4, abs=1e-9)
                assert cert.o_norm2[il, h, r] == pytest.approx(o @ o, rel=1e-4)
                mass += p
        np.testing.assert_allclose(imp.mass[il, :n_kv], mass, rtol=1e-4, atol=1e-7)
        if il == SWA_LAYER:  # nothing outside the window of the first reported row gets attention
            first = 600 + n_new - dims.n_rows
            assert np.all(mass[(pos >= 0) & (pos <= first - N_SWA)] == 0.0)
