"""The thirty-turn recall scenarios: facts early, real filler chat, recall probes at the end.

A scenario is fixed by its seed: five facts stated in turns 1–5, twenty filler questions
in turns 6–25, and the five facts asked back, in a shuffled order, in turns 26–30
(distances 21–29 turns). The assistant replies are *fixtures*: generated once with the
default model under a full cache, greedy, and committed as replay scripts under
``agent/lab/replay/fixtures/recall30/`` — so the history is real model text, identical for
every policy. A probe's fixture reply (the full-cache answer) follows it in the script,
so each policy's own answer is scored and then replaced by it.

Seeds 00–09 are the demo's. The calibration split (``certchat calibrate``) is 02–05 and 10–17; 00, 01 and 06–09 are
held out, and 18–23 were generated for a held-out check that no fit or diagnosis had looked at.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from agent.lab.replay import scoring
from agent.lab.replay.script import Probe, Script, Step, load

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "recall30"
FIXTURE_MODEL = "qwen2.5-coder-0.5b"
SYSTEM = "You are a helpful assistant. Answer concisely."
FIXTURE_MAX_TOKENS = 96
SEEDS = tuple(range(10))
QUICK_SEEDS = (0, 1)
N_FACTS = 5
N_FILLERS = 20


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    expect: tuple[str, ...]


FACTS: tuple[Fact, ...] = (
    Fact("My gym locker code is 4172.", "What is my gym locker code?", ("4172",)),
    Fact("My cat is called Purrnickel.", "What is my cat called?", ("Purrnickel",)),
    Fact("I grew up in Tromsø, in the north of Norway.", "Which town did I grow up in?", ("Tromsø", "Tromso")),
    Fact("My sister's name is Ilse.", "What is my sister's name?", ("Ilse",)),
    Fact("The wifi password at my cabin is maple-88.", "What is the wifi password at my cabin?",
         ("maple-88", "maple 88", "maple88")),
    Fact("My flight to Lisbon next week is TP 1843.", "What is my flight number to Lisbon?", ("1843",)),
    Fact("My favourite tea is lapsang souchong.", "What is my favourite tea?", ("lapsang",)),
    Fact("I drive a green 1998 Volvo 240.", "What car do I drive?", ("Volvo",)),
    Fact("My bike lock combination is 9305.", "What is my bike lock combination?", ("9305",)),
    Fact("My daughter's violin teacher is called Mrs. Okonkwo.", "What is my daughter's violin teacher called?",
         ("Okonkwo",)),
    Fact("My boat is named Saltfinch.", "What is my boat named?", ("Saltfinch",)),
    Fact("My employee ID is QX-5521.", "What is my employee ID?", ("5521",)),
    Fact("I am allergic to hazelnuts.", "Which food am I allergic to?", ("hazelnut",)),
    Fact("My grandmother lives in a village called Oberwil.", "What is my grandmother's village called?",
         ("Oberwil",)),
    Fact("I live in apartment 3B.", "What is my apartment number?", ("3B",)),
    Fact("The dog I'm fostering is a greyhound named Biscotti.", "What is the name of the dog I'm fostering?",
         ("Biscotti",)),
    Fact("My library card PIN is 6640.", "What is my library card PIN?", ("6640",)),
    Fact("My favourite composer is Hildegard von Bingen.", "Who is my favourite composer?", ("Hildegard",)),
    Fact("I parked in spot 112 of the garage.", "Which spot did I park in?", ("112",)),
    Fact("My brother lives in Valparaíso.", "Where does my brother live?", ("Valparaíso", "Valparaiso")),
    Fact("My password hint is 'blue heron'.", "What is my password hint?", ("heron",)),
    Fact("I call my fiddle-leaf fig Gustavo.", "What do I call my fiddle-leaf fig?", ("Gustavo",)),
    Fact("The conference I'm organising is in Ljubljana.", "Where is the conference I'm organising?",
         ("Ljubljana",)),
    Fact("My old school was Ridgemont Academy.", "What was my old school called?", ("Ridgemont",)),
    Fact("My landlord is Mr. Abernathy.", "What is my landlord's name?", ("Abernathy",)),
    Fact("My car's licence plate is KV-392-T.", "What is my car's licence plate?", ("392",)),
    Fact("I keep my spare key under the blue flowerpot.", "Where do I keep my spare key?",
         ("flowerpot", "flower pot")),
    Fact("My team's project codename is Bluefin.", "What is my team's project codename?", ("Bluefin",)),
    Fact("My favourite hiking trail is the Kungsleden.", "What is my favourite hiking trail?", ("Kungsleden",)),
    Fact("My piano is a 1962 Bösendorfer.", "What make is my piano?", ("Bösendorfer", "Bosendorfer")),
)

FILLERS: tuple[str, ...] = (
    "How do I reverse a list in Python?",
    "What is a good way to start learning to cook?",
    "Can you explain what a hash map is?",
    "Give me three tips for better sleep.",
    "What's the difference between a list and a tuple in Python?",
    "How do I center a div in CSS?",
    "Suggest a name for a bakery.",
    "What is the capital of Australia?",
    "Explain recursion in one paragraph.",
    "How can I make my morning routine more productive?",
    "What does HTTP status 404 mean?",
    "Write a haiku about autumn.",
    "How do I convert Celsius to Fahrenheit?",
    "What is a good stretch for a stiff neck?",
    "Explain what Git branches are for.",
    "What are some healthy snacks?",
    "How does binary search work?",
    "What should I pack for a weekend camping trip?",
    "Give me an idea for a birthday present for a friend who likes books.",
    "How do I write a for loop in JavaScript?",
    "Why is the sky blue?",
    "What is the difference between weather and climate?",
    "How can I stay focused while working from home?",
    "Explain what an API is.",
    "Recommend a board game for four players.",
    "How do I remove duplicates from a list in Python?",
    "What is a prime number?",
    "How long should I boil an egg for a soft yolk?",
    "What's a quick vegetarian dinner idea?",
    "How do I make coffee with a French press?",
    "What are the benefits of unit testing?",
    "Explain the difference between RAM and storage.",
    "How do I politely decline a meeting?",
    "What is photosynthesis?",
    "Suggest a short workout I can do at home.",
    "What's the best way to learn a new language?",
    "How do I read a CSV file in Python?",
    "What is the Pythagorean theorem?",
    "Give me a tip for writing clearer emails.",
    "What is a closure in programming?",
    "How do I keep basil alive indoors?",
    "What is compound interest?",
    "Name three famous painters and one work by each.",
    "How do I sort a dictionary by value in Python?",
    "What is the difference between SQL and NoSQL databases?",
    "How can I reduce my screen time?",
    "What causes thunder?",
    "Give me a fun fact about octopuses.",
    "How do I make a simple tomato sauce?",
    "What is the difference between a process and a thread?",
)


def scenario(seed: int) -> Script:
    """The scenario of ``seed`` without replies (turns 1–25 generate; probes score)."""
    rng = random.Random(f"recall30-{seed}")
    facts = rng.sample(FACTS, N_FACTS)
    fillers = rng.sample(FILLERS, N_FILLERS)
    order = list(range(N_FACTS))
    rng.shuffle(order)
    steps: list[Step] = []
    for i, fact in enumerate(facts):
        steps.append(Step(i + 1, fact.statement, 2 * i + 2))
    for j, text in enumerate(fillers):
        steps.append(Step(N_FACTS + j + 1, text, 2 * (N_FACTS + j) + 2))
    for k, i in enumerate(order):
        turn = N_FACTS + N_FILLERS + k + 1
        steps.append(Step(turn, facts[i].question, 2 * turn,
                          probe=Probe(expect=facts[i].expect, fact_turn=i + 1, category="recall30")))
    return Script(name=f"recall30-seed{seed:02d}", system=SYSTEM, steps=tuple(steps), source=f"recall30:{seed}",
                  meta={"seed": seed})


def fixture_path(seed: int, directory: Path = FIXTURE_DIR) -> Path:
    return directory / f"seed-{seed:02d}.jsonl"


def with_replies(script: Script, replies: list[str]) -> Script:
    """The scenario with one reply per step (fixed, teacher-forced text)."""
    if len(replies) != len(script.steps):
        raise ValueError(f"{script.name}: {len(replies)} replies for {len(script.steps)} steps")
    steps = tuple(Step(s.turn, s.user, s.lineno, r, s.probe, s.independent) for s, r in zip(script.steps, replies))
    return Script(script.name, script.system, steps, script.source, script.meta)


def write_fixture(script: Script, replies: list[str], path: Path, provenance: dict[str, Any]) -> Path:
    """Save a scenario with its replies as a replay script; provenance rides on the system line."""
    full = with_replies(script, replies)
    lines = [json.dumps({"role": "system", "content": full.system, "fixture": provenance}, ensure_ascii=False)]
    for step in full.steps:
        line: dict[str, Any] = {"role": "user", "content": step.user}
        if step.probe is not None:
            line["probe"] = {"expect": list(step.probe.expect), "fact_turn": step.probe.fact_turn}
        lines.append(json.dumps(line, ensure_ascii=False))
        lines.append(json.dumps({"role": "assistant", "content": step.assistant}, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def load_fixture(seed: int, directory: Path = FIXTURE_DIR) -> Script:
    """The committed script of ``seed``, checked against the generator (a stale fixture is an error)."""
    path = fixture_path(seed, directory)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no recall30 fixture for seed {seed}; run `certchat demo recall30 "
                                f"--regenerate-fixtures` (needs {FIXTURE_MODEL})")
    loaded = load(path)
    expected = scenario(seed)
    def shape(script: Script) -> list[tuple[Any, ...]]:
        return [(s.user, s.turn, s.probe and (s.probe.expect, s.probe.fact_turn)) for s in script.steps]

    if shape(loaded) != shape(expected):
        raise ValueError(f"{path}: does not match the recall30 generator for seed {seed}; regenerate the fixtures")
    steps = tuple(Step(s.turn, s.user, s.lineno, s.assistant, e.probe, s.independent)
                  for s, e in zip(loaded.steps, expected.steps))
    return Script(expected.name, loaded.system, steps, str(path), expected.meta)


def generate_replies(script: Script, send: Callable[[str], str]) -> list[str]:
    """Each step's reply from ``send`` (a full-cache session's ``send(text).answer``), in order."""
    return [send(step.user) for step in script.steps]


def fixture_report(script: Script) -> dict[str, Any]:
    """How the fixture's own (full-cache) probe replies score: the ceiling every policy is held to."""
    probes = script.probes
    correct = [scoring.contains(p.assistant or "", p.probe.expect) for p in probes if p.probe is not None]
    return {"probes": len(correct), "correct": sum(correct)}


def generate_fixtures(seeds: tuple[int, ...], model: str = FIXTURE_MODEL, directory: Path = FIXTURE_DIR,
                      threads: int | None = None, max_tokens: int = FIXTURE_MAX_TOKENS,
                      log: Callable[[str], None] = print) -> list[Path]:
    """Generate and write the fixtures of ``seeds``: full cache, greedy, one conversation each."""
    import tempfile  # noqa: PLC0415

    from agent import models  # noqa: PLC0415
    from agent.chat.session import ChatSession  # noqa: PLC0415
    from agent.config import Config  # noqa: PLC0415
    from agent.llm.engine import Engine, EngineSettings  # noqa: PLC0415
    from memory_store.store import Store  # noqa: PLC0415

    path = models.resolve(model)
    cfg = Config(model=model, policy="full", gate="off", temperature=0.0, max_tokens=max_tokens,
                 system_prompt=SYSTEM, n_ctx=4096).replace(threads=threads)
    engine = Engine(EngineSettings.from_config(cfg, path))
    written = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "fixtures.db")
            for seed in seeds:
                script = scenario(seed)
                session = ChatSession(cfg, store, engine, model if model in models.REGISTRY else path.name)
                try:
                    replies = generate_replies(script, lambda text: session.send(text).answer.strip())
                finally:
                    session.close()
                sha = models.sha256_of(model, path)
                name = model if model in models.REGISTRY else path.name
                provenance = {"generator": "agent.lab.replay.recall30", "seed": seed, "model": name,
                              "model_sha256": sha, "policy": "full", "temperature": 0.0,
                              "max_tokens": max_tokens, "history_tokens": engine.next_pos}
                out = write_fixture(script, replies, fixture_path(seed, directory), provenance)
                rep = fixture_report(load(out))
                log(f"{out}: {engine.next_pos} tokens; full-cache probe answers correct "
                    f"{rep['correct']}/{rep['probes']}")
                written.append(out)
            store.close()
    finally:
        engine.close()
    return written
