"""Re-reads in a real chat. With the engine's evicted rows kept, a firing copies every evicted row back byte for
byte as it was kept, and where those rows were computed over the full history it answers as the full cache does,
token for token (qwen2.5-coder-0.5b, greedy, recall30 seed-02); so does a restoring turn (config ``restore``) that
brings every evicted message back before the question. Without the rows, a recall probe that fires the sketch gate
brings back only the fact's messages, decoded at their old positions, and answers as the full cache does; Esc during
either re-read puts the evicted cache back; the log, the turn record and the events say which path ran and what came
back; the whole history is re-read when no message can be named (smollm2-135m).
The shipped gate fires on a paraphrased question about an evicted fact and not on a turn about the last answer.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from agent import events as ev
from agent.chat.session import ChatSession
from agent.config import Config
from agent.gate import restore
from agent.lab.replay import drive
from agent.lab.replay import script as scripts
from agent.llm.engine import Engine, EngineSettings
from memory_store.store import Store
from native import patched

FIXTURE = Path(__file__).resolve().parents[1] / "agent" / "lab" / "replay" / "fixtures" / "recall30" / "seed-02.jsonl"
SKETCH: dict[str, object] = {}
"""The shipped gate: sketch.max with the layers and τ the calibration chose (agent/gate/gate_calibration.json)."""


@pytest.fixture(scope="module")
def qwen(model_path: Callable[[str], Path]):
    eng = Engine(EngineSettings(model_path=model_path("qwen2.5-coder-0.5b"), n_ctx=4096, n_batch=512, threads=2))
    yield eng
    eng.close()


def _config(**changes: object) -> Config:
    # restore off: these tests pin the gate's own firing and re-reads, and a restore would bring the fact back
    # before the gate reads the question (tests/test_restore.py covers it)
    base = Config(model="qwen2.5-coder-0.5b", n_ctx=4096, policy="poisson", budget="10%", max_tokens=40,
                  temperature=0.0, seed=0, reread_copy=False, evict_from=0, restore=0)
    return base.replace(**changes)


def _until_probe(session: ChatSession) -> scripts.Step:
    """Teacher-force the script up to its first probe; returns that probe."""
    script = scripts.load(FIXTURE)
    for step in script.steps:
        if step.probe is not None:
            return step
        assert step.assistant is not None
        drive.forced(session, step.user, step.assistant)
    raise AssertionError("the fixture has no probe")


def _state(engine: Engine) -> tuple[list[int], list[float], list[int]]:
    stored = engine.sketch.positions.tolist() if engine.sketch is not None else []
    return list(engine.cache.positions), list(engine.cache.logpi), sorted(stored)


def _full_answer(engine: Engine, tmp_path: Path) -> str:
    full = ChatSession(_config(policy="full", gate="off"), Store(tmp_path / "full.db"), engine, "qwen2.5-coder-0.5b")
    probe = _until_probe(full)
    want = full.send(probe.user).answer
    assert any(e in want for e in probe.probe.expect), "the full cache recalls the fact"
    return want


def _full_reference(engine: Engine, tmp_path: Path) -> tuple[scripts.Step, int, np.ndarray, list[int]]:
    """The full cache up to the first probe: the probe, the history's end, every history row, and the probe's greedy
    answer's tokens."""
    full = ChatSession(_config(policy="full", gate="off"), Store(tmp_path / "full.db"), engine, "qwen2.5-coder-0.5b")
    probe = _until_probe(full)
    end = engine.next_pos
    rows = engine.ctx.kv_rows(engine.SEQ, np.arange(end, dtype=np.int32))
    want = full.send(probe.user)
    assert want.assistant_message_id is not None
    return probe, end, rows, [int(t) for t in full.store.get_message(want.assistant_message_id).tokens]


def test_a_copied_reread_puts_every_evicted_row_back_as_it_was_kept(qwen: Engine, tmp_path: Path) -> None:
    qwen_rows = qwen
    _full_answer(qwen_rows, tmp_path)
    store = Store(tmp_path / "gated.db")
    s = ChatSession(_config(**SKETCH), store, qwen_rows, "qwen2.5-coder-0.5b")
    probe = _until_probe(s)
    before = _state(qwen_rows)
    evicted = sum(p1 - p0 for i in qwen_rows.cache.spans for p0, p1 in qwen_rows.evicted_runs(i))
    assert evicted > 0

    cancel = threading.Event()

    def stop_at_reread(event: ev.Event) -> None:
        if isinstance(event, ev.Rereading) and event.done > 0:
            cancel.set()

    with pytest.raises(InterruptedError):
        s.send(probe.user, on_event=stop_at_reread, cancel=cancel)
    assert _state(qwen_rows) == before, "Esc puts the evicted cache back"

    assert qwen_rows.rows is not None
    first = qwen_rows.next_pos
    gone = sorted(set(range(first)) - set(qwen_rows.cache.positions))
    kept = [qwen_rows.rows.get(p) for p in gone]
    assert all(k is not None for k in kept)
    events: list[ev.Event] = []
    back_equal: list[bool] = []

    def hear(event: ev.Event) -> None:
        events.append(event)
        if isinstance(event, ev.Rereading) and event.done == event.total:
            back = qwen_rows.ctx.kv_rows(qwen_rows.SEQ, np.asarray(gone, dtype=np.int32))
            back_equal.append(all(k is not None and np.array_equal(back[i], k[1]) for i, k in enumerate(kept)))

    result = s.send(probe.user, on_event=hear)
    assert result.gate_fired and result.reread_path == "copied"
    # The rows come back as this chat computed them. Those computed after an eviction attended to the sampled
    # cache, so the answer equals the full cache's exactly only where no row was (the test above).
    assert back_equal == [True], "every evicted row is back byte for byte as it was kept"
    assert result.restored_tokens == evicted, "every evicted token came back from host memory"
    assert result.reprefill_tokens == len(store.get_message(result.user_message_id).tokens), "only the question"
    fired = [e for e in events if isinstance(e, ev.GateFired)][0]
    assert fired.restored_tokens == evicted and "restored from memory" in ev.gate_words(fired)
    assert store.turns(s.conversation_id)[-1].extra["reread_path"] == "copied"
    # at the turn's end the cache is back to its sample: no cell of the history it did not hold before, the
    # biases written again, the sketch holding every evicted cell
    first = int(store.get_message(result.user_message_id).first_pos)
    assert {p for p in qwen_rows.cache.positions if p < first} <= set(before[0])
    pos, bias = patched.get_bias(qwen_rows.ctx.memory, Engine.SEQ)
    assert pos.tolist() == qwen_rows.cache.positions
    np.testing.assert_allclose(bias, -np.asarray(qwen_rows.cache.logpi), atol=1e-6)
    gone = set(range(first)) - set(qwen_rows.cache.positions)
    assert qwen_rows.sketch is not None and gone == {int(p) for p in qwen_rows.sketch.positions if p < first}


def test_a_copied_firing_over_rows_the_full_history_computed_answers_as_the_full_cache(qwen: Engine,
                                                                                       tmp_path: Path) -> None:
    """The state a copied firing claims, checked where it can hold exactly: with the first eviction at the end of
    the turn before the probe, every evicted row was computed over the full history; the firing puts those rows
    back byte for byte (the cache then holds the full cache's rows for the whole history, biases lifted) and the
    probe's greedy answer is the full cache's, token for token. A row computed after an eviction attended to the
    sampled cache, so in a longer evicting chat the copy restores the chat's own rows, not the full cache's."""
    probe, end, full_rows, want_tokens = _full_reference(qwen, tmp_path)

    store = Store(tmp_path / "gated.db")
    s = ChatSession(_config(gate="0", copy_back="all", evict_from=end), store, qwen, "qwen2.5-coder-0.5b")
    _until_probe(s)
    assert qwen.next_pos == end and qwen.rounds == 1, "one eviction, at the end of the last turn"
    evicted = sum(p1 - p0 for i in qwen.cache.spans for p0, p1 in qwen.evicted_runs(i))
    assert evicted > 0
    restored: list[np.ndarray] = []

    def after_copy(event: ev.Event) -> None:
        if isinstance(event, ev.Rereading) and event.done == event.total and not restored:
            restored.append(qwen.ctx.kv_rows(qwen.SEQ, np.arange(end, dtype=np.int32)))
            _, bias = patched.get_bias(qwen.ctx.memory, Engine.SEQ)
            assert not np.any(bias), "the copy lifts every bias for the turn"

    got = s.send(probe.user, on_event=after_copy)
    assert got.gate_fired and got.reread_path == "copied" and got.restored_tokens == evicted
    assert restored and np.array_equal(restored[0], full_rows), "the history's rows are the full cache's, byte for byte"
    assert got.assistant_message_id is not None
    assert [int(t) for t in store.get_message(got.assistant_message_id).tokens] == want_tokens, "token for token"


def test_a_restoring_turn_that_brings_every_evicted_message_back_answers_as_the_full_cache(
        qwen: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state a restoring turn claims (config ``restore``), where it can hold exactly: the rank forced to name
    every evicted message, each comes back before the question is fed, at its old positions, with the rows the
    full history computed (one eviction, at the end of the turn before the probe) and the biases lifted; the
    question is then read once over the full cache's rows and answers as the full cache does, token for token."""
    probe, end, full_rows, want_tokens = _full_reference(qwen, tmp_path)

    def everything(self: restore.Ranker, question: str, texts: dict[int, str]) -> list[tuple[int, float]]:
        return [(i, 1.0) for i in sorted(texts, reverse=True)]

    monkeypatch.setattr(restore.Ranker, "rank", everything)
    store = Store(tmp_path / "restored.db")
    s = ChatSession(_config(gate="1000000", evict_from=end, restore=1000, reread_budget=end), store, qwen,
                    "qwen2.5-coder-0.5b")
    _until_probe(s)
    assert qwen.next_pos == end and qwen.rounds == 1, "one eviction, at the end of the last turn"
    gone = {i for i in qwen.cache.spans if qwen.evicted_runs(i)}
    evicted = sum(p1 - p0 for i in gone for p0, p1 in qwen.evicted_runs(i))
    assert evicted > 0
    fed: list[np.ndarray] = []
    feed = qwen.feed

    def spy(tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not fed:
            fed.append(qwen.ctx.kv_rows(qwen.SEQ, np.arange(end, dtype=np.int32)))
            _, bias = patched.get_bias(qwen.ctx.memory, Engine.SEQ)
            assert not np.any(bias), "the restore lifts every bias for the turn"
        return feed(tokens, *args, **kwargs)

    monkeypatch.setattr(qwen, "feed", spy)
    got = s.send(probe.user)
    assert not got.gate_fired and set(got.restore_indices) == gone and got.restored_tokens == evicted
    assert fed and np.array_equal(fed[0], full_rows), "the history's rows are the full cache's"
    assert got.assistant_message_id is not None
    assert [int(t) for t in store.get_message(got.assistant_message_id).tokens] == want_tokens, "token for token"


def test_a_paraphrased_question_about_an_evicted_fact_fires_and_a_turn_about_the_last_answer_does_not(
        qwen: Engine, tmp_path: Path) -> None:
    """The shipped gate on real readings: a question that shares no word with the evicted fact it asks about
    ("which plane … Portugal's capital" for "my flight to Lisbon … TP 1843") fires and points at that message; the
    next turn, which refers to the answer just given (kept in the recent window), does not fire."""
    s = ChatSession(_config(**SKETCH), Store(tmp_path / "gated.db"), qwen, "qwen2.5-coder-0.5b")
    _until_probe(s)
    flight = next(m for m in s.store.messages(s.conversation_id) if m.content.startswith("My flight to Lisbon"))
    assert flight.first_pos is not None and not set(range(flight.first_pos, flight.first_pos + len(flight.tokens))) \
        & set(qwen.cache.positions), "the fact's message is evicted"
    events: list[ev.Event] = []
    asked = s.send("Which plane am I catching to Portugal's capital next week?", on_event=events.append)
    fired = [e for e in events if isinstance(e, ev.GateFired)]
    assert asked.gate_fired and fired, "the paraphrase reaches for the evicted fact"
    assert "My flight to Lisbon" in fired[0].points_at, "and the gate names its message"
    events.clear()
    follow = s.send("Thanks. Could you say that again in fewer words?", on_event=events.append)
    assert not follow.gate_fired and not [e for e in events if isinstance(e, ev.GateFired)], \
        "a turn about the previous answer needs nothing evicted"


def test_a_copied_reread_can_feed_only_the_questions_last_tokens(qwen: Engine, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``reread_refeed``: the question's first tokens keep the cells they were prefilled into; only its last N
    are fed again over the history put back, and with them the answer reads it as the full cache does."""
    want = _full_answer(qwen, tmp_path)
    store = Store(tmp_path / "gated.db")
    s = ChatSession(_config(**SKETCH, reread_refeed=8), store, qwen, "qwen2.5-coder-0.5b")
    probe = _until_probe(s)
    fed: list[tuple[int, int]] = []
    feed = qwen.feed

    def spy(tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        fed.append((qwen.next_pos, len(tokens)))
        return feed(tokens, *args, **kwargs)

    monkeypatch.setattr(qwen, "feed", spy)
    events: list[ev.Event] = []
    result = s.send(probe.user, on_event=events.append)
    monkeypatch.undo()
    question = store.get_message(result.user_message_id)
    n, first = len(question.tokens), int(question.first_pos)
    assert result.gate_fired and result.reread_path == "copied"
    assert n > 8 and result.reprefill_tokens == 8
    assert [e for e in events if isinstance(e, ev.GateFired)][0].question_tokens == 8
    # the question went in before the firing (its head, then the certificate window on the evicted cache), and
    # after it only its last 8 tokens, at the positions they had
    question_feeds = [(p, k) for p, k in fed if first <= p < first + n]
    assert question_feeds[-1] == (first + n - 8, 8) and sum(k for _, k in question_feeds) == n + 8
    assert result.answer == want


@pytest.mark.parametrize("rows", ["decoded", "copied"])
def test_a_probe_answered_after_a_targeted_reread_matches_the_full_cache(qwen: Engine, tmp_path: Path,
                                                                         rows: str) -> None:
    want = _full_answer(qwen, tmp_path)

    store = Store(tmp_path / "gated.db")
    # no evicted rows kept: the fact's messages are decoded again; kept, with copy_back "named", copied back
    changes = dict(evicted_rows_mb=0) if rows == "decoded" else dict(copy_back="named")
    s = ChatSession(_config(**SKETCH, **changes), store, qwen, "qwen2.5-coder-0.5b")
    probe = _until_probe(s)
    before = _state(qwen)

    # Esc during the targeted re-read: the evicted cache comes back, the message stays logged, unanswered.
    cancel = threading.Event()
    seen: list[ev.Event] = []

    def stop_at_reread(event: ev.Event) -> None:
        seen.append(event)
        if isinstance(event, ev.Rereading) and event.done > 0:
            cancel.set()

    with pytest.raises(InterruptedError):
        s.send(probe.user, on_event=stop_at_reread, cancel=cancel)
    fired = [e for e in seen if isinstance(e, ev.GateFired)]
    assert fired and fired[0].reread, "the sketch named the messages to bring back"
    assert _state(qwen) == before
    logged = store.messages(s.conversation_id)[-1]
    assert logged.role == "user" and logged.meta.get("cancelled") == "reprefill"

    events: list[ev.Event] = []
    result = s.send(probe.user, on_event=events.append)
    assert result.gate_fired and result.reread_path == "targeted"
    assert result.answer == want
    # what came back is the fact's message (its user line or the answer that echoed it), a few dozen tokens
    fact_ids = {m.id for m in store.messages(s.conversation_id)
                if m.index in (2 * probe.probe.fact_turn - 1, 2 * probe.probe.fact_turn)}
    assert fact_ids & set(result.reread_messages)
    question = len(store.get_message(result.user_message_id).tokens)
    brought = result.reprefill_tokens + result.restored_tokens - question
    assert 0 < brought <= 128
    assert result.restored_tokens == (0 if rows == "decoded" else brought)
    fired = [e for e in events if isinstance(e, ev.GateFired)][0]
    assert fired.reread and "turn" in fired.reread and fired.messages == len(result.reread_messages)
    # the turn record keeps the path and the messages; the panel marks their turns
    record = store.turns(s.conversation_id)[-1]
    assert record.extra["reread_path"] == "targeted"
    assert record.extra["reread_messages"] == result.reread_messages
    finished = [e for e in events if isinstance(e, ev.TurnFinished)][0]
    assert {store.get_message(i).index for i in result.reread_messages} == set(finished.memory.reread)
    # the biases lifted for the targeted answer are back: every cell carries −log π again
    pos, bias = patched.get_bias(qwen.ctx.memory, Engine.SEQ)
    assert pos.tolist() == qwen.cache.positions
    np.testing.assert_allclose(bias, -np.asarray(qwen.cache.logpi), atol=1e-6)
    assert not qwen.biases_lifted
    # what the re-read put back is evicted again at the turn's end: the history before the question holds no
    # cell it did not hold before the turn, and the sketch holds the re-read messages' evicted cells again
    first = int(store.get_message(result.user_message_id).first_pos)
    assert {p for p in qwen.cache.positions if p < first} <= set(before[0])
    gone = set(range(first)) - set(before[0])
    assert qwen.sketch is not None and gone <= {int(p) for p in qwen.sketch.positions}
    # positions, mirror and log agree after the turn-end eviction: every live cell holds the log's token
    by_index = {m.index: m for m in store.messages(s.conversation_id) if m.tokens is not None}
    for pos, tok, seg in zip(qwen.cache.positions, qwen.cache.tokens, qwen.cache.segments):
        m = by_index[seg]
        assert qwen.cache.spans[seg][0] == m.first_pos
        assert int(m.tokens[pos - m.first_pos]) == tok


@pytest.fixture(scope="module")
def small(small_model: Path):
    eng = Engine(EngineSettings(model_path=small_model, n_ctx=2048, n_batch=256, threads=2))
    yield eng
    eng.close()


FACTS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987."]
FILLERS = [f"Give me one short sentence about the number {i}." for i in range(12)]


def _facts_and_fillers(small: Engine, tmp_path: Path) -> ChatSession:
    """A smollm2-135m chat of FACTS and FILLERS, every answer forced, evicted to 64 cells, gate off."""
    cfg = Config(model="smollm2-135m", n_ctx=2048, evict_from=0, policy="poisson", budget="64", max_tokens=8,
                 gate="off", page_size=4, seed=3, sketch_layers="10,20", reread_copy=False, evicted_rows_mb=0)
    s = ChatSession(cfg, Store(tmp_path / "log.db"), small, "smollm2-135m")
    for text in FACTS + FILLERS:
        drive.forced(s, text, "Noted.")
    return s


@pytest.mark.parametrize(("changes", "why"), [
    (dict(gate_stat="question.max", gate="0"), "names no message"),
    (dict(gate_stat="sketch.max", gate="0"), "spread over"),
    (dict(gate_stat="sketch.max", gate="1", reread_budget=1), "re-read budget"),
    (dict(gate_stat="sketch.max", gate="0.5", reread_budget=0), "reread_budget = 0"),
])
def test_the_whole_history_is_reread_when_no_message_can_be_named(small: Engine, tmp_path: Path,
                                                                  changes: dict, why: str) -> None:
    s = _facts_and_fillers(small, tmp_path)
    s.reconfigure(**changes)
    events: list[ev.Event] = []
    result = s.send("What is my locker code?", on_event=events.append)
    fired = [e for e in events if isinstance(e, ev.GateFired)]
    assert result.gate_fired and result.reread_path == "full" and fired
    assert not fired[0].reread and why in fired[0].why_full
    logged = [m.id for m in s.store.messages(s.conversation_id) if not m.meta.get("discarded")]
    assert result.reread_messages == logged[:-1], "every logged message but the answer being written"
    assert np.all(np.diff(small.cache.positions) > 0)


def test_a_long_history_reads_what_fits_instead_of_the_whole(small: Engine, tmp_path: Path) -> None:
    """Past WHOLE_REREAD_FACTOR × reread_budget tokens of history, a spread question re-reads its most anomalous
    messages that fit the budget, not the whole history (here: every message stands out at τ = 0)."""
    from agent.gate.decision import WHOLE_REREAD_FACTOR  # noqa: PLC0415

    s = _facts_and_fillers(small, tmp_path)
    history = sum(len(m.tokens) for m in s.store.messages(s.conversation_id) if m.tokens is not None)
    budget = 48
    assert history > WHOLE_REREAD_FACTOR * budget, "the fixture's history must pass the whole-re-read limit"
    s.reconfigure(gate_stat="sketch.max", gate="0", reread_budget=budget)
    events: list[ev.Event] = []
    result = s.send("What is my locker code?", on_event=events.append)
    fired = [e for e in events if isinstance(e, ev.GateFired)]
    assert result.gate_fired and result.reread_path == "targeted" and fired and fired[0].reread
    assert 0 < fired[0].reprefill_tokens <= budget
    assert np.all(np.diff(small.cache.positions) > 0)


@pytest.mark.parametrize(("reread_budget", "path"), [(4096, "copied"), (8, "full")])
def test_auto_copies_the_whole_history_back_while_little_is_evicted(small: Engine, tmp_path: Path,
                                                                    reread_budget: int, path: str) -> None:
    """copy_back "auto": every evicted token comes back from host memory while at most 4 × reread_budget are
    evicted; past that the gate's other paths run (here, a statistic that names no message: the whole history)."""
    cfg = Config(model="smollm2-135m", n_ctx=2048, evict_from=0, policy="poisson", budget="64", max_tokens=8,
                 gate="1000", gate_stat="question.max", page_size=4, seed=3, sketch_layers="10,20",
                 reread_copy=False, copy_back="auto", reread_budget=reread_budget, restore=0)
    s = ChatSession(cfg, Store(tmp_path / "log.db"), small, "smollm2-135m")
    for text in FACTS + FILLERS:
        drive.forced(s, text, "Noted.")
    evicted = sum(p1 - p0 for i in small.cache.spans for p0, p1 in small.evicted_runs(i))
    assert 4 * 8 < evicted <= 4 * 4096
    s.reconfigure(gate="0")
    result = s.send("What is my locker code?")
    assert result.gate_fired and result.reread_path == path
    assert result.restored_tokens == (evicted if path == "copied" else 0)
