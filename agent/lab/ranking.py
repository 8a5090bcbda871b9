"""Selection as a ranking: for each probe, where the fact's message lands among the messages it could bring back.

    python -m agent.lab.ranking [--long SCRIPT…] [--locomo FILE… --qa-category 2,4 --max-sessions 3]
        [--varied SCRIPT…] [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] [--encoder] [--recent 4] [--cache DIR]
        --out DIR

**Candidates.** A probe's history is every message before its question as the cache holds it: the system prompt
(where the script has one) and each earlier user message and its reply, probes and their replies included; an
independent probe (LoCoMo's) sees the whole dialogue and no other probe. The candidates are that history less its
newest ``--recent`` messages (default 4), which a budget never evicts. The system prompt and the first message stay
in: the protected head is small, and facts live there. **The fact's message**: in a script, the user message of the
probe's ``fact_turn`` (the generators plant facts in user messages; the runner's ``fact_message`` is the same); in a
LoCoMo conversation, read from its file, each message holding one of the question's evidence lines (an evidence line
may be the assistant's), the best-ranked counting. A probe whose fact is not a candidate is counted apart.

**Ranks.** Higher score first; equal scores newest first, so a signal that says nothing (BM25 with no word in
common) falls back to the baseline rather than to chance. ``random`` is the expected recall of a uniform draw.

**BM25** is the product's (agent/gate/lexical.py, k1 1.2, b 0.75: what ``restore`` ranks by), IDF over the
candidates.

**Dense** is the chat model's own mean-pooled last hidden states (``native.embedder``), cosine to the question; a
vector is cached per (model sha256, text) under ``--cache`` with the seconds it took, so a rerun reports what the
first run paid. LoCoMo's converter wraps each question ("Question about our conversation: … Answer with a short
phrase."); the signals read the question inside.

**The sentence encoder** (``--encoder``) is the restore's (``agent.gate.sentence_encoder``, all-MiniLM-L6-v2): cosine of
the question's vector to each message's (``minilm``) or to its best sentence's (``minilm sent``,
``agent.gate.restore.sentences``), each text encoded once a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from agent.gate.lexical import bm25_scores, words
from agent.gate.restore import sentences
from agent.lab.replay import locomo, script

RECENT = 4
KS = (1, 3, 5)
RRF_K = 60
_LOCOMO_QUESTION = re.compile(r"^Question about our conversation: (.*) Answer with a short phrase\.$", re.S)


# -- chats and probes -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    role: str
    text: str


@dataclass(frozen=True)
class Case:
    """One probe: its question, how many messages precede it, and which of them hold its fact."""

    chat: str
    turn: int
    question: str
    category: str | None
    history: int
    facts: tuple[int, ...]
    distance: int | None = None
    """Turns from the fact to the question."""


@dataclass(frozen=True)
class Chat:
    family: str
    name: str
    messages: tuple[Message, ...]
    cases: tuple[Case, ...]


def candidates(history: int, recent: int = RECENT) -> list[int]:
    """The message indices a question could bring back: all before it but the newest ``recent``."""
    return list(range(max(0, history - recent)))


def chat_of_script(s: script.Script, family: str, evidence: Sequence[Sequence[str]] | None = None) -> Chat:
    """The script's messages as the cache holds them, and its probes; ``evidence``: per probe in order, the lines that
    hold its fact (LoCoMo), else the fact is the user message of ``fact_turn``."""
    messages: list[Message] = [Message("system", s.system)] if s.system else []
    user_at: dict[int, int] = {}
    cases: list[Case] = []
    for step in s.steps:
        if step.probe is not None:
            lines = evidence[len(cases)] if evidence is not None else None
            if lines is not None:
                facts = tuple(i for i, m in enumerate(messages) if any(line in m.text for line in lines))
            else:
                fact = user_at.get(step.probe.fact_turn) if step.probe.fact_turn is not None else None
                facts = () if fact is None else (fact,)
            m = _LOCOMO_QUESTION.match(step.user)
            cases.append(Case(s.name, step.turn, m.group(1) if m else step.user, step.probe.category, len(messages),
                              facts, step.distance))
        if step.independent:
            continue
        user_at[step.turn] = len(messages)
        messages.append(Message("user", step.user))
        if step.assistant is not None:
            messages.append(Message("assistant", step.assistant))
    return Chat(family, s.name, tuple(messages), tuple(cases))


def locomo_chats(path: Path, options: locomo.Options) -> list[Chat]:
    out = []
    for (name, sample), s in zip(locomo.samples(path), locomo.load(path, options)):
        family = "locomo" if options.max_sessions else "locomo-all"
        out.append(chat_of_script(s, family, locomo.evidence_lines(sample, options)))
    return out


# -- pure scorers -----------------------------------------------------------------------------------------------------

def recency_scores(cands: Sequence[int]) -> np.ndarray:
    return np.asarray(cands, dtype=float)


def cosine_scores(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    q = query / (np.linalg.norm(query) or 1.0)
    norms = np.linalg.norm(rows, axis=1)
    norms[norms == 0] = 1.0
    return (rows @ q) / norms


def order(scores: np.ndarray, cands: Sequence[int]) -> list[int]:
    """Candidates best first: higher score, then newer."""
    return [cands[i] for i in sorted(range(len(cands)), key=lambda i: (-scores[i], -cands[i]))]


def ranks_of(scores: np.ndarray, cands: Sequence[int]) -> np.ndarray:
    """Each candidate's 1-based rank under :func:`order`, aligned with ``cands``."""
    out = np.zeros(len(cands), dtype=int)
    for r, i in enumerate(sorted(range(len(cands)), key=lambda i: (-scores[i], -cands[i])), start=1):
        out[i] = r
    return out


def rrf(rankings: Sequence[np.ndarray], k: int = RRF_K) -> np.ndarray:
    """Reciprocal-rank fusion of aligned 1-based rank arrays: Σ 1/(k + rank)."""
    return sum((1.0 / (k + np.asarray(r, dtype=float)) for r in rankings), np.zeros(len(rankings[0])))


def minmax_fuse(score_lists: Sequence[np.ndarray]) -> np.ndarray:
    """The mean of each signal's scores scaled to [0, 1] over the candidates (a constant signal adds 0)."""
    out = np.zeros(len(score_lists[0]))
    for s in score_lists:
        span = float(s.max() - s.min()) if len(s) else 0.0
        if span > 0:
            out += (s - s.min()) / span
    return out / len(score_lists)


def fact_rank(scores: np.ndarray, cands: Sequence[int], facts: Iterable[int]) -> int | None:
    """The best rank a fact's message gets, or None when none is a candidate."""
    where = {c: i for i, c in enumerate(cands)}
    hits = [where[f] for f in facts if f in where]
    if not hits:
        return None
    r = ranks_of(scores, cands)
    return int(min(r[i] for i in hits))


def recall_at(ranks: Sequence[int], k: int) -> float:
    return sum(1 for r in ranks if r <= k) / len(ranks) if ranks else float("nan")


def mrr(ranks: Sequence[int]) -> float:
    return sum(1.0 / r for r in ranks) / len(ranks) if ranks else float("nan")


def random_hit(n: int, m: int, k: int) -> float:
    """P(at least one of ``m`` fact messages among ``n`` candidates lands in a uniform draw's top ``k``)."""
    if m <= 0 or n <= 0:
        return 0.0
    if k >= n or m > n - k:
        return 1.0
    miss = 1.0
    for i in range(k):
        miss *= (n - m - i) / (n - i)
    return 1.0 - miss


def random_mrr(n: int, m: int) -> float:
    """E[1 / best rank] of ``m`` fact messages among ``n`` under a uniform order."""
    return sum((random_hit(n, m, r) - random_hit(n, m, r - 1)) / r for r in range(1, n + 1)) if n else 0.0


# -- signals ----------------------------------------------------------------------------------------------------------

class Signal(Protocol):
    """A ranking signal: ``prepare`` once per chat (returns its seconds), then ``scores`` per probe over candidates
    (returns the scores, aligned with ``cands``, and its seconds)."""

    name: str

    def prepare(self, chat: Chat) -> float: ...

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]: ...


class Recency:
    name = "recency"

    def prepare(self, chat: Chat) -> float:
        return 0.0

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]:
        t = time.perf_counter()
        return recency_scores(cands), time.perf_counter() - t


class BM25:
    name = "bm25"

    def __init__(self) -> None:
        self._docs: list[Counter[str]] = []

    def prepare(self, chat: Chat) -> float:
        t = time.perf_counter()
        self._docs = [Counter(words(m.text)) for m in chat.messages]
        return time.perf_counter() - t

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]:
        t = time.perf_counter()
        s = bm25_scores(words(case.question), [self._docs[i] for i in cands])
        return s, time.perf_counter() - t


def _short(model: str) -> str:
    return model.rsplit("-", 1)[-1] if "-" in model else model


class EmbeddingCache:
    """Vectors of one model by text hash, with the seconds each took; one ``.npz`` per model under ``folder``."""

    def __init__(self, folder: Path | None, model_sha: str) -> None:
        self.path = folder / f"{model_sha[:16]}.npz" if folder else None
        self.rows: dict[str, tuple[np.ndarray, float]] = {}
        if self.path and self.path.exists():
            with np.load(self.path) as z:
                self.rows = {str(k): (v, float(s)) for k, v, s in zip(z["keys"], z["vecs"], z["secs"])}
        self.dirty = False

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]

    def get(self, text: str) -> tuple[np.ndarray, float] | None:
        return self.rows.get(self.key(text))

    def put(self, text: str, vec: np.ndarray, secs: float) -> None:
        self.rows[self.key(text)] = (vec, secs)
        self.dirty = True

    def save(self) -> None:
        if not self.path or not self.dirty or not self.rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self.rows)
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=np.array(keys), vecs=np.stack([self.rows[k][0] for k in keys]),
                 secs=np.array([self.rows[k][1] for k in keys]))
        tmp.replace(self.path)
        self.dirty = False


class Dense:
    """Cosine of the question's and each message's mean-pooled hidden states under one chat model."""

    def __init__(self, model: str, cache: Path | None, threads: int = 2, n_ctx: int = 1024,
                 role_prefix: bool = False) -> None:
        from agent import models  # noqa: PLC0415 — the registry hashes files; model-free runs skip it

        self.model = model
        self.name = f"dense {_short(model)}"
        self.path = models.resolve(model)
        self.sha = models.gguf_sha256(self.path)
        self.cache = EmbeddingCache(cache, self.sha)
        self.threads, self.n_ctx, self.role_prefix = threads, n_ctx, role_prefix
        self._embedder: Any = None
        self._rows = np.zeros((0, 0), dtype=np.float32)

    def _text(self, m: Message) -> str:
        return f"{m.role}: {m.text}" if self.role_prefix else m.text

    def _embed(self, texts: list[str], one_by_one: bool) -> None:
        todo = list(dict.fromkeys(t for t in texts if self.cache.get(t) is None))
        if not todo:
            return
        if self._embedder is None:
            from native.embedder import Embedder  # noqa: PLC0415 — loads llama.cpp only when a vector is missing

            self._embedder = Embedder(self.path, n_ctx=self.n_ctx, n_threads=self.threads)
        groups = [[t] for t in todo] if one_by_one else [todo[i:i + 64] for i in range(0, len(todo), 64)]
        for group in groups:
            t = time.perf_counter()
            vecs = self._embedder.embed(group)
            secs = time.perf_counter() - t
            # a packed decode's time is shared out by tokens: what each text would cost in its own share
            sizes = np.array([len(self._embedder.tokens(x)) for x in group], dtype=float)
            for x, v, share in zip(group, vecs, sizes / sizes.sum()):
                self.cache.put(x, v, secs * float(share))
        self.cache.save()

    def prepare(self, chat: Chat) -> float:
        texts = [self._text(m) for m in chat.messages]
        self._embed(texts, one_by_one=False)
        # a question is embedded alone, as a turn would: its own decode, its own cost
        self._embed([c.question for c in chat.cases], one_by_one=True)
        rows = [self.cache.get(t) for t in texts]
        self._rows = np.stack([r[0] for r in rows if r is not None]) if rows else np.zeros((0, 0), np.float32)
        return float(sum(r[1] for r in rows if r is not None))

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]:
        hit = self.cache.get(case.question)
        if hit is None:
            self._embed([case.question], one_by_one=True)
            hit = self.cache.get(case.question)
        assert hit is not None
        t = time.perf_counter()
        s = cosine_scores(hit[0], self._rows[list(cands)])
        return s, hit[1] + time.perf_counter() - t

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None


class Encoder:
    """Cosine of the question's and each message's sentence-encoder vectors (:mod:`agent.gate.sentence_encoder`):
    the whole message (``minilm``), or its best-matching sentence (``minilm sent``), so a fact said in passing
    inside a long message is not averaged away."""

    def __init__(self, per_sentence: bool, encoder: Any) -> None:
        self.per_sentence = per_sentence
        self.name = "minilm sent" if per_sentence else "minilm"
        self._enc = encoder
        self._vecs: dict[str, np.ndarray] = {}
        self._owner: list[np.ndarray] = []  # per message: its rows' vectors

    def _vectors(self, texts: Sequence[str]) -> float:
        todo = list(dict.fromkeys(t for t in texts if t not in self._vecs))
        t = time.perf_counter()
        for text, vec in zip(todo, self._enc.encode(todo) if todo else []):
            self._vecs[text] = vec
        return time.perf_counter() - t

    def prepare(self, chat: Chat) -> float:
        parts = [sentences(m.text) if self.per_sentence else [m.text] for m in chat.messages]
        secs = self._vectors([x for ps in parts for x in ps])
        self._owner = [np.stack([self._vecs[x] for x in ps]) for ps in parts]
        return secs

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]:
        secs = self._vectors([case.question])
        t = time.perf_counter()
        q = self._vecs[case.question]
        s = np.array([float((self._owner[i] @ q).max()) for i in cands])
        return s, secs + time.perf_counter() - t


class RecordedSketch:
    """The gate's own ranking as a replay recorded it: each message's sketch anomaly (its share of the question's
    attention over its baseline, ``certificate_detail["sketch.messages"]``, keyed by the message's index in the
    chat). A message with nothing evicted has no reading and ranks last: it needs no restoring."""

    name = "sketch (recorded)"

    def __init__(self, files: Sequence[Path], policy: str) -> None:
        import gzip  # noqa: PLC0415 — only for recorded runs

        self.by_chat: dict[str, list[dict[str, Any]]] = {}
        for f in files:
            with (gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else open(f, encoding="utf-8")) as fh:
                doc = json.load(fh)
            for run in doc["runs"]:
                if run.get("policy") != policy:
                    continue
                name = Path(run.get("script") or doc["meta"]["scripts"][0]["name"]).stem
                probes = [st for st in run["steps"] if st.get("kind") == "probe"]
                self.by_chat[name] = [(st.get("certificate_detail") or {}).get("sketch.messages") or {}
                                      for st in probes]
        self._chat: Chat | None = None

    def prepare(self, chat: Chat) -> float:
        if chat.name not in self.by_chat:
            raise SystemExit(f"no recorded {self.name} run for {chat.name} (recorded: {', '.join(self.by_chat)})")
        if len(self.by_chat[chat.name]) != len(chat.cases):
            raise SystemExit(f"{chat.name}: the recording has {len(self.by_chat[chat.name])} probes, the chat "
                             f"{len(chat.cases)}: not the same conversion")
        self._chat = chat
        return math.nan  # read from a recording: the replay's own cost is the gate lab's to report

    def scores(self, case: Case, cands: Sequence[int]) -> tuple[np.ndarray, float]:
        assert self._chat is not None
        readings = self.by_chat[self._chat.name][self._chat.cases.index(case)]
        return np.array([float(readings[str(c)]["anomaly"]) if str(c) in readings else -np.inf
                         for c in cands]), math.nan


# -- the run ----------------------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One probe's ranks under every signal (None: its fact is not a candidate)."""

    family: str
    chat: str
    turn: int
    category: str | None
    candidates: int
    facts: list[int]
    distance: int | None
    ranks: dict[str, int | None] = field(default_factory=dict)


@dataclass
class Costs:
    per_turn: dict[str, list[float]] = field(default_factory=dict)
    per_chat: dict[str, list[float]] = field(default_factory=dict)

    def add(self, table: dict[str, list[float]], name: str, secs: float) -> None:
        table.setdefault(name, []).append(secs)


def fusions(partners: Sequence[str]) -> list[tuple[str, str, str]]:
    """(name, kind, partner) of each fusion of BM25 with a meaning signal: reciprocal ranks, and min-max scores where
    the partner's scores are all finite."""
    out = []
    for d in partners:
        out.append((f"rrf bm25+{d}", "rrf", d))
        if d.startswith(("dense", "minilm")):
            out.append((f"minmax bm25+{d}", "minmax", d))
    return out


def rank_chat(chat: Chat, signals: Sequence[Signal], recent: int, costs: Costs) -> list[Row]:
    """Every probe of a chat ranked under each signal and each BM25+dense fusion."""
    for sig in signals:
        costs.add(costs.per_chat, sig.name, sig.prepare(chat))
    partners = [s.name for s in signals if s.name not in ("recency", "bm25")]
    rows = []
    for case in chat.cases:
        cands = candidates(case.history, recent)
        row = Row(chat.family, chat.name, case.turn, case.category, len(cands), list(case.facts), case.distance)
        rows.append(row)
        got: dict[str, tuple[np.ndarray, float]] = {}
        for sig in signals:
            got[sig.name] = sig.scores(case, cands) if cands else (np.zeros(0), 0.0)
        for name, kind, d in fusions(partners):
            t = time.perf_counter()
            parts = [got["bm25"][0], got[d][0]]
            fused = rrf([ranks_of(p, cands) for p in parts]) if kind == "rrf" else minmax_fuse(parts)
            got[name] = (fused, got["bm25"][1] + got[d][1] + time.perf_counter() - t)
        for name, (s, secs) in got.items():
            row.ranks[name] = fact_rank(s, cands, case.facts) if cands else None
            costs.add(costs.per_turn, name, secs)
    for name, _, d in fusions(partners):
        costs.add(costs.per_chat, name, costs.per_chat["bm25"][-1] + costs.per_chat[d][-1])
    return rows


# -- the report -------------------------------------------------------------------------------------------------------

FAMILY_TITLES = {"long": "long chats", "locomo": "LoCoMo, first sessions", "locomo-all": "LoCoMo, whole conversations",
                 "varied": "varied recall (held out)"}


def _pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def _secs(xs: Sequence[float]) -> str:
    v = sum(xs) / len(xs) if xs else math.nan
    if math.isnan(v):
        return "—"
    return f"{v:.4f}" if v < 0.1 else f"{v:.2f}"


def summary(rows: Sequence[Row], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per signal: recall@k and MRR over the rows whose fact is a candidate, and random's expectation."""
    ranked = [r for r in rows if r.ranks.get(names[0]) is not None]
    out: dict[str, dict[str, float]] = {}
    for name in names:
        ranks = [r.ranks[name] for r in ranked if r.ranks.get(name) is not None]
        out[name] = {**{f"r@{k}": recall_at(ranks, k) for k in KS}, "mrr": mrr(ranks), "n": len(ranks)}  # type: ignore[arg-type]
    n = len(ranked)
    out["random"] = {**{f"r@{k}": sum(random_hit(r.candidates, _in(r), k) for r in ranked) / n if n else math.nan
                        for k in KS},
                     "mrr": sum(random_mrr(r.candidates, _in(r)) for r in ranked) / n if n else math.nan, "n": n}
    return out


def _in(row: Row) -> int:
    return sum(1 for f in row.facts if f < row.candidates)


def table(rows: Sequence[Row], names: Sequence[str], costs: Costs, chats: Sequence[Chat]) -> str:
    out: list[str] = []
    families = list(dict.fromkeys(r.family for r in rows))
    for fam in families:
        fr = [r for r in rows if r.family == fam]
        nchat = len({r.chat for r in fr})
        ranked = [r for r in fr if r.ranks.get(names[0]) is not None]
        sizes = [r.candidates for r in ranked]
        out.append(f"### {FAMILY_TITLES.get(fam, fam)}: {len(fr)} probes in {nchat} chats, "
                   f"{len(fr) - len(ranked)} with the fact not a candidate; candidates per probe "
                   f"{min(sizes, default=0)}–{max(sizes, default=0)} (mean {np.mean(sizes) if sizes else 0:.0f})\n")
        out.append("| signal | recall@1 | recall@3 | recall@5 | MRR | s per turn | s per chat |")
        out.append("|---|---|---|---|---|---|---|")
        s = summary(fr, names)
        for name in [*names, "random"]:
            v = s[name]
            turn_cost = _secs(_of_family(costs.per_turn.get(name, []), rows, fam))
            chat_cost = _secs(_of_family(costs.per_chat.get(name, []), chats, fam))
            if name == "random":
                turn_cost = chat_cost = "—"
            out.append(f"| {name} | {_pct(v['r@1'])} | {_pct(v['r@3'])} | {_pct(v['r@5'])} | {_pct(v['mrr'])} | "
                       f"{turn_cost} | {chat_cost} |")
        cats = sorted({r.category or "—" for r in fr})
        if len(cats) > 1:
            out.append("")
            counts = Counter(r.category or "—" for r in ranked)
            out.append("| signal | " + " | ".join(f"{c} r@1 / r@3 / r@5 (n={counts[c]})" for c in cats) + " |")
            out.append("|---|" + "---|" * len(cats))
            by = {c: summary([r for r in fr if (r.category or "—") == c], names) for c in cats}
            for name in [*names, "random"]:
                cells = [" / ".join(_pct(by[c][name][f"r@{k}"]) for k in KS) for c in cats]
                out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _of_family(xs: Sequence[float], items: Sequence[Any], fam: str) -> list[float]:
    """The costs of one family's items: a cost is recorded per item (a row per turn, a chat per chat), in order."""
    return [x for x, item in zip(xs, items) if item.family == fam]


# -- the command ------------------------------------------------------------------------------------------------------

def _machine_line() -> str:
    from agent.lab.replay.report import git_commit, machine  # noqa: PLC0415 — report imports matplotlib

    return f"machine: {machine()}; commit {git_commit()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.lab.ranking", description=__doc__.splitlines()[0])
    p.add_argument("--long", nargs="+", type=Path, default=[], help="long-chat scripts (make-long)")
    p.add_argument("--locomo", nargs="+", type=Path, default=[], help="LoCoMo conversation files")
    p.add_argument("--varied", nargs="+", type=Path, default=[], help="held-out varied-recall scripts")
    p.add_argument("--qa-category", default="2,4", help="LoCoMo question categories (default 2,4)")
    p.add_argument("--max-sessions", type=int, default=3, help="LoCoMo: the first N sessions (default 3; 0: all)")
    p.add_argument("--sketch", nargs="+", type=Path, default=[],
                   help="recorded results (.json[.gz]) whose probes carry per-message sketch readings, one per chat")
    p.add_argument("--sketch-policy", default="poisson", help="the recorded run to read (default poisson: ungated)")
    p.add_argument("--models", default="", help="comma-separated chat models for the dense signal (none: no dense)")
    p.add_argument("--encoder", action="store_true",
                   help="add the sentence encoder (all-MiniLM-L6-v2) per message and per best sentence")
    p.add_argument("--recent", type=int, default=RECENT, help=f"newest messages never candidates (default {RECENT})")
    p.add_argument("--role-prefix", action="store_true", help="dense: embed each message as 'role: text'")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, help="folder of cached embeddings")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    options = locomo.Options(categories=locomo.parse_categories(args.qa_category),
                             max_sessions=args.max_sessions or None)
    chats = [chat_of_script(script.load(f), "long") for f in args.long]
    chats += [c for f in args.locomo for c in locomo_chats(f, options)]
    chats += [chat_of_script(script.load(f), "varied") for f in args.varied]
    if not chats:
        p.error("no chats: give --long, --locomo or --varied files")

    signals: list[Signal] = [Recency(), BM25()]
    dense: list[Dense] = [Dense(m, args.cache, args.threads, role_prefix=args.role_prefix)
                          for m in args.models.split(",") if m.strip()]
    rows: list[Row] = []
    costs = Costs()
    for d in dense:  # one model in memory at a time: every vector first, then the ranking reads the cache
        for c in chats:
            d.prepare(c)
            print(f"[ranking] {d.name}: {c.name} embedded", file=sys.stderr, flush=True)
        d.close()
    signals += dense
    if args.encoder:
        from agent.gate.sentence_encoder import SentenceEncoder  # noqa: PLC0415 — loaded only when asked for

        enc = SentenceEncoder()
        signals += [Encoder(False, enc), Encoder(True, enc)]
    if args.sketch:
        signals.append(RecordedSketch(args.sketch, args.sketch_policy))
    for c in chats:
        rows += rank_chat(c, signals, args.recent, costs)
    names = list(rows[0].ranks) if rows else [s.name for s in signals]

    command = "python -m agent.lab.ranking " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                  else argv))
    models = ", ".join(f"{d.model} (sha256 {d.sha[:12]})" for d in dense) or "none (no dense signal)"
    text = ("## Selection as a ranking\n\n"
            f"Candidates: every message before the question but the newest {args.recent}; rank of the fact's message "
            "(best of its evidence messages on LoCoMo); ties newest first. Costs: mean seconds per probe turn "
            "(dense: the question's own decode), per chat (dense: every message embedded).\n\n"
            + table(rows, names, costs, chats)
            + f"\n`{command}` — models: {models}; {_machine_line()}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    doc = {"command": command, "models": [{"name": d.model, "sha256": d.sha} for d in dense],
           "recent": args.recent, "signals": names, "machine": _machine_line(),
           "probes": [r.__dict__ for r in rows],
           "costs": {"per_turn_s": {k: float(np.mean(v)) for k, v in costs.per_turn.items()},
                     "per_chat_s": {k: float(np.mean(v)) for k, v in costs.per_chat.items()}}}
    (args.out / "ranking.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
