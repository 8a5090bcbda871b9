"""The log's write lock: one writer or checkpointer at a time per database file, across threads and processes.

SQLite 3.7.0–3.51.2 (fixed in 3.51.3) has the WAL-reset bug: a checkpoint that overlaps another
connection's commit, or another checkpoint, can corrupt a WAL database. certchat writes one file from
several processes and threads, and Python's sqlite3 is often in that range. So every connection the
store opens sets ``wal_autocheckpoint = 0`` (no commit ever checkpoints on its own), and every write
transaction and every checkpoint holds this lock: a checkpoint can then never overlap a commit or another
checkpoint, whatever SQLite the user has. Reads take no lock (WAL readers never conflict with either).

The lock is an ``flock`` on ``<db>.lock`` beside the database, never on the database file itself:
closing any descriptor of that file would drop SQLite's own POSIX locks. ``flock`` excludes open file
descriptions, not threads, so a thread lock per database comes first; the thread lock is reentrant and
the file is locked only by the outermost holder. The kernel drops a killed process's flock with it, so a
crash never leaves the log locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_SUFFIX = ".lock"

# Waiting for a peer polls the file lock (flock has no timeout); the pause doubles up to this.
_MAX_PAUSE_S = 0.005


class LockTimeout(Exception):
    """Another writer held the lock for the whole timeout."""


def lock_path(database: str | os.PathLike[str]) -> Path:
    """The lock file of ``database``: beside its real path, so every spelling of the path shares one lock."""
    return Path(os.path.realpath(database) + LOCK_SUFFIX)


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def _flock(fd: int, deadline: float | None) -> None:
    """``LOCK_EX`` on ``fd``: wait for ever (``deadline`` None) or poll until ``deadline`` (monotonic) passes."""
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    pause = 0.0002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeout from None
            _pause(min(pause, deadline - now))
            pause = min(pause * 2, _MAX_PAUSE_S)


def _open_locked(path: Path, deadline: float | None) -> int:
    """A new descriptor of ``path`` holding ``LOCK_EX``; LockTimeout once ``deadline`` (monotonic) passes."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError:
            # Someone else's lock file: a read-only descriptor locks it just as well.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _flock(fd, deadline)
            # A lock file deleted (or replaced) while we waited locks nothing others see: take the new one.
            try:
                held, named = os.fstat(fd), os.stat(path)
                if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                    return fd
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


class WriteLock:
    """The write lock of one database file in this process (see ``for_database``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        # Commits made under this lock since this process last checkpointed the file.
        self.commits = 0

    @contextlib.contextmanager
    def held(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock for the block: wait at most ``timeout`` seconds (None: for ever, 0: not at all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise LockTimeout
        try:
            if self._depth == 0:
                self._fd = _open_locked(self.path, deadline)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fd, self._fd = self._fd, None
                    os.close(fd)  # the only descriptor of its open file description: this releases the flock
        finally:
            self._thread_lock.release()

    @property
    def held_here(self) -> bool:
        """Whether some thread of this process holds the lock now."""
        return self._fd is not None


_registry_lock = threading.Lock()
_locks: dict[Path, WriteLock] = {}


def for_database(database: str | os.PathLike[str]) -> WriteLock:
    """The process-wide write lock of ``database`` (one object per real path)."""
    path = lock_path(database)
    with _registry_lock:
        lock = _locks.get(path)
        if lock is None:
            lock = _locks[path] = WriteLock(path)
        return lock


def _after_fork_in_child() -> None:
    # A child forked while a thread held the lock shares that descriptor: keeping it open would hold
    # the parent's lock until the child exits. Thread locks held by the parent's other threads stay
    # locked in the child for ever, so the child starts with fresh ones.
    global _registry_lock, _locks
    for lock in _locks.values():
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
    _registry_lock = threading.Lock()
    _locks = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
