"""The chat UI's pure parts: memory pictures, status line, key remapping, settings, sidebar rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import config as cfg
from agent import events as ev
from memory_store.records import Conversation, SearchHit
from tui import bindings, render, settings
from tui.widgets.conversations import entries


def _memory(**kw: object) -> ev.MemoryView:
    base = dict(model="m", policy="poisson", budget_cells=100, live_cells=80, allocated_cells=1000)
    base.update(kw)
    return ev.MemoryView(**base)  # type: ignore[arg-type]


def test_chart_draws_bars_gate_line_and_marks() -> None:
    certs = [(1, 0.1, False), (2, 0.5, True), (3, None, False), (4, 0.2, False)]
    lines = render.certificate_chart(certs, 0.3, width=10, height=6).plain.split("\n")
    assert len(lines) == 7  # six bar rows and the mark row
    assert all(len(line) == 4 for line in lines)
    columns = ["".join(line[i] for line in lines[:-1]) for i in range(4)]
    # Turn 2 (0.5 ≥ τ) is the tallest bar and reaches the top row; turn 3 has no value.
    assert columns[1][0] != " " and columns[1][-1] == "█"
    assert columns[2].strip(" ─") == "·"
    # The gate line crosses every column that does not reach it, on one row.
    gate_rows = {r for r, line in enumerate(lines[:-1]) if "─" in line}
    assert len(gate_rows) == 1
    row = gate_rows.pop()
    assert lines[row][0] == "─" and lines[row][1] != "─"
    assert lines[-1] == " " + render.GATE_MARK + "  "


def test_chart_colours_breaches_and_keeps_the_newest_turns() -> None:
    certs = [(n, float(n), n % 5 == 0) for n in range(1, 31)]
    chart = render.certificate_chart(certs, 25.0, width=12, height=4)
    lines = chart.plain.split("\n")
    assert all(len(line) == 12 for line in lines)
    assert lines[-1].count(render.GATE_MARK) == 3  # turns 20, 25, 30 are among the last twelve
    error_spans = [s for s in chart.spans if s.style == "$error"]
    assert error_spans, "bars at or above τ use the error colour"
    caption = render.chart_caption(certs, 25.0, width=12).plain
    assert "T19–30" in caption and "6↻" in caption and "τ 25" in caption


def test_chart_without_turns_or_gate() -> None:
    assert render.certificate_chart([], None, 10, 6).plain == "no turns yet"
    lines = render.certificate_chart([(1, None, False)], None, 10, 3).plain.split("\n")
    assert lines == [" ", " ", "·", " "]


def test_retention_groups_messages_into_turns() -> None:
    retained = [(0, "system", 1.0), (1, "user", 0.5), (2, "assistant", 0.25), (3, "user", 1.0)]
    system, turns = render.retention_by_turn(retained)
    assert system == 1.0
    assert turns == [render.TurnRetention(1, 0.5, 0.25), render.TurnRetention(2, 1.0, None)]
    text = render.retention_rows(retained, 34).plain
    assert text.splitlines()[1].startswith("T1") and "50%" in text and "25%" in text
    assert render.retention_rows([], 34).plain == "nothing cached yet"


@pytest.mark.parametrize("share,full", [(0.0, 0), (0.5, 5), (1.0, 10)])
def test_share_bar_width_and_fill(share: float, full: int) -> None:
    bar = render.share_bar(share, 10).plain
    assert len(bar) == 10 and bar.count("█") == full


def test_cells_gauge_marks_the_budget() -> None:
    gauge = render.cells_gauge(_memory(live_cells=500, budget_cells=250), 20).plain
    assert len(gauge) == 20 and gauge[5] == "│" and gauge.count("█") == 9


def test_status_line_compares_certificate_with_gate() -> None:
    mem = _memory(gate_threshold=0.3, tok_per_s=12.34)
    info = render.StatusInfo(model="qwen", policy="poisson", budget="10%", gate="0.3", phase="ready", memory=mem,
                             certificate=0.41)
    line = render.status_line(info)
    assert "cert 0.41 ≥ τ 0.3" in line.plain and "80/1000" in line.plain and "12.3 tok/s" in line.plain
    assert any(s.style == "bold $error" for s in line.spans)
    below = render.status_line(render.StatusInfo("q", "poisson", "10%", "0.3", "ready", mem, certificate=0.1))
    assert "cert 0.1 < τ 0.3" in below.plain
    off = render.status_line(render.StatusInfo("q", "full", "10%", "off", "ready", _memory(budget_cells=None)))
    assert "gate off" in off.plain and "budget –" in off.plain
    assert "evicted K/V" not in off.plain, "nothing said while no rows are kept"
    kept = render.status_line(render.StatusInfo("q", "poisson", "10%", "auto", "ready",
                                                _memory(evicted_rows_bytes=86 << 20)))
    assert "evicted K/V 86 MiB in RAM" in kept.plain


def test_gate_note_says_how_much_history_was_re_read() -> None:
    note = render.gate_note(ev.GateFired("question", 0.52, 0.3, 1234, truncated=True))
    assert "re-read 1234 tokens of history" in note and "0.52 ≥ τ 0.3" in note and "most recent" in note
    # fired because too little was sampled: no "0 ≥ τ" that is not true
    note = render.gate_note(ev.GateFired("question", 0.0, 0.6, 99, uncertified=True))
    assert "too little of the evicted history was sampled" in note and "≥" not in note
    # the second signal fired it: its statistic and τ, not a message it "points at"
    note = render.gate_note(ev.GateFired("question", 0.961, 0.952, 5000, points_at="turn 4", second="question.mean"))
    assert "question.mean 0.961 ≥ 0.952" in note and "points at" not in note


def test_restore_note_names_the_nearest_message_and_counts_the_rest() -> None:
    one = render.restore_note(ev.Restored(("your turn 4 ('My cat is called Purrnickel.')",), 12))
    assert one == f"{render.RESTORE_MARK} brought back your turn 4 ('My cat is called Purrnickel.') (12 tokens) " \
                  "before answering"
    three = render.restore_note(ev.Restored(("your turn 4 ('x')", "your turn 9 ('y')", "the answer at turn 2 ('z')"),
                                            131))
    assert "your turn 4 ('x') and 2 more messages (131 tokens)" in three and "turn 9" not in three


def test_a_deferred_gate_says_its_reading_and_that_the_restore_answers() -> None:
    note = render.deferred_note(ev.GateDeferred("question", 3.21, 2.5))
    assert note == f"{render.RESTORE_MARK} certificate 3.21 ≥ τ 2.5; the restored messages answer"


def test_keymap_accepts_known_ids_and_reports_unknown_ones() -> None:
    good, problems = bindings.keymap({"new_chat": "ctrl+k", "toggle_memory": "f4, ctrl+t", "nope": "x"})
    assert good == {"new_chat": "ctrl+k", "toggle_memory": "f4,ctrl+t"}
    assert len(problems) == 1 and "nope" in problems[0]
    assert bindings.key_for("new_chat", good) == "ctrl+k"
    assert bindings.key_for("help", good) == "f1"
    ids = [k.id for k in bindings.ALL_KEYS]
    assert len(ids) == len(set(ids)), "binding ids are unique"


def test_persist_writes_only_the_changed_setting(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('n_ctx = 4096\n', encoding="utf-8")
    assert settings.persist(path, policy="topk") is None
    loaded = cfg.load(path)
    assert loaded.policy == "topk" and loaded.n_ctx == 4096 and loaded.model == cfg.Config().model
    path.write_text("policy = [", encoding="utf-8")
    problem = settings.persist(path, policy="full")
    assert problem is not None and problem.startswith("settings not saved")


def test_budget_and_gate_validation_messages() -> None:
    assert settings.budget_problem("25%") is None and settings.budget_problem("2048") is None
    assert "budget" in (settings.budget_problem("lots") or "")
    assert settings.gate_problem("off") is None and settings.gate_problem("0.25") is None
    assert "gate" in (settings.gate_problem("-1") or "")


def test_sidebar_entries_match_titles_and_messages() -> None:
    convs = [Conversation(1, "Trip to Oslo", None, {}, "t", "t", 4), Conversation(2, "Cats", None, {}, "t", "t", 2)]
    assert [e.conversation_id for e in entries(convs, None, "")] == [1, 2]
    hits = [SearchHit(2, "Cats", 7, 1, "user", "my [oslo] cat")]
    found = entries(convs, hits, "oslo")
    assert [e.conversation_id for e in found] == [1, 2]
    assert found[0].detail == "title matches" and "my [oslo] cat" in found[1].detail
