"""`certchat demo long` end to end on the real small model, a tiny long-chat script and a real SQLite log.

It checks what the demo records and prints (per-turn times, memory samples, the side-by-side
columns, plots, re-rendering merged results), never how fast anything was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import pytest

from agent.config import Config
from agent.gate.certification import Certification, Trial
from agent.lab import cli_replay
from agent.lab.replay import aggregate, longchat, longdemo
from agent.lab.replay.script import Script
from memory_store.store import Store

HAVE_LOCOMO = bool(sorted(longchat.SHARED_LOCOMO.glob("*.json")))


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="certchat")
    cli_replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


def _long_script(model: Path, tmp_path: Path, seed: int, tokens: int) -> tuple[Script, Path]:
    """A generated long-chat script of about ``tokens`` tokens with two probes, saved under ``tmp_path``."""
    counter = longchat.TokenCounter(model)
    try:
        s = longchat.generate(seed, tokens, counter, probes=2)
    finally:
        counter.close()
    return s, longchat.save(s, tmp_path / "scripts", "smollm2-135m")


@pytest.mark.slow  # about 45 s of CPU: four small jobs' worth of turns on smollm2
@pytest.mark.skipif(not HAVE_LOCOMO, reason="the shared LoCoMo data is not on this machine")
def test_demo_long_runs_side_by_side_and_rerenders(small_model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   calibrated_for: Callable[[str], None]) -> None:
    # poisson+gate under the calibrated gate evicts (else: the full cache), at the budget the record certifies for
    # the default risk (else: the full cache only)
    calibrated_for("smollm2-135m", certification=Certification((Trial("50%", 100, 0), Trial("25%", 99, 1))).to_json())
    s, path = _long_script(small_model, tmp_path, seed=5, tokens=700)
    out = tmp_path / "run"
    assert _cli(["demo", "long", "--script", str(path), "--policy", "full,poisson+gate", "--model", "smollm2-135m",
                 "--threads", "1", "--max-tokens", "4", "--no-progress", "--json", "--score-replies",
                 "--out", str(out)]) == 0
    columns = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["columns"]
    # without --budget the demo runs what the chat runs on the model: the cheapest budget its record certifies
    assert [(c["policy"], c["budget"]) for c in columns] == [("full", "100%"), ("poisson+gate", "25%")]
    full, gated = columns
    for c in columns:
        assert c["n_probes"] == 2 and c["turns"] == len(s.steps)
        assert c["turn_s_mean"] > 0 and c["turn_s_p95"] >= c["turn_s_mean"] * 0.5 and c["peak_cells"] > 0
        assert c["rss_peak_mib"] > 0 and sum(n for _, n in c["recall_by_category"].values()) == 2
    assert full["reprefill_tokens"] == 0 and full["gate_probes"] == 0 and full["restored_tokens"] == 0
    assert gated["gate_qfillers"] is not None  # the script's question fillers are known to the table
    pairs = gated["paired_with_full"]
    assert full["paired_with_full"] is None and pairs["n"] == 2
    assert pairs["both"] + pairs["full_only"] == full["n_correct"] and pairs["both"] + pairs["this_only"] == \
        gated["n_correct"]
    doc = aggregate.read_results(out / "results.json")
    for run in doc["runs"]:
        assert len(run["turn_wall_s"]) == len(run["steps"]) == len(run["rss_bytes"])
        assert run["question_fillers"] == s.meta["question_fillers"]
    assert doc["meta"]["demo"] == "long" and "resident set size" in doc["meta"]["host_memory"]
    assert doc["meta"]["design"]["evict_from"] == Config().evict_from
    for name in ("long-table.md", "table.md", "long-turn_time.png", "long-certificate_by_turn.png"):
        assert (out / name).exists(), name
    table = (out / "long-table.md").read_text(encoding="utf-8")
    assert "gate rate: probes / question fillers / other turns" in table and "turn time, mean / p95" in table
    assert "| paired with full: both / full only / this only / neither | — | " in table
    fit = next(line for line in table.splitlines() if "scripted replies' log-prob per token" in line)
    assert all(float(cell) < 0 for cell in fit.strip(" |").split(" | ")[1:])  # both columns scored every reply
    # the same table from the results on disk (as after `replay merge` of shards)
    assert _cli(["demo", "long", "--from-results", str(out), "--json", "--no-plots"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["columns"]
    assert again == columns
    assert longdemo.table(doc).splitlines()[0].startswith("| measure | full | poisson+gate")
    # per conversation: the same run under a second name pools to the same recall and ratio, twice the tokens
    twin = [{**r, "script": "twin"} for r in doc["runs"]]
    per_script = longdemo.by_script_table(aggregate.results_document(doc["meta"], doc["runs"] + twin))
    body = [line for line in per_script.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0] for line in body] == [f"| {s.name}", "| twin", "| all 2 (pooled)"]
    tokens = doc["runs"][0]["summary"]["history_tokens"]
    assert body[0].split(" | ")[1:3] == [f"{tokens:,}", "2"] and body[2].split(" | ")[1:3] == [f"{2 * tokens:,}", "4"]
    ratio = gated["turn_s_mean"] / full["turn_s_mean"]
    for line in body:
        full_cell, gated_cell = line.rstrip(" |").split(" | ")[3:5]
        assert full_cell.startswith(f"{full['recall']:.2f} · {full['turn_s_mean']:.2f} s · ")
        assert gated_cell.startswith(f"{gated['recall']:.2f} · {ratio:.2f}× · {gated['probe_turn_s_mean']:.2f} s · ")


def test_demo_long_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert _cli(["demo", "long", "--history", "lots", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == ("certchat demo: --history: expected a token count like 16k or "
                                               "12000, got 'lots'")
    assert _cli(["demo", "long", "--quick", "--shard", "3/2", "--out", str(tmp_path)]) == 1
    assert "--shard: expected i/n" in capsys.readouterr().err
    assert _cli(["demo", "long", "--script", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert _cli(["demo", "long", "--quick", "--history", "16k", "--out", str(tmp_path)]) == 1
    assert "give one of --quick" in capsys.readouterr().err


def test_paired_counts_and_the_time_bar() -> None:
    """Probes pair by script and turn (each seed of a sampled policy against the full cache's one run); the bar
    is ungated eviction's mean turn time plus a tenth of the full cache's."""
    full = {"answers": {("a", 0, 3): True, ("a", 0, 5): True, ("b", 0, 3): False}, "turn_s_mean": 2.0}
    gated = {"answers": {("a", 0, 3): True, ("a", 0, 5): False, ("b", 0, 3): True, ("a", 1, 3): True,
                         ("c", 0, 1): True}}
    got = longdemo.paired(full, gated)
    assert got is not None
    assert (got["both"], got["full_only"], got["this_only"], got["neither"], got["n"]) == (2, 1, 1, 0, 4)
    d, lo, hi = got["difference_ci95"]
    assert d == 0.0 and lo < 0 < hi
    assert longdemo.time_bar(full, {"turn_s_mean": 1.0}) == pytest.approx(1.2)
    assert longdemo.time_bar(full, None) is None


def test_recall_splits_by_the_facts_age_past_the_trained_context() -> None:
    """A probe whose fact lies further back than the trained context counts as "older", the rest as "within";
    a run of a script that does not run past it splits nothing."""
    def step(turn: int, correct: bool) -> dict:
        return {"turn": turn, "kind": "probe", "correct": correct, "independent": False, "gate_fired": False,
                "reprefill_tokens": 0, "distance": 5, "category": "verbatim"}

    summary = {"decode_s": 1.0, "decode_tokens": 10, "peak_live_cells": 1, "history_tokens": 50}
    past = {"script": "s", "seed": 0, "steps": [step(10, True), step(20, False), step(30, True)], "summary": summary,
            "wall_s": 1.0, "beyond": 1000, "fact_age_tokens": {"10": 4000, "20": 1500, "30": 200}}
    column = longdemo._column([past])
    assert column["recall_by_age"] == {"within 1,000 tokens": (1, 1), "older than 1,000 tokens": (1, 2)}
    plain = {**past, "beyond": None, "fact_age_tokens": {}}
    plain.pop("beyond")
    assert longdemo._column([plain])["recall_by_age"] == {}


def test_scripted_replies_log_probability_by_position_in_the_chat() -> None:
    """Scored replies pool per token into bands of the conversation's length (where each reply was fed); the
    table has a row per band and a dash for a column that scored nothing."""
    def step(turn: int, history: int, total: float | None, n: int) -> dict:
        out = {"turn": turn, "kind": "filler", "independent": False, "gate_fired": False, "reprefill_tokens": 0,
               "history_tokens": history}
        if total is not None:
            out.update(reply_logprob_sum=total, reply_scored_tokens=n)
        return out

    summary = {"decode_s": 1.0, "decode_tokens": 10, "peak_live_cells": 1, "history_tokens": 40_000}
    steps = [step(1, 100, -4.0, 4), step(2, 16_000, -2.0, 1), step(3, 20_000, -9.0, 3), step(4, 39_000, None, 0)]
    run = {"script": "s", "seed": 0, "policy": "poisson", "budget": "10%", "steps": steps, "summary": summary,
           "wall_s": 1.0}
    column = longdemo._column([run])
    assert column["reply_logprob_by_position"] == {"0k–16k": (-6.0 / 5, 5), "16k–32k": (-3.0, 3)}
    assert longdemo._column([{**run, "steps": steps[3:]}])["reply_logprob_by_position"] == {}


@pytest.mark.slow  # about a minute of CPU: two policies run twice on smollm2
@pytest.mark.skipif(not HAVE_LOCOMO, reason="the shared LoCoMo data is not on this machine")
def test_lockstep_takes_turns_and_changes_nothing_a_job_records(small_model: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each job of a lockstep group has an engine of its own: its records equal those of the same job run alone,
    and the log shows the jobs' turns interleaved, one turn of each in turn."""
    s, path = _long_script(small_model, tmp_path, seed=7, tokens=600)
    docs = {}
    for mode in ("alone", "lockstep"):
        out = tmp_path / mode
        assert _cli(["demo", "long", "--script", str(path), "--policy", "full,poisson+gate", "--budget", "25%",
                     "--gate", "0.5", "--model", "smollm2-135m", "--threads", "1", "--max-tokens", "4",
                     "--no-progress", "--no-plots", "--json", "--out", str(out)]
                    + (["--lockstep"] if mode == "lockstep" else [])) == 0
        capsys.readouterr()
        docs[mode] = aggregate.read_results(out / "results.json")
    assert docs["lockstep"]["meta"]["lockstep"] is True and docs["alone"]["meta"]["lockstep"] is False
    fields = ("kind", "answer", "gate_fired", "reprefill_tokens", "restored_tokens", "live_cells", "history_tokens",
              "restore_indices", "evictions", "correct")
    for alone, side in zip(docs["alone"]["runs"], docs["lockstep"]["runs"], strict=True):
        assert (alone["policy"], alone["budget"]) == (side["policy"], side["budget"])
        assert [[st.get(f) for f in fields] for st in alone["steps"]] == [[st.get(f) for f in fields]
                                                                         for st in side["steps"]]
        assert len(side["turn_wall_s"]) == len(side["steps"]) and side["wall_s"] == pytest.approx(
            sum(side["turn_wall_s"]))
    assert any(st["evictions"] for st in docs["lockstep"]["runs"][1]["steps"])  # the gated job did evict

    # in the log the two conversations' user messages alternate: turn k of each before turn k + 1 of either
    store = Store(tmp_path / "lockstep" / "replay.db")
    try:
        by_conversation = [[m.id for m in store.messages(run["conversation_id"]) if m.role == "user"]
                           for run in docs["lockstep"]["runs"]]
    finally:
        store.close()
    first, second = by_conversation
    assert len(first) == len(second) == len(s.steps)
    for k in range(len(first) - 1):
        assert max(first[k], second[k]) < min(first[k + 1], second[k + 1])


def test_the_time_bar_turn_by_turn_pairs_each_turn_with_the_same_turn_of_full_and_ungated() -> None:
    """Each turn less ungated's and a tenth of full's on the same script's turn; scripts without all three, or of
    another length, are left out."""
    full = {"turn_walls": {("a", 0): [2.0, 4.0], ("b", 0): [1.0]}}
    ungated = {"turn_walls": {("a", 0): [1.0, 1.0], ("b", 0): [1.0]}}
    gated = {"turn_walls": {("a", 0): [1.3, 1.7], ("b", 0): [9.0, 9.0], ("c", 0): [1.0, 1.0]}}
    got = longdemo.time_bar_by_turn(full, ungated, gated)
    assert got is not None
    mean, lo, hi, n = got
    assert n == 2 and mean == pytest.approx(0.2) and lo < 0.1 and hi > 0.3  # 1.3 - 1 - 0.2 and 1.7 - 1 - 0.4
    assert longdemo.time_bar_by_turn(full, ungated, {"turn_walls": {("c", 0): [1.0, 1.0]}}) is None
