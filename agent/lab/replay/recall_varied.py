"""Varied-recall chats: recall30's shape (thirty user turns, five facts asked back) in phrasing recall30 never uses.

recall30 states each fact as a short first-person message of its own and asks it back in
the fact's own words; a gate fitted on those chats can be fitted to that phrasing. Here a
fact is an aside in the middle of a longer message about something else (one always in the
first message), the question paraphrases it (synonyms, indirect references such as
"Portugal's capital" for Lisbon, none of the answer's strings), and the assistant's replies
are scripted in four styles (terse, chatty, bulleted, a question back) — templates, no model.
A chat is fixed by its seed; every reply is teacher-forced, so every policy sees one history.

Layout: facts in turn 1 and four of turns 3–16, the probes in five of turns 20–30 (in a
shuffled order), everything else everyday requests. About 1.4k tokens (qwen2.5-coder-0.5b's template: 1.3k–1.5k).

The committed fixtures (seeds 100–104, ``fixtures/recall_varied/``) are held out: they are
for measuring selection on phrasing the project's generator did not write. Never fit a
threshold on them.
"""

from __future__ import annotations

import random
from pathlib import Path

from agent.lab.replay import recall_varied_fillers as fill
from agent.lab.replay import script as scripts
from agent.lab.replay.recall_varied_facts import FACTS, FactKind, Value
from agent.lab.replay.script import Probe, Script, Step, load

GENERATOR = "agent.lab.replay.recall_varied"
FAMILY = "varied"
FIXTURE_DIR = Path(__file__).parent / "fixtures" / "recall_varied"
HELD_OUT_SEEDS = tuple(range(100, 105))
SYSTEM = "You are a helpful assistant. Answer concisely."
N_TURNS = 30
N_FACTS = 5
FACT_TURNS = range(3, 17)
"""Where the facts after the first may fall: at least three turns before the earliest probe."""
PROBE_TURNS = range(20, N_TURNS + 1)
OPENER_SHARE = 0.15
"""How often an ordinary request comes after an unrelated opener, so long messages are not a fact's tell."""


def _aside(kind: FactKind, value: Value, rng: random.Random) -> str:
    return rng.choice(kind.asides).format(v=value.text, **value.slots)


def _question(kind: FactKind, value: Value, rng: random.Random) -> str:
    question = rng.choice(kind.questions).format(**value.slots)
    frame = rng.choice(fill.PROBE_FRAMES)
    if frame.endswith(("— {q}", ": {q}")):
        question = question[:1].lower() + question[1:]
    return frame.format(q=question)


def scenario(seed: int) -> Script:
    """The chat of ``seed``, replies included."""
    rng = random.Random(f"recall-varied-{seed}")
    kinds = rng.sample(FACTS, N_FACTS)
    values = [rng.choice(k.values) for k in kinds]
    fact_turns = [1, *sorted(rng.sample(FACT_TURNS, N_FACTS - 1))]
    probe_turns = sorted(rng.sample(PROBE_TURNS, N_FACTS))
    order = list(range(N_FACTS))
    rng.shuffle(order)
    probe_of = dict(zip(probe_turns, order))
    fact_at = dict(zip(fact_turns, range(N_FACTS)))
    requests = iter(rng.sample(fill.REQUESTS, N_TURNS - N_FACTS))
    shuffled = rng.sample(fill.OPENERS, len(fill.OPENERS))
    # Every fact message gets an opener; ordinary requests share what is left, so none repeats.
    fact_openers, openers = iter(shuffled[:N_FACTS]), iter(shuffled[N_FACTS:])

    steps: list[Step] = []
    for turn in range(1, N_TURNS + 1):
        if turn in probe_of:
            i = probe_of[turn]
            user = _question(kinds[i], values[i], rng)
            steps.append(Step(turn, user, 2 * turn, fill.probe_reply(values[i].text, rng),
                              Probe(expect=values[i].expect, fact_turn=fact_turns[i], category=FAMILY)))
            continue
        request = next(requests)
        ask = fill.ask(request, rng.choice(fill.CONNECTIVES))
        if turn in fact_at:
            i = fact_at[turn]
            parts = [next(fact_openers), _aside(kinds[i], values[i], rng), ask]
            if turn == 1:
                parts.insert(0, rng.choice(fill.GREETINGS))
            user = " ".join(parts)
        elif rng.random() < OPENER_SHARE:
            user = f"{next(openers, '')} {ask}".strip()
        else:
            user = request.question
        steps.append(Step(turn, user, 2 * turn, fill.reply(request, rng)))
    meta = {"generator": GENERATOR, "seed": seed, "family": FAMILY, "facts": [k.kind for k in kinds]}
    return Script(name=script_name(seed), system=SYSTEM, steps=tuple(steps), source=f"recall_varied:{seed}",
                  meta=meta)


def script_name(seed: int) -> str:
    return f"recall-varied-seed{seed:02d}"


def estimated_tokens(script: Script) -> int:
    """Characters / 4 over every message, plus a few tokens of chat template per message: no tokenizer needed."""
    texts = [script.system or ""] + [t for s in script.steps for t in (s.user, s.assistant or "")]
    return sum(len(t) for t in texts) // 4 + 5 * len(texts)


def dumps(script: Script) -> str:
    """The chat as a replay script; the provenance (``fixture``) rides on the system line."""
    provenance = {**script.meta, "tokens_estimate": estimated_tokens(script)}
    return scripts.dump(script, {"fixture": provenance})


def fixture_path(seed: int, directory: Path = FIXTURE_DIR) -> Path:
    return Path(directory) / f"{script_name(seed)}.jsonl"


def save(script: Script, directory: Path) -> Path:
    path = fixture_path(int(script.meta["seed"]), directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(script), encoding="utf-8")
    return path


def load_fixture(seed: int, directory: Path = FIXTURE_DIR) -> Script:
    """The committed chat of ``seed``, checked against the generator (a stale fixture is an error)."""
    path = fixture_path(seed, directory)
    expected = scenario(seed)
    if path.read_text(encoding="utf-8") != dumps(expected):
        raise ValueError(f"{path}: does not match the recall_varied generator for seed {seed}; "
                         f"regenerate it with `certchat replay make-varied --seed {seed} --out {path.parent}`")
    loaded = load(path)
    return Script(expected.name, loaded.system, loaded.steps, str(path), expected.meta)


def describe(script: Script) -> str:
    """One line: turns, probes with their fact turns and distances, estimated tokens."""
    probes = script.probes
    distances = sorted(p.distance for p in probes if p.distance is not None)
    facts = sorted(script.fact_turns)
    return (f"{len(script.steps)} turns, {len(probes)} probes (facts in turns {', '.join(map(str, facts))}; "
            f"distances {distances[0]}–{distances[-1]}), ~{estimated_tokens(script):,} tokens (characters / 4)")
