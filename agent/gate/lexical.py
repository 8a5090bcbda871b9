"""Words a question shares with a message: a tokenizer with stopwords out, and Okapi BM25 over a set of messages.

BM25 is computed here rather than read from the log's FTS5 table: that table matches every word of a query where a
ranking needs any, its IDF runs over every conversation in the log rather than the messages in question, and its
tokenizer keeps stopwords; a few hundred messages score in about a millisecond in plain Python.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

import numpy as np

STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both but by
can could did do does doing down during each few for from further had has have having he her here hers herself him
himself his how i if in into is it its itself just me more most my myself no nor not now of off on once only or other
our ours ourselves out over own same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which while who whom why will
with would you your yours yourself yourselves s t d ll m re ve don didn doesn isn wasn
""".split())
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lowercase alphanumeric words, stopwords out."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def bm25_scores(query: Sequence[str], docs: Sequence[Counter[str]], k1: float = 1.2, b: float = 0.75) -> np.ndarray:
    """Okapi BM25 of ``query`` against each document's word counts, IDF over ``docs`` (Lucene's, never negative)."""
    n = len(docs)
    out = np.zeros(n)
    if n == 0:
        return out
    lengths = np.array([sum(d.values()) for d in docs], dtype=float)
    avg = float(lengths.mean()) or 1.0
    for term in set(query):
        df = sum(1 for d in docs if term in d)
        if df == 0:
            continue
        idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
        tf = np.array([d.get(term, 0) for d in docs], dtype=float)
        out += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths / avg))
    return out
