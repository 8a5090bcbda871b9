"""Patches 0005 and 0007 through the engine (smollm2-135m, the patched library): evicted tokens decoded back at
their old positions hold the K/V a prefill of the same tokens over the same visible cells (biases included)
computes; copied back from the engine's evicted rows they hold the very rows first computed, and a question then
reads what it would have read had they never been evicted; the engine's mirror, its spans, the cache's cells and
the sketch stay in step through re-insert, evict, re-insert, either way; refusals.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import pytest

from agent.llm.engine import Engine
from agent.llm.evicted_rows import EvictedRows
from native import llama, patched

SYSTEM = "You are a helpful assistant. Answer concisely. " * 3
FACT = "My gym locker code is 4172 and my cat is called Purrnickel, born in Tromsø."
LATER = "Tell me something about the sea, the mountains and the long rivers of Europe."
LAYERS = list(range(30))  # every layer of smollm2-135m


SMALL_BATCHES = {"n_ctx": 1024, "n_batch": 64}


@pytest.fixture(scope="module")
def engines(engine_factory: Callable[..., Engine]) -> tuple[Engine, Engine]:
    """Two engines that decode re-inserted tokens (no evicted rows kept)."""
    return engine_factory(**SMALL_BATCHES), engine_factory(**SMALL_BATCHES)


@pytest.fixture(scope="module")
def copying(engine_factory: Callable[..., Engine]) -> Engine:
    """An engine that keeps its evicted rows and copies re-inserted tokens back from them."""
    engine = engine_factory(**SMALL_BATCHES)
    engine.keep_rows(64)
    assert engine.rows is not None
    return engine


def _tok(engine: Engine, text: str) -> list[int]:
    return engine.model.tokenize(text, add_special=False, parse_special=False)


def _biases(engine: Engine, n: int) -> np.ndarray:
    """A cumulative log π per live cell: the first four protected (0), the rest sampled at π in (0.2, 0.9)."""
    rng = np.random.default_rng(7)
    logpi = np.log(rng.uniform(0.2, 0.9, n))
    logpi[:4] = 0.0
    return logpi


def _cells(engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    pos, bias = patched.get_bias(engine.ctx.memory, Engine.SEQ)
    return pos.astype(np.int64), bias.astype(np.float64)


def _assert_in_step(engine: Engine) -> None:
    """The mirror is what llama.cpp holds: the same positions, and −log π as each cell's bias."""
    pos, bias = _cells(engine)
    assert pos.tolist() == engine.cache.positions
    np.testing.assert_allclose(bias, -np.asarray(engine.cache.logpi), atol=1e-6)
    assert engine.cache.positions == sorted(engine.cache.positions)


def test_reinserted_cells_hold_what_a_prefill_over_the_same_cells_computes(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    sys_t, fact_t, later_t = _tok(a, SYSTEM), _tok(a, FACT), _tok(a, LATER)
    for eng in (a, b):
        eng.reset()
    a.feed(sys_t, segment=0, logits_last=False)
    a.feed(fact_t, segment=1, logits_last=False)
    a.feed(later_t, segment=2)
    first = len(sys_t)
    fact_pos = np.arange(first, first + len(fact_t))
    # Evict the fact whole and bias the system prompt's cells, as a sampled design would.
    keep = ~np.isin(np.asarray(a.cache.positions), fact_pos)
    logpi = np.zeros(len(keep))
    logpi[:len(sys_t)] = _biases(a, len(sys_t))
    a.evict(keep, logpi)
    assert a.evicted_runs(1) == [(first, first + len(fact_t))]
    assert a.evicted_by_message() == {1: [(first, first + len(fact_t))]}, "every message's runs in one pass"
    a.reinsert(fact_t, first, segment=1)
    _assert_in_step(a)
    assert a.evicted_runs(1) == []

    # The reference: the system prompt with the same biases, then the fact prefilled on top of it.
    b.feed(sys_t, segment=0, logits_last=False)
    b.evict(np.ones(len(sys_t), dtype=bool), logpi[:len(sys_t)])
    b.feed(fact_t, segment=1, logits_last=False)
    got = a.ctx.keys(Engine.SEQ, LAYERS, fact_pos)
    want = b.ctx.keys(Engine.SEQ, LAYERS, fact_pos)
    assert np.isfinite(got).all()
    # the cache holds K in F16: equal up to its rounding of values computed in another batch layout
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert np.mean(np.abs(got - want)) < 1e-3
    # the deepest layer's keys depend on what the tokens attended: a prefill without the biases differs
    b.truncate(first)
    b.evict(np.ones(len(sys_t), dtype=bool), np.zeros(len(sys_t)))
    b.feed(fact_t, segment=1, logits_last=False)
    unbiased = b.ctx.keys(Engine.SEQ, LAYERS[-1:], fact_pos)
    assert np.mean(np.abs(got[-1:] - unbiased)) > 10 * np.mean(np.abs(got - want))

    # V too: with no biases, the next token's logits over [system, fact re-inserted, later] are those of the
    # cache built in order (every cell then holds the same K and V).
    for eng in (a, b):
        eng.reset()
        for seg, toks in enumerate((sys_t, fact_t, later_t)):
            eng.feed(toks, segment=seg, logits_last=False)
    a.evict(~np.isin(np.asarray(a.cache.positions), fact_pos))
    a.reinsert(fact_t, first, segment=1)
    probe = _tok(a, " Yes")
    a.feed(probe, segment=3)
    b.feed(probe, segment=3)
    la, lb = a.ctx.logits(-1), b.ctx.logits(-1)
    assert int(np.argmax(la)) == int(np.argmax(lb))
    np.testing.assert_allclose(la, lb, atol=0.02 * float(np.abs(lb).max()))


def _sketch_rows(engine: Engine) -> dict[int, bytes]:
    """Position → its stored sketch row (codes and scales of every layer), read from a copy."""
    assert engine.sketch is not None
    rows = copy.deepcopy(engine.sketch).take(engine.sketch.positions)
    return {int(p): rows.codes[:, i].tobytes() + rows.scales[:, i].tobytes() for i, p in enumerate(rows.positions)}


@pytest.mark.parametrize("put_back", ["decoded", "copied"])
def test_mirror_spans_cells_and_sketch_stay_in_step(engines: tuple[Engine, Engine], copying: Engine,
                                                   put_back: str) -> None:
    a = engines[0] if put_back == "decoded" else copying
    copied = a.copied_tokens
    a.reset()
    a.set_sketch((5, 20), 8, 4)
    texts = [SYSTEM, FACT, LATER, FACT.upper(), LATER.lower()]
    starts = []
    for i, text in enumerate(texts):
        starts.append(a.next_pos)
        a.feed(_tok(a, text), segment=i)
    spans = dict(a.cache.spans)
    assert spans == {i: (s, s + len(_tok(a, t))) for i, (s, t) in enumerate(zip(starts, texts))}
    rng = np.random.default_rng(1)
    first_rows: dict[int, bytes] = {}
    for round_ in range(3):
        n = len(a.cache)
        keep = rng.uniform(size=n) < 0.4
        keep[:4] = keep[-1] = True
        logpi = np.where(keep, np.log(rng.uniform(0.3, 1.0, n)), 0.0) + np.asarray(a.cache.logpi)
        a.evict(keep, logpi)
        _assert_in_step(a)
        assert a.rounds == round_ + 1, "every eviction that removes cells is a round (the certificate's class)"
        gone = set(range(a.next_pos)) - set(a.cache.positions)
        assert set(a.sketch.positions.tolist()) == gone
        # a cell's sketch row is its keys as first evicted: evicted again after a re-insertion (keys re-decoded
        # over the evicted cache), the row it had comes back, not a new one
        rows = _sketch_rows(a)
        assert {p: rows[p] for p in first_rows if p in rows} == {p: r for p, r in first_rows.items() if p in rows}
        assert round_ == 0 or any(p in first_rows for p in rows)
        first_rows = {**rows, **first_rows}
        # put message 1 and 3 back, in pieces where parts of them survived
        for seg in (1, 3):
            first = a.cache.spans[seg][0]
            toks = _tok(a, texts[seg])
            for p0, p1 in a.evicted_runs(seg):
                a.reinsert(toks[p0 - first:p1 - first], p0, segment=seg)
            assert a.evicted_runs(seg) == []
        _assert_in_step(a)
        assert a.cache.spans == spans, "spans describe where messages were fed, evicted or not"
        gone = set(range(a.next_pos)) - set(a.cache.positions)
        assert set(a.sketch.positions.tolist()) == gone, "re-inserted cells leave the sketch"
        for seg in (1, 3):
            first, end = a.cache.spans[seg]
            where = [i for i, s in enumerate(a.cache.segments) if s == seg]
            assert [a.cache.positions[i] for i in where] == list(range(first, end))
            assert [a.cache.tokens[i] for i in where] == _tok(a, texts[seg])
    # decoding continues at the end of the sequence; a snapshot brings the re-inserted layout back
    snap = a.snapshot()
    a.feed(_tok(a, " And then?"), segment=5)
    a.restore(snap)
    _assert_in_step(a)
    assert a.cache.spans == spans
    # evict_reinserted takes out exactly the cells re-inserted since (the snapshot carries them): every cell of
    # messages 1 and 3 that was ever evicted, all live again now; their sketch rows come back as first kept
    back = {p for seg in (1, 3) for p in range(*a.cache.spans[seg]) if p in first_rows}
    live_before = set(a.cache.positions)
    assert a.rounds == 3, "a snapshot carries the rounds"
    a.evict_reinserted()
    _assert_in_step(a)
    assert set(a.cache.positions) == live_before - back and back
    rows = _sketch_rows(a)
    assert {p: rows[p] for p in back} == {p: first_rows[p] for p in back}
    assert a.rounds == 4
    a.evict(np.ones(len(a.cache), dtype=bool))
    assert a.rounds == 4, "an eviction that removes nothing is no round"
    a.reset()
    assert a.rounds == 0
    a.set_sketch((), 8, 4)
    assert (a.copied_tokens > copied) == (put_back == "copied")


SEAS = "Yesterday I walked along the harbour and counted seventeen red boats near the pier."


def test_rows_copied_back_are_those_first_computed(engines: tuple[Engine, Engine], copying: Engine) -> None:
    """Evict a message and one before it, put the message back: copied, the question's next-token logits are those
    of the cache that lost only the earlier message (as if the fact had never been evicted); decoded over the
    evicted cache they are not."""
    decoding, reference = engines
    question = "What is my gym locker code?"

    def logits(engine: Engine, evict: tuple[int, ...], back: bool) -> np.ndarray:
        engine.reset()
        msgs = [_tok(engine, t) for t in (SYSTEM, SEAS, FACT, LATER)]
        for seg, toks in enumerate(msgs):
            engine.feed(toks, segment=seg, logits_last=False)
        segs = np.asarray(engine.cache.segments)
        fact_pos = np.asarray(engine.cache.positions)[segs == 2]
        rows = engine.ctx.kv_rows(Engine.SEQ, fact_pos) if engine.rows is not None else None
        engine.evict(~np.isin(segs, evict))
        if back:
            engine.reinsert(msgs[2], int(fact_pos[0]), segment=2)
            _assert_in_step(engine)
            if rows is not None:
                assert np.array_equal(engine.ctx.kv_rows(Engine.SEQ, fact_pos), rows), "byte for byte"
        engine.feed(_tok(engine, question), segment=4)
        return engine.ctx.logits(-1, copy=True)

    want = logits(reference, (1,), back=False)
    before = copying.copied_tokens
    got = logits(copying, (1, 2), back=True)
    assert copying.copied_tokens - before == len(_tok(copying, FACT))
    decoded = logits(decoding, (1, 2), back=True)
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert np.abs(decoded - want).max() > 0.1, "decoded over the evicted cache, the fact's K/V differ"


def test_rows_are_put_back_only_for_the_tokens_they_hold(copying: Engine) -> None:
    a = copying
    a.reset()
    toks = _tok(a, FACT)
    a.feed(_tok(a, SYSTEM), segment=0, logits_last=False)
    first = a.next_pos
    a.feed(toks, segment=1, logits_last=False)
    a.feed(_tok(a, LATER), segment=2)
    a.evict(~(np.asarray(a.cache.segments) == 1))
    assert a.rows is not None and len(a.rows) == len(toks)
    before = a.copied_tokens
    other = list(toks)
    other[3] = toks[4]
    a.reinsert(other, first, segment=1)
    assert a.copied_tokens == before, "a row kept for another token is not that token's: decoded"
    _assert_in_step(a)
    a.evict_reinserted()
    assert len(a.rows) == len(toks), "a decoded re-insertion does not replace the rows first computed"
    a.reinsert(toks, first, segment=1)
    assert a.copied_tokens == before + len(toks)
    # positions given to new tokens forget their rows; so does an emptied cache
    a.truncate(first + 2)
    assert len(a.rows) == 2
    a.reset()
    assert len(a.rows) == 0


def test_native_row_refusals(copying: Engine) -> None:
    a = copying
    a.reset()
    a.feed(_tok(a, FACT), segment=0)
    rows = a.ctx.kv_rows(Engine.SEQ, [2, 3])
    with pytest.raises(patched.PatchError):
        a.ctx.put_kv_rows(Engine.SEQ, [2, 3], rows)  # still held
    with pytest.raises(patched.PatchError):
        a.ctx.kv_rows(Engine.SEQ, [a.next_pos])  # not in the cache
    assert a.ctx.seq_rm(Engine.SEQ, 2, 4)
    with pytest.raises(patched.PatchError):
        a.ctx.put_kv_rows(Engine.SEQ, [2, 2], rows)  # repeated
    with pytest.raises(patched.PatchError):
        a.ctx.put_kv_rows(Engine.SEQ, [2], rows)  # rows of another count
    a.ctx.put_kv_rows(Engine.SEQ, [3, 2], rows[::-1])
    assert np.array_equal(a.ctx.kv_rows(Engine.SEQ, [2, 3]), rows)
    a.reset()


def test_refusals(engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    a.reset()
    toks = _tok(a, FACT)
    a.feed(toks, segment=0)
    with pytest.raises(ValueError, match="still in the cache"):
        a.reinsert(toks[:3], 0, segment=0)
    with pytest.raises(ValueError, match="not below"):
        a.reinsert(toks[:3], a.next_pos, segment=0)
    # llama.cpp itself refuses a held position even when asked to take past positions
    a.ctx.set_reinsert(True)
    try:
        a.batch.set(toks[:1], [0], Engine.SEQ, logits="none")
        with pytest.raises(llama.KVCacheFull):
            a.ctx.decode(a.batch)
    finally:
        a.ctx.set_reinsert(False)
    # without the switch, a batch below the end is refused as before
    keep = np.ones(len(a.cache), dtype=bool)
    keep[5:8] = False
    a.evict(keep)
    a.batch.set(toks[5:8], [5, 6, 7], Engine.SEQ, logits="none")
    with pytest.raises(llama.LlamaError):
        a.ctx.decode(a.batch)
    _assert_in_step(a)


def test_row_store_keeps_the_newest_within_its_budget() -> None:
    store = EvictedRows(row_bytes=4, budget_bytes=12)
    rows = np.arange(16, dtype=np.uint8).reshape(4, 4)
    store.put(np.array([10, 11, 12, 13]), [5, 6, 7, 8], rows)
    assert len(store) == 3 and store.dropped == 1 and store.nbytes == 12
    assert store.take(10, [5]) is None, "the row evicted longest ago went first"
    got = store.take(11, [6, 7, 8])
    assert got is not None and np.array_equal(got, rows[1:])
    assert store.take(11, [6, 0, 8]) is None
    store.put(np.array([11]), [9], rows[:1])  # evicted again, after another token took the position
    assert store.take(11, [9]) is not None and store.take(11, [6]) is None
    with pytest.raises(ValueError):
        store.put(np.array([1, 2]), [1, 2], rows[:1])
