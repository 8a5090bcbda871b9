"""The evicted-key sketch's C++ quantisation and scoring against its numpy references, the quantisation
error bound, and the per-conversation store's bookkeeping (append, drop, clear, per-message sums, bytes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from native import sketch


def _keys(rng: np.random.Generator, n: int, n_kv: int, d: int) -> np.ndarray:
    # K rows after RoPE have a few large channels: heavy tails make the per-row scale matter
    k = rng.standard_normal((n, n_kv * d)).astype(np.float32)
    k[:, ::7] *= 6.0
    return k


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_matches_numpy_and_marks_absent_rows(bits: int) -> None:
    rng = np.random.default_rng(1)
    k = _keys(rng, 50, 2, 64)
    k[3] = np.nan
    k[7] = 0.0
    codes, scales = sketch.quantize(k, 2, bits)
    assert codes.shape == (50, 2 * 64 * bits // 8) and scales.shape == (50, 2)
    got = sketch.dequantize(codes, scales, 2, 64, bits)
    want = sketch.reference_quantize(k, 2, bits)
    assert np.isnan(got[3]).all() and np.isnan(want[3]).all()
    ok = ~np.isnan(want[:, 0])
    np.testing.assert_array_equal(got[ok], want[ok])
    assert (got[7] == 0).all()
    # the round trip error is at most half a step of the row's own scale
    step = np.abs(k[ok].reshape(-1, 2, 64)).max(axis=2) / (127 if bits == 8 else 7)
    err = np.abs(got[ok] - k[ok]).reshape(-1, 2, 64).max(axis=2)
    assert (err <= 0.5 * step * 1.002 + 1e-7).all()


def _queries(rng: np.random.Generator, n_rows: int, n_head: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    q = rng.standard_normal((n_rows, n_head, d)).astype(np.float32) * 2.0
    lse = rng.uniform(3.0, 9.0, size=(n_rows, n_head)).astype(np.float32)
    return q, lse


@pytest.mark.parametrize("renormalise", [False, True])
def test_f32_scoring_is_numpy_exactly(renormalise: bool) -> None:
    rng = np.random.default_rng(2)
    k = _keys(rng, 300, 2, 64)
    k[10] = np.nan  # absent: scores 0
    q, lse = _queries(rng, 6, 14, 64)
    lse[2, 5] = np.nan  # a row without data is skipped for that head
    codes, scales = sketch.quantize(k, 2, 32)
    got = sketch.score_layer(codes, scales, 2, 64, 32, q, lse, 0.125, renormalise)
    want = sketch.reference_score(k, q, lse, 0.125, renormalise)
    assert got.shape == (14, 300)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-30)
    assert (got[:, 10] == 0).all()
    assert (want > 0).sum() > 0.9 * want.size  # not a vacuous comparison of zeros


@pytest.mark.parametrize("bits", [8, 4])
def test_channel_scales_round_trip_like_numpy_and_shrink_the_error(bits: int) -> None:
    rng = np.random.default_rng(5)
    k = _keys(rng, 200, 2, 64)
    k[:, 3] *= 40.0  # one outlier channel, as RoPE'd keys have
    c = sketch.channel_scales(k)
    got = sketch.dequantize(*sketch.quantize(k, 2, bits, c), 2, 64, bits, c)
    np.testing.assert_array_equal(got, sketch.reference_quantize(k, 2, bits, c))
    plain = sketch.dequantize(*sketch.quantize(k, 2, bits), 2, 64, bits)
    q, lse = _queries(rng, 3, 14, 64)
    exact = sketch.reference_score(k, q, lse, 0.125)
    with_c = sketch.score_layer(*sketch.quantize(k, 2, bits, c), 2, 64, bits, q, lse, 0.125, channel_scale=c)
    np.testing.assert_allclose(with_c, sketch.reference_score(got, q, lse, 0.125), rtol=2e-5)
    err_c = np.abs(np.log(with_c / exact)).mean()
    err_plain = np.abs(np.log(sketch.reference_score(plain, q, lse, 0.125) / exact)).mean()
    assert err_c < 0.7 * err_plain
    with pytest.raises(sketch.SketchError, match="channel_scale"):
        sketch.quantize(k, 2, bits, np.zeros(128, np.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_scoring_is_numpy_on_the_same_codes_and_within_the_bound(bits: int) -> None:
    rng = np.random.default_rng(3)
    n_kv, d, n_head = 2, 64, 14
    k = _keys(rng, 400, n_kv, d)
    q, lse = _queries(rng, 1, n_head, d)  # one row: the bound holds entry by entry
    scale = 0.125
    codes, scales = sketch.quantize(k, n_kv, bits)
    got = sketch.score_layer(codes, scales, n_kv, d, bits, q, lse, scale)
    # exact against numpy on the same stored rows
    same = sketch.reference_score(sketch.reference_quantize(k, n_kv, bits), q, lse, scale)
    np.testing.assert_allclose(got, same, rtol=2e-5)
    # within the quantisation bound of the exact keys: |delta logit| <= scale * sum_d |q_d| * step / 2
    exact = sketch.reference_score(k, q, lse, scale)
    step = np.abs(k.reshape(-1, n_kv, d)).max(axis=2) / (127 if bits == 8 else 7)  # [n, n_kv]
    g = n_head // n_kv
    for h in range(n_head):
        bound = scale * np.abs(q[0, h]).sum() * 0.5 * step[:, h // g] * 1.002
        dlog = np.abs(np.log(got[h]) - np.log(exact[h]))
        assert (dlog <= bound + 1e-4).all()
    # and the error is real (the test would see a sketch that ignored the codes)
    assert np.abs(np.log(got) - np.log(exact)).max() > 1e-4


def test_store_append_drop_clear_and_per_message() -> None:
    rng = np.random.default_rng(4)
    layers = (11, 15, 20)
    sk = sketch.EvictedKeySketch(layers=layers, n_kv_head=2, head_dim=64, bits=8)
    pos1, msg1 = np.arange(10, 30), np.repeat([1, 2], 10)
    pos2, msg2 = np.arange(50, 60), np.full(10, 4)
    k1 = rng.standard_normal((3, 20, 128)).astype(np.float32)
    k2 = rng.standard_normal((3, 10, 128)).astype(np.float32)
    sk.append(pos1, msg1, k1)
    sk.append(pos2, msg2, k2)
    assert sk.n_tokens == 30 and sk.bytes_per_token == 3 * (128 + 4) + 8
    assert sk.channel_scale is not None and sk.nbytes == 30 * sk.bytes_per_token + 3 * 128 * 4
    np.testing.assert_array_equal(sk.channel_scale[1], np.abs(k1[1]).max(axis=0))  # from the first round
    np.testing.assert_array_equal(sk.keys()[1], sketch.reference_quantize(np.concatenate([k1[1], k2[1]]), 2, 8,
                                                                          sk.channel_scale[1]))

    q = rng.standard_normal((4, 3, 14, 64)).astype(np.float32)  # queries for layers 5, 11, 15, 20
    lse = np.full((4, 3, 14), 6.0, dtype=np.float32)
    queries = SimpleNamespace(layers=np.array([5, 11, 15, 20]), q=q, lse=lse, kq_scale=np.full(4, 0.125, np.float32))
    sc = sk.score(queries)
    assert sc.per_head.shape == (3, 14, 30)
    np.testing.assert_allclose(sc.per_head[2], sketch.reference_score(sk.keys()[2], q[3], lse[3], 0.125), rtol=2e-5)
    ids, mass = sc.per_message()
    np.testing.assert_array_equal(ids, [1, 2, 4])
    pp = sc.per_position()
    np.testing.assert_allclose(mass[:, 1], pp[:, 10:20].sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(sc.per_position(heads=[0, 7])[0], sc.per_head[0, [0, 7]].sum(axis=0), rtol=1e-6)

    # rows taken out (cells back in the cache) come back exactly as stored, whatever was appended meanwhile
    before = sk.score(queries).per_message()
    rows = sk.take(np.arange(12, 18))
    assert rows.n_tokens == 6 and sk.n_tokens == 24 and 12 not in sk.positions
    sk.append(np.arange(70, 72), np.full(2, 5), 100.0 * rng.standard_normal((3, 2, 128)).astype(np.float32))
    sk.drop(np.arange(70, 72))
    sk.put(rows)
    after = sk.score(queries).per_message()
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(after[1], before[1], rtol=1e-6)
    with pytest.raises(sketch.SketchError, match="put"):
        sketch.EvictedKeySketch(layers=(1,), n_kv_head=2, head_dim=64, bits=8).put(rows)

    sk.drop(np.arange(15, 25))
    assert sk.n_tokens == 20 and set(sk.score(queries).messages.tolist()) == {1, 2, 4}
    sk.clear()
    assert sk.n_tokens == 0 and sk.score(queries).per_head.shape == (3, 14, 0)


def test_bad_input_is_refused_with_a_clear_message() -> None:
    with pytest.raises(sketch.SketchError, match="bits"):
        sketch.EvictedKeySketch(layers=(1,), n_kv_head=2, head_dim=64, bits=6)
    sk = sketch.EvictedKeySketch(layers=(1, 2), n_kv_head=2, head_dim=64)
    with pytest.raises(sketch.SketchError, match="keys"):
        sk.append([1, 2], [0, 0], np.zeros((1, 2, 128), np.float32))
    sk.append([1, 2], [0, 0], np.zeros((2, 2, 128), np.float32))
    queries = SimpleNamespace(layers=np.array([1]), q=np.zeros((1, 1, 14, 64), np.float32),
                              lse=np.zeros((1, 1, 14), np.float32), kq_scale=np.ones(1, np.float32))
    with pytest.raises(sketch.SketchError, match="lack layers"):
        sk.score(queries)
    with pytest.raises(sketch.SketchError, match="n_head"):
        sketch.score_layer(*sketch.quantize(np.zeros((2, 128), np.float32), 2, 8), 2, 64, 8,
                           np.zeros((1, 3, 64), np.float32), np.zeros((1, 3), np.float32), 1.0)


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("renormalise", [False, True])
def test_threads_and_layers_in_one_call_do_not_change_the_scores(bits: int, renormalise: bool) -> None:
    # 1,100 tokens: two full chunks of work and a ragged one, tiles with a remainder
    rng = np.random.default_rng(7)
    n_layers, n, n_kv, d, n_head, rows = 3, 1100, 2, 64, 14, 5
    keys = np.stack([_keys(rng, n, n_kv, d) for _ in range(n_layers)])
    keys[1, 17] = np.nan
    ch = np.stack([sketch.channel_scales(keys[li]) for li in range(n_layers)])
    coded = [sketch.quantize(keys[li], n_kv, bits, ch[li]) for li in range(n_layers)]
    codes = np.stack([c for c, _ in coded])
    scales = np.stack([s for _, s in coded])
    q = rng.standard_normal((n_layers, rows, n_head, d)).astype(np.float32)
    lse = rng.uniform(3.0, 9.0, size=(n_layers, rows, n_head)).astype(np.float32)
    lse[2, 1, 3] = np.nan
    kq = np.array([0.125, 0.1, 0.2], np.float32)
    one = sketch.score_layers(codes, scales, n, n_kv, d, bits, q, lse, kq, renormalise, ch, threads=1)
    for threads in (2, 3, 0):
        got = sketch.score_layers(codes, scales, n, n_kv, d, bits, q, lse, kq, renormalise, ch, threads=threads)
        np.testing.assert_array_equal(got, one)
    for li in range(n_layers):
        alone = sketch.score_layer(codes[li], scales[li], n_kv, d, bits, q[li], lse[li], float(kq[li]), renormalise,
                                   ch[li])
        np.testing.assert_array_equal(alone, one[li])
        rows_of = sketch.dequantize(codes[li], scales[li], n_kv, d, bits, ch[li])
        want = sketch.reference_score(rows_of, q[li], lse[li], float(kq[li]), renormalise)
        np.testing.assert_allclose(one[li], want, rtol=5e-5, atol=1e-30)
    assert (one[1, :, 17] == 0).all()


def test_channel_scales_in_cpp_are_numpy_s() -> None:
    rng = np.random.default_rng(8)
    k = rng.standard_normal((2, 40, 128)).astype(np.float32)
    k[0, 3] = np.nan          # an absent row is ignored
    k[1, :, 5] = 0.0          # a channel never seen: 1
    k[1, 7, 9] = np.inf       # not finite: 1
    got = sketch.channel_scales_layers(k)
    np.testing.assert_array_equal(got, np.stack([sketch.channel_scales(k[0]), sketch.channel_scales(k[1])]))
    assert got[1, 5] == 1.0 and got[1, 9] == 1.0


@pytest.mark.parametrize("threads", [1, 2])
def test_the_store_grows_in_place_and_keeps_every_round(threads: int) -> None:
    # rounds of uneven sizes past the first capacity, drops between them, and a snapshot copy that stays put
    import copy

    rng = np.random.default_rng(9)
    sk = sketch.EvictedKeySketch(layers=(3, 7), n_kv_head=2, head_dim=64, bits=4, threads=threads)
    all_keys, all_pos, all_msg = [], [], []
    start = 0
    for r, size in enumerate([5, 300, 1, 700, 40]):
        pos = np.arange(start, start + size)
        start += size + 3
        k = rng.standard_normal((2, size, 128)).astype(np.float32)
        sk.append(pos, np.full(size, r), k)
        all_keys.append(k)
        all_pos.append(pos)
        all_msg.append(np.full(size, r))
        if r == 1:
            snap = copy.deepcopy(sk)
    keys = np.concatenate(all_keys, axis=1)
    pos = np.concatenate(all_pos)
    assert sk.n_tokens == len(pos) and sk.timing.append_rounds == 5 and sk.timing.append_tokens == len(pos)
    np.testing.assert_array_equal(sk.positions, pos)
    np.testing.assert_array_equal(sk.messages, np.concatenate(all_msg))
    for li in range(2):
        np.testing.assert_array_equal(sk.keys()[li], sketch.reference_quantize(keys[li], 2, 4, sk.channel_scale[li]))
    assert snap.n_tokens == 305 and snap.keys().shape == (2, 305, 128)
    np.testing.assert_array_equal(snap.keys(), sk.keys()[:, :305])
    gone = pos[::3]
    sk.drop(gone)
    keep = ~np.isin(pos, gone)
    np.testing.assert_array_equal(sk.positions, pos[keep])
    for li in range(2):
        np.testing.assert_array_equal(sk.keys()[li],
                                      sketch.reference_quantize(keys[li][keep], 2, 4, sk.channel_scale[li]))
    q = SimpleNamespace(layers=np.array([3, 7]), q=rng.standard_normal((2, 2, 14, 64)).astype(np.float32),
                        lse=np.full((2, 2, 14), 5.0, np.float32), kq_scale=np.full(2, 0.125, np.float32))
    sc = sk.score(q)
    np.testing.assert_allclose(sc.per_head[1], sketch.reference_score(sk.keys()[1], q.q[1], q.lse[1], 0.125),
                               rtol=5e-5)
    assert sk.timing.score_calls == 1
