"""Opening the SQLite file: path checks, pragmas, corruption detection.

Nothing here writes to a file before it is known to be a healthy SQLite
database: a foreign, damaged or non-SQLite file at the path is reported in one
line that names it and is never overwritten. The connection runs in driver
autocommit mode (``isolation_level=None``); writers open their own
``BEGIN IMMEDIATE`` transactions so that two processes never deadlock on a
read-to-write upgrade (which SQLite answers with SQLITE_BUSY at once, without
waiting for ``busy_timeout``). Every write transaction and every checkpoint
holds the log's write lock (``memory_store.locking``), and no connection
checkpoints on its own (``wal_autocheckpoint = 0``): SQLite's WAL-reset bug
(3.7.0–3.51.2) corrupts a file when a checkpoint overlaps a commit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from memory_store import locking
from memory_store.errors import (
    CorruptDatabaseError,
    DatabaseMissingError,
    DiskFullError,
    ReadOnlyError,
    StoreError,
)

# Long enough to ride out another process's commit of a 1 MB message or a
# migration; short enough that a wedged peer surfaces as an error, not a hang.
BUSY_TIMEOUT_MS = 15_000

# The WAL is truncated back to this size after a checkpoint, so a reader holding an old
# snapshot for a long time cannot leave a huge file behind for good.
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024

# A process checkpoints the WAL itself after this many of its commits (and when it closes the
# file): autocheckpoints are off, see the module docstring. At about 10 pages a commit this keeps
# the WAL near SQLite's default autocheckpoint size of 1000 pages.
CHECKPOINT_EVERY = 100

# Error codes that mean "the bytes on disk are not a usable database".
_DAMAGE_CODES = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}


def describe_sqlite_error(path: Path, error: sqlite3.Error) -> StoreError:
    """Turn a sqlite3 exception into a one-line StoreError naming the file."""
    name = getattr(error, "sqlite_errorname", "") or ""
    text = " ".join(str(error).split())
    if name == "SQLITE_NOTADB" or "not a database" in text:
        return CorruptDatabaseError(f"{path}: not a SQLite database; left untouched — move it aside or pass --db")
    if name in _DAMAGE_CODES or "malformed" in text:
        return CorruptDatabaseError(
            f"{path}: damaged SQLite database ({text}); left untouched — move it aside or pass --db"
        )
    if name == "SQLITE_FULL" or "disk is full" in text:
        return DiskFullError(
            f"{path}: the disk is full ({text}); this write was not saved, everything committed before it is "
            "kept — free some space and retry"
        )
    if name.startswith("SQLITE_IOERR") or "disk I/O error" in text:
        return DiskFullError(
            f"{path}: disk I/O error — the disk is full, a file-size limit was reached, or the disk is failing; "
            "this write was not saved, everything committed before it is kept — free some space (df) and retry"
        )
    if name.startswith("SQLITE_READONLY") or "readonly database" in text:
        return ReadOnlyError(
            f"{path}: the log is read-only ({text}); `certchat log list`/`log show` still read it — to write, "
            "make the file and its directory writable or pass --db"
        )
    return StoreError(f"{path}: {text}")


@contextlib.contextmanager
def sqlite_errors(path: Path) -> Iterator[None]:
    """Re-raise any sqlite3 error inside the block as a one-line StoreError."""
    try:
        yield
    except sqlite3.Error as error:
        raise describe_sqlite_error(path, error) from error


def writable(path: Path) -> bool:
    """Whether a read-write connection can work: the file and (for the WAL and its index) its directory."""
    return os.access(path, os.R_OK | os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _check_path(path: Path) -> None:
    """Refuse a directory or an inaccessible file, without opening it.

    Never open() the database file here: SQLite's POSIX locks belong to the
    process, and closing any descriptor of the file drops all of them — another
    process would then think it holds the last connection and delete the WAL
    under this process's open connections, losing their later commits. SQLite
    itself recognises a non-database file (SQLITE_NOTADB) on a read-only probe.
    """
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a database file")
    if not os.access(path, os.R_OK):
        raise StoreError(f"{path}: permission denied (need read access)")


def _create_empty(path: Path) -> None:
    """Create the parent directory and an empty, private database file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_EXCL: if another process created it meanwhile, use theirs.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    except FileExistsError:
        pass
    except OSError as error:
        raise StoreError(f"{path}: cannot create ({error.strerror})") from error


def _open(path: Path, *, read_only: bool, immutable: bool = False) -> sqlite3.Connection:
    target = f"file:{quote(str(path.resolve()))}?mode={'ro' if read_only else 'rw'}"
    if immutable:
        # A read-only directory holds no -shm/-wal and cannot get one: read the main file as it is.
        target += "&immutable=1"
    try:
        conn = sqlite3.connect(
            target,
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT_MS / 1000,
        )
    except sqlite3.Error as error:
        raise describe_sqlite_error(path, error) from error
    try:
        with sqlite_errors(path):
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys = ON")
            # No commit checkpoints implicitly: checkpoints run only under the write lock (``checkpoint``).
            conn.execute("PRAGMA wal_autocheckpoint = 0")
    except BaseException:
        conn.close()
        raise
    return conn


def connect(
    path: Path,
    *,
    create: bool = True,
    check: bool = True,
    verify: Callable[[sqlite3.Connection], None] | None = None,
    read_only: bool = False,
) -> sqlite3.Connection:
    """Open ``path`` read-write with the log's pragmas, once it is known to be safe.

    The checks run first on a separate read-only connection, which never
    writes the file (a read-write connection would checkpoint a leftover WAL
    into it on close): a first read (a non-SQLite file fails it), ``PRAGMA quick_check`` when ``check``
    (about 1 ms per MB), then ``verify`` (the caller's schema checks), which
    raises to refuse the file. WAL mode is switched on later by ``enable_wal``:
    changing the journal mode writes the header. ``read_only``: that checked
    read-only connection is the one returned (a file in a read-only directory
    is read as it is, ``immutable``).
    """
    path = Path(path)
    if not path.exists():
        if not create:
            raise DatabaseMissingError(f"{path}: no such database")
        _create_empty(path)
    _check_path(path)
    if not read_only and not writable(path):
        raise ReadOnlyError(
            f"{path}: the log is read-only (no write access to the file or its directory); `certchat log list`/"
            "`log show` still read it — to write, make it writable or pass --db"
        )
    immutable = read_only and not os.access(path.parent, os.W_OK | os.X_OK) \
        and not Path(f"{path}-wal").exists()
    probe = _open(path, read_only=True, immutable=immutable)
    try:
        with sqlite_errors(path):
            # The first read of page 1: a non-database file fails here.
            probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
            if check:
                rows = probe.execute("PRAGMA quick_check").fetchall()
                if rows != [("ok",)]:
                    detail = "; ".join(str(r[0]) for r in rows[:2])
                    raise CorruptDatabaseError(
                        f"{path}: damaged SQLite database ({detail}); left untouched — move it aside or pass --db"
                    )
            if verify is not None:
                verify(probe)
    except BaseException:
        probe.close()
        raise
    if read_only:
        return probe
    probe.close()
    return _open(path, read_only=False)


def enable_wal(conn: sqlite3.Connection, path: Path) -> None:
    """Switch to WAL (readers never block the writer) with full-sync commits."""
    with write_lock(path), sqlite_errors(path):
        # Under the write lock: switching a fresh file to WAL writes its header.
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: cannot switch to WAL journal mode (got {mode!r})")
        # FULL: a committed user message survives power loss, not only a crash.
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")


@contextlib.contextmanager
def write_lock(path: Path, timeout: float | None = BUSY_TIMEOUT_MS / 1000) -> Iterator[locking.WriteLock]:
    """Hold the log's write lock (every thread and process) for the block; reentrant within a thread.

    Waits at most ``timeout`` seconds (like ``busy_timeout``: a wedged peer surfaces as an error).
    """
    lock = locking.for_database(path)
    try:
        with lock.held(timeout):
            yield lock
    except locking.LockTimeout:
        raise StoreError(
            f"{path}: database is locked (another certchat writer held {lock.path.name} for {timeout or 0:g} s); "
            "nothing was written — retry"
        ) from None
    except OSError as error:
        if error.filename is None or os.fspath(error.filename) != os.fspath(lock.path):
            raise
        raise _lock_file_error(path, lock.path, error) from error


def _lock_file_error(path: Path, lock_file: Path, error: OSError) -> StoreError:
    """The write lock's file could not be opened: say so in the words of the matching SQLite error."""
    if error.errno == errno.ENOSPC:
        return DiskFullError(
            f"{path}: the disk is full (cannot create {lock_file.name}); this write was not saved, everything "
            "committed before it is kept — free some space and retry"
        )
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ReadOnlyError(
            f"{path}: the log is read-only (cannot open {lock_file.name}: {error.strerror}); `certchat log list`/"
            "`log show` still read it — to write, make the file and its directory writable or pass --db"
        )
    return StoreError(f"{path}: cannot open its write lock {lock_file.name} ({error.strerror})")


def checkpoint(
    conn: sqlite3.Connection, path: Path, *, timeout: float | None = BUSY_TIMEOUT_MS / 1000
) -> tuple[int, int]:
    """Copy the WAL's committed pages into the database file, under the write lock.

    PASSIVE: it never waits for readers, so holding the lock stays short; pages a reader's snapshot
    still needs are copied by a later checkpoint. Returns (frames in the WAL, frames checkpointed).
    """
    with write_lock(path, timeout) as lock, sqlite_errors(path):
        _busy, frames, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        lock.commits = 0
        return int(frames), int(done)


def close(conn: sqlite3.Connection, path: Path, *, read_only: bool = False, checkpoint_first: bool = True) -> None:
    """Close a connection; a read-write one under the write lock, checkpointing this process's commits first
    (unless not ``checkpoint_first``: a file being refused is left as it is).

    Closing the last connection to a file checkpoints it too, so that happens under the lock as well.
    """
    if read_only:
        conn.close()
        return
    try:
        with write_lock(path) as lock:
            if checkpoint_first and lock.commits and not conn.in_transaction:
                with contextlib.suppress(StoreError):  # the commits are safe in the WAL; a later one copies them
                    checkpoint(conn, path)
            conn.close()
    except StoreError:
        # The lock stayed busy: its holder has the file open, so this is not the last connection and
        # closing it checkpoints nothing.
        conn.close()


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection, path: Path) -> Iterator[sqlite3.Connection]:
    """The write lock plus ``BEGIN IMMEDIATE`` … ``COMMIT``; any exception (Ctrl-C included) rolls back.

    IMMEDIATE takes SQLite's write lock up front, so the busy handler waits for a
    writer outside certchat instead of failing on a read-to-write upgrade. Every
    ``CHECKPOINT_EVERY`` commits of this process, a checkpoint follows the commit
    under the same lock.
    """
    with write_lock(path) as lock:
        with sqlite_errors(path):
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            else:
                try:
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
        lock.commits += 1
        if lock.commits >= CHECKPOINT_EVERY:
            # The commit is durable in the WAL already: a failed checkpoint is retried after the next one.
            with contextlib.suppress(StoreError):
                checkpoint(conn, path)
