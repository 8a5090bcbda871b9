"""Moving the cache's positions down (smollm2-135m, the patched library): a shifted cache holds the keys, and gives
the next logits, that a fresh prefill of the same tokens at the shifted positions computes; a full cache that
runs out of cells drops its oldest history after the sinks and moves the rest down instead of re-reading the log,
its positions stay under the context size and the log keeps the conversation's own positions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from agent import events as ev
from agent.chat import resume
from agent.chat.saved_state import SavedStates
from agent.chat.session import ChatSession
from agent.config import Config
from agent.lab.replay import drive
from agent.llm.engine import Engine, EngineSettings
from memory_store.store import Store
from native import rope

TEXT = ("You are a helpful assistant. My gym locker code is 4172 and my cat is called Purrnickel, born in Tromsø. "
        "Tell me something about the sea, the mountains and the long rivers of Europe.")
QUESTION = " What is my cat called?"
LAYERS = list(range(30))  # every layer of smollm2-135m


def _pair(path: Path) -> Iterator[tuple[Engine, Engine]]:
    """Two engines on the test model: one to shift, one to compare it with."""
    pair = tuple(Engine(EngineSettings(model_path=path, n_ctx=1024, n_batch=64, threads=2)) for _ in range(2))
    yield pair[0], pair[1]
    for engine in pair:
        engine.close()


@pytest.fixture(scope="module")
def engines(small_model: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from _pair(small_model)


def _tok(engine: Engine, text: str) -> list[int]:
    return engine.model.tokenize(text, add_special=False, parse_special=False)


def _fed_at(engine: Engine, start: int, tokens: list[int]) -> None:
    engine.reset()
    engine.next_pos = start
    engine.feed(tokens, segment=0)


def test_a_shift_keeps_every_cells_keys_and_the_next_logits_of_a_fresh_prefill_there(engines) -> None:
    shifted, fresh = engines
    tokens = _tok(shifted, TEXT)
    question = _tok(shifted, QUESTION)
    n = len(tokens)

    _fed_at(fresh, 0, tokens)
    keys_fresh = fresh.ctx.keys(Engine.SEQ, LAYERS, np.arange(n))
    fresh.feed(question, segment=1)
    logits_fresh = fresh.ctx.logits()

    _fed_at(shifted, 700, tokens)
    keys_before = shifted.ctx.keys(Engine.SEQ, LAYERS, np.arange(700, 700 + n))
    shifted.shift_down(700, 700)
    assert shifted.cache.positions == list(range(n)) and shifted.next_pos == n and shifted.frame_offset == 700
    assert shifted.cache.spans[0] == (0, n)
    keys_after = shifted.ctx.keys(Engine.SEQ, LAYERS, np.arange(n))
    shifted.feed(question, segment=1)
    logits_shifted = shifted.ctx.logits()

    def rel(x: np.ndarray, y: np.ndarray) -> float:
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))

    # Layer 0's keys depend on nothing but the token and its rotation: the shift's own rounding (F16). Deeper
    # layers carry every earlier layer's rounding of angles at 700 against angles at 0.
    assert rel(keys_after[0], keys_fresh[0]) < 2e-3 < rel(keys_before[0], keys_fresh[0])
    assert max(rel(keys_after[i], keys_fresh[i]) for i in LAYERS) < 0.05
    # the next logits: as close to the fresh prefill's as the same prefill at 700 unshifted is (floating point),
    # and far closer than the same tokens with 300 positions between the first and the rest
    _fed_at(fresh, 700, tokens)
    fresh.feed(question, segment=1)
    rounding = float(np.abs(fresh.ctx.logits() - logits_fresh).max())
    error = float(np.abs(logits_shifted - logits_fresh).max())
    assert int(np.argmax(logits_shifted)) == int(np.argmax(logits_fresh))
    assert error < 2 * rounding + 0.1
    _fed_at(fresh, 0, tokens[:1])
    fresh.next_pos = 300
    fresh.feed(tokens[1:], segment=0)
    fresh.feed(question, segment=1)
    assert float(np.abs(fresh.ctx.logits() - logits_fresh).max()) > 2 * error


def test_a_shift_refuses_to_move_cells_onto_live_ones_and_changes_nothing(engines) -> None:
    engine, _ = engines
    tokens = _tok(engine, TEXT)
    _fed_at(engine, 0, tokens)
    before = list(engine.cache.positions)
    with pytest.raises(ValueError, match="still hold live cells"):
        engine.shift_down(20, 10)
    with pytest.raises(ValueError):
        engine.shift_down(5, 0)
    assert engine.cache.positions == before and engine.frame_offset == 0


def test_a_full_cache_out_of_cells_shifts_its_context_and_the_log_keeps_the_true_positions(small_model: Path,
                                                                                             tmp_path: Path) -> None:
    engine = Engine(EngineSettings(model_path=small_model, n_ctx=384, n_batch=64, threads=2))
    try:
        config = Config(model="smollm2-135m", n_ctx=384, policy="full", max_tokens=16)
        session = ChatSession(config, Store(tmp_path / "log.db"), engine, "smollm2-135m")
        notices: list[str] = []

        def hear(event: ev.Event) -> None:
            if isinstance(event, ev.Notice):
                notices.append(event.text)

        for i in range(12):
            session.send(f"Message {i}: the rivers of Europe are long and the mountains are high, number {i}.", hear)
        assert any("context shift" in n for n in notices)
        assert not any("keeping the system prompt" in n for n in notices)
        assert engine.frame_offset > 0 and engine.next_pos <= engine.n_ctx
        assert session.memory_view().frame_offset == engine.frame_offset
        assert engine.cache.positions[:config.sinks] == list(range(config.sinks))
        # the log's positions run on, in the conversation's order, past what the cache could ever hold
        tokens, positions = session.store.history(session.conversation_id).flatten()
        assert len(tokens) == len(positions) > engine.n_ctx
        assert np.all(np.diff(positions) > 0)
        # the newest cells are the log's newest tokens, at the log's positions less the shift
        n = 20
        assert engine.cache.tokens[-n:] == [int(t) for t in tokens[-n:]]
        assert [p + engine.frame_offset for p in engine.cache.positions[-n:]] == [int(p) for p in positions[-n:]]
        session.close()
    finally:
        engine.close()


# -- an evicting cache's frame shift -----------------------------------------------------------------------------
SYSTEM = "You are a helpful assistant. Answer concisely. "
OLD = " My gym locker code is 4172 and I keep my bike in the blue shed behind the old mill."
MIDDLE = " My cat is called Purrnickel and she was born in Tromsø, far in the north of Norway."
LATER = " Tell me something about the sea, the mountains and the long rivers of Europe, please."
ASK = " What is my cat called, and where was she born?"
SKETCH = (3, 11)


def _history(engine: Engine, start: int) -> dict[int, tuple[int, int]]:
    """Four sinks (0), then OLD (1), MIDDLE (2), LATER (3) fed from ``start``; OLD evicted whole, half of MIDDLE
    evicted (into the sketch). Returns the spans."""
    engine.reset()
    engine.set_sketch(SKETCH, 8, 8)
    engine.set_readout(True, 8)
    engine.feed(_tok(engine, SYSTEM)[:4], segment=0)
    engine.next_pos = start
    for segment, text in enumerate((OLD, MIDDLE, LATER), start=1):
        engine.feed(_tok(engine, text), segment=segment)
    segs = np.asarray(engine.cache.segments)
    gone = (segs == 1) | ((segs == 2) & (np.arange(len(segs)) % 2 == 0))
    engine.evict(~gone)
    return dict(engine.cache.spans)


def _ask(engine: Engine) -> tuple[np.ndarray, dict[int, float]]:
    engine.feed(_tok(engine, ASK), segment=4)
    assert engine.sketch is not None
    ids, mass = engine.sketch.score(engine.read_queries()).per_message()
    return engine.ctx.logits(), {int(i): float(m) for i, m in zip(ids, mass.sum(axis=0))}


@pytest.fixture(scope="module")
def evicting(small_model: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from _pair(small_model)


def test_the_sketch_reads_every_evicted_message_the_same_before_and_after_a_frame_shift(evicting) -> None:
    engine, unshifted = evicting
    spans = _history(unshifted, 300)
    logits_before, before = _ask(unshifted)
    asked = unshifted.read_queries()

    _history(engine, 300)
    shift = engine.shift_frame(4, spans[2][0])
    assert shift.packed == 0 and shift.delta == spans[2][0] - 4 and shift.homeless == (1,)
    assert engine.homeless == {1} and 1 not in engine.cache.spans
    assert engine.cache.spans[2] == (spans[2][0] - shift.delta, spans[2][1] - shift.delta)
    assert engine.cache.positions[:4] == [0, 1, 2, 3] and engine.frame_offset == shift.delta
    sketch = engine.sketch
    assert sketch is not None and set(sketch.lags) == {shift.delta}
    assert sketch.positions[sketch.messages == 1].max() < 0  # packed away: no place left

    # The same question rows, asked where the question now lands (delta positions lower): every evicted message
    # reads what it read before the shift, to rounding.
    moved = dataclasses.replace(asked, q=rope.rotate(np.asarray(asked.q), sketch.head_dim, engine.rope, -shift.delta))
    ids, mass = sketch.score(moved).per_message()
    after = {int(i): float(m) for i, m in zip(ids, mass.sum(axis=0))}
    assert set(after) == set(before) == {1, 2}
    for message in before:
        assert after[message] == pytest.approx(before[message], rel=1e-5), message
    # without the rotation the keys are read where they now lie: other masses, which the test would see
    lags = sketch.lags
    sketch._lags[: sketch.n_tokens] = 0
    ids, wrong = sketch.score(moved).per_message()
    misread = {int(i): float(m) for i, m in zip(ids, wrong.sum(axis=0))}
    assert max(abs(misread[m] - before[m]) / before[m] for m in before) > 0.03
    sketch._lags[: sketch.n_tokens] = lags

    # Asked for real after the shift, the question sees the sinks nearer than before (that is the shift's point),
    # so its own rows change a little; the readings keep their order and stay close.
    logits_after, real = _ask(engine)
    assert max(real, key=real.get) == max(before, key=before.get)
    for message in before:
        assert real[message] == pytest.approx(before[message], rel=0.3), message
    assert int(np.argmax(logits_after)) == int(np.argmax(logits_before))


def test_after_a_frame_shift_a_reread_lands_where_its_message_belongs(evicting) -> None:
    engine, unshifted = evicting
    spans = _history(unshifted, 300)
    runs = unshifted.evicted_runs(2)
    middle = _tok(unshifted, MIDDLE)
    for p0, p1 in runs:
        unshifted.reinsert(middle[p0 - spans[2][0]:p1 - spans[2][0]], p0, 2)
    logits_unshifted, _ = _ask(unshifted)

    _history(engine, 300)
    shift = engine.shift_frame(4, spans[2][0])
    moved = engine.evicted_runs(2)
    assert moved == [(p0 - shift.delta, p1 - shift.delta) for p0, p1 in runs]
    assert engine.evicted_by_message() == {i: engine.evicted_runs(i) for i in engine.cache.spans
                                           if engine.evicted_runs(i)}
    first = engine.cache.spans[2][0]
    for p0, p1 in moved:
        engine.reinsert(middle[p0 - first:p1 - first], p0, 2)
    assert engine.evicted_runs(2) == []
    segs = np.asarray(engine.cache.segments)
    assert [engine.cache.tokens[i] for i in np.flatnonzero(segs == 2)] == middle
    logits_shifted, _ = _ask(engine)
    # the same cells at the same distances from each other, only the sinks nearer
    spread = float(logits_unshifted.max() - logits_unshifted.min())
    assert float(np.abs(logits_shifted - logits_unshifted).max()) < 0.1 * spread
    assert int(np.argmax(logits_shifted)) == int(np.argmax(logits_unshifted))

    # a message the shift left without a place comes back at fresh positions for the turn, and leaves no trace
    assert engine.sketch is not None
    stored = int((engine.sketch.messages == 1).sum())
    back = sum(p1 - p0 for p0, p1 in moved)  # MIDDLE's re-inserted cells, whose rows go back as first evicted
    total = engine.sketch.n_tokens + back
    engine.truncate(engine.next_pos - len(_tok(engine, ASK)))
    start = engine.next_pos
    old = _tok(engine, OLD)
    engine.feed_transient(old, 1)
    assert engine.cache.positions[-len(old):] == list(range(start, start + len(old))) and 1 not in engine.cache.spans
    engine.feed(_tok(engine, ASK), segment=4)  # the question again, on top
    engine.evict_reinserted()
    assert 1 not in engine.cache.segments
    assert int((engine.sketch.messages == 1).sum()) == stored and engine.sketch.n_tokens == total


def test_after_a_frame_shift_evicted_rows_come_back_rotated_as_llama_cpp_rotates_a_live_cell(evicting) -> None:
    """The rows kept of evicted cells move with the frame: their keys rotated as llama.cpp's own shift rotates a
    live cell's, those of the packed zone let go; a re-read of a moved message is then a copy, and the question
    reads it as it does when the unshifted cache copies it back."""
    engine, unshifted = evicting
    middle = _tok(engine, MIDDLE)
    try:
        for e in (engine, unshifted):
            e.keep_rows(64)
        spans = _history(unshifted, 300)
        for p0, p1 in unshifted.evicted_runs(2):
            unshifted.reinsert(middle[p0 - spans[2][0]:p1 - spans[2][0]], p0, 2)
        assert unshifted.copied_tokens > 0
        logits_unshifted, _ = _ask(unshifted)

        _history(engine, 300)
        assert engine.rows is not None and len(engine.rows) == len(_tok(engine, OLD)) + sum(
            p1 - p0 for p0, p1 in engine.evicted_runs(2))
        live = spans[3][0]  # LATER's first cell: moved by llama.cpp's K-shift
        row_before = engine.ctx.kv_rows(Engine.SEQ, [live])
        shift = engine.shift_frame(4, spans[2][0])
        row_llama = engine.ctx.kv_rows(Engine.SEQ, [live - shift.delta])
        ours = engine._rotate_row_keys(row_before, -shift.delta)
        assert ours is not None
        width = row_before.shape[1] // engine.info.n_layer // 2  # bytes of one layer's K row (F16)
        k_ours, k_llama, k_before = (r.reshape(engine.info.n_layer, 2, width)[:, 0].view(np.float16).astype(np.float64)
                                     for r in (ours, row_llama, row_before))
        v_ours, v_llama = (r.reshape(engine.info.n_layer, 2, width)[:, 1] for r in (ours, row_llama))
        assert np.array_equal(v_ours, v_llama)  # values are not rotated
        scale = np.linalg.norm(k_llama)
        assert np.linalg.norm(k_ours - k_llama) / scale < 2e-3 < np.linalg.norm(k_before - k_llama) / scale
        # OLD's rows went with its place; MIDDLE's moved down
        moved = engine.evicted_runs(2)
        assert len(engine.rows) == sum(p1 - p0 for p0, p1 in moved)
        first = engine.cache.spans[2][0]
        copied = engine.copied_tokens
        for p0, p1 in moved:
            engine.reinsert(middle[p0 - first:p1 - first], p0, 2)
        assert engine.copied_tokens - copied == sum(p1 - p0 for p0, p1 in moved)  # copied, none decoded
        logits_shifted, _ = _ask(engine)
        spread = float(logits_unshifted.max() - logits_unshifted.min())
        assert float(np.abs(logits_shifted - logits_unshifted).max()) < 0.1 * spread
        assert int(np.argmax(logits_shifted)) == int(np.argmax(logits_unshifted))
    finally:
        for e in (engine, unshifted):
            e.keep_rows(0)


FACTS = ["My locker code is 4172, remember it.", "My cat is called Purrnickel.", "I go sailing on Lake Constance.",
         "The team meeting moved to Thursday at nine.", "My sister lives in Porto and teaches maths."]
QUESTIONS = ["What is my locker code?", "What is my cat called?", "Where do I go sailing?", "When is the meeting?"]


@pytest.mark.parametrize(("gate", "rows_mb"), [("off", 0), ("0", 0), ("0", 64)])
def test_an_evicting_chat_past_the_trained_context_moves_its_frame_and_goes_on(small_model: Path, tmp_path: Path,
                                                                              gate: str, rows_mb: int) -> None:
    """The model's trained context made short (400 positions) so that a few turns run past it: the frame moves
    down before they would, the sinks stay, the log keeps the conversation's positions; with the gate at τ = 0
    every turn re-reads, messages packed away come back at fresh positions, and the chat goes on. With the evicted
    rows kept, a firing after the shift still copies the history back (all but what the shift packed away); a
    firing where the shift packed away every evicted message feeds the ones it names."""
    engine = Engine(EngineSettings(model_path=small_model, n_ctx=1024, n_batch=256, threads=2))
    engine.info = dataclasses.replace(engine.info, n_ctx_train=400)
    try:
        config = Config(model="smollm2-135m", n_ctx=1024, n_batch=256, policy="poisson", budget="25%", gate=gate,
                        max_tokens=16, temperature=0.0, seed=0, evict_from=0, evicted_rows_mb=rows_mb,
                        reread_budget=48, copy_back="all")
        db = tmp_path / "log.db"
        saver = resume.Saver(SavedStates.beside(db, 64), "smollm2", "patch-level")
        session = ChatSession(config, Store(db), engine, "smollm2-135m", saver=saver)
        notices: list[str] = []

        def hear(event: ev.Event) -> None:
            if isinstance(event, ev.Notice):
                notices.append(event.text)

        # Every answer is given (teacher-forced; the gate still reads and fires on each question), so what is
        # evicted, packed away and left to copy is the same whatever the CPU's float rounding would make the model
        # say. Generated answers follow once the chat is reopened.
        results = [drive.forced(session, text, f"Noted: {text}", hear) for text in [*FACTS, *FACTS[::-1]]]
        results += [drive.forced(session, text, "You told me earlier in this chat.", hear) for text in QUESTIONS]
        shifts = [n for n in notices if "trained context" in n]
        assert shifts, notices
        assert engine.frame_offset > 0 and engine.next_pos <= 400
        assert engine.cache.positions[:4] == [0, 1, 2, 3]
        assert session.memory_view().frame_offset == engine.frame_offset
        tokens, positions = session.store.history(session.conversation_id).flatten()
        assert positions[-1] > 400 and np.all(np.diff(positions) > 0)
        # the budget follows the conversation's length, not the moved frame's
        assert session.memory.budget_cells() == config.kv_budget.cells(engine.log_position(engine.next_pos))
        n = 8
        assert engine.cache.tokens[-n:] == [int(t) for t in tokens[-n:]]
        assert [p + engine.frame_offset for p in engine.cache.positions[-n:]] == [int(p) for p in positions[-n:]]
        if gate == "0":
            assert engine.homeless and any(r.gate_fired for r in results[-4:])
            paths = [r.reread_path for r in results[-4:]]
            if not rows_mb:
                assert set(paths) == {"targeted"}, paths
            else:
                # a firing after the shift copies every evicted message that still has its place; where every
                # evicted message was packed away there is nothing to copy, and the messages it names are fed
                assert "copied" in paths, paths
                for r in results[-4:]:
                    if r.reread_path == "targeted":
                        fed = {session.store.get_message(i).index for i in r.reread_messages}
                        assert fed and fed <= engine.homeless, (fed, engine.homeless)
        assert all(r.answer_tokens > 0 for r in results)
        cache = (list(engine.cache.positions), engine.frame_offset, set(engine.homeless),
                 engine.sketch.lags.tolist() if engine.sketch is not None else [])
        cid = session.conversation_id
        session.close()
        # reopened, the chat resumes its shifted cache as it was
        engine.reset()
        again = ChatSession(config, Store(db), engine, "smollm2-135m", conversation_id=cid, saver=saver)
        assert again.opened is not None and again.opened.resumed, again.opened
        assert cache == (list(engine.cache.positions), engine.frame_offset, set(engine.homeless),
                         engine.sketch.lags.tolist() if engine.sketch is not None else [])
        assert again.send(QUESTIONS[0]).answer_tokens > 0
        again.close()
    finally:
        engine.close()
