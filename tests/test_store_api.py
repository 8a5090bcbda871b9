"""The Store API the agent and the TUI use, on a real SQLite file."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memory_store import EvictionRound, NotFoundError, Store, StoreError, StreamLostError, Turn, liveness


@pytest.fixture
def store(tmp_path: Path):
    with Store(tmp_path / "log.db") as s:
        yield s


def raw_rows(path: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Read through an independent connection: sees only what was committed."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_database_pragmas(store: Store) -> None:
    conn = store._conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000


def test_creates_private_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "log.db"
    Store(path).close()
    assert path.is_file()
    assert path.stat().st_mode & 0o077 == 0


def test_conversation_lifecycle(store: Store) -> None:
    a = store.create_conversation("first", model="qwen2.5-0.5b", settings={"budget": 0.1, "policy": "poisson"})
    b = store.create_conversation("second")
    assert (a.title, a.model, a.settings, a.message_count) == ("first", "qwen2.5-0.5b", {"budget": 0.1, "policy": "poisson"}, 0)
    store.append_user_message(a.id, "hello")
    # Most recently updated first: a got a message after b was created.
    assert [c.id for c in store.list_conversations()] == [a.id, b.id]
    assert store.list_conversations(limit=1)[0].message_count == 1
    renamed = store.rename_conversation(b.id, "renamed ✓")
    assert renamed.title == "renamed ✓" and store.get_conversation(b.id).title == "renamed ✓"
    assert [c.id for c in store.list_conversations()] == [b.id, a.id]
    updated = store.update_conversation(a.id, settings={"budget": 0.25})
    assert updated.settings == {"budget": 0.25} and updated.model == "qwen2.5-0.5b"
    store.delete_conversation(a.id)
    assert [c.id for c in store.list_conversations()] == [b.id]
    with pytest.raises(NotFoundError, match=f"no conversation {a.id}"):
        store.get_conversation(a.id)
    with pytest.raises(NotFoundError):
        store.delete_conversation(a.id)
    with pytest.raises(NotFoundError):
        store.append_user_message(a.id, "to nowhere")


def test_delete_cascades_to_messages_turns_rounds_and_search(store: Store) -> None:
    c = store.create_conversation("doomed")
    m = store.append_user_message(c.id, "unique-word-zanzibar")
    store.record_turn(Turn(c.id, message_id=m.id))
    store.record_eviction_round(EvictionRound(c.id, round=0, message_id=m.id))
    assert store.search("zanzibar")
    store.delete_conversation(c.id)
    assert store.search("zanzibar") == []
    for table in ("messages", "turns", "eviction_rounds"):
        assert raw_rows(store.path, f"SELECT count(*) FROM {table}") == [(0,)]


def test_user_message_is_committed_before_return(store: Store) -> None:
    c = store.create_conversation()
    m = store.append_user_message(c.id, "remember 8311")
    assert raw_rows(store.path, "SELECT content, status, idx FROM messages WHERE id = ?", (m.id,)) == [
        ("remember 8311", "complete", 0)
    ]


def test_message_validation(store: Store) -> None:
    c = store.create_conversation()
    with pytest.raises(ValueError, match="role"):
        store.append_message(c.id, "tool", "x")
    with pytest.raises(ValueError, match="lone surrogate"):
        store.append_user_message(c.id, "bad \ud800 text")
    with pytest.raises(ValueError, match="token ids"):
        store.append_user_message(c.id, "x", tokens=[1, -2], first_pos=0)
    with pytest.raises(ValueError, match="token ids"):
        store.append_user_message(c.id, "x", tokens=[2**31], first_pos=0)
    with pytest.raises(ValueError, match="stream_assistant"):
        store.append_message(c.id, "assistant", "x", status="partial")
    assert store.messages(c.id) == []


def test_stream_commits_partial_content_from_its_own_thread_while_open(store: Store,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # how soon the commit lands is measured by scripts/bench_stream_commit.py; here: that it lands, off the
    # appending thread, while the answer is still open
    c = store.create_conversation()
    committed = threading.Event()
    committers: list[threading.Thread] = []
    real_writer = store._stream_writer

    def observed_writer(conn: sqlite3.Connection | None) -> Any:
        write = real_writer(conn)

        def recording(message_id: int, content: str, blob: bytes, first_pos: int | None, status: str,
                      *rest: Any) -> None:
            write(message_id, content, blob, first_pos, status, *rest)
            if status == "partial" and content == "Hello, world":
                committers.append(threading.current_thread())
                committed.set()
        return recording

    monkeypatch.setattr(store, "_stream_writer", observed_writer)
    with store.stream_assistant(c.id, first_pos=10) as stream:
        # The row exists, partial, as soon as the stream starts.
        assert raw_rows(store.path, "SELECT status, content FROM messages WHERE id = ?", (stream.message_id,)) == [
            ("partial", "")
        ]
        stream.append("Hello", [101])
        stream.append(", world", [102, 103])
        assert committed.wait(timeout=60), "the stream never committed its partial content"
        assert committers[0] is not threading.current_thread()
        rows = raw_rows(store.path, "SELECT status, content, tokens FROM messages WHERE id = ?", (stream.message_id,))
        assert rows[0][:2] == ("partial", "Hello, world")
        assert np.frombuffer(rows[0][2], "<i4").tolist() == [101, 102, 103]
    final = store.get_message(stream.message_id)
    assert (final.status, final.content, final.tokens.tolist(), final.first_pos) == (
        "complete", "Hello, world", [101, 102, 103], 10,
    )


def test_stream_cancel_marks_interrupted_and_keeps_content(store: Store) -> None:
    c = store.create_conversation()
    stream = store.stream_assistant(c.id)
    stream.append("The answer is", [5, 6, 7])
    result = stream.cancel()
    assert (result.status, result.content, result.tokens.tolist()) == ("interrupted", "The answer is", [5, 6, 7])
    with pytest.raises(StoreError, match="already interrupted"):
        stream.append("more")
    assert stream.cancel().status == "interrupted"  # idempotent


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_exception_inside_stream_marks_interrupted(store: Store, exc: type[BaseException]) -> None:
    c = store.create_conversation()
    user = store.append_user_message(c.id, "question")
    with pytest.raises(exc):
        with store.stream_assistant(c.id) as stream:
            stream.append("partial ans", [1, 2])
            raise exc()
    messages = store.messages(c.id)
    assert [(m.id, m.status) for m in messages] == [(user.id, "complete"), (stream.message_id, "interrupted")]
    assert messages[1].content == "partial ans"


def test_interrupt_inside_a_write_leaves_the_database_consistent(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    c = store.create_conversation()
    store.append_user_message(c.id, "before")
    real = store._insert_message

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C after the INSERT, before COMMIT

    monkeypatch.setattr(store, "_insert_message", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.append_user_message(c.id, "lost")
    monkeypatch.undo()
    assert [m.content for m in store.messages(c.id)] == ["before"]
    assert store.search("lost") == []
    assert store.append_user_message(c.id, "after").index == 1


def test_close_interrupts_open_streams(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    store = Store(path)
    c = store.create_conversation()
    stream = store.stream_assistant(c.id)
    stream.append("cut off", [1])
    store.close()
    with Store(path) as again:
        (m,) = again.messages(c.id)
        assert (m.status, m.content) == ("interrupted", "cut off")


def test_deleting_a_conversation_while_streaming(store: Store) -> None:
    c = store.create_conversation()
    stream = store.stream_assistant(c.id, commit_interval=0.05)
    stream.append("x")
    store.delete_conversation(c.id)
    with pytest.raises(StreamLostError, match="deleted while streaming"):
        stream.finish()


def test_history_for_reprefill(store: Store) -> None:
    c = store.create_conversation()
    system = store.append_message(c.id, "system", "You are terse.", tokens=[1, 2, 3, 4], first_pos=0)
    user = store.append_user_message(c.id, "Hi")
    store.set_message_tokens(user.id, [5, 6, 7], first_pos=4)
    with store.stream_assistant(c.id, first_pos=7) as stream:
        stream.append("Hel", [8])
        stream.append("lo", np.array([9, 10], dtype=np.int64))
    cancelled = store.stream_assistant(c.id)
    cancelled.set_first_position(10)
    cancelled.append("Wait", [11])
    cancelled.cancel()
    history = store.history(c.id)
    assert [(m.role, m.status) for m in history.messages] == [
        ("system", "complete"), ("user", "complete"), ("assistant", "complete"), ("assistant", "interrupted"),
    ]
    tokens, positions = history.flatten()
    assert tokens.dtype == np.int32 and positions.dtype == np.int32
    assert tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert positions.tolist() == list(range(11))
    assert history.messages[0].id == system.id
    tokens, _ = store.history(c.id, statuses=("complete",)).flatten()
    assert tokens.tolist() == list(range(1, 11))


def test_contents_of_some_messages_by_index(store: Store) -> None:
    c = store.create_conversation()
    other = store.create_conversation()
    for text in ("You are terse.", "How did your last message start?", "It started: Hi."):
        store.append_message(c.id, "user" if text.endswith("?") else "assistant", text)
    store.append_message(other.id, "user", "Not this conversation's.")
    assert store.contents(c.id, [2, 1, 1, 7]) == {1: "How did your last message start?", 2: "It started: Hi."}
    assert store.contents(other.id, [0, 1]) == {0: "Not this conversation's."}
    assert store.contents(c.id, []) == {}


def test_history_with_position_gaps_and_errors(store: Store) -> None:
    c = store.create_conversation()
    store.append_user_message(c.id, "a", tokens=[1, 2], first_pos=0)
    store.append_message(c.id, "assistant", "b", tokens=[3], first_pos=100)  # gaps are allowed
    tokens, positions = store.history(c.id).flatten()
    assert (tokens.tolist(), positions.tolist()) == ([1, 2, 3], [0, 1, 100])
    untokenized = store.append_user_message(c.id, "not yet tokenized")
    with pytest.raises(ValueError, match="no recorded token ids"):
        store.history(c.id).flatten()
    assert store.history(c.id).flatten(skip_untokenized=True)[0].tolist() == [1, 2, 3]
    store.set_message_tokens(untokenized.id, [4, 5], first_pos=50)  # overlaps the previous message
    with pytest.raises(ValueError, match="before the previous message ends"):
        store.history(c.id).flatten()


def test_history_leaves_out_what_the_chat_took_back(store: Store) -> None:
    """A replaced answer stays logged, discarded, at the positions its replacement then took: re-prefilling the
    history reads the replacement, not both."""
    c = store.create_conversation()
    store.append_user_message(c.id, "q", tokens=[1, 2], first_pos=0)
    store.append_message(c.id, "assistant", "generated", tokens=[3, 4, 5], first_pos=2,
                         meta={"discarded": True, "replaced": True})
    store.append_message(c.id, "assistant", "scripted", tokens=[6], first_pos=2, meta={"forced": True})
    store.append_user_message(c.id, "next", tokens=[7], first_pos=3)
    tokens, positions = store.history(c.id).flatten()
    assert (tokens.tolist(), positions.tolist()) == ([1, 2, 6, 7], [0, 1, 2, 3])


def test_turns_and_eviction_rounds_round_trip(store: Store) -> None:
    c = store.create_conversation()
    with store.stream_assistant(c.id) as stream:
        stream.append("ok", [1])
    turn = Turn(
        c.id,
        message_id=stream.message_id,
        policy="poisson",
        budget=0.1,
        allocated_cells=512,
        live_cells=301,
        cert_stats={"window_p95": 0.4125, "max": 1.5},
        cert_layers=[0.1, 0.2, 1 / 3],
        gate_stat=0.4125,
        gate_threshold=0.38,
        gate_fired=True,
        reprefill_tokens=2873,
        prompt_tokens=40,
        decode_tokens=17,
        prefill_s=1.25,
        decode_s=0.5,
        tokens_per_s=34.0,
        seed=12345,
        extra={"note": "ünïcode"},
    )
    saved = store.record_turn(turn)
    assert saved.id is not None and saved.created_at
    (loaded,) = store.turns(c.id)
    assert loaded == saved
    for field in ("policy", "budget", "cert_stats", "cert_layers", "gate_fired", "reprefill_tokens", "seed", "extra"):
        assert getattr(loaded, field) == getattr(turn, field)
    rounds = [
        EvictionRound(c.id, round=r, policy="poisson", cells_before=1000 + r, cells_after=100, expected_budget=97.5, seed=7, sum_pi=97.5)
        for r in (1, 0)
    ]
    for r in rounds:
        store.record_eviction_round(r)
    loaded_rounds = store.eviction_rounds(c.id)
    assert [r.round for r in loaded_rounds] == [0, 1]
    assert (loaded_rounds[1].cells_before, loaded_rounds[1].sum_pi) == (1001, 97.5)
    with pytest.raises(StoreError):  # (conversation, round) is unique
        store.record_eviction_round(EvictionRound(c.id, round=0))
    with pytest.raises(NotFoundError):
        store.record_turn(Turn(9999))


def test_search(store: Store) -> None:
    a = store.create_conversation("pets")
    b = store.create_conversation("travel")
    m1 = store.append_user_message(a.id, "My cat is called Purrnickel.")
    store.append_user_message(b.id, "I flew to Tromsø in 2019.")
    store.append_message(b.id, "assistant", "Tromsø is lovely — enjoy!")
    hits = store.search("purrnickel")
    assert [(h.conversation_id, h.message_id, h.title) for h in hits] == [(a.id, m1.id, "pets")]
    assert "[Purrnickel]" in hits[0].snippet
    assert {h.role for h in store.search("Tromsø")} == {"user", "assistant"}
    # FTS syntax in user text is searched for, not interpreted.
    for query in ('"unbalanced AND (', '"', '""', "!!!", "NEAR(", "*", "^cat", "called NOT", "cat OR"):
        assert isinstance(store.search(query), list), query
    assert [h.message_id for h in store.search('"Purrnickel"')] == [m1.id]
    assert [h.message_id for h in store.search("cat OR")] == []  # OR is a word here, not an operator
    # Where the index has no word to match, a substring does: inside words, CJK runs.
    tokyo = store.append_user_message(b.id, "私は東京に住んでいる")
    assert [(h.message_id, h.snippet) for h in store.search("東京")] == [(tokyo.id, "私は[東京]に住んでいる")]
    assert [(h.message_id, h.snippet) for h in store.search("PURRNICK")] == [(m1.id, "My cat is called [Purrnick]el.")]
    assert [h.message_id for h in store.search("cat-is")] == [m1.id]
    assert store.search("   ") == []
    # Partial answers are searchable while they stream.
    with store.stream_assistant(a.id, commit_interval=0.05) as stream:
        stream.append("streaming-word-xylophone")
        deadline = time.monotonic() + 2
        while not store.search("xylophone") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.search("xylophone")[0].message_id == stream.message_id


def test_store_shared_between_threads(store: Store) -> None:
    c = store.create_conversation()
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(20):
                store.append_user_message(c.id, f"t{k} m{i}")
                store.list_conversations()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    messages = store.messages(c.id)
    assert [m.index for m in messages] == list(range(80))
    assert len({m.content for m in messages}) == 80


def test_partial_rows_of_dead_or_foreign_writers(store: Store) -> None:
    c = store.create_conversation()
    now = time.time()

    def partial(pid: int | None, host: str | None, token: str | None, heartbeat: float | None) -> int:
        m = store.append_message(c.id, "assistant", "x")
        conn = sqlite3.connect(store.path, isolation_level=None)
        try:
            conn.execute(
                "UPDATE messages SET status = 'partial', writer_pid = ?, writer_host = ?, writer_token = ?, heartbeat_at = ? WHERE id = ?",
                (pid, host, token, heartbeat, m.id),
            )
        finally:
            conn.close()
        return m.id

    me = liveness.Writer.current()
    parent = os.getppid()
    alive_parent = partial(parent, me.host, liveness.process_token(parent), now)
    reused_pid = partial(parent, me.host, "some-other-boot:12345", now)
    no_lease = partial(None, None, None, None)
    dead_pid = partial(2**22 + 12345, me.host, "x:1", now)  # above pid_max's default
    remote_fresh = partial(4242, "another-host.example", None, now)
    remote_stale = partial(4242, "another-host.example", None, now - 3600)
    own_abandoned = partial(me.pid, me.host, me.token, now)
    assert store.recover_interrupted() == 5
    status = {m.id: m.status for m in store.messages(c.id)}
    assert status[alive_parent] == "partial"
    assert status[remote_fresh] == "partial"
    for mid in (reused_pid, no_lease, dead_pid, remote_stale, own_abandoned):
        assert status[mid] == "interrupted"


def test_an_open_stream_only_vouches_for_its_own_database(tmp_path: Path) -> None:
    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        stream = a.stream_assistant(a.create_conversation().id)
        # In b, a partial row with the same id, "written" by this process but by no open stream.
        c = b.create_conversation()
        m = b.append_message(c.id, "assistant", "orphan")
        assert m.id == stream.message_id
        me = liveness.Writer.current()
        conn = sqlite3.connect(b.path, isolation_level=None)
        try:
            conn.execute(
                "UPDATE messages SET status = 'partial', writer_pid = ?, writer_host = ?, writer_token = ? WHERE id = ?",
                (me.pid, me.host, me.token, m.id),
            )
        finally:
            conn.close()
        assert a.recover_interrupted() == 0
        assert b.recover_interrupted() == 1
        assert a.get_message(stream.message_id).status == "partial"
        stream.finish()


def test_idle_stream_keeps_its_heartbeat_fresh(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long re-prefill mid-answer appends nothing for minutes: the writer must still look alive.
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.2)
    c = store.create_conversation()
    with store.stream_assistant(c.id, commit_interval=0.1) as stream:
        stream.append("thinking", [1])
        time.sleep(0.3)
        (first,) = raw_rows(store.path, "SELECT heartbeat_at FROM messages WHERE id = ?", (stream.message_id,))[0]
        time.sleep(0.6)
        (later,) = raw_rows(store.path, "SELECT heartbeat_at FROM messages WHERE id = ?", (stream.message_id,))[0]
        assert later > first


def test_message_meta_and_status_updates(store: Store) -> None:
    c = store.create_conversation()
    m = store.append_user_message(c.id, "q", meta={"probe": {"expect": ["x"], "fact_turn": 1}})
    updated = store.update_message_meta(m.id, {"discarded": True, "replaced": True})
    assert updated.meta == {"probe": {"expect": ["x"], "fact_turn": 1}, "discarded": True, "replaced": True}
    assert store.update_message_meta(m.id, {"replaced": None}).meta == {"probe": {"expect": ["x"], "fact_turn": 1}, "discarded": True}
    assert raw_rows(store.path, "SELECT meta FROM messages WHERE id = ?", (m.id,))[0][0] == (
        '{"discarded": true, "probe": {"expect": ["x"], "fact_turn": 1}}'
    )
    with pytest.raises(NotFoundError):
        store.update_message_meta(9999, {"a": 1})
    stream = store.stream_assistant(c.id)
    with pytest.raises(StoreError, match="being streamed"):
        store.set_message_status(stream.message_id, "complete")
    stream.cancel()
    assert store.set_message_status(stream.message_id, "complete").status == "complete"
    with pytest.raises(ValueError):
        store.set_message_status(m.id, "partial")
