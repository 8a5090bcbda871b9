"""The log across real processes: kill -9 mid-stream, and a writer and a reader side by side."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memory_store import Store, StoreError

REPO = Path(__file__).resolve().parent.parent
WRITER = Path(__file__).resolve().parent / "store_writer.py"


def spawn(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(
        [sys.executable, str(WRITER), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def committed(path: Path, message_id: int) -> tuple[str, str, bytes]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT status, content, tokens FROM messages WHERE id = ?", (message_id,)).fetchone()
    finally:
        conn.close()


def chunks(n: int) -> str:
    return "".join(f"c{i} " for i in range(n))


def test_kill_9_while_streaming(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    writer = spawn("crash", str(path))
    try:
        line = writer.stdout.readline()
        assert line, writer.stderr.read()
        ids = json.loads(line)
        # Let it stream for a while: several periodic commits.
        deadline = time.monotonic() + 10
        while len(committed(path, ids["assistant"])[1]) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Another process opening the log meanwhile must not declare the live writer dead.
        with Store(path) as peer:
            assert peer.recovered == 0
            assert peer.get_message(ids["assistant"]).status == "partial"
        time.sleep(0.3)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    status, content, _ = committed(path, ids["assistant"])
    assert status == "partial" and content  # as the dead process left it
    with Store(path) as store:
        assert store.recovered == 1
        user, answer = store.messages(ids["conversation"])
        assert (user.id, user.role, user.status, user.content) == (ids["user"], "user", "complete", "Tell me a long story.")
        assert user.tokens.tolist() == [7, 8, 9]
        assert (answer.id, answer.status) == (ids["assistant"], "interrupted")
        # Content and tokens were committed together: chunk i is "c{i} " with token i.
        n = len(answer.tokens)
        assert n >= 10
        assert answer.tokens.tolist() == list(range(n))
        assert answer.content == chunks(n)
        tokens, positions = store.history(ids["conversation"]).flatten()
        assert tokens.tolist() == [7, 8, 9, *range(n)]
        assert positions.tolist() == list(range(3 + n))
    with Store(path) as again:
        assert again.recovered == 0


@pytest.mark.slow
def test_writer_and_reader_for_30_seconds(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    Store(path).close()  # created and migrated before the race begins
    expected_file = tmp_path / "written.json"
    seconds = float(os.environ.get("CERTCHAT_STRESS_SECONDS", "30"))
    writer = spawn("stress", str(path), str(seconds), str(expected_file))
    errors: list[str] = []
    seen: dict[int, int] = {}  # message id -> longest content seen
    reads = searches = opens = 0
    started = time.monotonic()
    try:
        while writer.poll() is None and time.monotonic() - started < seconds + 60:
            try:
                # As a TUI refresh or a `certchat log` call would: open, read, close.
                with Store(path) as store:
                    opens += 1
                    for conversation in store.list_conversations(limit=5):
                        for message in store.messages(conversation.id):
                            if message.status == "partial":
                                # Streaming content and tokens always belong together.
                                n = len(message.tokens)
                                assert message.content == chunks(n), (message.content[-20:], n)
                            previous = seen.get(message.id, 0)
                            assert len(message.content) >= previous, "committed content went backwards"
                            seen[message.id] = len(message.content)
                        store.history(conversation.id).flatten(skip_untokenized=True)
                        reads += 1
                    store.search("Tromsø 8311")
                    store.search("Purrnickel")
                    searches += 2
                    if opens % 20 == 0:
                        conversations = store.list_conversations(limit=1)
                        if conversations:  # a write from the reader side, too
                            store.rename_conversation(conversations[0].id, conversations[0].title)
            except (StoreError, sqlite3.Error) as error:
                errors.append(f"{type(error).__name__}: {error}")
            time.sleep(0.02)
        out, err = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 0, err
    assert errors == []
    assert opens > 50 and reads > 50, (opens, reads)
    written = json.loads(expected_file.read_text(encoding="utf-8"))
    assert len(written) >= 3
    n_messages = sum(len(c["messages"]) for c in written)
    print(f"\nwriter: {len(written)} conversations, {n_messages} messages; reader: {opens} opens, {reads} history reads, {searches} searches")
    conn = sqlite3.connect(path)
    unfinished = conn.execute(
        "SELECT id, conversation_id, idx, role, status, length(content), writer_pid, heartbeat_at, updated_at "
        "FROM messages WHERE status != 'complete'"
    ).fetchall()
    conn.close()
    assert unfinished == [], (unfinished, err[-2000:])
    with Store(path) as store:
        assert store.recovered == 0
        for conversation in written:
            messages = store.messages(conversation["id"])
            assert [
                (m.role, m.content, m.tokens.tolist(), m.first_pos, m.status) for m in messages
            ] == [
                (w["role"], w["content"], w["tokens"], w["first_pos"], "complete") for w in conversation["messages"]
            ]
            assert len(store.turns(conversation["id"])) == sum(w["role"] == "assistant" for w in conversation["messages"])
        tokens, positions = store.history(written[0]["id"]).flatten()
        assert np.all(np.diff(positions) == 1)
        assert store.search("Purrnickel") == []  # it is only in titles, and titles are not indexed
        assert len(store.search("Tromsø", limit=10_000)) == sum(
            w["role"] == "user" for c in written for w in c["messages"]
        )


def test_opening_more_stores_in_one_process_keeps_its_locks(tmp_path: Path) -> None:
    # SQLite's POSIX locks belong to the process: closing *any* descriptor of the
    # file drops them all. If opening a second Store (or a stream's flusher
    # connection) read the file with open()/close(), another process closing
    # its connection would believe it is the last one and delete the WAL under
    # our feet, silently losing every later commit.
    path = tmp_path / "log.db"
    first = Store(path)
    c = first.create_conversation("kept")
    Store(path).close()
    with first.stream_assistant(c.id) as stream:  # its flusher opens a connection too
        stream.append("streamed", [1])
    other = subprocess.run(
        [sys.executable, "-c", f"import sqlite3; sqlite3.connect({str(path)!r}).execute('SELECT 1 FROM messages').fetchall()"],
        capture_output=True, text=True, timeout=60,
    )
    assert other.returncode == 0, other.stderr
    for i in range(5):
        first.append_user_message(c.id, f"after {i}")
    check = subprocess.run(
        [sys.executable, "-c", f"import sqlite3; print(sqlite3.connect({str(path)!r}).execute('SELECT count(*) FROM messages').fetchone()[0])"],
        capture_output=True, text=True, timeout=60,
    )
    first.close()
    assert check.stdout.strip() == "6", check.stderr


def test_unhandled_exception_exit_marks_the_answer_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    code = (
        "from memory_store import Store\n"
        f"store = Store({str(path)!r})\n"
        "c = store.create_conversation()\n"
        "stream = store.stream_assistant(c.id)\n"
        "stream.append('half', [1])\n"
        "raise RuntimeError('agent crashed')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "agent crashed" in result.stderr
    conn = sqlite3.connect(path)
    try:
        # Marked at exit, by the dying process itself: no later open needed.
        assert conn.execute("SELECT status, content FROM messages").fetchall() == [("interrupted", "half")]
    finally:
        conn.close()
