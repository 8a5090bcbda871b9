"""Reopening a chat from its saved state (smollm2-135m, greedy, a real SQLite log): it goes on token for token as
the chat never closed would, with evictions and gated re-reads before and after; every reason a state cannot
serve falls back to re-reading the log and says so; a writer killed mid-write leaves the previous state or none;
states are pruned least-recently-used under the disk budget and go with their conversation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from agent import events as ev
from agent.chat import resume, saved_state
from agent.chat.saved_state import SavedState, SavedStates, StateError
from agent.chat.session import ChatSession
from agent.cli import main as cli
from agent.config import Config
from agent.llm.engine import Engine, EngineSettings
from memory_store.store import Store

FIRST = ["My locker code is 4172. Remember it.", "I like sailing on the lake near Oslo every summer with my brother.",
         "My cat is called Purrnickel and she is grey.", "The meeting is on Tuesday at 3pm in room 12.",
         "What is my locker code?"]
THEN = ["What is my cat called?", "Where do I go sailing?", "When is the meeting?", "What is my locker code?"]


def _config(**changes: object) -> Config:
    # a 64-cell budget from the first turn, and a gate at τ = 0 that re-reads on every evicted turn: full re-reads
    # at first, targeted ones once messages have baselines. No evicted rows: a saved state carries none, so a
    # reopened chat decodes what it re-reads, and the chat kept open must too for the two to agree token for token
    base = Config(model="smollm2-135m", n_ctx=2048, n_batch=256, threads=2, policy="poisson", budget="64", gate="0",
                  max_tokens=24, temperature=0.0, seed=0, evict_from=0, evicted_rows_mb=0)
    return base.replace(**changes)


def _engine(path: Path) -> Engine:
    return Engine(EngineSettings(model_path=path, n_ctx=2048, n_batch=256, threads=2))


def _saver(db: Path, model: str = "smollm2", budget_mb: int = 64) -> resume.Saver:
    return resume.Saver(SavedStates.beside(db, budget_mb), model, "patch-level")


def _turn(r: ev.TurnResult) -> tuple:
    return (r.answer, r.answer_tokens, r.certificate, r.gate_fired, r.reread_path, tuple(r.reread_messages),
            r.live_cells, r.reprefill_tokens)


def _cache(engine: Engine) -> tuple:
    sketch = engine.sketch.positions.tolist() if engine.sketch is not None else []
    return list(engine.cache.positions), list(engine.cache.tokens), list(engine.cache.logpi), sketch, engine.rounds


def test_a_resumed_chat_goes_on_as_the_chat_never_closed(small_model: Path, tmp_path: Path) -> None:
    eng = _engine(small_model)
    try:
        kept = ChatSession(_config(), Store(tmp_path / "kept.db"), eng, "smollm2-135m")
        want = [_turn(kept.send(text)) for text in FIRST]
        want_then, want_cache = [], []
        for text in THEN:
            want_then.append(_turn(kept.send(text)))
            want_cache.append(_cache(eng))
    finally:
        eng.close()
    assert any(t[3] for t in want), "the gate re-read the history before the close"
    assert {t[4] for t in want_then} >= {"targeted"}, "and re-reads after it"

    db = tmp_path / "closed.db"
    eng = _engine(small_model)
    try:
        s = ChatSession(_config(), Store(db), eng, "smollm2-135m", saver=_saver(db))
        got = [_turn(s.send(text)) for text in FIRST]
        cid = s.conversation_id
        s.store.close()
    finally:
        eng.close()
    assert got == want
    assert saved_state.state_dir(db).joinpath(f"conversation-{cid}.state").is_file()

    eng = _engine(small_model)  # a new process would load the model afresh
    try:
        s = ChatSession(_config(), Store(db), eng, "smollm2-135m", conversation_id=cid, saver=_saver(db))
        assert s.opened is not None and s.opened.resumed and s.opened.words() == "resumed"
        assert s.memory_view().opened == "resumed"
        for text, turn, cache in zip(THEN, want_then, want_cache):
            assert _turn(s.send(text)) == turn
            assert _cache(eng) == cache
        # the TUI's chat list reopens through open(): it says which path ran
        seen: list[ev.Event] = []
        s.open(cid, on_event=seen.append)
        assert [e.text for e in seen if isinstance(e, ev.Notice)] == ["resumed"]
        assert _cache(eng) == want_cache[-1]
    finally:
        eng.close()


def _closed_chat(small_model: Path, db: Path, **changes: object) -> int:
    """A three-turn evicted chat whose state is saved, closed."""
    eng = _engine(small_model)
    try:
        s = ChatSession(_config(**changes), Store(db), eng, "smollm2-135m", saver=_saver(db))
        for text in FIRST[:3]:
            s.send(text)
        s.store.close()
        return s.conversation_id
    finally:
        eng.close()


def _reopen(engine: Engine, db: Path, cid: int, saver: resume.Saver | None = None, **changes: object) -> ev.Opened:
    s = ChatSession(_config(**changes), Store(db), engine, "smollm2-135m", conversation_id=cid,
                    saver=saver or _saver(db))
    assert s.opened is not None
    assert s.send("What is my locker code?").answer  # the chat goes on either way
    return s.opened


def test_each_reason_a_state_cannot_serve_falls_back_to_the_log(small_model: Path, engine: Engine,
                                                                 tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    cid = _closed_chat(small_model, db)
    path = saved_state.state_dir(db) / f"conversation-{cid}.state"
    good = path.read_bytes()

    opened = _reopen(engine, db, cid, budget="128")
    assert not opened.resumed and opened.reread_tokens > 0
    assert "another budget 64 → 128" in opened.reason
    assert opened.words().startswith("re-read ") and "budget 64 → 128" in opened.words()

    path.write_bytes(good)
    opened = _reopen(engine, db, cid, saver=_saver(db, model="another-gguf"))
    assert not opened.resumed and "another model" in opened.reason

    path.unlink()
    opened = _reopen(engine, db, cid)
    assert not opened.resumed and opened.reason == "no saved state"

    path.write_bytes(good[: len(good) // 2])
    assert "truncated" in _reopen(engine, db, cid).reason

    damaged = bytearray(good)
    damaged[-100] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert "damaged" in _reopen(engine, db, cid).reason

    # the log moved on without the state: a message logged after it was saved (a crash between the log's commit
    # and the save, or a turn of an older certchat)
    path.write_bytes(good)
    with Store(db) as store:
        store.append_message(cid, "user", "Also, my bike is blue.")
        store.append_message(cid, "assistant", "Noted.")
    opened = _reopen(engine, db, cid)
    assert not opened.resumed and "moved on" in opened.reason
    # the re-read saved a fresh state, which the next reopening resumes
    assert _reopen(engine, db, cid).resumed


def test_the_cache_is_checked_against_the_log_token_by_token(small_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    cid = _closed_chat(small_model, db)
    saver = _saver(db)
    eng = _engine(small_model)
    try:
        s = ChatSession(_config(), Store(db), eng, "smollm2-135m", saver=saver)
        state = saver.load(cid, saver.key(s.config, eng, s.gate.statistic), threads=2)
        rereadable = Store(db).rereadable(cid)
        assert resume.check_against_log(state, rereadable) is None
        snap = state.engine
        bad = list(snap.tokens)
        bad[len(bad) // 2] += 1
        forged = resume.SessionState(state.conversation_id, state.last_message_id, state.segments,
                                     type(snap)(snap.state, snap.positions, bad, snap.segments, snap.logpi,
                                                snap.next_pos, snap.sketch, snap.spans, snap.held, snap.reinserted,
                                                snap.rounds),
                                     state.memory, state.gate)
        assert "differ from the log's" in (resume.check_against_log(forged, rereadable) or "")
    finally:
        eng.close()


def _state(n: int, tag: int) -> SavedState:
    return SavedState({"model": "m"}, {"tag": tag}, {"a": np.full(n, tag, dtype=np.int64)})


WRITER = """
import sys
import numpy as np
from pathlib import Path
from agent.chat.saved_state import SavedState, write
path = Path(sys.argv[1])
for tag in range(1, 10**6):
    write(path, SavedState({"model": "m"}, {"tag": tag}, {"a": np.full(2_000_000, tag, dtype=np.int64)}))
    print(tag, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_the_previous_state_or_none(tmp_path: Path) -> None:
    path = tmp_path / "states" / "conversation-1.state"
    root = Path(__file__).resolve().parents[1]
    for delay in (0.05, 0.3, 0.7, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=root, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(root)})
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        written = proc.communicate()[0].split()
        proc.wait()
        if not path.exists():
            assert not written, "a completed write left a file"
            continue
        state = saved_state.read(path)  # never a half-written file
        tag = state.meta["tag"]
        assert written and tag >= int(written[-1]) and np.all(state.arrays["a"] == tag)


def test_states_are_pruned_least_recently_used_under_the_budget(tmp_path: Path) -> None:
    states = SavedStates(tmp_path / "s", budget=3 * 8_300)
    for cid in (1, 2, 3):
        states.save(cid, _state(1000, cid))
        os.utime(states.path(cid), (cid, cid))  # distinct ages whatever the clock's resolution
    assert sorted(states.sizes()) == [1, 2, 3]
    states.load(1)  # resuming marks it used: 2 is now the oldest
    states.save(4, _state(1000, 4))
    assert sorted(states.sizes()) == [1, 3, 4]
    # one state over the whole budget is not kept at the expense of the others forever: it goes first next time
    big = SavedStates(tmp_path / "s", budget=8_300)
    big.save(5, _state(1000, 5))
    assert sorted(big.sizes()) == [5]
    with pytest.raises(StateError, match="no saved state"):
        big.load(1)
    # states of conversations the log no longer has go too
    assert big.prune(existing=[]) == [5] and big.sizes() == {}


def test_deleting_a_conversation_deletes_its_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "log.db"
    with Store(db) as store:
        conv = store.create_conversation(title="Cats")
    states = SavedStates.beside(db, 64)
    states.save(conv.id, _state(10, 1))
    assert cli.main(["log", "--db", str(db), "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["state_bytes"] == states.sizes()[conv.id]
    assert cli.main(["log", "--db", str(db), "delete", str(conv.id)]) == 0
    assert states.sizes() == {}
    with Store(db) as store:
        assert store.list_conversations() == []
