"""The long-chat generator: its format and invariants on the real tokenizer and the shared LoCoMo dialogue.

Not its timing: the demo's speed is measured by the demo, never here.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from agent.lab import cli_replay
from agent.lab.replay import longchat, scoring, script
from agent.lab.replay.longchat_facts import FACTS, content_words, reply

HAVE_LOCOMO = bool(sorted(longchat.SHARED_LOCOMO.glob("*.json")))
needs_locomo = pytest.mark.skipif(not HAVE_LOCOMO, reason="the shared LoCoMo data is not on this machine")


@pytest.fixture(scope="module")
def counter():
    c = longchat.counter_for()
    yield c
    c.close()


@pytest.fixture(scope="module")
def sixteen(counter: longchat.TokenCounter) -> script.Script:
    return longchat.generate(3, 16000, counter)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="certchat")
    cli_replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


def _auc(positive: list[int], negative: list[int]) -> float:
    """P(a positive's turn index exceeds a negative's): 1.0 when the probes are all at the end."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def test_fact_pool() -> None:
    expects = [e.casefold() for f in FACTS for e in f.expect]
    assert len(set(expects)) == len(expects) and len(FACTS) >= 40
    for f in FACTS:
        assert any(e.casefold() in f.clause.casefold() for e in f.expect), f
        assert not any(e.casefold() in g.clause.casefold() for e in f.expect for g in FACTS if g is not f), f
        assert scoring.contains(reply(f), f.expect), f
        # paraphrased: no content word shared with the fact; verbatim: some
        assert not content_words(f.paraphrased) & content_words(f.clause), f
        assert content_words(f.verbatim) & content_words(f.clause), f
        assert not scoring.contains(f.verbatim + " " + f.paraphrased, f.expect), f


def test_sizes_parse() -> None:
    assert longchat.parse_size("8k") == 8000 and longchat.parse_size("16K") == 16000
    assert longchat.parse_size("12,000") == 12000 and longchat.size_label(32000) == "32k"
    for bad in ("lots", "100"):
        with pytest.raises(longchat.LongchatError, match="--history"):
            longchat.parse_size(bad)
    assert [longchat.default_probes(t) for t in (8000, 16000, 32000)] == [10, 20, 40]


@needs_locomo
def test_a_16k_script_keeps_the_invariants(sixteen: script.Script, counter: longchat.TokenCounter,
                                            tmp_path: Path) -> None:
    s = sixteen
    # it is a valid replay script, every reply teacher-forced, and round-trips through the file
    again = longchat.load(longchat.save(s, tmp_path))
    assert again.steps == s.steps and again.meta["question_fillers"] == s.meta["question_fillers"]
    assert all(st.assistant for st in s.steps) and not any(st.independent for st in s.steps)
    # size: near the target under the real tokenizer and template
    assert abs(counter.history(s) - 16000) <= 0.03 * 16000 and s.meta["tokens"] == counter.history(s)
    probes = s.probes
    assert len(probes) == 20
    by_turn = {st.turn: st for st in s.steps}
    fillers = set(s.meta["question_fillers"])
    assert len(fillers) == 20 and not fillers & set(p.turn for p in probes) and not fillers & s.fact_turns
    for p in probes:
        assert p.probe is not None and p.probe.fact_turn is not None
        fact_step = by_turn[p.probe.fact_turn]
        # the fact is earlier, in an ordinary (dialogue) user message, and says the answer; the probe does not
        assert p.probe.fact_turn < p.turn and fact_step.probe is None and fact_step.turn not in fillers
        assert scoring.contains(fact_step.user, p.probe.expect)
        assert not scoring.contains(p.user, p.probe.expect)
        # the teacher-forced answer is correct by the probe's own rule
        assert scoring.contains(p.assistant or "", p.probe.expect)
        # nothing before the fact gives the answer away
        earlier = " ".join(f"{st.user} {st.assistant}" for st in s.steps if st.turn < p.probe.fact_turn)
        assert not scoring.contains(earlier, p.probe.expect)
    # distances from a few turns to well over a hundred
    distances = sorted(p.distance for p in probes)
    assert distances[0] <= 5 and distances[-1] >= 100
    assert sum(d >= 25 for d in distances) >= 5 and sum(d < 10 for d in distances) >= 5
    # about half paraphrased, and paraphrased probes share no content word with their fact
    para = [p for p in probes if p.probe.category == "paraphrased"]
    assert len(para) == 10 and {p.probe.category for p in probes} == {"paraphrased", "verbatim"}
    fact_of = {f.expect: f for f in FACTS}
    for p in para:
        assert not content_words(p.user) & content_words(fact_of[p.probe.expect].clause), p.user
    # probes are spread through the script: turn index does not separate them from the other turns
    others = [st.turn for st in s.steps if st.probe is None]
    assert _auc([p.turn for p in probes], others) < 0.7
    assert _auc([p.turn for p in probes], sorted(fillers)) < 0.7
    thirds = [sum(1 for p in probes if k * len(s.steps) / 3 < p.turn <= (k + 1) * len(s.steps) / 3) for k in range(3)]
    assert min(thirds) >= 4, thirds


@needs_locomo
def test_question_fillers_ask_about_the_previous_turn(sixteen: script.Script) -> None:
    by_turn = {st.turn: st for st in sixteen.steps}
    for turn in sixteen.meta["question_fillers"]:
        filler, before = by_turn[turn], by_turn[turn - 1]
        assert filler.probe is None and filler.user.endswith("?")
        assert before.probe is None and turn - 1 not in sixteen.meta["question_fillers"]
        # answered by a quote of the previous assistant message: no older history needed
        quoted = filler.assistant.split('"', 1)[1].rsplit('"', 1)[0]
        assert quoted and quoted in (before.assistant or "")


@needs_locomo
def test_generation_is_deterministic_by_seed(counter: longchat.TokenCounter, sixteen: script.Script) -> None:
    a = longchat.generate(3, 16000, counter)
    assert longchat.dumps(a) == longchat.dumps(sixteen)
    b = longchat.generate(4, 16000, counter)
    assert [st.user for st in b.steps] != [st.user for st in a.steps]


@needs_locomo
@pytest.mark.parametrize("target", [8000, 32000])
def test_other_sizes_are_near_their_target(counter: longchat.TokenCounter, target: int) -> None:
    s = longchat.generate(1, target, counter)
    assert abs(s.meta["tokens"] - target) <= 0.03 * target
    assert len(s.probes) == longchat.default_probes(target)
    if target == 32000:
        # fits the fixture model's 32,768-token context with room for an answer
        assert s.meta["tokens"] + 256 < counter.context_length()
        assert max(p.distance for p in s.probes) >= 200


@needs_locomo
def test_committed_fixture_matches_the_generator(counter: longchat.TokenCounter) -> None:
    path = longchat.fixture_path(*longchat.QUICK_FIXTURE)
    assert path.exists(), f"{path}: regenerate with `certchat replay make-long --history 8k --out {path.parent}`"
    committed = longchat.load(path)
    label, seed = longchat.QUICK_FIXTURE
    fresh = longchat.generate(seed, longchat.parse_size(label), counter)
    assert committed.steps == fresh.steps and committed.meta["tokens"] == fresh.meta["tokens"]
    assert json.loads(path.read_text(encoding="utf-8").split("\n", 1)[0])["longchat"]["tokenizer"] == \
        longchat.FIXTURE_MODEL


def test_the_committed_fixture_is_self_consistent() -> None:
    """Without LoCoMo at hand: the fixture's probes, facts and fillers still keep the invariants."""
    s = longchat.load(longchat.fixture_path(*longchat.QUICK_FIXTURE))
    by_turn = {st.turn: st for st in s.steps}
    assert 7000 <= s.meta["tokens"] <= 9000 and len(s.probes) == 10
    for p in s.probes:
        assert scoring.contains(by_turn[p.probe.fact_turn].user, p.probe.expect)
        assert scoring.contains(p.assistant or "", p.probe.expect)
    assert sum(p.probe.category == "paraphrased" for p in s.probes) == 5


def test_layout_invariants_over_many_seeds() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        turns = rng.randrange(60, 500)
        k = rng.randrange(3, 41)
        if turns < 3 * 2 * k:
            with pytest.raises(longchat.LongchatError, match="too few"):
                longchat.layout(turns, k, k, rng)
            continue
        plan = longchat.layout(turns, k, k, rng)
        assert len(plan.probes) == k and len(plan.fillers) == k
        facts = set(plan.probes.values())
        assert len(facts) == k and not facts & set(plan.probes) and not facts & plan.fillers
        assert all(p - f >= longchat.MIN_DISTANCE for p, f in plan.probes.items())
        assert all(1 <= t <= turns for t in [*plan.probes, *facts, *plan.fillers])
        assert all(f - 1 not in plan.probes and f - 1 not in plan.fillers for f in plan.fillers)


def test_a_layout_past_the_trained_context_asks_after_it_about_facts_older_and_younger_than_it() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        turns = rng.randrange(400, 900)
        mark = int(turns * rng.uniform(0.5, 0.7))
        k = rng.randrange(4, 31)
        plan = longchat.layout_beyond(turns, k, k, mark, rng)
        margin = max(3, turns // 50)
        assert len(plan.probes) == k and len(plan.fillers) == k
        assert all(p > mark for p in plan.probes)
        older = [p for p, f in plan.probes.items() if p - f > mark]
        assert len(older) == k // 2 and all(p - f >= mark + margin for p, f in plan.probes.items() if p in older)
        assert all(p - f <= mark - margin for p, f in plan.probes.items() if p not in older)
        facts = set(plan.probes.values())
        assert len(facts) == k and not facts & set(plan.probes) and not facts & plan.fillers
    with pytest.raises(longchat.LongchatError, match="no room"):
        longchat.layout_beyond(100, 30, 30, 60, random.Random(0))


@needs_locomo
def test_a_script_past_the_trained_context_records_each_fact_age(counter: longchat.TokenCounter) -> None:
    from agent.lab.replay.longdemo import fact_ages

    s = longchat.generate(5, 8000, counter, probes=6, beyond=5000)
    assert s.meta["beyond"] == 5000 and len(s.meta["turn_tokens"]) == len(s.steps)
    assert s.meta["turn_tokens"] == sorted(s.meta["turn_tokens"])
    ages = fact_ages(s)["fact_age_tokens"]
    assert len(ages) == 6 and sum(a > 5000 for a in ages.values()) == 3
    assert fact_ages(longchat.generate(5, 8000, counter, probes=6)) == {}


@needs_locomo
def test_make_long_cli_prints_token_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["replay", "make-long", "--history", "3k,5500", "--seed", "2", "--probes", "4",
                 "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line, target, label in zip(lines, (3000, 5500), ("3k", "5500")):
        path = tmp_path / f"longchat-{label}-seed02.jsonl"
        assert line.startswith(f"{path}: ") and "4 probes (2 paraphrased)" in line
        s = longchat.load(path)
        assert f"{s.meta['tokens']:,} tokens" in line and abs(s.meta["tokens"] - target) <= 0.05 * target
    assert _cli(["replay", "make-long", "--history", "lots", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == "certchat replay: --history: expected a token count like 16k or " \
                                              "12000, got 'lots'"
    assert _cli(["replay", "make-long", "--locomo", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 1
    assert "no such LoCoMo file" in capsys.readouterr().err
