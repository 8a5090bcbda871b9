"""LoCoMo → replay scripts: roles, dates, probes at the end, fact turns from evidence, filters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab.replay import locomo, script
from agent.lab.replay.locomo import LocomoError, Options

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo"


def _sample() -> dict:
    return {
        "speaker_a": "Ann", "speaker_b": "Bob",
        "session_1_date_time": "1:00 pm on 1 May, 2023",
        "session_1": [
            {"speaker": "Ann", "dia_id": "D1:1", "text": "I adopted a cat named Mochi."},
            {"speaker": "Bob", "dia_id": "D1:2", "text": "Lovely!"},
            {"speaker": "Bob", "dia_id": "D1:3", "text": "I bought a kayak.", "blip_caption": "a red kayak"},
        ],
        "session_2_date_time": "9:00 am on 3 June, 2023",
        "session_2": [
            {"speaker": "Bob", "dia_id": "D2:1", "text": "How is Mochi?"},
            {"speaker": "Ann", "dia_id": "D2:2", "text": "Great, we moved to Oslo."},
        ],
        "qa": [
            {"question": "What is Ann's cat called?", "answer": "Mochi", "evidence": ["D1:1"], "category": 4},
            {"question": "What did Bob buy?", "answer": "a kayak", "evidence": ["D1:3"], "category": 4},
            {"question": "When did Ann move?", "answer": "June 2023", "evidence": ["D2:2", "D1:1"], "category": 2},
            {"question": "Why?", "evidence": ["D1:1"], "category": 5, "adversarial_answer": "x"},
            {"question": "Where?", "answer": 2023, "evidence": ["D2:2"], "category": 3},
        ],
    }


def test_conversion_alternates_roles_with_dates_and_speakers() -> None:
    s = locomo.convert("t", {"conversation": _sample(), "qa": _sample()["qa"]})
    turns = [st for st in s.steps if not st.independent]
    assert len(turns) == 2
    assert turns[0].user == "(Session 1, 1:00 pm on 1 May, 2023)\nAnn: I adopted a cat named Mochi."
    # consecutive lines of one speaker merge; a photo becomes its caption
    assert turns[0].assistant == "Bob: Lovely!\nBob: I bought a kayak. [shares a photo: a red kayak]\n" \
                                 "(Session 2, 9:00 am on 3 June, 2023)\nBob: How is Mochi?"
    assert turns[1].user == "Ann: Great, we moved to Oslo."
    # a trailing user message gets a fixed reply so every policy keeps the same history
    assert turns[1].assistant == "Bob: (no reply)"
    assert "Ann" in (s.system or "") and "Bob" in (s.system or "")


def test_qa_become_independent_probes_with_fact_turns() -> None:
    s = locomo.convert("t", {"conversation": _sample(), "qa": _sample()["qa"]})
    probes = s.probes
    assert [p.probe.reference for p in probes] == ["Mochi", "a kayak", "June 2023", "2023"]  # no category 5
    assert all(p.independent and p.turn == 3 for p in probes)
    # an assistant line counts as the user turn it answers; the earliest evidence wins
    assert [p.probe.fact_turn for p in probes] == [1, 1, 1, 2]
    assert [p.distance for p in probes] == [2, 2, 2, 1]
    assert probes[0].probe.category == "single-hop" and probes[2].probe.category == "temporal"
    assert "What is Ann's cat called?" in probes[0].user


def test_filters_categories_sessions_and_probe_count() -> None:
    sample = {"conversation": _sample(), "qa": _sample()["qa"]}
    assert [p.probe.reference for p in locomo.convert("t", sample, Options(categories=(2,))).probes] == ["June 2023"]
    one = locomo.convert("t", sample, Options(max_sessions=1))
    # only questions whose evidence lies in the kept sessions
    assert [p.probe.reference for p in one.probes] == ["Mochi", "a kayak"]
    assert "Oslo" not in script.dump(one).split('"independent"')[0]
    two = locomo.convert("t", sample, Options(max_probes=2))
    assert [p.probe.reference for p in two.probes] == ["Mochi", "2023"]  # evenly spaced: first and last
    with pytest.raises(LocomoError, match="no QA left"):
        locomo.convert("t", sample, Options(categories=(1,)))


def test_category_parsing() -> None:
    assert locomo.parse_categories("2,4") == (2, 4)
    for bad in ("5", "0,2", "x", ""):
        with pytest.raises(LocomoError):
            locomo.parse_categories(bad)


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"speaker_a": "x"}')
    with pytest.raises(LocomoError, match="not a LoCoMo conversation"):
        locomo.load(bad)
    bad.write_text("{")
    with pytest.raises(LocomoError, match="not a readable JSON"):
        locomo.load(bad)


@pytest.mark.skipif(not (SHARED / "26.json").exists(), reason="the shared LoCoMo data is not in this checkout")
def test_the_shared_conversations_convert_to_valid_scripts(tmp_path: Path) -> None:
    for path in sorted(SHARED.glob("*.json")):
        (s,) = locomo.load(path, Options(categories=(2, 4)))
        again = script.load(script.save(s, tmp_path / f"{s.name}.jsonl"))
        assert again.steps == s.steps
        assert len(s.probes) > 50 and all(p.independent for p in s.probes)
        assert sum(p.probe.fact_turn is not None for p in s.probes) >= 0.95 * len(s.probes)
        assert max(p.distance for p in s.probes if p.distance is not None) > 150


def test_a_list_file_with_conversation_objects(tmp_path: Path) -> None:
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps([{"sample_id": "conv-1", "conversation": _sample(), "qa": _sample()["qa"]}]))
    (s,) = locomo.load(path)
    assert s.name == "locomo-conv-1" and len(s.probes) == 4
