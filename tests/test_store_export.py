"""Replay JSONL and Markdown export, JSONL import."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from memory_store import ImportFormatError, Store
from memory_store.export import export_jsonl, export_markdown, import_jsonl, read_jsonl

SCRIPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "My cat is called Purrnickel."},
    {"role": "assistant", "content": "What a lovely name!"},
    {"role": "user", "content": "What is my cat called?", "probe": {"expect": ["Purrnickel"], "fact_turn": 1}},
    {"role": "user", "content": "And my PIN?", "probe": {"expect": ["8311"], "fact_turn": 3}, "independent": True},
]


@pytest.fixture
def store(tmp_path: Path):
    with Store(tmp_path / "log.db") as s:
        yield s


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_import_replay_script_and_export_it_back(store: Store, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "recall_01.jsonl", [json.dumps(line) for line in SCRIPT])
    conversation = import_jsonl(store, source)
    assert (conversation.title, conversation.message_count) == ("recall_01", 5)
    messages = store.messages(conversation.id)
    assert [m.role for m in messages] == [line["role"] for line in SCRIPT]
    assert messages[3].meta == {"probe": {"expect": ["Purrnickel"], "fact_turn": 1}}
    assert messages[4].meta == {"probe": {"expect": ["8311"], "fact_turn": 3}, "independent": True}
    assert all(m.tokens is None and m.status == "complete" for m in messages)

    out = io.StringIO()
    assert export_jsonl(store, conversation.id, out) == 5
    lines = [json.loads(raw) for raw in out.getvalue().splitlines()]
    # Exactly the replay format, plus keys a replay reader ignores.
    for exported, original in zip(lines, SCRIPT):
        assert {k: v for k, v in exported.items() if k not in ("status", "conversation")} == original
        assert exported["status"] == "complete"
    assert lines[0]["conversation"]["title"] == "recall_01"
    assert all("conversation" not in line for line in lines[1:])


def test_export_carries_status_tokens_and_conversation_header(store: Store, tmp_path: Path) -> None:
    c = store.create_conversation("chat", model="qwen", settings={"budget": 0.25})
    store.append_user_message(c.id, "hi", tokens=[1, 2], first_pos=0, meta={"source": "tui"})
    stream = store.stream_assistant(c.id, first_pos=2)
    stream.append("hel", [3])
    stream.cancel()
    out = io.StringIO()
    export_jsonl(store, c.id, out)
    lines = [json.loads(raw) for raw in out.getvalue().splitlines()]
    assert lines == [
        {
            "role": "user", "content": "hi", "status": "complete", "meta": {"source": "tui"},
            "tokens": [1, 2], "first_pos": 0,
            "conversation": {"title": "chat", "model": "qwen", "settings": {"budget": 0.25}},
        },
        {"role": "assistant", "content": "hel", "status": "interrupted", "tokens": [3], "first_pos": 2},
    ]
    out = io.StringIO()
    export_jsonl(store, c.id, out, tokens=False)
    assert all("tokens" not in json.loads(raw) for raw in out.getvalue().splitlines())
    path = write_lines(tmp_path / "x.jsonl", out.getvalue().splitlines())
    copy = import_jsonl(store, path)
    assert (copy.title, copy.model, copy.settings) == ("chat", "qwen", {"budget": 0.25})
    assert [m.status for m in store.messages(copy.id)] == ["complete", "interrupted"]
    assert import_jsonl(store, path, title="override").title == "override"


def test_unknown_keys_and_blank_lines_are_ignored(store: Store, tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "extra.jsonl",
        [
            json.dumps({"role": "user", "content": "a", "speaker": "Caroline", "dia_id": "D1:3", "turn": 1}),
            "",
            "   ",
            json.dumps({"role": "assistant", "content": "b", "future_field": [1, 2, 3]}),
        ],
    )
    c = import_jsonl(store, path)
    assert [(m.role, m.content, m.meta) for m in store.messages(c.id)] == [("user", "a", {}), ("assistant", "b", {})]


def test_partial_status_imports_as_interrupted(store: Store, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"role": "assistant", "content": "cut", "status": "partial"})])
    (m,) = store.messages(import_jsonl(store, path).id)
    assert m.status == "interrupted"


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"content": "x"}', '"role" must be one of'),
    ('{"role": "tool", "content": "x"}', '"role" must be one of'),
    ('{"role": "user"}', '"content" must be a string'),
    ('{"role": "user", "content": 5}', '"content" must be a string'),
    ('{"role": "user", "content": "x", "probe": {"expect": "Purrnickel", "fact_turn": 1}}', '"probe.expect"'),
    ('{"role": "user", "content": "x", "probe": {"expect": ["a"], "fact_turn": "one"}}', '"probe.fact_turn"'),
    ('{"role": "assistant", "content": "x", "probe": {"expect": ["a"], "fact_turn": 1}}', "probe must be a user"),
    ('{"role": "user", "content": "x", "independent": "yes"}', '"independent"'),
    ('{"role": "user", "content": "x", "status": "done"}', '"status" must be one of'),
    ('{"role": "user", "content": "x", "tokens": [1, -1], "first_pos": 0}', '"tokens"'),
    ('{"role": "user", "content": "x", "tokens": [1], "first_pos": -3}', '"first_pos"'),
    ('{"role": "user", "content": "\\ud800"}', "lone surrogate"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_malformed_line_names_file_and_line(store: Store, tmp_path: Path, bad: str, reason: str) -> None:
    good = json.dumps({"role": "user", "content": "fine"})
    path = write_lines(tmp_path / "bad.jsonl", [good, "", good, bad, good])
    with pytest.raises(ImportFormatError) as error:
        import_jsonl(store, path)
    message = str(error.value)
    assert message.startswith(f"{path}:4: ")
    assert reason in message
    assert "\n" not in message
    # Nothing was imported: the file is taken whole or not at all.
    assert store.list_conversations() == []


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ImportFormatError, match="cannot read"):
        read_jsonl(tmp_path / "missing.jsonl")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"role": "user", "content": "caf\xe9"}\n')
    with pytest.raises(ImportFormatError, match=f"{latin1}: not UTF-8"):
        read_jsonl(latin1)


def test_line_separators_inside_content_do_not_split_lines(store: Store, tmp_path: Path) -> None:
    text = "one\u2028two\u0085three\x1cfour\rfive"
    c = store.create_conversation()
    store.append_user_message(c.id, text)
    out = io.StringIO()
    export_jsonl(store, c.id, out)
    path = tmp_path / "sep.jsonl"
    path.write_text(out.getvalue(), encoding="utf-8")
    assert [m.content for m in store.messages(import_jsonl(store, path).id)] == [text]


def test_markdown_export(store: Store) -> None:
    c = store.create_conversation("Cats", model="qwen2.5-0.5b")
    store.append_message(c.id, "system", "Be brief.")
    store.append_user_message(c.id, "What is my cat called?", meta={"probe": {"expect": ["Purrnickel"], "fact_turn": 1}})
    stream = store.stream_assistant(c.id)
    stream.append("It is **Purr")
    stream.cancel()
    out = io.StringIO()
    export_markdown(store, c.id, out)
    assert out.getvalue() == (
        "# Cats\n\n"
        f"*conversation {c.id} · model `qwen2.5-0.5b` · created {c.created_at}*\n"
        "\n## System\n\nBe brief.\n"
        "\n## User — probe, expects Purrnickel\n\nWhat is my cat called?\n"
        "\n## Assistant (interrupted)\n\nIt is **Purr\n"
    )
