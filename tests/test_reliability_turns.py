"""What a reopened, refused, killed or doubly-opened conversation leaves in the log, through `certchat ask`.

Separate processes, as `ask` is used: each call loads the model, reopens the conversation from
the log and answers one message.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agent import paths
from memory_store import ConversationBusyError, Store
from tests.reliability_support import EVICTING, cli, consistent, kill_when, one_line_error, roles, spawn


@pytest.fixture(autouse=True)
def _model(small_model: Path) -> None:
    """The registry model the CLI loads by name (pulled once)."""


def _turn(*args: str) -> dict:
    r = cli("ask", *EVICTING, "--json", *args)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "UNIQUE" not in r.stderr, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_reopened_conversation_continues_its_eviction_rounds() -> None:
    first = _turn("--new", "My name is Ada and I keep bees on a hill above the harbour, three hives.")
    cid = first["conversation_id"]
    for question in ("How many hives do I keep?", "What is my name?"):
        assert _turn("--conversation", str(cid), question)["conversation_id"] == cid
    with Store(paths.db_path()) as store:
        turns = store.turns(cid)
        rounds = [r.round for r in store.eviction_rounds(cid)]
        messages = store.messages(cid)
    assert len(turns) == 3  # every turn recorded, none lost to a repeated round
    assert len(rounds) >= 2 and rounds == sorted(set(rounds))
    assert [m.role for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert all(m.status == "complete" for m in messages)


def test_refused_message_is_marked_and_never_reread() -> None:
    # τ 0 on the question's certificate: the gate fires on every turn, so the next turn re-reads the history
    # (the default sketch statistic needs two earlier turns of baselines before it reads anything)
    Path(os.environ["CERTCHAT_CONFIG"]).write_text('gate_stat = "question.max"\n', encoding="utf-8")
    first = _turn("--new", "Remember: the lighthouse keeper is called Orla.")
    cid = str(first["conversation_id"])
    huge = "lighthouse " * 700  # more tokens than --n-ctx 512 leaves beside the answer
    r = cli("ask", *EVICTING, "--n-ctx", "512", "--max-tokens", "64", "--conversation", cid, huge)
    assert r.returncode == 1
    one_line_error(r.stderr, "tokens but the context has room", "shorten it or raise --n-ctx")
    with Store(paths.db_path()) as store:
        refused = store.messages(int(cid))[-1]
        assert refused.content == huge and refused.meta.get("refused") == "too long"
        assert roles(store, int(cid)) == ["system", "user", "assistant"]
    # The next turn re-reads everything before the refused message (the refusal used to cut it off).
    nxt = _turn("--conversation", cid, "What is the keeper called?")
    with Store(paths.db_path()) as store:
        reread = store.rereadable(int(cid))
        assert [m.role for m in reread] == ["system", "user", "assistant", "user", "assistant"]
        assert huge not in [m.content for m in reread]
        assert "Orla" in reread[1].content
    assert nxt["reprefill_tokens"] > 0  # the gate (τ 0) fired and re-read that history


def test_kill_during_prefill_leaves_an_unanswered_message_that_is_not_reread() -> None:
    first = _turn("--new", "Remember: the boat is green.")
    cid = first["conversation_id"]
    long_text = "Tell me everything about boats, their sails and their crews. " * 150
    db = paths.db_path()

    def logged_unanswered() -> bool:
        with Store(db, read_only=True) as store:
            last = store.messages(cid)[-1]
            return last.role == "user" and last.content == long_text

    proc = spawn("ask", *EVICTING, "--n-ctx", "4096", "--conversation", str(cid), long_text)
    assert kill_when(proc, logged_unanswered)
    with Store(db, read_only=True) as store:
        last = store.messages(cid)[-1]
    assert last.role == "user" and last.content == long_text  # committed before the model saw it
    nxt = _turn("--conversation", str(cid), "What colour is the boat?")
    with Store(db) as store:
        messages = store.messages(cid)
        killed = next(m for m in messages if m.content == long_text)
        assert killed.meta.get("unanswered") and killed.meta.get("discarded")
        assert [m.role for m in store.rereadable(cid)] == ["system", "user", "assistant", "user", "assistant"]
        assert consistent(roles(store, cid))
    assert nxt["answer"]


def test_second_writer_on_one_conversation_is_refused_naming_the_first() -> None:
    first = _turn("--new", "Remember: the kite is red.")
    cid = first["conversation_id"]
    repl = spawn("repl", *EVICTING, "--conversation", str(cid), stdin=subprocess.PIPE)
    try:
        def holds() -> bool:
            with Store(paths.db_path(), read_only=True) as store:
                return store.conversation_writer(cid) is not None
        # wait until the REPL holds the conversation, without killing it
        import time  # noqa: PLC0415

        deadline = time.monotonic() + 120
        while not holds():
            assert repl.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        r = cli("ask", *EVICTING, "--conversation", str(cid), "What colour is the kite?")
        assert r.returncode == 1
        one_line_error(r.stderr, f"conversation {cid} is being written by another certchat process",
                       f"pid {repl.pid}", "--new")
        with Store(paths.db_path()) as store:
            assert [m.role for m in store.messages(cid)] == ["system", "user", "assistant"]
            with pytest.raises(ConversationBusyError):
                store.append_user_message(cid, "sneaking in")
        # the first session still writes
        out, err = repl.communicate(b"What colour is the kite?\n", timeout=300)
        assert repl.returncode == 0, err
    finally:
        if repl.poll() is None:
            repl.kill()
    with Store(paths.db_path()) as store:
        assert [m.role for m in store.messages(cid)] == ["system", "user", "assistant", "user", "assistant"]
        assert store.conversation_writer(cid) is None  # released when the REPL quit
