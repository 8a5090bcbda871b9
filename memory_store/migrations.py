"""The schema, as an ordered list of named migrations.

One function per schema change, applied in order, each recorded by name in
``_certchat_migrations`` (the pattern of simonw/llm). A migration is never
edited once released: a later change is a new function at the end of the list.
A database holding a migration name this code does not know was written by a
newer certchat and is refused before anything writes to it.

Callers run ``migrate`` inside one ``BEGIN IMMEDIATE`` transaction, so two
processes opening a fresh file at once cannot both apply a migration, and a
crash mid-migration leaves the previous version intact.
"""

from __future__ import annotations

import datetime
import sqlite3
from collections.abc import Callable

import sqlite_utils
from sqlite_utils.db import ForeignKey

MIGRATIONS_TABLE = "_certchat_migrations"

# Written to the SQLite header (PRAGMA application_id) so a certchat log can be
# told apart from some other program's database. ASCII "cert".
APPLICATION_ID = 0x63657274

Migration = Callable[[sqlite_utils.Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    """Register ``fn`` as the next schema change."""
    MIGRATIONS.append(fn)
    return fn


def _cascade(table: str, column: str, other: str) -> ForeignKey:
    # Deleting a conversation deletes everything that belongs to it.
    return ForeignKey(table, column, other, "id", on_delete="CASCADE")


@migration
def m001_conversations_messages(db: sqlite_utils.Database) -> None:
    """Conversations and their messages, with the exact token ids the model saw."""
    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    db.table("conversations").create(
        {
            "id": int,
            "title": str,
            "model": str,
            "settings": str,  # JSON object
            "created_at": str,  # ISO 8601, UTC
            "updated_at": str,
        },
        pk="id",
        not_null=["title", "settings", "created_at", "updated_at"],
        defaults={"title": "", "settings": "{}"},
    )
    db.table("conversations").create_index(["updated_at"])
    db.table("messages").create(
        {
            "id": int,
            "conversation_id": int,
            "idx": int,  # 0-based order within the conversation
            "role": str,  # system | user | assistant
            "content": str,
            "tokens": bytes,  # little-endian int32 token ids, NULL until known
            "first_pos": int,  # position of tokens[0] in the model's sequence
            "status": str,  # complete | partial | interrupted
            "meta": str,  # JSON object (replay probes and the like)
            "created_at": str,
            "updated_at": str,
        },
        pk="id",
        foreign_keys=[_cascade("messages", "conversation_id", "conversations")],
        not_null=["conversation_id", "idx", "role", "content", "status", "meta", "created_at", "updated_at"],
        defaults={"content": "", "status": "complete", "meta": "{}"},
    )
    db.table("messages").create_index(["conversation_id", "idx"], unique=True)


@migration
def m002_messages_fts(db: sqlite_utils.Database) -> None:
    """Full-text search over message content, kept current by triggers."""
    db.table("messages").enable_fts(["content"], create_triggers=True)


@migration
def m003_turns_eviction_rounds(db: sqlite_utils.Database) -> None:
    """Per-answer measurements and per-round eviction records."""
    db.table("turns").create(
        {
            "id": int,
            "conversation_id": int,
            "message_id": int,  # the assistant answer this turn produced
            "policy": str,
            "budget": float,
            "allocated_cells": int,
            "live_cells": int,
            "cert_stats": str,  # JSON object: statistic name -> value
            "cert_layers": str,  # JSON array: per-layer values
            "gate_stat": float,
            "gate_threshold": float,
            "gate_fired": int,
            "reprefill_tokens": int,
            "prompt_tokens": int,
            "decode_tokens": int,
            "prefill_s": float,
            "decode_s": float,
            "tokens_per_s": float,
            "seed": int,
            "extra": str,  # JSON object for measurements without a column yet
            "created_at": str,
        },
        pk="id",
        foreign_keys=[
            _cascade("turns", "conversation_id", "conversations"),
            _cascade("turns", "message_id", "messages"),
        ],
        not_null=["conversation_id", "cert_stats", "cert_layers", "gate_fired", "extra", "created_at"],
        defaults={"cert_stats": "{}", "cert_layers": "[]", "gate_fired": 0, "extra": "{}"},
    )
    db.table("turns").create_index(["conversation_id"])
    db.table("turns").create_index(["message_id"])
    db.table("eviction_rounds").create(
        {
            "id": int,
            "conversation_id": int,
            "message_id": int,  # the message being processed when the round ran
            "round": int,
            "policy": str,
            "cells_before": int,
            "cells_after": int,
            "expected_budget": float,
            "seed": int,
            "sum_pi": float,
            "created_at": str,
        },
        pk="id",
        foreign_keys=[
            _cascade("eviction_rounds", "conversation_id", "conversations"),
            _cascade("eviction_rounds", "message_id", "messages"),
        ],
        not_null=["conversation_id", "round", "created_at"],
    )
    db.table("eviction_rounds").create_index(["conversation_id", "round"], unique=True)
    db.table("eviction_rounds").create_index(["message_id"])


@migration
def m004_message_writer_lease(db: sqlite_utils.Database) -> None:
    """Who is streaming a partial message, so a dead writer's answer can be marked interrupted."""
    messages = db.table("messages")
    messages.add_column("writer_pid", int)
    messages.add_column("writer_host", str)
    messages.add_column("writer_token", str)  # boot id + process start time, where known
    messages.add_column("heartbeat_at", float)  # unix time of the writer's last commit
    messages.create_index(["status"])


@migration
def m005_conversation_writers(db: sqlite_utils.Database) -> None:
    """Which process may append to a conversation, so two sessions never interleave their turns."""
    db.table("conversation_writers").create(
        {
            "conversation_id": int,
            "writer_pid": int,
            "writer_host": str,
            "writer_token": str,
            "heartbeat_at": float,
            "claimed_at": str,
        },
        pk="conversation_id",
        foreign_keys=[_cascade("conversation_writers", "conversation_id", "conversations")],
        not_null=["writer_pid", "writer_host", "heartbeat_at", "claimed_at"],
    )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def known_names() -> list[str]:
    return [fn.__name__ for fn in MIGRATIONS]


def applied_names(conn: sqlite3.Connection) -> list[str]:
    """Names recorded in the migrations table, in the order they were applied."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MIGRATIONS_TABLE,)
    ).fetchone()
    if not exists:
        return []
    return [row[0] for row in conn.execute(f"SELECT name FROM [{MIGRATIONS_TABLE}] ORDER BY rowid")]


def unknown_names(conn: sqlite3.Connection) -> list[str]:
    """Applied migrations this code does not know: the file is from a newer certchat."""
    known = set(known_names())
    return [name for name in applied_names(conn) if name not in known]


def is_foreign(conn: sqlite3.Connection) -> bool:
    """True when the file holds some other program's tables (never migrate into those)."""
    (app_id,) = conn.execute("PRAGMA application_id").fetchone()
    if app_id == APPLICATION_ID or applied_names(conn):
        return False
    (n_objects,) = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return n_objects > 0


def pending(conn: sqlite3.Connection) -> list[str]:
    done = set(applied_names(conn))
    return [name for name in known_names() if name not in done]


def migrate(db: sqlite_utils.Database, *, stop_after: str | None = None) -> list[str]:
    """Apply every migration not yet recorded, in order; return the names applied.

    ``stop_after`` (tests) stops once the named migration is in place, which is
    how a database "from an earlier version" is built.
    """
    if stop_after is not None and stop_after not in known_names():
        raise ValueError(f"unknown migration {stop_after!r}")
    db.table(MIGRATIONS_TABLE).create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
    done = set(applied_names(db.conn))
    applied: list[str] = []
    for fn in MIGRATIONS:
        name = fn.__name__
        if name not in done:
            fn(db)
            db.table(MIGRATIONS_TABLE).insert({"name": name, "applied_at": _now()})
            applied.append(name)
        if name == stop_after:
            break
    return applied
