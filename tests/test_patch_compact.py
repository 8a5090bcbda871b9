"""KV compaction of the llama.cpp patch: every K/V row moves intact, the attention width shrinks, the
logits stay, decoding continues, and the cell meta data (positions, biases, sequences) moves with the data.

Real patched library; SmolLM2-135M for the data moves, a tiny F32 random-weights model for logit
comparisons at 1e-5 (compaction changes the order of summation over cells, and quantized weights round
the activations they multiply, which turns last-bit differences into visible ones).
"""

from __future__ import annotations

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
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return ps.load_model(ps.tiny_model("qwen2", tmp_path_factory.getbasetemp(), "f32"))


@pytest.fixture
def drivers() -> Iterator[Callable[..., ps.Driver]]:
    made: list[ps.Driver] = []

    def make(model: Any, **kw: Any) -> ps.Driver:
        d = ps.make_driver(model, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def _pad(n: int) -> int:
    return max(256, -(-n // 256) * 256)


def _prefill_and_scatter(d: ps.Driver, toks: list[int], n: int, n_evict: int, seed: int) -> np.ndarray:
    """Prefill n tokens, evict n_evict random positions (never the 4 sinks or the newest 8), bias a third
    of the survivors; returns the surviving positions."""
    d.decode(toks[: min(n, 512)], 0)
    if n > 512:
        d.decode(toks[512:n], 512)
    rng = np.random.default_rng(seed)
    gone = rng.choice(np.arange(4, n - 8), size=n_evict, replace=False)
    d.evict(gone)
    kept = np.setdiff1d(np.arange(n), gone)
    biased = kept[rng.random(len(kept)) < 0.33]
    patched.set_bias_pos(d.mem, 0, biased, rng.uniform(0.1, 3.0, size=len(biased)))
    return kept


def test_compaction_moves_every_row_and_shrinks_the_attention_width(
    smol: Any, drivers: Callable[..., ps.Driver]
) -> None:
    """K and V (stored transposed: no flash attention) of every live position are bitwise the same after
    compaction; biases, positions and the importance map move with them; n_kv shrinks to PAD(live, 256)."""
    layers = [0, 15, 29]
    n = 400
    toks = ps.tokens(n + 1, seed=21)
    cap_plain, cap_packed = ps.kv_capture(layers), ps.kv_capture(layers)
    plain, packed = drivers(smol, capture=cap_plain), drivers(smol, capture=cap_packed)
    for d in (plain, packed):
        kept = _prefill_and_scatter(d, toks, n, 220, seed=22)
        patched.set_attn_certificate(d.ctx, True, 1)  # for n_kv and the cell -> position map
    live = len(kept)
    assert patched.extent(packed.mem, 0) == n
    bias_before = patched.get_bias(packed.mem, 0)

    assert patched.compact(packed.ctx, 0) == live
    assert patched.extent(packed.mem, 0) == live
    bias_after = patched.get_bias(packed.mem, 0)
    np.testing.assert_array_equal(bias_after[0], bias_before[0])
    np.testing.assert_array_equal(bias_after[1], bias_before[1])
    assert ps.llama().llama_memory_seq_pos_max(packed.mem, 0) == n - 1

    cap_plain.armed = cap_packed.armed = True
    a = plain.step(toks[n], n)
    b = packed.step(toks[n], n)
    assert patched.certificate_dims(plain.ctx).n_cells == _pad(n + 1) == 512
    assert patched.certificate_dims(packed.ctx).n_cells == _pad(live + 1) == 256
    imp_a, imp_b = patched.get_importance(plain.ctx), patched.get_importance(packed.ctx)

    # the live cells now fill [0, live), and the new token went right after them
    assert set(imp_b.cell_pos[0][: live + 1].tolist()) == set(kept.tolist()) | {n}
    assert np.all(imp_b.cell_pos[0][live + 1 :] == -1)
    for il in layers:
        rows_a = ps.kv_by_position(cap_plain, il, imp_a.cell_pos[il])
        rows_b = ps.kv_by_position(cap_packed, il, imp_b.cell_pos[il])
        assert sorted(rows_a) == sorted(rows_b) == sorted(set(kept.tolist()) | {n})
        for pos in kept.tolist():  # not the new token: computed after the move, through other rounding
            k, v = rows_a[pos]
            np.testing.assert_array_equal(rows_b[pos][0], k)
            np.testing.assert_array_equal(rows_b[pos][1], v)
    # layer 0 sees the same query in both (deeper layers see last-bit differences through Q4 rounding)
    first = [patched.Importance(mass=i.mass[:1], cell_pos=i.cell_pos[:1]) for i in (imp_a, imp_b)]
    np.testing.assert_allclose(first[1].per_position(kept), first[0].per_position(kept), rtol=1e-4, atol=1e-7)
    assert ps.cosine(imp_b.per_position(kept), imp_a.per_position(kept)) > 0.999
    assert ps.cosine(a, b) > 0.999


@pytest.mark.parametrize("certificate", [False, True], ids=["plain", "with-certificate"])
def test_compaction_keeps_the_logits_and_decoding_continues(
    tiny_f32: Any, drivers: Callable[..., ps.Driver], certificate: bool
) -> None:
    toks = ps.tokens(701, seed=23, low=3, high=500)
    # an F32 cache too: the new tokens' values would otherwise round to F16 from slightly different inputs
    plain, packed = drivers(tiny_f32, kv_type=ps.GGML_TYPE_F32), drivers(tiny_f32, kv_type=ps.GGML_TYPE_F32)
    for d in (plain, packed):
        kept = _prefill_and_scatter(d, toks, 700, 500, seed=24)
        if certificate:
            patched.set_attn_certificate(d.ctx, True, 1)
    assert patched.compact(packed.ctx, 0) == len(kept)
    a = plain.step(toks[700], 700)
    b = packed.step(toks[700], 700)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    # greedy decoding continues at the next positions, in the cells after the packed ones; the new tokens'
    # K/V carry the first step's last-bit differences forward, so later steps get a little more room
    for i in range(6):
        tok = int(np.argmax(a))
        assert tok == int(np.argmax(b))
        a = plain.step(tok, 701 + i)
        b = packed.step(tok, 701 + i)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    assert patched.extent(packed.mem, 0) == len(kept) + 7


def test_compaction_of_a_packed_cache_changes_nothing(smol: Any, drivers: Callable[..., ps.Driver]) -> None:
    toks = ps.tokens(101, seed=25)
    d = drivers(smol)
    d.decode(toks[:100], 0)
    ref = d.step(toks[100], 100)
    d.seq_rm(0, 100, -1)
    assert patched.compact(d.ctx, 0) == 100
    np.testing.assert_array_equal(d.step(toks[100], 100), ref)


def test_compaction_keeps_every_sequence_of_the_stream(tiny_f32: Any, drivers: Callable[..., ps.Driver]) -> None:
    toks = ps.tokens(300, seed=26, low=3, high=500)
    lc = ps.llama()
    kw: dict[str, Any] = {"n_seq_max": 2, "kv_type": ps.GGML_TYPE_F32}
    ref, packed = drivers(tiny_f32, **kw), drivers(tiny_f32, **kw)
    for d in (ref, packed):
        d.decode(toks[:200], 0)
        lc.llama_memory_seq_cp(d.mem, 0, 1, -1, -1)
        d.evict(range(10, 60), seq_id=0)  # still held by sequence 1
        d.evict(range(100, 180), seq_id=0)
        d.evict(range(100, 180), seq_id=1)  # now free
        patched.set_bias(d.mem, 1, 20, 50, 0.75)
        d.decode(toks[200:220], 200, seq_ids=(1,))  # refills the freed cells
    assert patched.compact(packed.ctx, 0) == 200 - 80 + 20
    for s in (0, 1):
        assert lc.llama_memory_seq_pos_min(packed.mem, s) == lc.llama_memory_seq_pos_min(ref.mem, s)
        assert lc.llama_memory_seq_pos_max(packed.mem, s) == lc.llama_memory_seq_pos_max(ref.mem, s)
        for x, y in zip(patched.get_bias(packed.mem, s), patched.get_bias(ref.mem, s)):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(packed.step(toks[250], 200, 0), ref.step(toks[250], 200, 0), rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed.step(toks[251], 220, 1), ref.step(toks[251], 220, 1), rtol=0, atol=1e-5)


def _flash_kv_capture(layers: list[int]) -> ps.Capture:
    def fa(t: int) -> tuple[np.ndarray, np.ndarray]:
        node = ps.GgmlTensor.from_address(t).view_src  # kqv_out is a reshape of the flash-attention node
        return ps.read_tensor(ps.src(node, 1)), ps.read_tensor(ps.src(node, 2))  # K, V: [1, n_head_kv, n_kv, d]

    return ps.Capture(reads={f"kqv_out-{il}": fa for il in layers})


def test_compaction_with_flash_attention_moves_untransposed_values(
    smol: Any, drivers: Callable[..., ps.Driver]
) -> None:
    """With flash attention V is stored row by row. The cell maps come from shadow contexts without flash
    attention that go through the same cache operations (cell allocation does not depend on it)."""
    layers = [29]
    toks = ps.tokens(301, seed=27)
    rows: dict[str, list[dict[int, tuple[np.ndarray, np.ndarray]]]] = {}
    for name in ("plain", "packed"):
        cap = _flash_kv_capture(layers)
        fa, shadow = drivers(smol, flash_attn=True, capture=cap), drivers(smol)
        patched.set_attn_certificate(shadow.ctx, True, 1)
        for d in (fa, shadow):
            d.decode(toks[:300], 0)
            d.evict(np.random.default_rng(28).choice(np.arange(4, 292), size=200, replace=False))
            if name == "packed":
                assert patched.compact(d.ctx, 0) == 100
            cap.armed = d is fa
            d.decode(toks[300:301], 300)
        cell_pos = patched.get_importance(shadow.ctx).cell_pos
        rows[name] = []
        for il in layers:
            k, v = cap.values[f"kqv_out-{il}"]
            n_kv = k.shape[2]
            rows[name].append({int(p): (k[0, :, c].copy(), v[0, :, c].copy()) for c, p in enumerate(cell_pos[il][:n_kv]) if p >= 0})
    for plain, packed in zip(rows["plain"], rows["packed"]):
        assert sorted(plain) == sorted(packed) and len(plain) == 101
        for pos, (k, v) in plain.items():
            if pos == 300:  # the new token: computed after the move, through other rounding
                continue
            np.testing.assert_array_equal(packed[pos][0], k)
            np.testing.assert_array_equal(packed[pos][1], v)


def test_compaction_rejects_a_bad_sequence(smol: Any, drivers: Callable[..., ps.Driver]) -> None:
    d = drivers(smol)
    d.decode(ps.tokens(8, seed=29), 0)
    with pytest.raises(patched.PatchError) as err:
        patched.compact(d.ctx, 4096)
    assert err.value.code == patched.Status.ERR_ARG
