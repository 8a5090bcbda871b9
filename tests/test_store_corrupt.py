"""A damaged or non-SQLite file at the database path: one line naming it, file untouched."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import pytest

from agent.cli import log as cli_log
from memory_store import CorruptDatabaseError, Store, StoreError


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real certchat log with enough rows to span many pages, checkpointed into one file."""
    path = tmp_path_factory.mktemp("healthy") / "healthy.db"
    with Store(path) as store:
        c = store.create_conversation("t")
        for i in range(300):
            store.append_user_message(c.id, f"message {i} " + "lorem ipsum " * 40, tokens=list(range(50)), first_pos=0)
    return path.read_bytes()


def damage(kind: str, good: bytes) -> bytes:
    if kind == "text":
        return b"these are my notes, not a database\n" * 20
    if kind == "random":
        return os.urandom(64 * 1024)
    if kind == "truncated":
        return good[: len(good) // 3]
    if kind == "page_garbage":
        page = int.from_bytes(good[16:18], "big")
        damaged = bytearray(good)
        damaged[page * 5 : page * 6] = os.urandom(page)
        return bytes(damaged)
    if kind == "first_page_garbage":
        damaged = bytearray(good)
        damaged[100:1000] = os.urandom(900)
        return bytes(damaged)
    if kind == "bad_header":
        return b"SQLite format 2\x00" + good[16:]
    raise AssertionError(kind)


KINDS = ["text", "random", "truncated", "page_garbage", "first_page_garbage", "bad_header"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_file_is_refused_and_not_overwritten(tmp_path: Path, healthy: bytes, kind: str) -> None:
    path = tmp_path / "log.db"
    path.write_bytes(damage(kind, healthy))
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(CorruptDatabaseError) as error:
        Store(path)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    # A second attempt (e.g. the user retrying) does not change it either.
    with pytest.raises(CorruptDatabaseError):
        Store(path, create=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="certchat")
    subparsers = parser.add_subparsers()
    cli_log.register(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("kind", ["text", "truncated"])
def test_cli_prints_one_line_naming_the_file(tmp_path: Path, healthy: bytes, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "log.db"
    path.write_bytes(damage(kind, healthy))
    before = path.read_bytes()
    for argv in (["list"], ["show", "1"], ["search", "lorem"], ["export", "1"], ["import", str(tmp_path / "x.jsonl")]):
        assert cli(["log", "--db", str(path), *argv]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and lines[0].startswith("certchat: ")
    assert path.read_bytes() == before


def test_directory_and_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is a directory"):
        Store(tmp_path)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "log.db").write_bytes(b"")
    blocked.chmod(0o500)
    try:
        if os.access(blocked, os.W_OK):
            pytest.skip("running as a user that ignores permissions (root)")
        with pytest.raises(StoreError) as error:
            Store(blocked / "log.db")
        assert str(blocked / "log.db") in str(error.value)
    finally:
        blocked.chmod(0o700)


def test_damage_found_after_open_is_reported_not_raw(tmp_path: Path, healthy: bytes) -> None:
    # Without the open-time check, damage in data pages surfaces on first use:
    # still a one-line StoreError naming the file, not a raw sqlite3 error.
    path = tmp_path / "log.db"
    good = healthy
    page = int.from_bytes(good[16:18], "big")
    damaged = bytearray(good)
    for n in range(2, len(damaged) // page):
        damaged[n * page : n * page + 64] = os.urandom(64)
    path.write_bytes(bytes(damaged))
    with pytest.raises(StoreError) as error:
        with Store(path, check=False) as store:
            for c in store.list_conversations():
                store.messages(c.id)
            store.search("lorem")
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)
    assert path.read_bytes() == bytes(damaged)
