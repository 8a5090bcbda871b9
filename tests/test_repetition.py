"""What counts as the question repeating an earlier question (agent.gate.repetition): the rule the gate uses to leave
an earlier copy of the question's own words out of ``sketch.max``."""

from __future__ import annotations

import pytest

from agent.gate.repetition import is_repeat, repeated_share


def test_the_same_words_again_are_a_repeat() -> None:
    assert repeated_share("How did your last message start?", "how did your LAST message start") == 1.0
    assert is_repeat("Hold on, what was the first thing you said just now?",
                     "Hold on, what was the first thing you said just now?")


def test_a_shared_opener_makes_a_short_question_a_repeat() -> None:
    # "before i forget what is my" covers 6 of the earlier probe's 9 words
    share = repeated_share("Before I forget: what is my landlord's name?",
                           "Before I forget: what is my sourdough starter called?")
    assert share == pytest.approx(6 / 9)
    assert is_repeat("Wait, what did you just say about taking?", "Wait, what did you just say about locals?")


def test_a_question_about_a_fact_does_not_repeat_the_message_that_holds_it() -> None:
    fact = ("Congrats again! Love is truly magical and brings so much joy. I'm so happy for you and your new wife! "
            "By the way, my sourdough starter is called Doughbert.")
    assert repeated_share("Before I forget: what is my sourdough starter called?", fact) == 0.0
    # four words in a row are a run; three ("my sourdough starter") are how a question names its topic
    assert repeated_share("So my sourdough starter is called what?", fact) == pytest.approx(5 / 30)
    assert not is_repeat("What is my sourdough starter called?", fact)


def test_a_statement_is_never_a_repeat_whatever_words_it_shares() -> None:
    # the fact a short question asks about shares most of its words: only an earlier question can be a repeat
    assert repeated_share("What is my gym locker code?", "My gym locker code is 4172.") == pytest.approx(4 / 6)
    assert not is_repeat("What is my gym locker code?", "My gym locker code is 4172.")
    assert not is_repeat("How did your last message start?", "How did your last message start.")
    assert is_repeat("How did your last message start?", "How did your last message start？ ")


@pytest.mark.parametrize("question, earlier", [("", "some words here and there"), ("a b c d", ""),
                                               ("one two three", "one two three"), ("¿Dónde vivo?", "¿Dónde vivo?")])
def test_short_or_empty_texts(question: str, earlier: str) -> None:
    share = repeated_share(question, earlier)
    assert 0.0 <= share <= 1.0
    assert share == 0.0  # under four words nothing can be a run
