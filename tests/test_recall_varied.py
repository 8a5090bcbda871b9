"""The varied-recall generator: deterministic, valid scripts, facts mid-message, questions that paraphrase.

No model: the chats are templates, and everything here reads text.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from agent.lab import cli_replay
from agent.lab.replay import recall30, recall_varied, script
from agent.lab.replay.longchat_facts import content_words
from agent.lab.replay.recall_varied_facts import FACTS

SEEDS = tuple(range(60))
# Mr./Mrs./Ms. end in a full stop but do not end a sentence.
_SENTENCE_END = re.compile(r"(?<!Mr\.)(?<!Mrs\.)(?<!Ms\.)(?<=[.?!])\s+")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="certchat")
    cli_replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


def _chats() -> list[script.Script]:
    return [recall_varied.scenario(s) for s in SEEDS]


def _fact_step(chat: script.Script, probe: script.Step) -> script.Step:
    assert probe.probe is not None and probe.probe.fact_turn is not None
    return chat.steps[probe.probe.fact_turn - 1]


def _aside(chat: script.Script, probe: script.Step) -> tuple[int, list[str]]:
    """The index of the sentence that states the probe's answer, and the fact message's sentences."""
    assert probe.probe is not None
    sentences = _SENTENCE_END.split(_fact_step(chat, probe).user)
    answer = probe.probe.expect[0].casefold()
    hits = [i for i, s in enumerate(sentences) if answer in s.casefold()]
    assert len(hits) == 1, (probe.user, sentences)
    return hits[0], sentences


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def test_data_is_varied_enough_for_seeds_to_differ() -> None:
    assert len(FACTS) >= 25
    assert len({f.kind for f in FACTS}) == len(FACTS)
    for fact in FACTS:
        assert len(fact.values) >= 2 and len(fact.asides) >= 2 and len(fact.questions) >= 2, fact.kind
        for value in fact.values:
            assert value.expect[0].casefold() in value.text.casefold(), (fact.kind, value)
    texts = {recall_varied.dumps(c) for c in _chats()}
    assert len(texts) == len(SEEDS)


def test_deterministic_by_seed() -> None:
    for seed in (0, 7, 100):
        assert recall_varied.dumps(recall_varied.scenario(seed)) == recall_varied.dumps(recall_varied.scenario(seed))


def test_scripts_load_and_follow_the_format(tmp_path: Path) -> None:
    for seed in SEEDS[:20]:
        chat = recall_varied.scenario(seed)
        path = recall_varied.save(chat, tmp_path)
        assert path.name == f"recall-varied-seed{seed:02d}.jsonl"
        loaded = script.load(path)
        assert [(s.turn, s.user, s.assistant, s.probe) for s in loaded.steps] == \
            [(s.turn, s.user, s.assistant, s.probe) for s in chat.steps]
        assert len(loaded.steps) == recall_varied.N_TURNS
        assert all(s.assistant for s in loaded.steps)  # every reply teacher-forced: one history for every policy
        probes = loaded.probes
        assert len(probes) == recall_varied.N_FACTS
        assert all(p.probe is not None and p.probe.fact_turn is not None and p.distance and p.distance > 0
                   for p in probes)
        first = json.loads(path.read_text(encoding="utf-8").split("\n", 1)[0])
        assert first["role"] == "system"
        assert first["fixture"]["generator"] == "agent.lab.replay.recall_varied"
        assert first["fixture"]["seed"] == seed and first["fixture"]["family"] == "varied"


def test_each_answer_is_in_its_fact_message_and_nowhere_else() -> None:
    for chat in _chats():
        for p in chat.probes:
            assert p.probe is not None
            expect = [e.casefold() for e in p.probe.expect]
            assert expect[0] in _fact_step(chat, p).user.casefold(), p.user
            assert not any(e in p.user.casefold() for e in expect), p.user
            assert any(e in (p.assistant or "").casefold() for e in expect)  # the replacing reply is correct
            others = [s.user for s in chat.steps if s.turn != p.probe.fact_turn]
            others += [s.assistant or "" for s in chat.steps if s.turn != p.turn]
            leaks = [t for t in others if any(e in t.casefold() for e in expect)]
            assert not leaks, (chat.name, p.probe.expect, leaks)


def test_facts_sit_mid_message_and_one_opens_the_chat() -> None:
    for chat in _chats():
        assert 1 in chat.fact_turns, chat.name
        for p in chat.probes:
            index, sentences = _aside(chat, p)
            # an unrelated sentence before the fact and the message's real request after it
            assert 0 < index < len(sentences) - 1, sentences


def test_questions_paraphrase_their_facts() -> None:
    # Every template pair, not only the drawn ones: no question shares a content word with its fact's asides.
    for fact in FACTS:
        for value in fact.values:
            for aside in fact.asides:
                stated = content_words(aside.format(v=value.text, **value.slots))
                for question in fact.questions:
                    shared = content_words(question.format(**value.slots)) & stated
                    assert not shared, (fact.kind, question, shared)
    # In the chats the probe's frame ("Sorry, my memory is shot today.") may add one common word; a bound of
    # 0.1 allows one shared word against the ~10 content words a probe and its aside hold together, while
    # recall30's questions, which repeat their facts, share far more (checked below as the contrast).
    varied = []
    for chat in _chats():
        for p in chat.probes:
            index, sentences = _aside(chat, p)
            score = _jaccard(content_words(p.user), content_words(sentences[index]))
            assert score <= 0.1, (p.user, sentences[index])
            varied.append(score)
    same = [_jaccard(content_words(f.question), content_words(f.statement)) for f in recall30.FACTS]
    assert sum(varied) / len(varied) < 0.02 < 0.3 < sum(same) / len(same)


@pytest.mark.parametrize("seed", recall_varied.HELD_OUT_SEEDS)
def test_committed_fixtures_are_the_generators(seed: int) -> None:
    path = recall_varied.fixture_path(seed)
    assert path.read_text(encoding="utf-8") == recall_varied.dumps(recall_varied.scenario(seed)), \
        f"{path}: regenerate with `certchat replay make-varied --seed 100 --count 5 --out {path.parent}`"
    loaded = recall_varied.load_fixture(seed)
    assert loaded.meta["seed"] == seed and len(loaded.probes) == recall_varied.N_FACTS


def test_load_fixture_refuses_a_stale_file(tmp_path: Path) -> None:
    path = recall_varied.save(recall_varied.scenario(3), tmp_path)
    path.write_text(path.read_text(encoding="utf-8").replace("?", "!", 1), encoding="utf-8")
    with pytest.raises(ValueError, match="does not match"):
        recall_varied.load_fixture(3, tmp_path)


def test_cli_writes_count_chats_from_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["replay", "make-varied", "--seed", "5", "--count", "2", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recall-varied-seed05.jsonl", "recall-varied-seed06.jsonl"]
    assert "5 probes" in capsys.readouterr().out
    assert (tmp_path / "recall-varied-seed06.jsonl").read_text(encoding="utf-8") == \
        recall_varied.dumps(recall_varied.scenario(6))
    assert _cli(["replay", "make-varied", "--seed", "5"]) == 1
    assert _cli(["replay", "make-varied", "--count", "0", "--out", str(tmp_path)]) == 1
