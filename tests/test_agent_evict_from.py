"""config ``evict_from``: below it an evicting policy runs the full cache (no eviction, no certificate, no gate),
from it on the policy applies; the memory view, `ask --json`, the TUI's status line and replays say and honour it.

Real model (SmolLM2-135M), real SQLite log; behaviour only, never timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import events as ev
from agent.chat.session import ChatSession
from agent.config import Config, ConfigError, load
from agent.lab import bench
from agent.lab.replay import drive, runner
from agent.llm.engine import Engine
from memory_store.store import Store
from tests.reliability_support import cli, one_line_error

EVICT_FROM = 600
FACT = "My locker code is 4172 and my sister's name is Ingrid, she lives in Tromsø by the harbour."


def _session(engine: Engine, tmp_path: Path, name: str, **cfg: object) -> ChatSession:
    config = Config(model="smollm2-135m", n_ctx=2048, n_batch=256, max_tokens=8, page_size=4,
                    **{"policy": "poisson", "budget": "48", "gate": "0", "evict_from": EVICT_FROM, **cfg})
    return ChatSession(config, Store(tmp_path / f"{name}.db"), engine, "smollm2-135m")


def test_evict_from_is_validated_naming_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match=r"^evict_from: "):
            Config(evict_from=bad).validate()  # type: ignore[arg-type]
    path = tmp_path / "config.toml"
    path.write_text('evict_from = "4k"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^evict_from: expected int"):
        load(path)
    path.write_text("evict_from = 0\n", encoding="utf-8")
    assert load(path).evict_from == 0


def test_below_evict_from_the_chat_is_the_full_cache_then_the_policy_applies(engine: Engine,
                                                                              tmp_path: Path) -> None:
    """τ = 0 fires on any certificate, so a gate that read one would fire: below evict_from it never does, nothing
    is evicted, the answers are the full cache's token for token, and the view says "full cache until"; from
    evict_from on the cache is evicted and the gate reads (and fires on) the certificate."""
    full = _session(engine, tmp_path, "full", policy="full")
    full_answers = []
    while engine.next_pos < EVICT_FROM - 150:
        drive.forced(full, FACT, "Noted, thank you for telling me.")
        full_answers.append(full.send("What is my locker code?").answer)

    s = _session(engine, tmp_path, "gated")
    answers: list[str] = []
    while engine.next_pos < EVICT_FROM - 150:
        drive.forced(s, FACT, "Noted, thank you for telling me.")
        r = s.send("What is my locker code?")
        answers.append(r.answer)
        assert not r.gate_fired and r.reprefill_tokens == 0
        assert r.certificate is None, "no certificate is read for the full cache"
        assert r.live_cells == engine.next_pos and r.budget_cells is None
        view = s.memory_view()
        assert view.full_cache_until == EVICT_FROM and view.budget_cells is None
    assert answers == full_answers
    assert s.store.eviction_rounds(s.conversation_id) == []

    s.reconfigure(gate="off")
    while engine.next_pos < EVICT_FROM + 100:
        r = drive.forced(s, FACT, "Noted, thank you for telling me.")
    assert r.live_cells < engine.next_pos, "past evict_from the turn-end eviction ran"
    assert r.budget_cells == 48 and s.memory_view().full_cache_until is None
    assert s.store.eviction_rounds(s.conversation_id)
    s.reconfigure(gate="0")
    r = s.send("What is my locker code?")
    assert r.certificate is not None and r.gate_fired


def test_evict_from_zero_evicts_from_the_first_turn(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path, "zero", evict_from=0, gate="off")
    for _ in range(3):
        r = drive.forced(s, FACT, "Noted.")
    assert r.live_cells < engine.next_pos and s.memory_view().full_cache_until is None


def test_eviction_starts_before_the_full_cache_fills_the_context(engine: Engine, tmp_path: Path) -> None:
    """A full cache that filled the context would lose old messages to a truncated re-read, evicted by no policy:
    eviction starts once the cache could no longer take a turn (n_ctx less n_batch and max_tokens), whatever
    evict_from says."""
    s = _session(engine, tmp_path, "late", evict_from=100_000, gate="off")
    assert s.memory_view().full_cache_until == 2048 - (256 + 8 + 16)
    seen: list[ev.Event] = []
    while engine.next_pos < 2048 - 256:
        r = drive.forced(s, FACT, "Noted.", on_event=seen.append)
    assert r.live_cells < engine.next_pos and s.memory_view().full_cache_until is None
    # (the one notice said is the explicit budget's: smollm2's record certifies none, tests/test_risk.py)
    assert not [e for e in seen if isinstance(e, ev.Notice) and e.text != s.budget_notice], "no truncated re-read"


def test_a_reopened_long_conversation_evicts_by_its_next_turn(engine: Engine, tmp_path: Path) -> None:
    s = _session(engine, tmp_path, "reopen", gate="off")
    while engine.next_pos < EVICT_FROM - 40:
        drive.forced(s, FACT, "Noted.")
    s2 = ChatSession(s.config, s.store, engine, "smollm2-135m", conversation_id=s.conversation_id)
    while engine.next_pos < EVICT_FROM + 60:
        r = s2.send("What is my locker code?")
    assert r.answer and r.live_cells < engine.next_pos


def test_the_status_words() -> None:
    assert ev.full_cache_words(4096) == "full cache until 4k tokens"
    assert ev.full_cache_words(1500) == "full cache until 1.5k tokens"
    assert ev.full_cache_words(600) == "full cache until 600 tokens"


def test_replay_variants_take_evict_from() -> None:
    assert runner.variant_overrides("poisson+gate@evict_from=0") == {"evict_from": 0}
    assert runner.parse_policies("full,poisson+gate@evict_from=0") == ["full", "poisson+gate@evict_from=0"]
    with pytest.raises(ConfigError, match="evict_from"):
        runner.parse_policies("poisson@evict_from=-5")


def test_crossover_is_the_first_length_from_which_eviction_never_loses() -> None:
    def rows(pairs: dict[int, tuple[float, float]]) -> list[dict[str, object]]:
        return [r for h, (f, e) in pairs.items() for r in ({"history": h, "arm": "full", "turn_ms_normal": f},
                                                          {"history": h, "arm": "evicted 10%", "turn_ms_normal": e})]
    assert bench.crossover(rows({1024: (1.0, 2.0), 2048: (2.0, 1.7), 4096: (3.0, 2.0)})) == 2048
    assert bench.crossover(rows({1024: (1.0, 0.8), 2048: (2.0, 2.1), 4096: (3.0, 2.0)})) == 4096
    # within the margin is not paying: a ratio of two single measurements moves by about a tenth
    assert bench.crossover(rows({1024: (1.0, 0.95), 2048: (2.0, 1.7)})) == 2048
    assert bench.crossover(rows({1024: (1.0, 2.0), 2048: (2.0, 2.1)})) is None


def test_the_length_sweep_runs_each_arm_from_the_same_history(small_model: Path) -> None:
    rows = bench.length_sweep(small_model, "smollm2-135m", 1, (384,))
    by = {r["arm"]: r for r in rows}
    assert set(by) == {a.name for a in bench.ARMS}
    assert by["full"]["history_actual"] == by["evicted 10%"]["history_actual"] >= 384 - 64
    # the full arm keeps every cell of its growing history; the evicted arm holds about a tenth of it
    assert by["full"]["live_cells"] > by["full"]["history_actual"]
    assert by["evicted 10%"]["live_cells"] < by["full"]["live_cells"] / 2
    text = bench.render({"model": "smollm2-135m", "threads": 1, "cpu_count": 2, "history_tokens": 384,
                         "length_sweep": rows})
    assert "evicted 10%" in text and "384" in text


def test_ask_json_says_full_cache_until(small_model: Path) -> None:
    # an explicit τ and budget: under gate "auto" a model the gate is not calibrated for runs the full cache at any
    # length (tests/test_uncalibrated_model.py), and so does budget "auto" on a model whose record certifies none
    # (tests/test_risk.py)
    fast = ["--model", "smollm2-135m", "--max-tokens", "4", "--threads", "1", "--n-ctx", "1024", "--gate", "0",
            "--budget", "25%"]
    r = cli("ask", *fast, "--policy", "poisson", "--json", "hello")
    assert r.returncode == 0, r.stderr
    # the default evict_from, or the length at which the full cache could no longer take a turn
    assert json.loads(r.stdout.strip().splitlines()[-1])["full_cache_until"] == min(Config().evict_from,
                                                                                   1024 - (512 + 4 + 16))
    r = cli("ask", *fast, "--policy", "poisson", "--evict-from", "0", "--json", "hello")
    assert json.loads(r.stdout.strip().splitlines()[-1])["full_cache_until"] is None
    r = cli("ask", *fast, "--policy", "full", "--json", "hello")
    assert json.loads(r.stdout.strip().splitlines()[-1])["full_cache_until"] is None
    r = cli("ask", *fast, "--evict-from", "-1", "hello")
    assert r.returncode != 0
    one_line_error(r.stderr, "evict_from: must be a token count")
