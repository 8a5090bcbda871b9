"""The evicted-key sketch in a real chat (smollm2-135m, the patched library): the engine keeps the keys of
exactly the cells it evicted — through turns, independent probes, re-reads and truncation — and the gate reads
the question's attention on them into every turn's detail."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from agent.chat.session import ChatSession
from agent.config import EVICT_AT, Config, ConfigError
from agent.gate import calibration
from agent.gate.decision import SHARE_FLOOR
from agent.lab.fits.sketch_records import recorded_ratios
from agent.lab.replay import drive
from agent.llm.engine import Engine, EngineSettings
from memory_store.store import Store

FACTS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987."]
FILLERS = [f"Give me one short sentence about the number {i}." for i in range(6)]


def _config(**changes: object) -> Config:
    return Config(model="smollm2-135m", n_ctx=2048, evict_from=0, policy="poisson", budget="64", max_tokens=8, gate="off",
                  page_size=4, seed=3, sketch_layers="10,20").replace(**changes)


def _evicted(engine: Engine) -> set[int]:
    return set(range(engine.next_pos)) - set(engine.cache.positions)


def _stored(engine: Engine) -> set[int]:
    return set(engine.sketch.positions.tolist()) if engine.sketch is not None else set()


@pytest.mark.parametrize("evict_at", EVICT_AT)
def test_the_sketch_holds_exactly_the_evicted_cells(engine: Engine, tmp_path: Path, evict_at: str) -> None:
    s = ChatSession(_config(evict_at=evict_at), Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for text in FACTS + FILLERS:
        drive.forced(s, text, "Noted.")
        assert _stored(engine) == _evicted(engine)
    assert engine.sketch is not None and engine.sketch.n_tokens > 0
    assert engine.sketch.layers == (10, 20)
    # the message each stored key belongs to is the one the log says holds that position
    messages = {m.index: m for m in s.store.messages(s.conversation_id)}
    for pos, index in zip(engine.sketch.positions.tolist(), engine.sketch.messages.tolist()):
        m = messages[index]
        assert m.first_pos <= pos < m.first_pos + len(m.tokens)

    if evict_at == "turn-end":
        # an independent probe is rolled back: so is what its turn evicted (at the question, the probe's logged
        # round would be numbered again after the rollback, which only the replays' store accepts)
        before = _stored(engine)
        drive.independent(s, "What is my locker code?")
        assert _stored(engine) == before == _evicted(engine)

    # a re-read puts the whole history back: the sketch empties, then refills with what the next rounds evict
    s.reconfigure(gate="0", gate_stat="question.max")
    r = s.send("And my cat's name?")
    assert r.gate_fired
    assert _stored(engine) == _evicted(engine)


def test_every_turn_records_the_question_s_attention_on_evicted_messages(engine: Engine, tmp_path: Path) -> None:
    s = ChatSession(_config(), Store(tmp_path / "log.db"), engine, "smollm2-135m")
    results = [drive.forced(s, text, "Noted.") for text in FACTS + FILLERS]
    results.append(s.send("What is my locker code?"))
    sketched = [r for r in results if "sketch.max" in r.certificate_detail]
    assert sketched, "once cells are evicted, every turn reads the sketch"
    last = results[-1].certificate_detail
    assert last["sketch.evicted_mass"] > 0
    assert np.isfinite(last["sketch.max"]) and last["sketch.max"] >= 0
    # implicated messages are mostly evicted earlier messages, most anomalous first
    top = last["sketch.top"]
    question = s.store.get_message(results[-1].user_message_id).index
    assert top and all(isinstance(m, int) and m < question for m, _ in top)
    assert [a for _, a in top] == sorted((a for _, a in top), reverse=True)
    # the turn record keeps the numbers (the studies re-run offline from them)
    assert s.store.turns(s.conversation_id)[-1].cert_stats["sketch.max"] == pytest.approx(last["sketch.max"])
    # per message with evicted cells, its share and baseline per layer: sketch.max comes back from them alone
    # (agent/lab/fits/sketch_layers.py does this for layer subsets)
    assert last["sketch.layers"] == [10, 20]
    records = last["sketch.messages"]
    assert records and all(r["evicted"] > 0 and len(r["share"]) == 2 for r in records.values())
    anomalies = [max(sh / max(b, SHARE_FLOOR) for sh, b in zip(r["share"], r["base"]))
                 for r in records.values() if r["base"] is not None and r["evicted"] > r["live"]]
    assert max(anomalies, default=0.0) == pytest.approx(last["sketch.max"], rel=2e-3)
    ratios = recorded_ratios(records)  # the helper the offline scripts use
    assert max((float(r.max()) for r in ratios.values()), default=0.0) == pytest.approx(last["sketch.max"], rel=2e-3)
    # the shares are a census of the whole history: live cells (biases taken out) and evicted ones, every
    # message counted once, sum to 1 in each layer
    total = np.sum(np.stack(list(s.gate.turn.shares.values())), axis=0)
    np.testing.assert_allclose(total, 1.0, rtol=1e-6)


def test_an_earlier_copy_of_the_question_is_no_anomaly(engine: Engine, tmp_path: Path) -> None:
    question = "Could you tell me how your last message started?"
    s = ChatSession(_config(), Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for text in FACTS + FILLERS[:2] + [question] + FILLERS[2:]:
        drive.forced(s, text, "Noted.")
    copy = next(m.index for m in s.store.messages(s.conversation_id) if m.content == question)
    asked = s.send(question).certificate_detail  # the same words again
    records = asked["sketch.messages"]
    assert records[copy]["evicted"] > records[copy]["live"] and records[copy]["base"] is not None, \
        "the earlier copy is evicted and has a baseline, so sketch.max would range over it"
    assert records[copy].get("repeat") is True
    assert copy not in [m for m, _ in asked["sketch.top"]]
    assert copy not in s.gate.turn.anomalies and copy not in s.gate.turn.excess
    # the offline helpers leave it out too, so studies recompute the statistic the gate read
    ratios = recorded_ratios(records)
    assert copy not in ratios
    assert max((float(r.max()) for r in ratios.values()), default=0.0) == pytest.approx(asked["sketch.max"], rel=2e-3)
    # a question about a fact repeats nothing
    about = s.send("What is my locker code?").certificate_detail["sketch.messages"]
    assert not any(r.get("repeat") for r in about.values())


def test_the_sketch_needs_a_sampled_design_and_valid_layers(engine: Engine, tmp_path: Path) -> None:
    ChatSession(_config(policy="topk"), Store(tmp_path / "a.db"), engine, "smollm2-135m")
    assert engine.sketch is None, "a deterministic design keeps no sketch: the gate reads none"
    with pytest.raises(ValueError, match="sketch_layers"):
        ChatSession(_config(sketch_layers="10,99"), Store(tmp_path / "b.db"), engine, "smollm2-135m")
    with pytest.raises(ConfigError, match="sketch_layers"):
        _config(sketch_layers="ten")
    with pytest.raises(ConfigError, match="sketch_bits"):
        _config(sketch_bits=6)


def test_the_sketch_reads_only_full_attention_layers(model_path: Callable[[str], Path]) -> None:
    """A sliding-window layer never sees an evicted position outside its window, so the sketch cannot read the
    question's attention there: "auto" moves the calibrated depths to full-attention layers, and naming a
    windowed layer is refused with the layers to choose from."""
    default = calibration.load(calibration.PATH, "turn-end")
    assert default is not None
    shipped = default.sketch_layers((0,) * 24)
    assert shipped, "the shipped turn-end calibration reads a sketch"
    assert default.sketch_layers((512,) * 24) == (), "no full-attention layer: no sketch"
    windows = tuple(0 if il in (7, 15, 23) else 512 for il in range(24))
    moved = default.sketch_layers(windows)
    assert moved and set(moved) <= {7, 15, 23}
    for x in shipped:  # each calibrated layer moves to a nearest full-attention one
        nearest = min(abs(f - x) for f in (7, 15, 23))
        assert any(abs(m - x) == nearest for m in moved)
    eng = Engine(EngineSettings(model_path=model_path("gemma3-270m"), n_ctx=512, n_batch=64, threads=2))
    try:
        full = [il for il, w in enumerate(eng.info.layer_windows) if w == 0]
        assert full == [5, 11, 17]
        auto = calibration.fallback_sketch_layers(eng.info.layer_windows)
        assert auto and set(auto) <= set(full)
        eng.set_sketch(auto, 8, 4)
        with pytest.raises(ValueError, match=r"sketch_layers: layers 2,8 .*512-token sliding window.*\(5,11,17\)"):
            eng.set_sketch((2, 5, 8), 8, 4)
    finally:
        eng.close()


def test_a_reopened_conversation_gates_on_the_baselines_and_recent_statistics_it_had(
        engine: Engine, tmp_path: Path, calibrated_for: Callable[[str], None]) -> None:
    calibrated_for("smollm2-135m")  # the calibrated gate's adaptive bar, which the reopened chat must restore
    s = ChatSession(_config(gate="auto"), Store(tmp_path / "log.db"), engine, "smollm2-135m")
    for text in FACTS + FILLERS:
        drive.forced(s, text, "Noted.")
    drive.independent(s, "Tell me a joke.")  # rolled back: neither a baseline nor a recent statistic
    bar = s.gate.threshold()
    first = drive.independent(s, "What is my locker code?").certificate_detail["sketch.messages"]

    # closed and reopened: the history is re-read and evicted anew (another sample, another sketch), but what
    # earlier questions paid each message, and the conversation's recent statistics, come back from the log
    s2 = ChatSession(s.config, s.store, engine, "smollm2-135m", conversation_id=s.conversation_id)
    assert s2.gate.threshold() == pytest.approx(bar)
    again = drive.independent(s2, "What is my locker code?").certificate_detail["sketch.messages"]
    both = sorted(set(first) & set(again))
    assert both, "messages evicted in both samples"
    for m in both:
        assert first[m]["base"] is not None, "nine turns of history give every evicted message a baseline"
        assert again[m]["base"] is not None, "the reopened chat has the baselines back"
        np.testing.assert_allclose(again[m]["base"], first[m]["base"], rtol=1e-3)

    # a fresh gate over the same log would have no baselines: the restore is what carries them
    s2.gate.new_conversation()
    fresh = drive.independent(s2, "What is my locker code?").certificate_detail["sketch.messages"]
    assert all(r["base"] is None for r in fresh.values())
