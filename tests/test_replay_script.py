"""The replay script format: what parses, what each step means, and the errors bad lines get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab.replay import script
from agent.lab.replay.script import ScriptError


def _write(tmp_path: Path, lines: list[object], name: str = "s.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n",
                    encoding="utf-8")
    return path


GOOD = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "My locker code is 4172.", "note": "unknown keys are ignored"},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "user", "content": "What is my locker code?", "probe": {"expect": ["4172"], "fact_turn": 1}},
    {"role": "assistant", "content": "4172."},
    {"role": "user", "content": "And again?", "probe": {"expect": ["4172"], "fact_turn": 1}, "independent": True},
    "",
    {"role": "user", "content": "Bye", "probe": {"expect": "bye", "fact_turn": 3, "answer": "Bye!", "category": 4}},
]


def test_a_script_becomes_steps_with_turns_and_distances(tmp_path: Path) -> None:
    s = script.load(_write(tmp_path, GOOD))
    assert s.name == "s" and s.system == "Be brief."
    assert [(st.turn, st.lineno) for st in s.steps] == [(1, 2), (2, 4), (3, 5), (4, 7), (4, 9)]
    first, joke, probe, independent, last = s.steps
    assert first.assistant == "Noted." and first.probe is None
    assert joke.assistant is None  # its generated answer enters the history
    assert probe.assistant == "4172." and probe.probe.expect == ("4172",) and probe.distance == 2
    # an independent probe takes the next turn's number without using it up
    assert independent.independent and independent.distance == 3
    assert last.probe.expect == ("bye",) and last.probe.reference == "Bye!" and last.probe.category == "4"
    assert s.fact_turns == {1, 3} and s.filler_turns() == [2]


def test_dump_and_load_round_trip(tmp_path: Path) -> None:
    s = script.load(_write(tmp_path, GOOD))
    again = script.load(script.save(s, tmp_path / "copy" / "s.jsonl"))
    assert again.steps == s.steps and again.system == s.system


@pytest.mark.parametrize("lines, lineno, message", [
    (['{"role": "user", "content": "x"', ], 1, "not valid JSON"),
    ([[1, 2]], 1, "expected a JSON object"),
    ([{"role": "bot", "content": "x"}], 1, "\"role\" must be one of"),
    ([{"role": "user", "content": 3}], 1, "\"content\" must be a string"),
    ([{"role": "user", "content": "  "}], 1, "a user message needs text"),
    ([{"role": "assistant", "content": "hi"}], 1, "must follow a user message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}],
     3, "must follow a user message"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], 2, "only be the first line"),
    ([{"role": "user", "content": "a", "independent": True}, {"role": "assistant", "content": "b"}], 2,
     "cannot follow an independent"),
    ([{"role": "user", "content": "a", "probe": {"expect": []}}], 1, "non-empty list"),
    ([{"role": "user", "content": "a", "probe": ["x"]}], 1, "\"probe\" must be an object"),
    ([{"role": "user", "content": "a", "probe": {"expect": ["x"], "fact_turn": 1}}], 1, "is not before the probe"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b", "probe": {"expect": ["x"], "fact_turn": 0}}],
     2, "must be a user turn number"),
    ([{"role": "user", "content": "a", "independent": "yes"}], 1, "\"independent\" must be true or false"),
    ([{"role": "system", "content": "only a system line"}], None, "no user messages"),
])
def test_malformed_lines_name_the_file_and_line(tmp_path: Path, lines: list[object], lineno: int | None,
                                                message: str) -> None:
    path = _write(tmp_path, lines)
    with pytest.raises(ScriptError) as err:
        script.load(path)
    text = str(err.value)
    assert text.startswith(f"{path}:{lineno}: " if lineno else f"{path}: ") and message in text


def test_unreadable_files_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match="cannot read"):
        script.load(tmp_path / "missing.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"role": "user", "content": "caf\xe9"}\n')
    with pytest.raises(ScriptError, match="not UTF-8"):
        script.load(bad)


def test_a_locomo_file_given_as_a_script_says_to_pass_it_with_locomo(tmp_path: Path) -> None:
    path = tmp_path / "30.json"
    path.write_text(json.dumps({"conversation": {"speaker_a": "A", "speaker_b": "B"}, "qa": []}, indent=1))
    with pytest.raises(ScriptError) as err:
        script.load(path)
    assert str(err.value) == (f"{path}: a LoCoMo conversation, not a replay script: pass it with --locomo {path} "
                              "(one --locomo per file)")


def test_a_line_separator_inside_content_is_not_a_line_break(tmp_path: Path) -> None:
    path = tmp_path / "u2028.jsonl"
    path.write_text(json.dumps({"role": "user", "content": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert script.load(path).steps[0].user == "a\u2028b"
