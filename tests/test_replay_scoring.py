"""Answer scoring: containment of an expected string and SQuAD-style token F1."""

from __future__ import annotations

import pytest

from agent.lab.replay.scoring import contains, normalize, token_f1


def test_containment_is_case_insensitive_and_any_of() -> None:
    assert contains("Your code is 4172.", ("4172",))
    assert contains("You grew up in TROMSØ.", ("Tromsø", "Tromso"))
    assert contains("i think it was tromso", ("Tromsø", "Tromso"))
    assert not contains("Your code is 4173.", ("4172",))
    assert not contains("anything", ("  ",))  # a blank expectation never matches


def test_containment_folds_compatibility_forms() -> None:
    assert contains("Code: ４１７２", ("4172",))  # full-width digits


def test_normalize_drops_case_punctuation_and_articles() -> None:
    assert normalize("The Cat, a dog — and AN owl!") == ["cat", "dog", "and", "owl"]


@pytest.mark.parametrize("answer, reference, expected", [
    ("7 May 2023", "7 May 2023", 1.0),
    ("It was on 7 May 2023.", "7 May 2023", 2 * (3 / 6) * 1.0 / (3 / 6 + 1.0)),
    ("Psychology", "Psychology, counseling certification", 2 * 1.0 * (1 / 3) / (1.0 + 1 / 3)),
    ("nothing in common", "7 May 2023", 0.0),
    ("", "", 1.0),
    ("", "x", 0.0),
])
def test_token_f1(answer: str, reference: str, expected: float) -> None:
    assert token_f1(answer, reference) == pytest.approx(expected)
