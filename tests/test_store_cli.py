"""``certchat log …`` through a parser built the way agent/cli/main.py builds it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from agent import paths
from agent.cli import log as cli_log
from memory_store import Store


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="certchat")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cli_log.register(subparsers)
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "log.db"
    with Store(path) as store:
        cats = store.create_conversation("Cats", model="qwen2.5-0.5b")
        store.append_user_message(cats.id, "My cat is Purrnickel.", tokens=[1, 2, 3], first_pos=0)
        store.append_message(cats.id, "assistant", "Nice! \x1b[31mred\x1b[0m", tokens=[4], first_pos=3)
        trip = store.create_conversation("Trip")
        store.append_user_message(trip.id, "I flew to Tromsø.")
        stream = store.stream_assistant(trip.id)
        stream.append("Tromsø is")
        stream.cancel()
    return path


def test_path_follows_env_and_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    assert run(["log", "path"], capsys) == (0, f"{paths.db_path()}\n", "")
    monkeypatch.setenv("CERTCHAT_DB", str(tmp_path / "env.db"))
    assert run(["log", "path"], capsys)[1] == f"{tmp_path / 'env.db'}\n"
    assert run(["log", "--db", str(tmp_path / "flag.db"), "path"], capsys)[1] == f"{tmp_path / 'flag.db'}\n"
    assert run(["log", "path", "--db", str(tmp_path / "after.db")], capsys)[1] == f"{tmp_path / 'after.db'}\n"
    assert not (tmp_path / "env.db").exists() and not (tmp_path / "flag.db").exists()


def test_global_db_flag_is_not_overwritten(tmp_path: Path, capsys) -> None:
    # The lead's main parser may define --db itself; the log parser must not reset it.
    parser = argparse.ArgumentParser(prog="certchat")
    parser.add_argument("--db")
    cli_log.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["--db", str(tmp_path / "global.db"), "log", "path"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'global.db'}\n"


def test_list(db: Path, capsys) -> None:
    code, out, err = run(["log", "--db", str(db), "list"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "MSGS", "STATE", "UPDATED", "TITLE"]
    assert "Trip" in lines[1] and "Cats" in lines[2] and "[qwen2.5-0.5b]" in lines[2]
    code, out, _ = run(["log", "list", "--json", "--db", str(db)], capsys)
    data = json.loads(out)
    assert [(c["id"], c["title"], c["message_count"]) for c in data] == [(2, "Trip", 2), (1, "Cats", 2)]
    assert json.loads(run(["log", "--db", str(db), "list", "--json", "--limit", "1"], capsys)[1])[0]["id"] == 2


def test_show(db: Path, capsys) -> None:
    code, out, _ = run(["log", "--db", str(db), "show", "1", "--json"], capsys)
    data = json.loads(out)
    assert (data["id"], data["title"], data["model"], data["message_count"]) == (1, "Cats", "qwen2.5-0.5b", 2)
    assert [(m["index"], m["role"], m["status"], m["content"], m["n_tokens"]) for m in data["messages"]] == [
        (0, "user", "complete", "My cat is Purrnickel.", 3),
        (1, "assistant", "complete", "Nice! \x1b[31mred\x1b[0m", 1),
    ]
    code, out, _ = run(["log", "--db", str(db), "show", "2"], capsys)
    assert code == 0
    assert "[1] assistant (interrupted)\nTromsø is" in out
    code, out, _ = run(["log", "--db", str(db), "show", "1"], capsys)
    # Terminal escapes in a message are shown, not executed.
    assert "\x1b" not in out and "Nice! \\x1b[31mred\\x1b[0m" in out


def test_show_unknown_id(db: Path, capsys) -> None:
    code, out, err = run(["log", "--db", str(db), "show", "99"], capsys)
    assert (code, out) == (1, "")
    assert err == f"certchat: {db}: no conversation 99\n"


def test_search(db: Path, capsys) -> None:
    code, out, _ = run(["log", "--db", str(db), "search", "tromsø"], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("2:") and len(out.splitlines()) == 2
    data = json.loads(run(["log", "--db", str(db), "search", "purrnickel", "--json"], capsys)[1])
    assert [(h["conversation_id"], h["index"], h["role"]) for h in data] == [(1, 0, "user")]
    assert run(["log", "--db", str(db), "search", "zebra"], capsys)[1] == "no matches\n"


def test_export_and_import(db: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = run(["log", "--db", str(db), "export", "1", "--format", "jsonl"], capsys)
    lines = [json.loads(raw) for raw in out.splitlines()]
    assert [(x["role"], x["content"], x["tokens"]) for x in lines] == [
        ("user", "My cat is Purrnickel.", [1, 2, 3]),
        ("assistant", "Nice! \x1b[31mred\x1b[0m", [4]),
    ]
    target = tmp_path / "cats.md"
    assert run(["log", "--db", str(db), "export", "1", "--format", "md", "-o", str(target)], capsys)[0] == 0
    assert target.read_text(encoding="utf-8").startswith("# Cats\n")
    jsonl = tmp_path / "cats.jsonl"
    run(["log", "--db", str(db), "export", "1", "-o", str(jsonl)], capsys)
    code, out, _ = run(["log", "--db", str(db), "import", str(jsonl), "--title", "Cats again"], capsys)
    assert (code, out) == (0, "imported conversation 3 (2 messages)\n")
    with Store(db) as store:
        assert [m.content for m in store.messages(3)] == [m.content for m in store.messages(1)]
    code, out, err = run(["log", "--db", str(db), "export", "42", "-o", str(tmp_path / "none.jsonl")], capsys)
    assert code == 1 and "no conversation 42" in err and not (tmp_path / "none.jsonl").exists()


def test_bad_import_file(db: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "ok"}\n{"role": "user"\n', encoding="utf-8")
    code, out, err = run(["log", "--db", str(db), "import", str(bad)], capsys)
    assert code == 1
    assert err.startswith(f"certchat: {bad}:2: not valid JSON") and err.count("\n") == 1


def test_read_commands_do_not_create_a_database(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere" / "log.db"
    assert run(["log", "--db", str(missing), "list"], capsys)[1] == "no conversations\n"
    assert run(["log", "--db", str(missing), "list", "--json"], capsys)[1] == "[]\n"
    assert run(["log", "--db", str(missing), "search", "x"], capsys)[1] == "no matches\n"
    code, _, err = run(["log", "--db", str(missing), "show", "1"], capsys)
    assert code == 1 and "does not exist" in err
    assert not missing.exists() and not missing.parent.exists()


def test_default_database_is_under_the_data_dir(capsys) -> None:
    # tests/conftest.py points CERTCHAT_DATA_DIR at a temporary directory.
    with Store(paths.db_path()) as store:
        store.create_conversation("in the default place")
    data = json.loads(run(["log", "list", "--json"], capsys)[1])
    assert [c["title"] for c in data] == ["in the default place"]
    assert paths.db_path().parent == paths.data_dir()
