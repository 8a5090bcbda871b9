"""Moving the cache's positions down (smollm2-135m, the patched library): a shifted cache holds the keys, and gives
the next logits, that a fresh prefill of the same tokens at the shifted positions computes; a full cache that
runs out of cells drops its oldest history after the sinks and moves the rest down instead of re-reading the log,
its positions stay under the context size and the log keeps the conversation's own positions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent import events as ev
from agent.chat.session import ChatSession
from agent.config import Config
from agent.llm.engine import Engine, EngineSettings
from memory_store.store import Store

TEXT = ("You are a helpful assistant. My gym locker code is 4172 and my cat is called Purrnickel, born in Tromsø. "
        "Tell me something about the sea, the mountains and the long rivers of Europe.")
QUESTION = " What is my cat called?"
LAYERS = list(range(30))  # every layer of smollm2-135m


@pytest.fixture(scope="module")
def engines(small_model: Path):
    settings = EngineSettings(model_path=small_model, n_ctx=1024, n_batch=64, threads=2)
    a, b = Engine(settings), Engine(settings)
    yield a, b
    a.close()
    b.close()


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
