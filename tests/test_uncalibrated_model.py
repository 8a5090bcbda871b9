"""A model the gate was not calibrated for fails safe: under gate "auto" an evicting policy keeps the full cache and
says why (the memory view and the status line, a notice in the chat, `ask --json`, `doctor`); an explicit threshold
or "off" evicts as configured. Real models (smollm2-135m is not calibrated, qwen2.5-coder-0.5b is) and real SQLite."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest

from agent import events as ev
from agent import models
from agent.chat.session import ChatSession
from agent.cli import doctor
from agent.config import EVICT_AT, Config
from agent.gate import calibration
from agent.llm.engine import Engine
from memory_store.store import Store
from tests.reliability_support import cli
from tui import render

QWEN = models.REGISTRY["qwen2.5-coder-0.5b"].sha256
SMOLLM = models.REGISTRY["smollm2-135m"].sha256
TURNS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987.",
         "Give me one short sentence about the sea.", "What is my locker code?"]


def _session(engine: Engine, tmp_path: Path, name: str, **changes: object) -> ChatSession:
    # a 48-cell budget from the first turn: any evicting run is far over it after two turns
    config = Config(model="smollm2-135m", n_ctx=2048, n_batch=256, evict_from=0, policy="poisson", budget="48",
                    max_tokens=8, page_size=4, seed=3).replace(**changes)
    return ChatSession(config, Store(tmp_path / f"{name}.db"), engine, "smollm2-135m")


def _chat(s: ChatSession, texts: list[str]) -> list[ev.Event]:
    events: list[ev.Event] = []
    for text in texts:
        s.send(text, on_event=events.append)
    return events


def _notices(events: list[ev.Event]) -> list[str]:
    return [e.text for e in events if isinstance(e, ev.Notice)]


def test_the_calibration_holds_for_the_model_it_was_fitted_on() -> None:
    for evict_at in EVICT_AT:
        assert calibration.covers(QWEN, evict_at), "the shipped records were fitted on qwen2.5-coder-0.5b"
        assert not calibration.covers(SMOLLM, evict_at)
    assert not calibration.covers(None)
    assert calibration.load(calibration.PATH, "turn-end").model_sha256 == QWEN


def test_a_model_is_known_by_its_bytes_not_its_name(small_model: Path, tmp_path: Path) -> None:
    assert models.gguf_sha256(small_model) == SMOLLM  # the verified registry file: the registry's record
    # the same bytes under another name (a user's own path) are hashed, and are the same model
    renamed = tmp_path / "my-model.gguf"
    try:
        os.link(small_model, renamed)
    except OSError:
        pytest.skip("no hard links here")
    assert models.gguf_sha256(renamed) == SMOLLM
    renamed.unlink()
    renamed.write_bytes(small_model.read_bytes()[: 1 << 20])  # other bytes at the same path: hashed anew
    assert models.gguf_sha256(renamed) != SMOLLM


def test_an_uncalibrated_model_keeps_the_full_cache_and_says_why(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path, "auto")  # gate "auto", the default
    events = _chat(s, TURNS)
    view = s.memory_view()
    assert view.full_cache_reason == calibration.UNCALIBRATED
    assert view.full_cache_until is None and view.budget_cells is None
    assert engine.live_cells == engine.next_pos, "nothing was evicted"
    assert s.store.next_eviction_round(s.conversation_id) == 0, "no eviction round was logged"
    assert not engine.readout[0] and (engine.sketch is None or engine.sketch.n_tokens == 0)
    # said once in the chat, with the way to evict anyway
    said = _notices(events)
    assert said == [s.full_cache_notice] and "--gate TAU" in said[0] and "--gate off" in said[0]
    assert all(not e.gate_fired for e in (s.store.turns(s.conversation_id)))
    # the status line carries it
    info = render.StatusInfo(model="smollm2-135m", policy="poisson", budget="48", gate="auto", phase="ready",
                             memory=view)
    assert calibration.UNCALIBRATED in render.status_line(info).plain


@pytest.mark.parametrize("gate", ["5.11", "off"])
def test_an_explicit_gate_evicts_as_configured(engine: Engine, tmp_path: Path, gate: str) -> None:
    s = _session(engine, tmp_path, f"gate-{gate}", gate=gate)
    events = _chat(s, TURNS)
    assert s.memory_view().full_cache_reason is None and s.full_cache_notice is None
    assert engine.live_cells <= 48 < engine.next_pos
    assert s.store.next_eviction_round(s.conversation_id) >= len(TURNS) - 1
    # the one line said is the explicit budget's: smollm2's record certifies no budget (tests/test_risk.py)
    assert s.budget_notice is not None and _notices(events) == [s.budget_notice]


def test_choosing_a_threshold_mid_chat_starts_eviction(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path, "switch")
    _chat(s, TURNS[:3])
    assert engine.live_cells == engine.next_pos
    s.reconfigure(gate="0")  # at τ 0 every turn fires the gate: the re-read is certified, then evicted again
    r = s.send(TURNS[3])
    assert s.memory.full_reason is None and r.budget_cells == 48 and engine.live_cells < engine.next_pos
    assert s.store.next_eviction_round(s.conversation_id) >= 1
    s.reconfigure(gate="auto")
    assert s.memory_view().full_cache_reason == calibration.UNCALIBRATED


def test_a_calibrated_model_evicts_under_the_calibrated_gate(engine: Engine, tmp_path: Path,
                                                              calibrated_for: Callable[[str], None]) -> None:
    calibrated_for("smollm2-135m")
    s = _session(engine, tmp_path, "calibrated")
    events = _chat(s, TURNS)
    # the one line said is the explicit budget's: the record has no certification (tests/test_risk.py)
    assert s.memory_view().full_cache_reason is None and _notices(events) == [s.budget_notice]
    assert engine.live_cells < engine.next_pos and s.store.next_eviction_round(s.conversation_id) > 0
    assert s.gate.threshold() is not None


def test_doctor_says_which_models_are_calibrated(tmp_path: Path) -> None:
    config = Path(os.environ["CERTCHAT_CONFIG"])
    config.write_text('model = "smollm2-135m"\n', encoding="utf-8")
    data = doctor.report()
    assert data["models"]["qwen2.5-coder-0.5b"]["gate_calibrated"] is True
    assert data["models"]["smollm2-135m"]["gate_calibrated"] is False
    assert data["gate"]["calibrated"] is False and calibration.UNCALIBRATED in data["gate"]["note"]
    assert calibration.UNCALIBRATED in doctor.render(data)
    config.write_text('model = "smollm2-135m"\ngate = "0.5"\n', encoding="utf-8")
    assert doctor.report()["gate"]["note"] is None, "an explicit threshold evicts: nothing to warn about"
    config.write_text('model = "qwen2.5-coder-0.5b"\n', encoding="utf-8")
    data = doctor.report()
    assert data["gate"]["calibrated"] is True and data["gate"]["note"] is None


def test_ask_json_carries_the_reason(small_model: Path) -> None:
    fast = ["--model", "smollm2-135m", "--max-tokens", "4", "--threads", "1", "--n-ctx", "1024", "--policy",
            "poisson", "--evict-from", "0", "--json"]
    r = cli("ask", *fast, "hello")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["full_cache_reason"].startswith(calibration.UNCALIBRATED) and "--gate" in line["full_cache_reason"]
    assert line["full_cache_until"] is None and line["budget_cells"] is None
    # the gate off evicts at an explicit budget (budget "auto" would keep the full cache: smollm2's record certifies
    # none, tests/test_risk.py)
    r = cli("ask", *fast, "--gate", "off", "--budget", "25%", "hello")
    assert json.loads(r.stdout.strip().splitlines()[-1])["full_cache_reason"] is None
