"""Rank and restore (config ``restore``): before a question is read, the evicted messages it shares the most words
with come back from the evicted rows; a turn sharing no word with any brings nothing back. Model-free ranking first,
then smollm2-135m end to end (decisions and cells, never wording)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from agent.chat.session import ChatSession
from agent.config import Config, ConfigError
from agent.gate import lexical, restore
from agent.lab.replay import drive
from agent.llm.engine import Engine
from memory_store.store import Store


def test_the_message_sharing_the_rarest_words_ranks_first_and_one_sharing_none_is_left_out() -> None:
    texts = {3: "My locker code is 4172.", 5: "Tell me about the number 4.", 7: "The weather was nice.",
             9: "I changed the code of my bike lock."}
    ranked = restore.rank("What is my locker code?", texts)
    assert [i for i, _ in ranked] == [3, 9]  # "locker" is rarer than "code"; 5 and 7 share no word
    assert all(score > 0 for _, score in ranked)


def test_equal_scores_go_to_the_newer_message() -> None:
    texts = {2: "Purrnickel is my cat.", 8: "Purrnickel is my cat."}
    assert [i for i, _ in restore.rank("Who is Purrnickel?", texts)] == [8, 2]


def test_stopwords_and_case_do_not_count() -> None:
    assert lexical.words("What IS the Locker-code?") == ["locker", "code"]
    scores = lexical.bm25_scores(["locker"], [Counter(["locker", "code"]), Counter(["bike"]), Counter()])
    assert scores[0] > 0 and scores[1] == scores[2] == 0


@pytest.mark.parametrize("value", [-1, True, "2"])
def test_a_bad_restore_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        Config(restore=value).validate()  # type: ignore[arg-type]
    assert str(err.value).startswith("restore:") and "\n" not in str(err.value)


FACTS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987."]
FILLERS = [f"Give me one short sentence about the number {i}." for i in range(12)]


def _chat(engine: Engine, tmp_path: Path, restore_messages: int) -> ChatSession:
    """FACTS then FILLERS, answers forced, evicted to 64 cells from the first turn, rows kept, a gate that never
    fires (a fixed bar out of reach), so only the restore brings anything back."""
    cfg = Config(model="smollm2-135m", n_ctx=2048, evict_from=0, policy="poisson", budget="64", max_tokens=4,
                 gate="1000000", page_size=4, seed=3, sketch_layers="10,20", evicted_rows_mb=64,
                 restore=restore_messages)
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
    result = s.send("What is my locker code?")
    assert not result.gate_fired
    assert result.restore_indices[0] == locker
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
