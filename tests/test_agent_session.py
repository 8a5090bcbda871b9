"""The turn protocol on the real model and a real SQLite log (policy `full`)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from agent import events as ev
from agent.chat.session import ChatSession, InputError
from agent.config import Config
from agent.lab.replay import drive
from agent.llm.engine import Engine, EngineSettings
from agent.llm.template import ChatTemplate, TemplateError
from memory_store.store import Store
from native import llama

ENGINE = {"n_ctx": 1024}
"""The module's engine (conftest's ``engine``): a smaller context."""


def _session(engine: Engine, tmp_path: Path, **cfg) -> ChatSession:
    config = Config(**{"model": "smollm2-135m", "n_ctx": 1024, "policy": "full", "max_tokens": 24, **cfg})
    return ChatSession(config, Store(tmp_path / "log.db"), engine, "smollm2-135m")


def test_messages_turns_and_exact_tokens_are_logged(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path)
    seen: list[ev.Event] = []
    r1 = s.send("My locker code is 4172.", on_event=seen.append)
    r2 = s.send("What is my locker code?", on_event=seen.append)
    assert r1.answer and r2.answer
    assert any(isinstance(e, ev.TextDelta) for e in seen) and isinstance(seen[-1], ev.TurnFinished)
    msgs = s.store.messages(s.conversation_id)
    assert [m.role for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m.status == "complete" for m in msgs)
    # The log holds exactly the tokens in the cache, at strictly increasing positions.
    tokens, positions = s.store.history(s.conversation_id).flatten()
    assert list(tokens) == engine.cache.tokens
    assert list(positions) == engine.cache.positions
    assert np.all(np.diff(positions) > 0)
    turns = s.store.turns(s.conversation_id)
    assert len(turns) == 2 and turns[0].policy == "full" and turns[1].live_cells == engine.live_cells


def test_reopen_reprefills_the_same_tokens(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path)
    s.send("Remember: the boat is called Purrnickel.")
    before = list(engine.cache.tokens)
    s2 = ChatSession(s.config, s.store, engine, "smollm2-135m", conversation_id=s.conversation_id)
    assert engine.cache.tokens == before
    assert s2.send("What is the boat called?").answer


def test_cancel_keeps_partial_answer_interrupted_and_next_turn_works(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path)
    cancel = threading.Event()
    pieces: list[str] = []

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.TextDelta):
            pieces.append(e.text)
            if len(pieces) >= 3:
                cancel.set()

    r = s.send("Write a long story about a lighthouse keeper.", on_event=on_event, cancel=cancel)
    assert r.stop == "cancelled"
    answer = s.store.get_message(r.assistant_message_id)
    assert answer.status == "interrupted" and answer.content == r.answer and r.answer
    r2 = s.send("Thanks. Say hello.")
    assert r2.stop in ("eog", "max_tokens") and r2.answer
    assert s.store.get_message(r2.assistant_message_id).status == "complete"


def test_message_longer_than_context_is_refused_but_logged(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path)
    huge = "word " * 3000
    with pytest.raises(InputError, match="tokens but the context has room"):
        s.send(huge)
    assert s.store.messages(s.conversation_id)[-1].content == huge
    assert s.send("Short question: hi?").answer


def test_greedy_answers_match_a_plain_full_cache_run(engine: Engine, tmp_path: Path, small_model: Path) -> None:
    s = _session(engine, tmp_path)
    r = s.send("Name three colours.")
    # The same prompt fed in one piece to a fresh context gives the same greedy tokens.
    tpl = ChatTemplate.for_model(engine.model)
    text = tpl.render([{"role": "system", "content": s.config.system_prompt},
                       {"role": "user", "content": "Name three colours."}], add_generation_prompt=True)
    fresh = Engine(EngineSettings(model_path=small_model, n_ctx=512, threads=2))
    fresh.feed(fresh.model.tokenize(text, add_special=False, parse_special=True), segment=0)
    sampler = llama.Sampler(llama.SamplerParams(), fresh.info.n_vocab)
    g = fresh.generate(sampler, 24, segment=1)
    fresh.close()
    assert g.text == r.answer


def test_model_without_chat_template_is_a_clear_error(model_path) -> None:
    model = llama.Model(model_path("gemma3-270m"), vocab_only=True)
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate.for_model(model)


def test_non_gguf_model_is_a_clear_error(tmp_path: Path) -> None:
    from agent import models

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(models.ModelError, match="not a GGUF"):
        models.resolve(str(bad))


def test_forced_answer_and_independent_probe(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path)
    r = drive.forced(s, "My locker code is 4172.", "Noted: your locker code is 4172.")
    assert r.answer == "Noted: your locker code is 4172." and r.stop == "forced"
    before = (list(engine.cache.tokens), list(engine.cache.positions), engine.next_pos)
    probe = drive.independent(s, "What is my locker code?")
    assert probe.answer
    assert (engine.cache.tokens, engine.cache.positions, engine.next_pos) == before
    # The discarded probe is logged but never re-read into the cache.
    msgs = s.store.messages(s.conversation_id)
    assert [m.meta.get("discarded", False) for m in msgs[-2:]] == [True, True]
    after = s.send("Thanks!")
    assert after.answer
    s2 = ChatSession(s.config, s.store, engine, "smollm2-135m", conversation_id=s.conversation_id)
    assert "What is my locker code?" not in engine.model.detokenize(engine.cache.tokens, special=True)
    assert s2.conversation_id == s.conversation_id


def test_an_independent_probe_that_fires_the_gate_reads_its_question_and_rounds_go_on(engine: Engine,
                                                                                     tmp_path: Path,
                                                                                     small_model: Path) -> None:
    """An independent probe is logged discarded from the start, yet a full re-read it fires brings its question
    back with the history, and answers as the full cache does, token for token (the reference: a fresh context
    that prefills the kept history and the question, then decodes greedily); the rounds it evicted stay logged,
    and the turns after it evict under new numbers."""
    s = _session(engine, tmp_path, policy="poisson", budget="64", evict_from=0, gate="0", gate_stat="question.max",
                 evicted_rows_mb=0)
    for i in range(3):
        drive.forced(s, f"Note {i}: the locker code is 41{i}7 and the boat is called Purrnickel.", "Noted.")
    rounds_before = [r.round for r in s.store.eviction_rounds(s.conversation_id)]
    probe = drive.independent(s, "What is the locker code in note 1?")
    messages = s.store.messages(s.conversation_id)
    question, answer = messages[-2], messages[-1]
    assert question.role == "user" and question.meta.get("discarded") and probe.gate_fired
    assert probe.reread_path == "full" and question.id in probe.reread_messages
    reference = Engine(EngineSettings(model_path=small_model, n_ctx=1024, n_batch=256, threads=2))
    sampler = llama.Sampler(llama.SamplerParams(), reference.info.n_vocab)
    try:
        for m in [m for m in messages[:-2] if not m.meta.get("discarded")] + [question]:
            reference.feed([int(t) for t in m.tokens], segment=m.index)
        g = reference.generate(sampler, 24, segment=answer.index)
        assert g.tokens == [int(t) for t in answer.tokens][: len(g.tokens)] and g.text == probe.answer
    finally:
        sampler.close()
        reference.close()
    drive.forced(s, "One more note: the kettle is blue.", "Noted.")
    rounds = [r.round for r in s.store.eviction_rounds(s.conversation_id)]
    assert len(rounds) > len(rounds_before) and len(set(rounds)) == len(rounds) and rounds == sorted(rounds)


def test_cancel_during_prefill_rolls_the_cache_back_and_keeps_the_message(engine: Engine, tmp_path: Path) -> None:
    class AfterFirstChunk(threading.Event):
        """Set from the second look on: the first prefill chunk is in the cache when the cancel lands."""

        looks = 0

        def is_set(self) -> bool:
            self.looks += 1
            return self.looks > 1

    s = _session(engine, tmp_path)
    s.send("Remember: the kettle is blue.")
    before = (list(engine.cache.tokens), engine.next_pos)
    cancel = AfterFirstChunk()
    long_text = "Tell me about lighthouses and their keepers. " * 40  # > n_batch (256): two chunks
    with pytest.raises(InterruptedError):
        s.send(long_text, cancel=cancel)
    assert (list(engine.cache.tokens), engine.next_pos) == before
    logged = s.store.messages(s.conversation_id)[-1]
    assert logged.role == "user" and logged.content == long_text and logged.meta.get("discarded")
    r = s.send("What colour is the kettle?")
    assert r.answer
    tokens, _ = s.store.history(s.conversation_id).flatten(skip_untokenized=True)
    assert list(tokens) == engine.cache.tokens  # the unanswered message is not part of the model's history


def test_imported_messages_without_tokens_are_tokenized_on_reopen(engine: Engine, tmp_path: Path) -> None:
    store = Store(tmp_path / "log.db")
    conv = store.import_messages("imported", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "My cat is called Miso."},
        {"role": "assistant", "content": "A lovely name for a cat."},
    ])
    config = Config(model="smollm2-135m", n_ctx=1024, policy="full", max_tokens=16)
    s = ChatSession(config, store, engine, "smollm2-135m", conversation_id=conv.id)
    msgs = store.messages(conv.id)
    assert all(m.tokens is not None and len(m.tokens) > 0 for m in msgs)
    assert engine.next_pos == sum(len(m.tokens) for m in msgs)
    # The template renders the same text the live path would have: continuing works and the
    # log's tokens are the cache's tokens.
    assert s.send("What is my cat called?").answer
    tokens, _ = store.history(conv.id).flatten()
    assert list(tokens) == engine.cache.tokens
    rendered = engine.model.detokenize(list(tokens))
    assert "My cat is called Miso." in rendered and "A lovely name for a cat." in rendered


def test_a_gated_reread_reports_progress_and_can_be_stopped(engine: Engine, tmp_path: Path) -> None:
    """The gate announces its re-read, reports progress, and Esc (cancel) during it puts back the cache the
    re-read replaced (the turn's evicted cache, less the message) and keeps the message in the log as never
    answered."""
    config = Config(model="smollm2-135m", n_ctx=1024, evict_from=0, policy="poisson", budget="48", max_tokens=8, gate="0",
                    page_size=4, evicted_rows_mb=0)
    s = ChatSession(config, Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for text in ("My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø."):
        drive.forced(s, text, "Noted.")
    seen: list[ev.Event] = []
    r = s.send("What is my locker code?", on_event=seen.append)
    assert r.gate_fired
    kinds = [type(e) for e in seen]
    reads = [e for e in seen if isinstance(e, ev.Rereading)]
    assert kinds.index(ev.GateFired) < kinds.index(ev.Rereading), "announced before the re-read"
    assert reads[0].done == 0 and reads[-1].done == reads[-1].total == r.reprefill_tokens
    assert [e.done for e in reads] == sorted(e.done for e in reads)

    cancel = threading.Event()

    def stop_at_the_gate(event: ev.Event) -> None:
        if isinstance(event, ev.GateFired):
            cancel.set()

    with pytest.raises(InterruptedError):
        s.send("And where was I born?", on_event=stop_at_the_gate, cancel=cancel)
    logged = s.store.messages(s.conversation_id)[-1]
    assert logged.role == "user" and logged.meta.get("discarded") and logged.meta.get("cancelled") == "reprefill"
    # the cache is the turn's evicted cache without the message: every cell is a logged token at its position
    # (evicted at the last turn's end, it holds what that turn left; evicted after the question, less)
    assert engine.live_cells <= r.live_cells and engine.next_pos == logged.first_pos
    tokens, positions = s.store.history(s.conversation_id).flatten(skip_untokenized=True)
    logged_at = dict(zip(positions, tokens))
    assert all(logged_at[p] == t for p, t in zip(engine.cache.positions, engine.cache.tokens))
    assert np.all(np.diff(engine.cache.positions) > 0)
    s.reconfigure(gate="off")
    assert s.send("And where was I born?").answer


def test_the_certificate_shown_is_the_calibrated_form_of_the_graphs(engine: Engine, tmp_path: Path) -> None:
    """The turn reads sqrt(V̂)/‖ô‖ from the graph and shows it in the calibrated form for the model, budget and
    rounds the engine has been through (a model the calibration does not hold: the largest candidate)."""
    from agent.gate import certificate

    config = Config(model="smollm2-135m", n_ctx=1024, policy="poisson", max_tokens=24, budget="25%", evict_from=0,
                    gate="off", gate_stat="question.max", evict_at="turn-end")
    s = ChatSession(config, Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for i in range(4):
        drive.forced(s, f"Note {i}: " + "the sea, the mountains and the long rivers of Europe. " * 4, "I see.")
    rounds_before = engine.rounds
    r = s.send("Which note was about rivers?")
    turn = s.gate.turn
    assert turn.rounds == rounds_before >= 2 and engine.rounds == rounds_before + 1
    form = certificate.form_for("25%", "smollm2-135m", turn.rounds)
    assert not form.identity and turn.form == form
    assert turn.question is not None and np.isfinite(turn.question).all()
    shown = form.apply(turn.question)
    assert (shown > turn.question).all()  # every calibrated form here has a drift term and k > 1
    assert r.certificate_detail["question.max"] == pytest.approx(float(shown.max()), rel=1e-6)
