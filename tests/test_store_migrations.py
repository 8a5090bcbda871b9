"""Schema migrations of the conversation log, on real SQLite files."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from memory_store import ForeignDatabaseError, SchemaTooNewError, Store, migrations
from memory_store import db as dbmod


def file_state(path: Path) -> dict[str, str | None]:
    """Hashes of the database file and its WAL (the -shm index is not data)."""
    state: dict[str, str | None] = {}
    for suffix in ("", "-wal"):
        part = Path(f"{path}{suffix}")
        state[suffix] = hashlib.sha256(part.read_bytes()).hexdigest() if part.exists() else None
    return state


def assert_untouched(path: Path, before: dict[str, str | None]) -> None:
    """Same database bytes, same WAL — or, where there was none, at most the empty
    one any reader of a WAL database leaves behind."""
    after = file_state(path)
    assert after[""] == before[""]
    empty = hashlib.sha256(b"").hexdigest()
    assert after["-wal"] == before["-wal"] or (before["-wal"] is None and after["-wal"] in (None, empty))


def execute(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def query(path: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def table_names(path: Path) -> set[str]:
    return {r[0] for r in query(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}


def build_at(path: Path, last: str) -> None:
    """A database as an earlier certchat would have left it: migrations up to ``last``."""
    db = sqlite_utils.Database(dbmod.connect(path))
    with dbmod.write_transaction(db.conn, path):
        migrations.migrate(db, stop_after=last)
    db.conn.close()


def test_migrations_from_empty(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Store(path) as store:
        assert store.list_conversations() == []
    applied = [r[0] for r in query(path, "SELECT name FROM _certchat_migrations ORDER BY rowid")]
    assert query(path, "PRAGMA journal_mode") == [("wal",)]
    assert query(path, "PRAGMA application_id") == [(migrations.APPLICATION_ID,)]
    assert applied == migrations.known_names()
    assert len(applied) >= 3
    assert {"conversations", "messages", "messages_fts", "turns", "eviction_rounds"} <= table_names(path)


def test_migrations_from_an_empty_existing_file(tmp_path: Path) -> None:
    # A zero-byte file is an empty SQLite database, not a corrupt one.
    path = tmp_path / "log.db"
    path.touch()
    with Store(path) as store:
        store.create_conversation("x")
    assert "messages" in table_names(path)


def test_reopening_applies_nothing(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    Store(path).close()
    before = query(path, "SELECT name, applied_at FROM _certchat_migrations ORDER BY rowid")
    Store(path).close()
    after = query(path, "SELECT name, applied_at FROM _certchat_migrations ORDER BY rowid")
    assert before == after


@pytest.mark.parametrize("last", migrations.known_names()[:-1])
def test_migrations_from_every_earlier_version(tmp_path: Path, last: str) -> None:
    path = tmp_path / "log.db"
    build_at(path, last)
    # Data written by that earlier version, through its own schema.
    execute(
        path,
        "INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', '2026-01-01', '2026-01-01')",
        "INSERT INTO messages (conversation_id, idx, role, content, status, created_at, updated_at) "
        "VALUES (1, 0, 'user', 'the zebra is called Purrnickel', 'complete', '2026-01-01', '2026-01-01')",
        "INSERT INTO messages (conversation_id, idx, role, content, status, created_at, updated_at) "
        "VALUES (1, 1, 'assistant', 'half an answ', 'partial', '2026-01-01', '2026-01-01')",
    )
    with Store(path) as store:
        applied = [r[0] for r in query(path, "SELECT name FROM _certchat_migrations ORDER BY rowid")]
        assert applied == migrations.known_names()
        old = store.messages(1)
        assert [m.content for m in old] == ["the zebra is called Purrnickel", "half an answ"]
        # A partial answer from before writer leases existed has no live writer.
        assert old[1].status == "interrupted"
        # Full-text search covers rows written before the FTS migration.
        assert [hit.message_id for hit in store.search("purrnickel")] == [old[0].id]
        # Every later table works.
        message = store.append_user_message(1, "new")
        assert message.index == 2
        with store.stream_assistant(1) as stream:
            stream.append("ok", [1])
        assert store.messages(1)[-1].status == "complete"


def test_newer_schema_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Store(path) as store:
        store.create_conversation("from the future")
    execute(path, "INSERT INTO _certchat_migrations (name, applied_at) VALUES ('m099_hologram_column', 'later')")
    before = file_state(path)
    with pytest.raises(SchemaTooNewError) as error:
        Store(path)
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message and "m099_hologram_column" in message and "newer certchat" in message
    assert_untouched(path, before)


def test_newer_schema_with_a_leftover_wal_is_left_untouched(tmp_path: Path) -> None:
    # A newer certchat crashed: its last commits are still in the WAL, not yet
    # in the main file. Refusing must not checkpoint them into it either.
    path = tmp_path / "log.db"
    Store(path).close()
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("INSERT INTO _certchat_migrations (name, applied_at) VALUES ('m099_hologram_column', 'later')")
    before = file_state(path)
    assert before["-wal"] is not None
    try:
        with pytest.raises(SchemaTooNewError):
            Store(path)
        assert_untouched(path, before)
    finally:
        writer.close()


def test_foreign_sqlite_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "photos.db"
    execute(path, "CREATE TABLE photos (id INTEGER PRIMARY KEY, name TEXT)", "INSERT INTO photos (name) VALUES ('cat.jpg')")
    before = file_state(path)
    with pytest.raises(ForeignDatabaseError) as error:
        Store(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert_untouched(path, before)
    assert table_names(path) == {"photos"}


def test_migration_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "log.db"
    build_at(path, migrations.known_names()[0])

    def broken(db: sqlite_utils.Database) -> None:
        db["half_done"].create({"id": int}, pk="id")
        raise RuntimeError("disk on fire")

    broken.__name__ = "m900_broken"
    monkeypatch.setattr(migrations, "MIGRATIONS", [*migrations.MIGRATIONS, broken])
    with pytest.raises(RuntimeError, match="disk on fire"):
        Store(path)
    # Nothing of the failed run is kept: not even the migrations before it.
    applied = [r[0] for r in query(path, "SELECT name FROM _certchat_migrations")]
    assert applied == migrations.known_names()[:1]
    assert "half_done" not in table_names(path)
    assert "turns" not in table_names(path)
