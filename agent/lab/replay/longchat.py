"""Long-chat scripts: thousands of tokens of real dialogue with facts, probes and fillers spread through it.

A script is fixed by its seed and its target length (tokens of the fixture model's chat
template, :data:`FIXTURE_MODEL`):

- the dialogue is LoCoMo's (the shared conversations): speaker A's messages are the
  user's, speaker B's the assistant's, teacher-forced, session after session;
- facts (``agent.lab.replay.longchat_facts``) are planted as asides appended to ordinary user
  messages of that dialogue;
- probes are user turns of their own, spread evenly over the whole script (not gathered at
  the end), each followed by its correct answer, teacher-forced, so every policy continues
  from the same history; their distances to their facts are spread on a log scale from two
  turns to most of the script; about half of them are paraphrased (category
  ``paraphrased``: no content word in common with the fact), the rest reuse the fact's words
  (``verbatim``);
- question fillers, as many as probes and also spread evenly, ask about the previous
  assistant message ("what did you just say about …?") and are answered with a quote of it:
  question-shaped, unscored, needing nothing older than the previous turn.

The system line carries the provenance (``longchat``: seed, target, token count, sources,
the question fillers' turns), which :func:`load` reads back into ``Script.meta``.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from agent.errors import ExplainedError
from agent.lab.replay.longchat_facts import FACTS, Fact, reply
from agent.lab.replay.script import Probe, Script, ScriptError, Step
from agent.lab.replay.script import load as load_script

FIXTURE_MODEL = "qwen2.5-coder-0.5b"
"""Whose tokenizer and chat template define a script's length."""
FIXTURE_DIR = Path(__file__).parent / "fixtures" / "longchat"
SHARED_LOCOMO = Path(__file__).resolve().parents[4] / "shared" / "data" / "locomo"
"""Where this machine keeps the shared LoCoMo conversations (the dialogue's source)."""
SYSTEM = ("You are a friendly assistant in a long, casual chat with the user that goes on over many days. "
          "Reply briefly. When the user asks about something said earlier in the chat, answer concisely.")
MIN_DISTANCE = 2
QUICK_FIXTURE = ("8k", 0)
"""(size label, seed) of the committed script `certchat demo long --quick` runs."""
QUICK_MAX_TOKENS = 24

_ASIDES = (
    "{text} Oh, and unrelated, but so it's written down somewhere: {fact}.",
    "{text} (Side note: {fact}.)",
    "{text} By the way, {fact}.",
    "Random thing first: {Fact}. Anyway. {text}",
    "{text} Also, before I forget, {fact}.",
)
_PROBE_OPENERS = ("", "Quick question: ", "Totally unrelated, but ", "Sorry, off topic: ", "Before I forget: ",
                  "One more thing: ")


class LongchatError(ExplainedError, ValueError):
    """A size that cannot be built, or no dialogue source."""


# -- sizes and token counting ----------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``8k`` → 8000 tokens (k = 1,000, so ``32k`` still fits a 32,768-token context); ``12000`` → 12000."""
    raw = str(text).strip().lower().replace(",", "").replace("_", "")
    try:
        value = float(raw[:-1]) * 1000 if raw.endswith("k") else float(raw)
    except ValueError:
        raise LongchatError(f"--history: expected a token count like 16k or 12000, got {text!r}") from None
    if value < 600:
        raise LongchatError(f"--history: {text!r} is too short for a long chat (at least 600 tokens)")
    return int(round(value))


def size_label(tokens: int) -> str:
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else str(tokens)


def default_probes(target: int) -> int:
    """One probe per ~800 tokens of history (10 at 8k, 20 at 16k, 40 at 32k), within the fact pool."""
    return max(3, min(len(FACTS), round(target / 800)))


class TokenCounter:
    """Token counts under a model's tokenizer and chat template (a vocab-only load: no weights)."""

    def __init__(self, model_path: Path) -> None:
        from agent.llm.template import ChatTemplate  # noqa: PLC0415 — loads llama.cpp
        from native import llama  # noqa: PLC0415

        self._vocab = llama.Model(model_path, vocab_only=True)
        self.template = ChatTemplate.for_model(self._vocab)
        self._memo: dict[str, int] = {}
        # measured beside a system message: without one, some templates insert a default system prompt
        system = [{"role": "system", "content": "x"}]
        self.per_message = (self._tokens(self.template.render([*system, {"role": "user", "content": "x"}], False))
                            - self._tokens(self.template.render(system, False)) - self.text("x"))

    def _tokens(self, rendered: str) -> int:
        return len(self._vocab.tokenize(rendered, add_special=False, parse_special=True))

    def text(self, text: str) -> int:
        """Tokens of a message's content alone."""
        n = self._memo.get(text)
        if n is None:
            n = self._memo[text] = len(self._vocab.tokenize(text, add_special=False, parse_special=False))
        return n

    def approx(self, system: str | None, contents: Sequence[str]) -> int:
        """The history's tokens as a sum over messages (what the generator steers by)."""
        total = sum(self.text(c) + self.per_message for c in contents)
        return total + (self.text(system) + self.per_message if system else 0)

    def history(self, script: Script) -> int:
        """Exact tokens of the whole script rendered by the chat template (the full cache at its end)."""
        messages: list[dict[str, str]] = []
        if script.system:
            messages.append({"role": "system", "content": script.system})
        for step in script.steps:
            if step.independent:
                continue
            messages.append({"role": "user", "content": step.user})
            if step.assistant is not None:
                messages.append({"role": "assistant", "content": step.assistant})
        return self._tokens(self.template.render(messages, False))

    def context_length(self) -> int:
        """The context the model was trained for (0 when its GGUF does not say)."""
        arch = self._vocab.meta("general.architecture") or ""
        value = self._vocab.meta(f"{arch}.context_length") if arch else None
        return int(value) if value and value.isdigit() else 0

    def close(self) -> None:
        self._vocab.close()


def counter_for(model: str = FIXTURE_MODEL) -> TokenCounter:
    from agent import models  # noqa: PLC0415

    # a registry model verified when pulled needs no re-validation (parsing its GGUF metadata in Python
    # takes seconds for a large vocabulary); anything else is validated
    pulled = model in models.REGISTRY and models.is_pulled(model)
    return TokenCounter(models.model_file(model) if pulled else models.resolve(model))


# -- the dialogue -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    user: str
    assistant: str
    source: str
    """``conversation:session``, for provenance."""


def _line(turn: dict[str, Any]) -> str:
    text = " ".join(str(turn.get("text", "")).split())
    caption = turn.get("blip_caption")
    return f"{text} [shares a photo: {caption}]".strip() if caption else text


def dialogue(files: Sequence[Path]) -> dict[str, list[Exchange]]:
    """Each LoCoMo conversation's exchanges in order: A's messages (merged) and B's reply."""
    from agent.lab.replay.locomo import samples  # noqa: PLC0415

    out: dict[str, list[Exchange]] = {}
    for path in files:
        for name, sample in samples(path):
            conv = sample["conversation"]
            speaker_a = conv["speaker_a"]
            numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k))
                             and isinstance(conv[k], list))
            exchanges: list[Exchange] = []
            for n in numbers:
                merged: list[tuple[str, list[str]]] = []
                for turn in conv[f"session_{n}"]:
                    role = "user" if turn.get("speaker") == speaker_a else "assistant"
                    line = _line(turn)
                    if not line:
                        continue
                    if merged and merged[-1][0] == role:
                        merged[-1][1].append(line)
                    else:
                        merged.append((role, [line]))
                if merged and merged[0][0] == "assistant":
                    merged = merged[1:]  # a session B opens has nothing for the user to have said
                for i in range(0, len(merged) - 1, 2):
                    exchanges.append(Exchange(" ".join(merged[i][1]), " ".join(merged[i + 1][1]), f"{name}:{n}"))
            out[name] = exchanges
    return out


def source_files(paths: Sequence[Path] | None = None) -> list[Path]:
    """The LoCoMo files to draw from: the ones given, else the shared folder's."""
    files = [Path(p) for p in paths] if paths else sorted(SHARED_LOCOMO.glob("*.json"))
    if not files:
        raise LongchatError(f"no LoCoMo conversations to draw dialogue from (looked in {SHARED_LOCOMO}); "
                            "pass --locomo FILE")
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise LongchatError(f"{missing[0]}: no such LoCoMo file")
    return files


# -- the layout -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """What each user turn (1-based) is: probe → its fact turn; question fillers; the rest dialogue."""

    turns: int
    probes: dict[int, int]
    fillers: frozenset[int]

    @property
    def facts(self) -> dict[int, int]:
        return {f: p for p, f in self.probes.items()}


def _spread(turns: int, count: int, lo: int, ok: Callable[[int], bool], taken: set[int], rng: random.Random,
            hi: int | None = None) -> list[int]:
    """``count`` free turns spread evenly over [lo, hi] (default: the last turn), each one ``ok`` accepts."""
    hi = turns if hi is None else hi
    slots = []
    width = (hi - lo + 1) / count
    for i in range(count):
        want = lo + int((i + rng.random()) * width)
        for d in sorted(range(-turns, turns + 1), key=abs):
            s = want + d
            if lo <= s <= hi and s not in taken and ok(s):
                slots.append(s)
                taken.add(s)
                break
        else:
            raise LongchatError(f"no room left in {turns} turns for {count} probes or fillers")
    return slots


def _fillers(turns: int, n_fillers: int, probes: Sequence[int], taken: set[int], rng: random.Random) -> list[int]:
    placed: set[int] = set()

    def after_dialogue(s: int) -> bool:
        # the turn before a filler is dialogue (what it asks about), and no filler follows a filler
        if s - 1 in probes or s - 1 in placed or s + 1 in placed:
            return False
        placed.add(s)
        return True

    return _spread(turns, n_fillers, 2, after_dialogue, taken, rng)


def layout(turns: int, n_probes: int, n_fillers: int, rng: random.Random) -> Layout:
    """Probes and fillers spread evenly; each probe's distance drawn on a log scale, 2 … ~0.8·turns."""
    if turns < 3 * (n_probes + n_fillers):
        raise LongchatError(f"{turns} turns are too few to spread {n_probes} probes and {n_fillers} fillers "
                            "through dialogue; ask for fewer --probes or a longer --history")
    taken: set[int] = set()
    probes = _spread(turns, n_probes, max(MIN_DISTANCE + 1, turns // 25), lambda s: True, taken, rng)
    top = max(MIN_DISTANCE + 1, int(0.8 * turns))
    distances = sorted((round(math.exp(math.log(MIN_DISTANCE) + (i + rng.random()) / n_probes
                                       * (math.log(top) - math.log(MIN_DISTANCE)))) for i in range(n_probes)),
                       reverse=True)
    facts: dict[int, int] = {}
    free = set(probes)
    for want in distances:
        # the longest first, each to a random probe late enough for it
        fits = sorted(p for p in free if p - want >= 1) or [max(free)]
        p = rng.choice(fits)
        free.discard(p)
        for d in sorted(range(MIN_DISTANCE, p), key=lambda d: abs(d - want)):
            f = p - d
            if f not in taken:
                facts[p] = f
                taken.add(f)
                break
        else:
            raise LongchatError(f"no free turn for the fact of the probe at turn {p}")
    fillers = _fillers(turns, n_fillers, probes, taken, rng)
    return Layout(turns, dict(sorted(facts.items())), frozenset(fillers))


def layout_beyond(turns: int, n_probes: int, n_fillers: int, mark: int, rng: random.Random) -> Layout:
    """For a chat longer than the model's trained context, which spans about ``mark`` turns: every probe after the
    first ``mark`` turns (spread over the last two thirds of what follows them); half of their facts older than
    the trained context when asked about (more than ``mark`` turns, and a margin, before their probe), which a
    cache cut to that context cannot hold, half within it."""
    if turns < 3 * (n_probes + n_fillers) or not 10 <= mark < turns - 3 * n_probes:
        raise LongchatError(f"{turns} turns with the trained context's end at turn {mark} leave no room for "
                            f"{n_probes} probes after it; ask for fewer --probes or a longer --history")
    taken: set[int] = set()
    lo = mark + (turns - mark) // 3
    probes = _spread(turns, n_probes, lo, lambda s: True, taken, rng)
    older = set(rng.sample(sorted(probes), n_probes // 2))
    facts: dict[int, int] = {}
    for p in sorted(probes, key=lambda p: (p not in older, p)):
        margin = max(3, turns // 50)
        first, last = (2, p - mark - margin) if p in older else (max(2, p - mark + margin), p - MIN_DISTANCE)
        free = [f for f in range(first, last + 1) if f not in taken]
        if not free:
            raise LongchatError(f"no free turn for the fact of the probe at turn {p}")
        facts[p] = rng.choice(free)
        taken.add(facts[p])
    fillers = _fillers(turns, n_fillers, probes, taken, rng)
    return Layout(turns, dict(sorted(facts.items())), frozenset(fillers))


# -- question fillers ---------------------------------------------------------------------------
_SENTENCE = re.compile(r"[^.!?]+[.!?]*")
_FILLERS = (
    ("Wait, what did you just say about {kw}?", 'I said: "{sentence}"'),
    ("Sorry, can you repeat the last thing you said?", 'Sure: "{last}"'),
    ("Hold on, what was the first thing you said just now?", 'I said: "{first}"'),
    ("You just mentioned {kw}. What exactly did you say?", 'I said: "{sentence}"'),
    ("Did you just say something about {kw}?", 'Yes, I said: "{sentence}"'),
    ("How did your last message start?", 'It started: "{first}"'),
)


def question_filler(previous: str, rng: random.Random) -> tuple[str, str]:
    """A question about the previous assistant message, and its answer quoted from that message."""
    sentences = [s.strip() for s in _SENTENCE.findall(previous) if s.strip()] or [previous.strip()]
    keyed = [(s, w) for s in sentences for w in re.findall(r"[A-Za-z]{5,}", s)
             if w.lower() not in {"about", "really", "thanks", "there", "their", "would", "could", "should",
                                  "that's", "going", "great", "sounds"}]
    question, answer = _FILLERS[rng.randrange(len(_FILLERS))]
    if "{kw}" in question and not keyed:
        question, answer = _FILLERS[1]
    sentence, kw = rng.choice(keyed) if keyed else (sentences[-1], "")
    return question.format(kw=kw), answer.format(sentence=sentence, first=sentences[0], last=sentences[-1])


# -- the generator ------------------------------------------------------------------------------
def _aside(text: str, fact: Fact, rng: random.Random) -> str:
    template = _ASIDES[rng.randrange(len(_ASIDES))]
    return template.format(text=text, fact=fact.clause, Fact=fact.clause[0].upper() + fact.clause[1:])


def _probe_text(fact: Fact, paraphrased: bool, rng: random.Random) -> str:
    question = fact.paraphrased if paraphrased else fact.verbatim
    opener = _PROBE_OPENERS[rng.randrange(len(_PROBE_OPENERS))]
    return opener + (question[0].lower() + question[1:] if opener else question)


def _assemble(seed: int, target: int, exchanges: list[Exchange], n_dialogue: int, n_probes: int,
              name: str, beyond: int = 0) -> Script:
    rng = random.Random(f"longchat-{seed}-{n_dialogue}-{n_probes}")
    used = exchanges[:n_dialogue]
    turns = n_dialogue + 2 * n_probes
    plan = (layout_beyond(turns, n_probes, n_probes, max(10, turns * beyond // target), rng) if 0 < beyond < target
            else layout(turns, n_probes, n_probes, rng))
    seen = " ".join(f"{e.user} {e.assistant}" for e in used).casefold()
    # a fact whose answer the dialogue already says would be recalled from the wrong place
    pool = [f for f in FACTS if not any(e.casefold() in seen for e in f.expect)]
    if len(pool) < n_probes:
        raise LongchatError(f"only {len(pool)} facts fit this dialogue; ask for at most that many probes")
    chosen = rng.sample(pool, n_probes)
    by_distance = sorted(plan.probes, key=lambda p: (p - plan.probes[p], p))
    paraphrased: set[int] = set()
    for i in range(0, len(by_distance), 2):
        pair = by_distance[i:i + 2]
        if len(pair) == 2:
            paraphrased.add(rng.choice(pair))
        elif rng.random() < 0.5:
            paraphrased.add(pair[0])
    fact_of = {p: chosen[k] for k, p in enumerate(sorted(plan.probes))}
    facts_at = {f: fact_of[p] for f, p in plan.facts.items()}
    steps: list[Step] = []
    source = iter(used)
    previous = ""
    for turn in range(1, turns + 1):
        lineno = 2 * turn
        if turn in plan.probes:
            fact = fact_of[turn]
            kind = "paraphrased" if turn in paraphrased else "verbatim"
            steps.append(Step(turn, _probe_text(fact, turn in paraphrased, rng), lineno, reply(fact),
                              Probe(expect=fact.expect, fact_turn=plan.probes[turn], category=kind)))
        elif turn in plan.fillers:
            question, answer = question_filler(previous, rng)
            steps.append(Step(turn, question, lineno, answer))
        else:
            ex = next(source)
            user = _aside(ex.user, facts_at[turn], rng) if turn in facts_at else ex.user
            steps.append(Step(turn, user, lineno, ex.assistant))
            previous = ex.assistant
    meta = {"generator": "agent.lab.replay.longchat", "seed": seed, "target_tokens": target,
            **({"beyond": beyond} if 0 < beyond < target else {}),
            "question_fillers": sorted(plan.fillers), "sources": sorted({e.source for e in used},
                                                                         key=lambda s: (s.split(":")[0],
                                                                                        int(s.split(":")[1])))}
    return Script(name=name, system=SYSTEM, steps=tuple(steps), source=f"longchat:{seed}:{target}", meta=meta)


def generate(seed: int, target: int, counter: TokenCounter, files: Sequence[Path] | None = None,
             probes: int | None = None, beyond: int = 0) -> Script:
    """The script of ``seed`` whose history is about ``target`` tokens under ``counter``. ``beyond``: the model's
    trained context, when ``target`` runs past it (:func:`layout_beyond`: the probes after it, half their facts
    before it); each step's token offset is then in ``meta["turn_tokens"]``."""
    n_probes = default_probes(target) if probes is None else probes
    if not 1 <= n_probes <= len(FACTS):
        raise LongchatError(f"--probes: between 1 and {len(FACTS)} (the fact pool), got {n_probes}")
    conversations = dialogue(source_files(files))
    order = sorted(conversations)
    rng = random.Random(f"longchat-{seed}")
    rng.shuffle(order)
    first = conversations[order[0]]
    start = rng.randrange(max(1, len(first) // 3))
    exchanges = first[start:] + [e for name in order[1:] for e in conversations[name]]
    name = f"longchat-{size_label(target)}-seed{seed:02d}"

    def total(n: int) -> int:
        s = _assemble(seed, target, exchanges, n, n_probes, name, beyond)
        contents = [c for st in s.steps for c in (st.user, st.assistant or "")]
        return counter.approx(s.system, contents)

    # the number of exchanges whose total is nearest the target: a secant step, then walk
    per = max(1, sum(counter.text(e.user) + counter.text(e.assistant) + 2 * counter.per_message
                     for e in exchanges[:50]) // min(50, len(exchanges)))
    n = max(4 * n_probes, min(len(exchanges), (target - 110 * n_probes) // per))
    for _ in range(6):
        step = round((target - total(n)) / per)
        if step == 0:
            break
        n = max(4 * n_probes, min(len(exchanges), n + step))
    while n < len(exchanges) and total(n) < target and abs(total(n + 1) - target) < abs(total(n) - target):
        n += 1
    while n > 4 * n_probes and total(n) > target and abs(total(n - 1) - target) < abs(total(n) - target):
        n -= 1
    if n >= len(exchanges) and total(n) < 0.95 * target:
        raise LongchatError(f"the LoCoMo dialogue holds about {total(n)} tokens, short of {target}; "
                            "pass more --locomo files or a smaller --history")
    script = _assemble(seed, target, exchanges, n, n_probes, name, beyond)
    script.meta["tokens"] = counter.history(script)
    if script.meta.get("beyond"):
        at, offsets = counter.approx(script.system, []), []
        for st in script.steps:
            offsets.append(at)
            at += counter.approx(None, [st.user, st.assistant or ""])
        script.meta["turn_tokens"] = offsets
    return script


# -- files --------------------------------------------------------------------------------------
def dumps(script: Script, model: str = FIXTURE_MODEL) -> str:
    """JSONL; the provenance rides on the system line (the format ignores unknown keys)."""
    lines = [json.dumps({"role": "system", "content": script.system,
                         "longchat": {**script.meta, "tokenizer": model}}, ensure_ascii=False)]
    for step in script.steps:
        line: dict[str, Any] = {"role": "user", "content": step.user}
        if step.probe is not None:
            line["probe"] = {"expect": list(step.probe.expect), "fact_turn": step.probe.fact_turn,
                             "category": step.probe.category}
        lines.append(json.dumps(line, ensure_ascii=False))
        lines.append(json.dumps({"role": "assistant", "content": step.assistant}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def save(script: Script, directory: Path, model: str = FIXTURE_MODEL) -> Path:
    path = Path(directory) / f"{script.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(script, model), encoding="utf-8")
    return path


def load(path: str | Path) -> Script:
    """A script with its ``longchat`` provenance (if any) as ``meta``."""
    script = load_script(path)
    try:
        first = json.loads(Path(path).read_text(encoding="utf-8").split("\n", 1)[0])
    except json.JSONDecodeError:
        first = {}
    meta = first.get("longchat") if isinstance(first, dict) else None
    if meta is not None and not isinstance(meta, dict):
        raise ScriptError(f"{path}:1: \"longchat\" must be an object")
    return Script(script.name, script.system, script.steps, script.source, dict(meta or {}))


def fixture_path(label: str = "8k", seed: int = 0) -> Path:
    return FIXTURE_DIR / f"longchat-{label}-seed{seed:02d}.jsonl"


def describe(script: Script) -> str:
    """One line: tokens, turns, probes (paraphrased), fillers, distance range (what the script says of itself)."""
    probes = script.probes
    distances = sorted(p.distance for p in probes if p.distance is not None)
    parts = []
    tokens = script.meta.get("tokens")
    if tokens:
        parts.append(f"{tokens:,} tokens ({script.meta.get('tokenizer', FIXTURE_MODEL)})")
    parts.append(f"{len(script.steps)} turns")
    kinds = [p.probe.category for p in probes if p.probe is not None]
    para = f" ({kinds.count('paraphrased')} paraphrased)" if "paraphrased" in kinds else ""
    parts.append(f"{len(probes)} probes{para}")
    if "question_fillers" in script.meta:
        parts.append(f"{len(script.meta['question_fillers'])} question fillers")
    if distances:
        parts.append(f"distances {distances[0]}–{distances[-1]} turns")
    return ", ".join(parts)
