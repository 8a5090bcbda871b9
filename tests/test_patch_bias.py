"""The per-cell logit bias of the llama.cpp patch: equivalence with removal, Hajek reweighting,
reset on reuse, sharing across sequences, refusals.

Real patched library, real models (SmolLM2-135M; tiny random GGUFs for the refused architectures).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import patch_support as ps
import pytest

from native import patched


@pytest.fixture(scope="module")
def smol(small_model: Path) -> Any:
    return ps.load_model(small_model)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return lambda arch: ps.tiny_model(arch, tmp_path_factory.getbasetemp())


@pytest.fixture
def drivers(smol: Any) -> Iterator[Callable[..., ps.Driver]]:
    made: list[ps.Driver] = []

    def make(**kw: Any) -> ps.Driver:
        d = ps.make_driver(smol, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def test_library_reports_patch_level() -> None:
    version = patched.patch_version()
    assert version is not None and version >= patched.MIN_PATCH_VERSION


GONE = [3, 4, 5, 40, 41, 77, 150, 151, 152, 153, 298]  # never the newest: the next batch continues it


@pytest.mark.parametrize("value", [-math.inf, -1e4])
def test_negative_infinite_bias_equals_removal(tmp_path_factory: pytest.TempPathFactory, value: float) -> None:
    """seq_rm frees the cells and the next token refills one, so the layouts differ: an F32 model keeps the
    different order of summation below 1e-5 (quantized weights round the activations and would amplify it)."""
    model = ps.load_model(ps.tiny_model("qwen2", tmp_path_factory.getbasetemp(), "f32"))
    toks = ps.tokens(301, seed=11, low=3, high=500)
    removed, biased = ps.make_driver(model), ps.make_driver(model)
    try:
        for d in (removed, biased):
            d.decode(toks[:300], 0)
        removed.evict(GONE)
        for p in GONE:
            assert patched.set_bias(biased.mem, 0, p, p + 1, value) == 1
        a = removed.step(toks[300], 300)
        b = biased.step(toks[300], 300)
    finally:
        removed.close()
        biased.close()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flash_attn", [False, True], ids=["f32-mask", "f16-mask"])
@pytest.mark.parametrize("value", [-math.inf, pytest.param(-1e4, marks=pytest.mark.slow)])
def test_negative_infinite_bias_equals_removal_real_model(
    drivers: Callable[..., ps.Driver], flash_attn: bool, value: float
) -> None:
    """SmolLM2, with both masks (flash attention reads an F16 one). To compare the same computation the cells
    keep their places: a second sequence holds them while sequence 0 loses them to seq_rm."""
    toks = ps.tokens(201, seed=11)
    lc = ps.llama()
    removed, biased = drivers(flash_attn=flash_attn, n_seq_max=2), drivers(flash_attn=flash_attn, n_seq_max=2)
    gone = [p for p in GONE if p < 199]
    for d in (removed, biased):
        d.decode(toks[:200], 0)
        lc.llama_memory_seq_cp(d.mem, 0, 1, -1, -1)
    removed.evict(gone, seq_id=0)
    for p in gone:
        patched.set_bias(biased.mem, 0, p, p + 1, value)
    a = removed.step(toks[200], 200)
    b = biased.step(toks[200], 200)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_bias_changes_logits_and_zero_bias_restores_them(drivers: Callable[..., ps.Driver]) -> None:
    toks = ps.tokens(201, seed=12)
    d = drivers()
    d.decode(toks[:200], 0)
    ref = d.step(toks[200], 200)
    d.seq_rm(0, 200, -1)
    patched.set_bias(d.mem, 0, 10, 150, 2.0)
    moved = d.step(toks[200], 200)
    d.seq_rm(0, 200, -1)
    patched.set_bias(d.mem, 0, -1, -1, 0.0)
    back = d.step(toks[200], 200)
    assert np.abs(moved - ref).max() > 1e-2
    np.testing.assert_array_equal(back, ref)


def test_bias_is_reset_when_a_cell_is_freed_and_reused(drivers: Callable[..., ps.Driver]) -> None:
    toks = ps.tokens(120, seed=13)
    d = drivers()
    d.decode(toks[:100], 0)
    assert patched.set_bias(d.mem, 0, 0, 100, 1.5) == 100
    d.evict(range(20, 40))
    d.decode(toks[100:120], 100)  # refills the 20 freed cells
    pos, bias = patched.get_bias(d.mem, 0)
    got = dict(zip(pos.tolist(), bias.tolist()))
    assert sorted(got) == [p for p in range(120) if not 20 <= p < 40]
    assert all(got[p] == pytest.approx(1.5) for p in range(100) if p in got)
    assert all(got[p] == 0.0 for p in range(100, 120))


def test_bulk_bias_by_position(drivers: Callable[..., ps.Driver]) -> None:
    d = drivers()
    d.decode(ps.tokens(64, seed=14), 0)
    d.evict([7, 8])
    positions = np.array([1, 7, 8, 30, 63, 500], dtype=np.int32)  # 7, 8 evicted, 500 never existed
    values = np.array([0.5, 9.0, 9.0, 2.25, 3.0, 1.0], dtype=np.float32)
    assert patched.set_bias_pos(d.mem, 0, positions, values) == 3
    pos, bias = patched.get_bias(d.mem, 0)
    got = dict(zip(pos.tolist(), bias.tolist()))
    assert got[1] == pytest.approx(0.5) and got[30] == pytest.approx(2.25) and got[63] == pytest.approx(3.0)
    assert 7 not in got and 8 not in got
    assert sum(1 for v in got.values() if v != 0.0) == 3
    with pytest.raises(ValueError):
        patched.set_bias_pos(d.mem, 0, [1, 2], [0.5])
    with pytest.raises(patched.PatchError) as err:
        patched.set_bias(d.mem, 9999, 0, 5, 1.0)
    assert err.value.code == patched.Status.ERR_ARG


def _hajek_capture(layer: int) -> ps.Capture:
    def kq(t: int) -> tuple[np.ndarray, np.ndarray]:
        return ps.read_tensor(ps.src(t, 0)), ps.read_tensor(ps.src(t, 1))  # K, Q views

    def kqv(t: int) -> tuple[np.ndarray, np.ndarray]:
        view = ps.GgmlTensor.from_address(t)
        product = view.view_src or t  # with the certificate on, kqv is a view of a larger product
        return ps.read_tensor(t), ps.read_tensor(ps.src(product, 0))  # output, V view

    return ps.Capture(reads={f"kq-{layer}": kq, f"kqv-{layer}": kqv})


@pytest.mark.parametrize("layer", [0, pytest.param(17, marks=pytest.mark.slow)])
def test_log_pi_bias_reproduces_hajek_reweighted_attention(smol: Any, layer: int) -> None:
    """Capture one layer's Q, K, V and compare its output with numpy's Hajek estimator."""
    cap = _hajek_capture(layer)
    d = ps.make_driver(smol, kv_type=ps.GGML_TYPE_F32, capture=cap)
    try:
        toks = ps.tokens(400, seed=15)
        d.decode(toks[:380], 0)
        rng = np.random.default_rng(16)
        d.evict(rng.choice(np.arange(4, 370), size=120, replace=False))  # holes
        kept, _ = patched.get_bias(d.mem, 0)
        sampled = kept[(kept >= 4) & (kept < 370)]
        pi = {int(p): float(x) for p, x in zip(sampled, rng.uniform(0.05, 1.0, size=len(sampled)))}
        patched.set_bias_pos(d.mem, 0, list(pi), [-math.log(x) for x in pi.values()])
        patched.set_attn_certificate(d.ctx, True, 1)  # only for the cell -> position map
        cap.armed = True
        d.decode(toks[380:381], 380)
        cell_pos = patched.get_importance(d.ctx).cell_pos[layer]
    finally:
        d.close()

    k, q = cap.values[f"kq-{layer}"]  # K [1, n_head_kv, n_kv, d], Q [1, n_head, 1, d]
    out, v = cap.values[f"kqv-{layer}"]  # out [1, n_head, 1, d], V [1, n_head_kv, d, n_kv]
    n_head, n_head_kv, n_kv, dim = q.shape[1], k.shape[1], k.shape[2], q.shape[3]
    pos = cell_pos[:n_kv]
    visible = (pos >= 0) & (pos <= 380)
    log_pi = np.array([math.log(pi.get(int(p), 1.0)) for p in pos])

    worst = 0.0
    unbiased_gap = 0.0
    for h in range(n_head):
        g = h // (n_head // n_head_kv)
        s = (k[0, g].astype(np.float64) @ q[0, h, 0].astype(np.float64)) / math.sqrt(dim)
        for bias, track in ((-log_pi, True), (np.zeros(n_kv), False)):
            z = np.where(visible, s + bias, -np.inf)
            p = np.exp(z - z.max())
            p /= p.sum()
            o = v[0, g].astype(np.float64) @ p
            err = np.abs(out[0, h, 0] - o).max() / np.abs(o).max()
            if track:
                worst = max(worst, err)
            else:
                unbiased_gap = max(unbiased_gap, err)
    assert worst <= 1e-4
    assert unbiased_gap > 1e-3  # the bias did change the output


def test_seq_cp_shares_the_cell_bias(drivers: Callable[..., ps.Driver]) -> None:
    """The bias lives on the cell: sequences that share a cell (seq_cp) share its bias."""
    toks = ps.tokens(121, seed=17)
    shared = drivers(n_seq_max=2)
    shared.decode(toks[:120], 0)
    ps.llama().llama_memory_seq_cp(shared.mem, 0, 1, -1, -1)
    assert patched.set_bias(shared.mem, 0, 20, 90, 2.5) == 70  # 70 shared cells, counted once
    pos1, bias1 = patched.get_bias(shared.mem, 1)
    assert np.all(bias1[(pos1 >= 20) & (pos1 < 90)] == np.float32(2.5))
    assert np.all(bias1[(pos1 < 20) | (pos1 >= 90)] == 0.0)

    single = drivers()
    single.decode(toks[:120], 0)
    patched.set_bias(single.mem, 0, 20, 90, 2.5)
    ref = single.step(toks[120], 120)
    np.testing.assert_allclose(shared.step(toks[120], 120, seq_id=1), ref, rtol=0, atol=1e-4)

    # the cell leaves sequence 0 but stays in sequence 1, bias included
    shared.seq_rm(0, 0, -1)
    pos1, bias1 = patched.get_bias(shared.mem, 1)
    assert np.all(bias1[(pos1 >= 20) & (pos1 < 90)] == np.float32(2.5))


def test_alibi_model_is_refused(tiny_gguf: Callable[[str], Path]) -> None:
    d = ps.make_driver(ps.load_model(tiny_gguf("bloom")), n_ctx=256)
    try:
        d.decode(ps.tokens(16, low=3, high=500), 0)
        with pytest.raises(patched.PatchError) as err:
            patched.set_bias(d.mem, 0, 0, 8, 1.0)
        assert err.value.code == patched.Status.ERR_ALIBI
        assert "ALiBi" in str(err.value)
        with pytest.raises(patched.PatchError):
            patched.set_bias_pos(d.mem, 0, [1], [1.0])
    finally:
        d.close()


def test_recurrent_model_is_refused(tiny_gguf: Callable[[str], Path]) -> None:
    d = ps.make_driver(ps.load_model(tiny_gguf("mamba")), n_ctx=256)
    try:
        d.decode(ps.tokens(16, low=3, high=500), 0)
        for call in (
            lambda: patched.set_bias(d.mem, 0, 0, 8, 1.0),
            lambda: patched.get_bias(d.mem, 0),
            lambda: patched.compact(d.ctx, 0),
            lambda: patched.set_attn_certificate(d.ctx, True, 1),
        ):
            with pytest.raises(patched.PatchError) as err:
                call()
            assert err.value.code == patched.Status.ERR_MEMORY
    finally:
        d.close()
