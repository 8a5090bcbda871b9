"""The conversation log's API, used by the agent and the TUI.

``Store(path)`` opens (creating if asked) the SQLite file, refuses a damaged,
foreign or newer-schema file without touching it, switches on WAL, applies
pending migrations and marks interrupted any partial answer whose writer is
gone. Every write is one ``BEGIN IMMEDIATE`` transaction that commits before
the method returns, so a returned user message is on disk and Ctrl-C mid-write
leaves the previous state. One Store may be shared by threads (calls are
serialised); several processes may open the same file at once (not over a
network file system: WAL needs shared memory).

Content is stored as TEXT bound with its length, so NUL and every control
character round-trip exactly; text that is not valid Unicode (a lone
surrogate) is refused. SQL's own string functions stop at a NUL, so the
substring fallback of ``search`` does not look past one (FTS5 does).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sqlite_utils

from memory_store import db as dbmod
from memory_store import liveness, migrations
from memory_store.errors import (
    ConversationBusyError,
    ForeignDatabaseError,
    NotFoundError,
    ReadOnlyError,
    SchemaTooNewError,
    StoreError,
    StreamLostError,
)
from memory_store.records import (
    NOT_REREAD,
    ROLES,
    STATUSES,
    Conversation,
    EvictionRound,
    History,
    Message,
    SearchHit,
    Turn,
)
from memory_store.stream import AssistantStream, check_text
from memory_store.tokens import pack, unpack

_MESSAGE_COLUMNS = "id, conversation_id, idx, role, content, tokens, first_pos, status, meta, created_at, updated_at"
_CONVERSATION_COLUMNS = (
    "c.id, c.title, c.model, c.settings, c.created_at, c.updated_at, "
    "(SELECT count(*) FROM messages m WHERE m.conversation_id = c.id)"
)


# SQLite integers are signed 64-bit: a larger id cannot name a row.
_MAX_ID = 2**63 - 1


def _check_id(value: int, what: str, path: Path) -> None:
    if not isinstance(value, int) or not 0 <= value <= _MAX_ID:
        raise NotFoundError(f"{path}: no {what} {value}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _json_object(value: dict[str, Any] | None, what: str) -> str:
    if value is None:
        return "{}"
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a dict, got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _insert_conversation(
    conn: sqlite3.Connection, title: str, model: str | None, settings: dict[str, Any] | None, now: str
) -> int:
    """Inside a write transaction: a new conversation's row; returns its id."""
    cur = conn.execute(
        "INSERT INTO conversations (title, model, settings, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
        (title, model, _json_object(settings, "settings"), now, now),
    )
    assert cur.lastrowid is not None
    return cur.lastrowid


def _known_fields(cls: type, row: dict[str, Any]) -> dict[str, Any]:
    # SELECT * may return columns a later migration added before the dataclass knows them.
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: value for key, value in row.items() if key in names}


def _message(row: Sequence[Any]) -> Message:
    return Message(
        id=row[0],
        conversation_id=row[1],
        index=row[2],
        role=row[3],
        content=row[4],
        tokens=unpack(row[5]),
        first_pos=row[6],
        status=row[7],
        meta=json.loads(row[8]),
        created_at=row[9],
        updated_at=row[10],
    )


def _conversation(row: Sequence[Any]) -> Conversation:
    return Conversation(
        id=row[0],
        title=row[1],
        model=row[2],
        settings=json.loads(row[3]),
        created_at=row[4],
        updated_at=row[5],
        message_count=row[6],
    )


class Store:
    """One open conversation log.

    ``path`` is the database file; ``recovered`` is how many partial answers of
    dead writers were marked interrupted when it was opened, ``unanswered`` how
    many of their user messages were left without an answer (marked, so no
    re-read includes them). ``read_only`` opens without writing anything (a
    read-only data dir, a full disk): reads work, writes raise ReadOnlyError.

    Writing a message to a conversation claims it for this process (see
    ``claim_conversation``); another live process's claim refuses the write
    with ConversationBusyError, so two sessions never interleave their turns.
    """

    def __init__(self, path: str | Path, *, create: bool = True, check: bool = True, read_only: bool = False) -> None:
        self.path = Path(path).expanduser()
        # Identifies this file in the process-wide registry of open streams.
        self.key = str(self.path.resolve())
        self.read_only = read_only
        self._lock = threading.RLock()
        self._streams: dict[int, AssistantStream] = {}
        self._claimed: set[int] = set()
        self.recovered = self.unanswered = 0
        conn = dbmod.connect(self.path, create=create and not read_only, check=check,
                             verify=self._refuse_unless_ours, read_only=read_only)
        try:
            with dbmod.sqlite_errors(self.path):
                self._db = sqlite_utils.Database(conn)
                if read_only:
                    self._refuse_unreadable(conn)
                else:
                    dbmod.enable_wal(conn, self.path)
                    self._migrate()
            self._conn = conn
            if not read_only:
                self.recovered = self.recover_interrupted()
                self.unanswered = self.recover_unanswered()
        except BaseException:
            dbmod.close(conn, self.path, read_only=read_only, checkpoint_first=False)
            raise

    # -- lifecycle ------------------------------------------------------------------

    def _refuse_unless_ours(self, conn: sqlite3.Connection) -> None:
        """Checks that only read: a refused file is left byte-for-byte as it was."""
        if migrations.is_foreign(conn):
            raise ForeignDatabaseError(
                f"{self.path}: a SQLite database from another program, not a certchat log; left untouched — pass --db"
            )
        unknown = migrations.unknown_names(conn)
        if unknown:
            raise SchemaTooNewError(
                f"{self.path}: written by a newer certchat (unknown schema migrations: {', '.join(unknown)}); "
                "upgrade certchat or pass --db — the file was not modified"
            )

    def _refuse_unreadable(self, conn: sqlite3.Connection) -> None:
        """Read-only: the tables a reader needs must exist (the writers' table is only for writing)."""
        missing = [name for name in migrations.pending(conn) if name != "m005_conversation_writers"]
        if missing:
            raise StoreError(
                f"{self.path}: written by an older certchat and not yet upgraded (needs {', '.join(missing)}); "
                "open it once with write access to upgrade it"
            )

    def _migrate(self) -> None:
        if not migrations.pending(self._db.conn):
            return
        with dbmod.write_transaction(self._db.conn, self.path):
            # Re-check under the write lock: another process may have migrated meanwhile.
            self._refuse_unless_ours(self._db.conn)
            migrations.migrate(self._db)

    def close(self) -> None:
        """Close the log; streams still open are committed and marked interrupted, claims released."""
        for stream in list(self._streams.values()):
            if not stream.closed:
                stream.cancel()
        for conversation_id in list(self._claimed):
            try:
                self.release_conversation(conversation_id)
            except StoreError:
                pass  # a dead writer's claim is taken over by the next one anyway
        with self._lock:
            dbmod.close(self._conn, self.path, read_only=self.read_only)

    def checkpoint(self, *, timeout: float | None = dbmod.BUSY_TIMEOUT_MS / 1000) -> tuple[int, int]:
        """Copy the WAL's committed pages into the database file now, under the write lock.

        The store also does this by itself (every ``db.CHECKPOINT_EVERY`` commits of this process, and on
        close). Waits at most ``timeout`` seconds for another writer (StoreError after). Returns (frames in
        the WAL, frames checkpointed); fewer checkpointed while a reader still needs older pages.
        """
        if self.read_only:
            raise ReadOnlyError(f"{self.path}: opened read-only; a checkpoint writes the database file")
        with self._lock:
            return dbmod.checkpoint(self._conn, self.path, timeout=timeout)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _side_connection(self) -> sqlite3.Connection:
        """A second connection to the same file (for a stream's flusher thread)."""
        conn = dbmod.connect(self.path, create=False, check=False)
        try:
            dbmod.enable_wal(conn, self.path)
        except BaseException:
            dbmod.close(conn, self.path, checkpoint_first=False)
            raise
        return conn

    def _close_side_connection(self, conn: sqlite3.Connection) -> None:
        dbmod.close(conn, self.path)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock, dbmod.sqlite_errors(self.path):
            return self._conn.execute(sql, params).fetchall()

    def _read_dicts(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock, dbmod.sqlite_errors(self.path):
            cur = self._conn.execute(sql, params)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def _write(self) -> Any:
        """Context manager: the lock plus one IMMEDIATE transaction on the main connection."""
        return _LockedTransaction(self)

    # -- conversations --------------------------------------------------------------

    def create_conversation(
        self, title: str = "", *, model: str | None = None, settings: dict[str, Any] | None = None
    ) -> Conversation:
        check_text(title, "title")
        with self._write() as conn:
            cid = _insert_conversation(conn, title, model, settings, utc_now())
        return self.get_conversation(cid)

    def get_conversation(self, conversation_id: int) -> Conversation:
        _check_id(conversation_id, "conversation", self.path)
        rows = self._read(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c WHERE c.id = ?", (conversation_id,))
        if not rows:
            raise NotFoundError(f"{self.path}: no conversation {conversation_id}")
        return _conversation(rows[0])

    def list_conversations(self, *, limit: int | None = None) -> list[Conversation]:
        """Most recently updated first."""
        sql = f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c ORDER BY c.updated_at DESC, c.id DESC"
        params: tuple[Any, ...] = ()
        if limit is not None:
            sql += " LIMIT ?"
            params = (limit,)
        return [_conversation(row) for row in self._read(sql, params)]

    def update_conversation(
        self,
        conversation_id: int,
        *,
        title: str | None = None,
        model: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Conversation:
        """Change any of title, model, settings (None leaves a field as it is)."""
        changes: dict[str, Any] = {}
        if title is not None:
            check_text(title, "title")
            changes["title"] = title
        if model is not None:
            changes["model"] = model
        if settings is not None:
            changes["settings"] = _json_object(settings, "settings")
        changes["updated_at"] = utc_now()
        _check_id(conversation_id, "conversation", self.path)
        assignments = ", ".join(f"{column} = ?" for column in changes)
        with self._write() as conn:
            cur = conn.execute(
                f"UPDATE conversations SET {assignments} WHERE id = ?", (*changes.values(), conversation_id)
            )
            if cur.rowcount == 0:
                raise NotFoundError(f"{self.path}: no conversation {conversation_id}")
        return self.get_conversation(conversation_id)

    def rename_conversation(self, conversation_id: int, title: str) -> Conversation:
        return self.update_conversation(conversation_id, title=title)

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation with its messages, turns and eviction rounds."""
        _check_id(conversation_id, "conversation", self.path)
        with self._write() as conn:
            cur = conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cur.rowcount == 0:
                raise NotFoundError(f"{self.path}: no conversation {conversation_id}")

    def search(self, text: str, *, limit: int = 50) -> list[SearchHit]:
        """Messages whose content matches every word of ``text`` (FTS5, best match first).

        When the index finds nothing, falls back to a plain substring scan:
        FTS5's unicode61 tokenizer neither splits CJK runs into words nor
        matches inside words ("Purrnick"), and a user searching a chat log
        expects both.
        """
        hits = self._search_index(text, limit)
        return hits if hits else self._search_substring(text, limit)

    def _search_substring(self, text: str, limit: int) -> list[SearchHit]:
        needle = text.strip()
        if not needle:
            return []
        # lower() folds ASCII only, on both sides alike: case-insensitive for ASCII.
        rows = self._read(
            "SELECT m.conversation_id, c.title, m.id, m.idx, m.role, m.content "
            "FROM messages m JOIN conversations c ON c.id = m.conversation_id "
            "WHERE instr(lower(m.content), lower(?)) > 0 ORDER BY m.id DESC LIMIT ?",
            (needle, limit),
        )
        hits = []
        for cid, title, mid, index, role, content in rows:
            match = re.search(re.escape(needle), content, re.IGNORECASE)
            at, end = match.span() if match else (0, 0)
            before = ("…" if at > 40 else "") + content[max(0, at - 40) : at]
            after = content[end : end + 40] + ("…" if end + 40 < len(content) else "")
            hits.append(SearchHit(cid, title, mid, index, role, f"{before}[{content[at:end]}]{after}"))
        return hits

    def _search_index(self, text: str, limit: int) -> list[SearchHit]:
        check_text(text, "search text")
        if not text.strip():
            return []
        # Every whitespace-separated word becomes a quoted FTS5 string, so that
        # quotes, AND/OR/NOT, NEAR(…), * and ^ in user text are searched for, not
        # interpreted (sqlite-utils' quote_fts keeps user quotes as phrase syntax).
        query = " ".join('"' + word.replace('"', '""') + '"' for word in text.split())
        rows = self._read(
            "SELECT m.conversation_id, c.title, m.id, m.idx, m.role, "
            "snippet(messages_fts, 0, '[', ']', '…', 12) "
            "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
            "JOIN conversations c ON c.id = m.conversation_id "
            "WHERE messages_fts MATCH ? ORDER BY messages_fts.rank LIMIT ?",
            (query, limit),
        )
        return [SearchHit(*row) for row in rows]

    # -- messages -------------------------------------------------------------------

    def _insert_message(
        self,
        conn: sqlite3.Connection,
        conversation_id: int,
        role: str,
        content: str,
        *,
        tokens: Sequence[int] | np.ndarray | None,
        first_pos: int | None,
        status: str,
        meta: dict[str, Any] | None,
        writer: liveness.Writer | None = None,
        now: str,
    ) -> int:
        _check_id(conversation_id, "conversation", self.path)
        exists = conn.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if not exists:
            raise NotFoundError(f"{self.path}: no conversation {conversation_id}")
        self._hold(conn, conversation_id)
        (index,) = conn.execute(
            "SELECT coalesce(max(idx) + 1, 0) FROM messages WHERE conversation_id = ?", (conversation_id,)
        ).fetchone()
        cur = conn.execute(
            "INSERT INTO messages (conversation_id, idx, role, content, tokens, first_pos, status, meta, "
            "created_at, updated_at, writer_pid, writer_host, writer_token, heartbeat_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                conversation_id,
                index,
                role,
                content,
                None if tokens is None else pack(tokens),
                first_pos,
                status,
                _json_object(meta, "meta"),
                now,
                now,
                writer.pid if writer else None,
                writer.host if writer else None,
                writer.token if writer else None,
                time.time() if writer else None,
            ),
        )
        conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        assert cur.lastrowid is not None
        return cur.lastrowid

    @staticmethod
    def _validate_message(
        role: str, content: str, tokens: Sequence[int] | np.ndarray | None, first_pos: int | None, status: str
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        check_text(content, "message content")
        if first_pos is not None and first_pos < 0:
            raise ValueError("first_pos must be >= 0")
        if tokens is not None:
            pack(tokens)  # validates

    def append_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        first_pos: int | None = None,
        status: str = "complete",
        meta: dict[str, Any] | None = None,
    ) -> Message:
        """Append a finished message (system, user or assistant); committed on return."""
        self._validate_message(role, content, tokens, first_pos, status)
        if status == "partial":
            raise ValueError("a partial message is written through stream_assistant()")
        # A user message records its writer: if that process dies before an answer starts, the next
        # open marks the message unanswered (recover_unanswered), so no re-read includes it.
        writer = liveness.Writer.current() if role == "user" else None
        with self._write() as conn:
            mid = self._insert_message(
                conn, conversation_id, role, content,
                tokens=tokens, first_pos=first_pos, status=status, meta=meta, writer=writer, now=utc_now(),
            )
        return self.get_message(mid)

    def append_user_message(
        self,
        conversation_id: int,
        content: str,
        *,
        tokens: Sequence[int] | np.ndarray | None = None,
        first_pos: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Message:
        """Append the user's message; it is committed (on disk) before this returns."""
        return self.append_message(conversation_id, "user", content, tokens=tokens, first_pos=first_pos, meta=meta)

    def set_message_tokens(self, message_id: int, tokens: Sequence[int] | np.ndarray, first_pos: int) -> Message:
        """Record the exact token ids the model saw for a message, once it is tokenized."""
        if first_pos < 0:
            raise ValueError("first_pos must be >= 0")
        blob = pack(tokens)
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE messages SET tokens = ?, first_pos = ?, updated_at = ? WHERE id = ?",
                (blob, first_pos, utc_now(), message_id),
            )
            if cur.rowcount == 0:
                raise NotFoundError(f"{self.path}: no message {message_id}")
        return self.get_message(message_id)

    def update_message_meta(self, message_id: int, changes: dict[str, Any]) -> Message:
        """Merge ``changes`` into a message's meta (a key set to None is removed)."""
        _json_object(changes, "meta changes")
        with self._write() as conn:
            row = conn.execute("SELECT meta FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"{self.path}: no message {message_id}")
            meta = json.loads(row[0])
            meta.update(changes)
            meta = {key: value for key, value in meta.items() if value is not None}
            conn.execute(
                "UPDATE messages SET meta = ?, updated_at = ? WHERE id = ?",
                (_json_object(meta, "meta"), utc_now(), message_id),
            )
        return self.get_message(message_id)

    def set_message_status(self, message_id: int, status: str) -> Message:
        """Mark a message complete or interrupted (e.g. the user rejected a partial answer)."""
        if status not in ("complete", "interrupted"):
            raise ValueError("status can only be set to complete or interrupted")
        if liveness.is_active_here((self.key, message_id)):
            raise StoreError(f"message {message_id} is being streamed; finish() or cancel() its stream")
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE messages SET status = ?, updated_at = ? WHERE id = ?", (status, utc_now(), message_id)
            )
            if cur.rowcount == 0:
                raise NotFoundError(f"{self.path}: no message {message_id}")
        return self.get_message(message_id)

    def get_message(self, message_id: int) -> Message:
        _check_id(message_id, "message", self.path)
        rows = self._read(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise NotFoundError(f"{self.path}: no message {message_id}")
        return _message(rows[0])

    def messages(self, conversation_id: int) -> list[Message]:
        """A conversation's messages in order (raises NotFoundError for an unknown id)."""
        with self._lock:
            self.get_conversation(conversation_id)
            rows = self._read(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? ORDER BY idx", (conversation_id,)
            )
        return [_message(row) for row in rows]

    def contents(self, conversation_id: int, indices: Sequence[int]) -> dict[int, str]:
        """The text of the conversation's messages at ``indices`` (those that exist), by index."""
        wanted = sorted({int(i) for i in indices})
        if not wanted:
            return {}
        marks = ", ".join("?" * len(wanted))
        rows = self._read(f"SELECT idx, content FROM messages WHERE conversation_id = ? AND idx IN ({marks})",
                          (conversation_id, *wanted))
        return {int(idx): str(content) for idx, content in rows}

    def rereadable(self, conversation_id: int) -> list[Message]:
        """The messages a re-read gives the model: all but those marked discarded, refused or unanswered
        (a cancelled or independent turn, a message refused as too long, one whose writer died before
        answering). Interrupted answers stay: their tokens were in the cache."""
        return [m for m in self.messages(conversation_id) if not any(m.meta.get(k) for k in NOT_REREAD)]

    def mark_refused(self, message_id: int, reason: str) -> Message:
        """A message the model was never given (e.g. too long for the context): kept, never re-read."""
        return self.update_message_meta(message_id, {"discarded": True, "refused": reason})

    def mark_unanswered(self, message_id: int, phase: str = "prefill") -> Message:
        """A user message whose turn stopped before an answer started: kept, never re-read."""
        return self.update_message_meta(message_id, {"discarded": True, "unanswered": phase})

    # -- conversation writers ----------------------------------------------------------

    def claim_conversation(self, conversation_id: int, *, only: bool = False) -> None:
        """Make this process the conversation's writer before a session continues it.

        Raises ConversationBusyError (naming the other process) while another live process holds it; a
        dead holder's claim is taken over, and its unanswered user messages are marked first. ``only``:
        release this store's other claims (a UI switching conversations). Appending a message claims
        implicitly; this is the early check, before a model re-reads the history.
        """
        self.get_conversation(conversation_id)
        with self._write() as conn:
            self._hold(conn, conversation_id)
        if only:
            for other in list(self._claimed - {conversation_id}):
                self.release_conversation(other)
        self.recover_unanswered(conversation_id)

    def release_conversation(self, conversation_id: int) -> None:
        """Give up this process's claim (closing the store releases them all)."""
        me = liveness.Writer.current()
        self._claimed.discard(conversation_id)
        with self._write() as conn:
            conn.execute(
                "DELETE FROM conversation_writers WHERE conversation_id = ? AND writer_pid = ? AND writer_host = ?",
                (conversation_id, me.pid, me.host),
            )

    def conversation_writer(self, conversation_id: int) -> liveness.Writer | None:
        """The live process that holds the conversation, if any (None: free, or its holder is gone)."""
        rows = self._read(
            "SELECT writer_pid, writer_host, writer_token, heartbeat_at FROM conversation_writers "
            "WHERE conversation_id = ?", (conversation_id,),
        )
        if not rows:
            return None
        pid, host, token, heartbeat = rows[0]
        mine = pid == liveness.Writer.current().pid and host == liveness.Writer.current().host
        if not mine and not liveness.writer_alive(pid, host, token, heartbeat, active_here=True):
            return None
        return liveness.Writer(pid=pid, host=host, token=token)

    def _hold(self, conn: sqlite3.Connection, conversation_id: int) -> None:
        """Inside a write transaction: refuse if another live process holds the conversation, else hold it
        (and refresh the heartbeat that tells hosts without /proc that this writer is alive)."""
        me = liveness.Writer.current()
        row = conn.execute(
            "SELECT writer_pid, writer_host, writer_token, heartbeat_at FROM conversation_writers "
            "WHERE conversation_id = ?", (conversation_id,),
        ).fetchone()
        if row is not None:
            pid, host, token, heartbeat = row
            mine = pid == me.pid and host == me.host and (token is None or me.token is None or token == me.token)
            if not mine and liveness.writer_alive(pid, host, token, heartbeat, active_here=True):
                self._claimed.discard(conversation_id)
                raise ConversationBusyError(
                    f"conversation {conversation_id} is being written by another certchat process (pid {pid} on "
                    f"{host}); finish or quit that session first, or start a new conversation (--new) — "
                    f"`certchat log show {conversation_id}` reads it meanwhile"
                )
        conn.execute(
            "INSERT INTO conversation_writers (conversation_id, writer_pid, writer_host, writer_token, heartbeat_at, "
            "claimed_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(conversation_id) DO UPDATE SET "
            "writer_pid = excluded.writer_pid, writer_host = excluded.writer_host, "
            "writer_token = excluded.writer_token, heartbeat_at = excluded.heartbeat_at"
            + (", claimed_at = excluded.claimed_at" if conversation_id not in self._claimed else ""),
            (conversation_id, me.pid, me.host, me.token, time.time(), utc_now()),
        )
        self._claimed.add(conversation_id)

    def history(self, conversation_id: int, *, statuses: Sequence[str] = STATUSES) -> History:
        """The conversation as the model saw it: every message's token ids and first position.

        Interrupted answers are included by default: their tokens were in the
        cache. Pass ``statuses=("complete",)`` to leave them out.
        """
        wanted = set(statuses)
        return History(conversation_id, [m for m in self.messages(conversation_id) if m.status in wanted])

    def recover_unanswered(self, conversation_id: int | None = None) -> int:
        """Mark unanswered every user message whose writer is gone with no answer after it; return how many.

        Only messages that recorded a writer are candidates (an imported conversation ending with a
        user message is left as it is); this process's own are never marked (it may be prefilling one).
        """
        where = "" if conversation_id is None else " AND u.conversation_id = ?"
        rows = self._read(
            "SELECT u.id, u.writer_pid, u.writer_host, u.writer_token, u.heartbeat_at, u.meta FROM messages u "
            "WHERE u.role = 'user' AND u.writer_pid IS NOT NULL" + where + " AND NOT EXISTS (SELECT 1 FROM messages a "
            "WHERE a.conversation_id = u.conversation_id AND a.idx = u.idx + 1 AND a.role = 'assistant')",
            () if conversation_id is None else (conversation_id,),
        )
        me = liveness.Writer.current()
        dead = [
            mid for mid, pid, host, token, heartbeat, meta in rows
            if not any(json.loads(meta).get(k) for k in NOT_REREAD)
            and not (pid == me.pid and host == me.host)
            and not liveness.writer_alive(pid, host, token, heartbeat, active_here=False)
        ]
        if not dead:
            return 0
        marked = 0
        with self._write() as conn:
            now = utc_now()
            for mid in dead:
                # Re-checked under the write lock: its answer may have started meanwhile.
                row = conn.execute(
                    "SELECT u.meta FROM messages u WHERE u.id = ? AND NOT EXISTS (SELECT 1 FROM messages a "
                    "WHERE a.conversation_id = u.conversation_id AND a.idx = u.idx + 1)", (mid,),
                ).fetchone()
                if row is None:
                    continue
                meta = {**json.loads(row[0]), "discarded": True, "unanswered": "writer gone"}
                conn.execute("UPDATE messages SET meta = ?, updated_at = ? WHERE id = ?",
                             (_json_object(meta, "meta"), now, mid))
                marked += 1
        return marked

    def stream_assistant(
        self,
        conversation_id: int,
        *,
        first_pos: int | None = None,
        meta: dict[str, Any] | None = None,
        commit_interval: float = 0.5,
    ) -> AssistantStream:
        """Start an assistant answer: the row exists (``partial``) and is committed on return."""
        if first_pos is not None and first_pos < 0:
            raise ValueError("first_pos must be >= 0")
        writer = liveness.Writer.current()
        with self._write() as conn:
            mid = self._insert_message(
                conn, conversation_id, "assistant", "",
                tokens=[], first_pos=first_pos, status="partial", meta=meta, writer=writer, now=utc_now(),
            )
        stream = AssistantStream(self, self.get_message(mid), commit_interval=commit_interval, writer=writer)
        self._streams[mid] = stream
        return stream

    def _stream_writer(self, conn: sqlite3.Connection | None) -> Callable[..., None]:
        """The UPDATE a stream commits, on its flusher's connection or (conn=None) the main one."""

        def write(
            message_id: int,
            content: str,
            blob: bytes,
            first_pos: int | None,
            status: str,
            writer: liveness.Writer,
            heartbeat: float,
        ) -> None:
            now = utc_now()
            final = status != "partial"
            with _LockedTransaction(self, conn) as tx:
                cur = tx.execute(
                    "UPDATE messages SET content = ?, tokens = ?, first_pos = ?, status = ?, updated_at = ?, "
                    "writer_pid = ?, writer_host = ?, writer_token = ?, heartbeat_at = ? WHERE id = ?",
                    (content, blob, first_pos, status, now,
                     writer.pid, writer.host, writer.token, heartbeat, message_id),
                )
                if cur.rowcount == 0:
                    raise StreamLostError(f"{self.path}: assistant message {message_id} was deleted while streaming")
                if final:
                    tx.execute(
                        "UPDATE conversations SET updated_at = ? WHERE id = "
                        "(SELECT conversation_id FROM messages WHERE id = ?)",
                        (now, message_id),
                    )
            if final:
                self._streams.pop(message_id, None)

        return write

    def recover_interrupted(self) -> int:
        """Mark interrupted every partial message whose writer is gone; return how many."""
        rows = self._read(
            "SELECT id, writer_pid, writer_host, writer_token, heartbeat_at FROM messages WHERE status = 'partial'"
        )
        dead = [
            mid
            for mid, *writer in rows
            if not liveness.writer_alive(*writer, active_here=liveness.is_active_here((self.key, mid)))
        ]
        if not dead:
            return 0
        marked = 0
        with self._write() as conn:
            now = utc_now()
            for mid in dead:
                # Only if still partial: its writer may have finished meanwhile.
                cur = conn.execute(
                    "UPDATE messages SET status = 'interrupted', updated_at = ? WHERE id = ? AND status = 'partial'",
                    (now, mid),
                )
                marked += cur.rowcount
        return marked

    # -- turns and eviction rounds ---------------------------------------------------

    def record_turn(self, turn: Turn) -> Turn:
        """Store one answer's measurements; returns it with ``id`` and ``created_at`` set."""
        row = {
            "conversation_id": turn.conversation_id,
            "message_id": turn.message_id,
            "policy": turn.policy,
            "budget": turn.budget,
            "allocated_cells": turn.allocated_cells,
            "live_cells": turn.live_cells,
            "cert_stats": json.dumps(turn.cert_stats, sort_keys=True),
            "cert_layers": json.dumps(list(turn.cert_layers)),
            "gate_stat": turn.gate_stat,
            "gate_threshold": turn.gate_threshold,
            "gate_fired": int(bool(turn.gate_fired)),
            "reprefill_tokens": turn.reprefill_tokens,
            "prompt_tokens": turn.prompt_tokens,
            "decode_tokens": turn.decode_tokens,
            "prefill_s": turn.prefill_s,
            "decode_s": turn.decode_s,
            "tokens_per_s": turn.tokens_per_s,
            "seed": turn.seed,
            "extra": json.dumps(turn.extra, sort_keys=True),
            "created_at": utc_now(),
        }
        with self._write():
            self._require_conversation(turn.conversation_id)
            tid = self._db.table("turns").insert(row).last_pk
        return self._turn_from_row(self._read_dicts("SELECT * FROM turns WHERE id = ?", (tid,))[0])

    def turns(self, conversation_id: int) -> list[Turn]:
        rows = self._read_dicts("SELECT * FROM turns WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [self._turn_from_row(row) for row in rows]

    @staticmethod
    def _turn_from_row(data: dict[str, Any]) -> Turn:
        data["cert_stats"] = json.loads(data["cert_stats"])
        data["cert_layers"] = json.loads(data["cert_layers"])
        data["extra"] = json.loads(data["extra"])
        data["gate_fired"] = bool(data["gate_fired"])
        return Turn(**_known_fields(Turn, data))

    def record_eviction_round(self, round_: EvictionRound) -> EvictionRound:
        row = {
            "conversation_id": round_.conversation_id,
            "message_id": round_.message_id,
            "round": round_.round,
            "policy": round_.policy,
            "cells_before": round_.cells_before,
            "cells_after": round_.cells_after,
            "expected_budget": round_.expected_budget,
            "seed": round_.seed,
            "sum_pi": round_.sum_pi,
            "created_at": utc_now(),
        }
        with self._write():
            self._require_conversation(round_.conversation_id)
            rid = self._db.table("eviction_rounds").insert(row).last_pk
        row = self._read_dicts("SELECT * FROM eviction_rounds WHERE id = ?", (rid,))[0]
        return EvictionRound(**_known_fields(EvictionRound, row))

    def next_eviction_round(self, conversation_id: int) -> int:
        """The round number the conversation's next eviction takes: one past the last logged (0 for none).
        A reopened conversation continues from here, so its rounds never repeat one already recorded."""
        ((value,),) = self._read(
            "SELECT coalesce(max(round) + 1, 0) FROM eviction_rounds WHERE conversation_id = ?", (conversation_id,)
        )
        return int(value)

    def eviction_rounds(self, conversation_id: int) -> list[EvictionRound]:
        rows = self._read_dicts(
            "SELECT * FROM eviction_rounds WHERE conversation_id = ? ORDER BY round", (conversation_id,)
        )
        return [EvictionRound(**_known_fields(EvictionRound, row)) for row in rows]

    def _require_conversation(self, conversation_id: int) -> None:
        if not self._conn.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone():
            raise NotFoundError(f"{self.path}: no conversation {conversation_id}")

    # -- bulk import (used by export.import_jsonl) ---------------------------------

    def import_messages(
        self,
        title: str,
        messages: Iterator[dict[str, Any]] | Sequence[dict[str, Any]],
        *,
        model: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Conversation:
        """Create a conversation holding ``messages`` in one transaction (all or nothing).

        Each item: role, content, and optionally tokens, first_pos, status, meta.
        """
        items = list(messages)
        for item in items:
            status = item.get("status", "complete")
            self._validate_message(item["role"], item["content"], item.get("tokens"), item.get("first_pos"), status)
        check_text(title, "title")
        now = utc_now()
        with self._write() as conn:
            cid = _insert_conversation(conn, title, model, settings, now)
            for item in items:
                status = item.get("status", "complete")
                self._insert_message(
                    conn, cid, item["role"], item["content"],
                    tokens=item.get("tokens"), first_pos=item.get("first_pos"),
                    # A partial answer without a live writer is an interrupted one.
                    status="interrupted" if status == "partial" else status,
                    meta=item.get("meta"), now=now,
                )
        return self.get_conversation(cid)


class _LockedTransaction:
    """The store's lock (main connection only) plus ``BEGIN IMMEDIATE`` … ``COMMIT``."""

    def __init__(self, store: Store, conn: sqlite3.Connection | None = None) -> None:
        self._store = store
        self._side = conn
        self._tx: Any = None

    def __enter__(self) -> sqlite3.Connection:
        if self._store.read_only:
            # Refused before the write lock, whose file a read-only store must not create.
            raise ReadOnlyError(
                f"{self._store.path}: the log is read-only (opened read-only); `certchat log list`/`log show` "
                "still read it — to write, make the file and its directory writable or pass --db"
            )
        if self._side is None:
            self._store._lock.acquire()
        try:
            conn = self._side if self._side is not None else self._store._conn
            self._tx = dbmod.write_transaction(conn, self._store.path)
            return self._tx.__enter__()
        except BaseException:
            if self._side is None:
                self._store._lock.release()
            raise

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self._tx.__exit__(*exc_info)
        finally:
            if self._side is None:
                self._store._lock.release()
