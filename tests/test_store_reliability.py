"""The store's answers for the reliability gaps, without a model: round numbers, re-readable messages,
one writer per conversation, unanswered messages of dead writers, ids out of range."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memory_store import ConversationBusyError, EvictionRound, NotFoundError, Store
from tests.reliability_support import cli, env

HOLDER = """
import sys, time
from memory_store import Store
store = Store(sys.argv[1])
store.claim_conversation(int(sys.argv[2]))
print("held", flush=True)
time.sleep(600)
"""

DIES_AFTER_ASKING = """
import os, signal, sys
from memory_store import Store
store = Store(sys.argv[1])
store.append_user_message(int(sys.argv[2]), "asked, never answered")
os.kill(os.getpid(), signal.SIGKILL)
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env())


def test_next_eviction_round_continues_from_the_log(tmp_path: Path) -> None:
    with Store(tmp_path / "log.db") as store:
        cid = store.create_conversation("r").id
        assert store.next_eviction_round(cid) == 0
        for r in (0, 1, 4):
            store.record_eviction_round(EvictionRound(conversation_id=cid, round=r, policy="poisson"))
        assert store.next_eviction_round(cid) == 5
        assert store.next_eviction_round(store.create_conversation("other").id) == 0


def test_rereadable_leaves_out_refused_unanswered_and_discarded(tmp_path: Path) -> None:
    with Store(tmp_path / "log.db") as store:
        cid = store.create_conversation("r").id
        kept = store.append_user_message(cid, "kept")
        store.append_message(cid, "assistant", "answer")
        store.mark_refused(store.append_user_message(cid, "far too long").id, "too long")
        store.mark_unanswered(store.append_user_message(cid, "cut off").id)
        store.append_user_message(cid, "probe", meta={"discarded": True})
        assert [m.content for m in store.rereadable(cid)] == ["kept", "answer"]
        assert len(store.messages(cid)) == 5  # nothing is deleted
        assert store.get_message(kept.id).meta == {}
    r = cli("log", "show", "--db", str(tmp_path / "log.db"), str(cid))
    assert r.returncode == 0, r.stderr
    assert "[2] user (refused: too long)\nfar too long" in r.stdout
    assert "[3] user (unanswered: prefill)\ncut off" in r.stdout
    r = cli("log", "show", "--db", str(tmp_path / "log.db"), "--json", str(cid))
    assert [m["reread"] for m in json.loads(r.stdout)["messages"]] == [True, True, False, False, False]


def test_second_process_is_refused_until_the_holder_dies(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    with Store(db) as store:
        cid = store.create_conversation("shared").id
    holder = _child(HOLDER, str(db), str(cid))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with Store(db) as store:
            with pytest.raises(ConversationBusyError, match=rf"conversation {cid} .* \(pid {holder.pid} on "):
                store.append_user_message(cid, "me too")
            with pytest.raises(ConversationBusyError):
                store.claim_conversation(cid)
            assert store.messages(cid) == []
            writer = store.conversation_writer(cid)
            assert writer is not None and writer.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with Store(db) as store:  # a dead holder's claim is taken over
        assert store.conversation_writer(cid) is None
        store.append_user_message(cid, "now mine")
        assert store.conversation_writer(cid).pid == os.getpid()
    with Store(db) as store:  # released on close (same process may claim it again anyway)
        assert store.conversation_writer(cid) is None


def test_user_message_of_a_dead_writer_is_marked_unanswered(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    with Store(db) as store:
        cid = store.create_conversation("c").id
        store.append_user_message(cid, "first")
        store.append_message(cid, "assistant", "first answer")
        imported = store.import_messages("imported", [{"role": "user", "content": "ends with a question"}]).id
    child = _child(DIES_AFTER_ASKING, str(db), str(cid))
    child.wait()
    assert child.returncode == -signal.SIGKILL
    with Store(db) as store:
        assert store.unanswered == 1
        last = store.messages(cid)[-1]
        assert last.content == "asked, never answered" and last.meta["unanswered"] == "writer gone"
        assert [m.content for m in store.rereadable(cid)] == ["first", "first answer"]
        # an imported conversation ending with a user message recorded no writer: left as it is
        assert [m.meta for m in store.messages(imported)] == [{}]
    with Store(db) as store:
        assert store.unanswered == 0  # marked once


@pytest.mark.parametrize("ident", [2**63, 2**70, -1])
def test_ids_out_of_range_are_not_found(tmp_path: Path, ident: int) -> None:
    with Store(tmp_path / "log.db") as store:
        for call in (store.get_conversation, store.get_message, store.messages, store.delete_conversation):
            with pytest.raises(NotFoundError, match=f"no (conversation|message) {ident}"):
                call(ident)
