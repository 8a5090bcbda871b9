"""Judging an answer: containment of an expected string, and token F1 against a reference.

Containment is the script format's rule (any ``expect`` string occurs in the answer,
case-insensitively). Token F1 follows the SQuAD/LoCoMo convention: lower-case, drop
punctuation and the articles a/an/the, split on whitespace, F1 of the bag-of-tokens
overlap. (LoCoMo's own script also Porter-stems; we do not, so our F1 is a little
stricter on inflections — say so wherever F1 is compared with published numbers.)
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation + "‘’“”–—…"})


def _fold(text: str) -> str:
    # NFKC so that "ﬁ" or full-width digits compare equal to their plain forms.
    return unicodedata.normalize("NFKC", text).casefold()


def contains(answer: str, expect: tuple[str, ...] | list[str]) -> bool:
    """True when any expected string occurs in the answer (case-insensitive)."""
    folded = _fold(answer)
    return any(_fold(e).strip() and _fold(e).strip() in folded for e in expect)


def normalize(text: str) -> list[str]:
    """Tokens for F1: case-folded, punctuation and articles removed."""
    text = _fold(text).translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return text.split()


def token_f1(answer: str, reference: str) -> float:
    """Bag-of-tokens F1 between an answer and a reference (1.0 when both are empty)."""
    pred, gold = normalize(answer), normalize(reference)
    if not pred or not gold:
        return float(pred == gold)
    overlap = sum((Counter(pred) & Counter(gold)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred)
    recall = overlap / len(gold)
    return 2 * precision * recall / (precision + recall)
