"""Commits and checkpoints of the log never overlap, so SQLite's WAL-reset bug (3.7.0–3.51.2) cannot corrupt it.

Real SQLite files and real processes: two writers append thousands of messages and checkpoint
concurrently; every connection the store opens has autocheckpoints off; a checkpoint waits while
another process holds the write lock. Orderings are asserted with events, never with timings.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path

import pytest

from memory_store import Store, StoreError, locking
from memory_store import db as dbmod

# Each writer process: this many commits, an explicit checkpoint after every CHECKPOINT_EACH of them
# (the store's own every db.CHECKPOINT_EVERY comes on top).
COMMITS = 2000
CHECKPOINT_EACH = 20

# Only a guard against a hung peer; no assertion depends on how long anything takes.
GUARD_S = 120

SPAWN = multiprocessing.get_context("spawn")


def _write_and_checkpoint(path: str, conversation_id: int, tag: str, start: Barrier, results: multiprocessing.Queue) -> None:
    with Store(path, check=False) as store:
        start.wait(GUARD_S)
        checkpoints: list[tuple[int, int]] = []
        for i in range(COMMITS):
            role = "user" if i % 2 == 0 else "assistant"
            store.append_message(conversation_id, role, f"{tag} {i}")
            if i % CHECKPOINT_EACH == CHECKPOINT_EACH - 1:
                checkpoints.append(store.checkpoint())
    results.put((tag, checkpoints))


def _hold_the_write_lock(path: str, conversation_id: int, held: Event, release: Event, released: Event) -> None:
    with Store(path, check=False) as store:
        with store._write() as conn:  # the write lock and an open write transaction
            conn.execute("UPDATE conversations SET title = 'written while holding' WHERE id = ?", (conversation_id,))
            held.set()
            release.wait(GUARD_S)
            released.set()  # from here on the transaction commits and the lock is let go


def _rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _integrity(path: Path) -> list[tuple[object, ...]]:
    return _rows(path, "PRAGMA integrity_check")


def test_two_processes_commit_and_checkpoint_one_file_concurrently(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Store(path) as store:
        ids = {tag: store.create_conversation(tag).id for tag in ("A", "B")}
    start = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    writers = [SPAWN.Process(target=_write_and_checkpoint, args=(str(path), cid, tag, start, results))
               for tag, cid in ids.items()]
    for writer in writers:
        writer.start()
    try:
        reported = dict(results.get(timeout=GUARD_S) for _ in writers)
    finally:
        for writer in writers:
            writer.join(GUARD_S)
    assert [w.exitcode for w in writers] == [0, 0]

    assert _integrity(path) == [("ok",)]
    for tag, checkpoints in reported.items():
        assert len(checkpoints) == COMMITS // CHECKPOINT_EACH
        assert all(0 <= done <= frames for frames, done in checkpoints)
    # The checkpoints did copy pages while the other process was committing.
    assert sum(done for checkpoints in reported.values() for _, done in checkpoints) > 0
    owners = [row[0] for row in _rows(path, "SELECT conversation_id FROM messages ORDER BY id")]
    assert sum(a != b for a, b in zip(owners, owners[1:])) > 1, "the two writers' commits never interleaved"
    with Store(path) as store:
        for tag, cid in ids.items():
            messages = store.messages(cid)
            assert [m.content for m in messages] == [f"{tag} {i}" for i in range(COMMITS)]
            assert [m.index for m in messages] == list(range(COMMITS))
        # The full-text index, kept by triggers in the same commits, found the last one too.
        hits = store.search(f"B {COMMITS - 1}")
        assert (ids["B"], COMMITS - 1) in {(hit.conversation_id, hit.index) for hit in hits}


def test_no_connection_the_store_opens_checkpoints_on_commit(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    with Store(path) as store:
        assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        side = store._side_connection()  # what a stream's flusher thread writes through
        try:
            assert side.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        finally:
            store._close_side_connection(side)
        store.create_conversation("x")
    with Store(path, read_only=True) as reader:
        assert reader._conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)


def test_the_store_checkpoints_every_so_many_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dbmod, "CHECKPOINT_EVERY", 5)
    path = tmp_path / "log.db"
    with Store(path) as store:
        lock = locking.for_database(path)
        lock.commits = 0
        c = store.create_conversation()
        for i in range(3):
            store.append_message(c.id, "system", f"m{i}")
        assert lock.commits == 4
        store.append_message(c.id, "system", "m3")
        assert lock.commits == 0  # the fifth commit checkpointed, under the same lock
        frames, done = store.checkpoint()
        assert frames == done  # nothing was left to copy
        assert not lock.held_here


def test_a_checkpoint_waits_while_another_process_holds_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "log.db"
    with Store(path) as store:
        cid = store.create_conversation("before").id
        store.checkpoint()
        held, release, released = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
        holder = SPAWN.Process(target=_hold_the_write_lock, args=(str(path), cid, held, release, released))
        holder.start()
        try:
            assert held.wait(GUARD_S), "the holder never took the lock"
            # May not wait: refused at once, in one line naming the file.
            with pytest.raises(StoreError, match="database is locked") as refused:
                store.checkpoint(timeout=0)
            assert str(path) in str(refused.value) and "\n" not in str(refused.value)

            # May wait: it finds the lock taken, and returns only once the holder has let it go.
            waiting = threading.Event()
            pause = locking._pause

            def noted_pause(seconds: float) -> None:
                waiting.set()
                pause(seconds)

            monkeypatch.setattr(locking, "_pause", noted_pause)
            results: list[tuple[int, int]] = []
            released_first: list[bool] = []

            def checkpoint() -> None:
                results.append(store.checkpoint(timeout=GUARD_S))
                released_first.append(released.is_set())

            waiter = threading.Thread(target=checkpoint)
            waiter.start()
            assert waiting.wait(GUARD_S), "the checkpoint never had to wait"
            assert not results  # still waiting: the holder has not been told to let go
            release.set()
            waiter.join(GUARD_S)
        finally:
            release.set()
            holder.join(GUARD_S)
        assert holder.exitcode == 0
        assert released_first == [True]
        ((frames, done),) = results
        assert frames > 0 and done == frames  # it ran after the holder's commit, and copied it
        assert store.get_conversation(cid).title == "written while holding"
    assert _integrity(path) == [("ok",)]
