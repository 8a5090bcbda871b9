"""The thirty-turn recall scenarios and their committed fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab.replay import recall30, script


def test_scenarios_are_seeded_and_shaped() -> None:
    a, b = recall30.scenario(0), recall30.scenario(0)
    assert a == b and recall30.scenario(1) != a
    assert len(a.steps) == 30 and [s.turn for s in a.steps] == list(range(1, 31))
    probes = a.probes
    assert [p.turn for p in probes] == [26, 27, 28, 29, 30]
    assert sorted(p.probe.fact_turn for p in probes) == [1, 2, 3, 4, 5]
    assert all(21 <= p.distance <= 29 for p in probes)
    assert a.filler_turns() == list(range(6, 26))
    facts = [s.user for s in a.steps[:5]]
    # each probe asks about a fact stated in its fact turn, and no filler mentions an answer
    for p in probes:
        fact = next(f for f in recall30.FACTS if f.statement == facts[p.probe.fact_turn - 1])
        assert p.user == fact.question and p.probe.expect == fact.expect
    fillers = " ".join(s.user for s in a.steps[5:25]).lower()
    assert not any(e.lower() in fillers for f in recall30.FACTS for e in f.expect)


def test_fact_pool_answers_are_distinct() -> None:
    expects = [e.lower() for f in recall30.FACTS for e in f.expect]
    for f in recall30.FACTS:
        # a fact's expected strings occur in its own statement and in no other fact's statement
        assert any(e.lower() in f.statement.lower() for e in f.expect), f
        others = [g for g in recall30.FACTS if g is not f]
        assert not any(e.lower() in g.statement.lower() for e in f.expect for g in others), f
    assert len(set(expects)) == len(expects)


@pytest.mark.parametrize("seed", recall30.SEEDS)
def test_committed_fixtures_match_the_generator(seed: int) -> None:
    path = recall30.fixture_path(seed)
    if not path.exists():
        pytest.fail(f"{path} is missing: run `certchat demo recall30 --regenerate-fixtures`")
    s = recall30.load_fixture(seed)
    assert all(step.assistant for step in s.steps)  # every reply is fixed text
    provenance = json.loads(path.read_text(encoding="utf-8").splitlines()[0])["fixture"]
    assert provenance["model"] == recall30.FIXTURE_MODEL and provenance["policy"] == "full"
    assert provenance["temperature"] == 0.0 and provenance["seed"] == seed


def test_a_stale_fixture_is_refused(tmp_path: Path) -> None:
    s = recall30.scenario(3)
    path = recall30.write_fixture(s, ["ok"] * 30, recall30.fixture_path(3, tmp_path), {"model": "x"})
    assert recall30.load_fixture(3, tmp_path).steps[0].assistant == "ok"
    text = path.read_text(encoding="utf-8").replace(s.steps[7].user, "Something else entirely?")
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="does not match the recall30 generator"):
        recall30.load_fixture(3, tmp_path)
    with pytest.raises(FileNotFoundError, match="regenerate-fixtures"):
        recall30.load_fixture(4, tmp_path)


@pytest.mark.slow
def test_fixture_generation_runs_on_a_real_model(small_model: Path, tmp_path: Path) -> None:
    (path,) = recall30.generate_fixtures((5,), model=str(small_model), directory=tmp_path, threads=1,
                                         max_tokens=6, log=lambda line: None)
    s = script.load(path)
    assert len(s.steps) == 30 and all(step.assistant is not None for step in s.steps)
    assert recall30.load_fixture(5, tmp_path).probes[0].assistant == s.probes[0].assistant
