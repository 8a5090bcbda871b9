"""Summaries, aggregates, the --json line, shard merging, the Markdown table and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab.replay import aggregate, report
from agent.lab.replay.aggregate import ResultsError


def step(turn: int, kind: str, *, correct: bool | None = None, distance: int | None = None, gate: bool = False,
         history: int = 100, reprefill: int = 0, cert: float | None = None, tokens: int = 0, ms: float = 0.0,
         peak: int = 50, f1: float | None = None) -> dict:
    s = {"turn": turn, "lineno": turn, "kind": kind, "independent": False, "forced": tokens == 0,
         "user_tokens": 10, "history_tokens": history, "live_cells": peak, "budget_cells": 10, "peak_cells": peak,
         "evictions": 1, "certificate": cert, "certificate_detail": {"question": cert}, "gate_threshold": 0.5,
         "gate_fired": gate, "gate_events": [], "reprefill_tokens": reprefill, "answer_tokens": tokens,
         "decode_ms": ms, "prefill_ms": 1.0, "logprob_mean": None, "stop": "eog"}
    if kind == "probe":
        s.update({"question": "q", "expected": ["x"], "answer": "a", "correct": correct, "f1": f1,
                  "reference": None, "fact_turn": turn - distance if distance is not None else None,
                  "distance": distance, "category": None})
    return s


def run(policy: str, budget: str, seed: int, steps: list[dict], script: str = "a", protocol: str = "multi-round",
        wall: float = 2.0) -> dict:
    r = {"script": script, "source": script, "policy": policy, "budget": budget, "seed": seed,
         "protocol": protocol, "wall_s": wall, "steps": steps, "gate_threshold": 0.5}
    r["summary"] = aggregate.summarize(r)
    return r


def _runs() -> list[dict]:
    a = [step(1, "fact", history=100), step(2, "filler", history=200, gate=True, reprefill=200),
         step(3, "probe", correct=True, distance=2, history=300, tokens=10, ms=500.0, peak=300, cert=0.9),
         step(30, "probe", correct=False, distance=29, history=400, tokens=10, ms=500.0, cert=0.1)]
    b = [step(1, "fact"), step(26, "probe", correct=True, distance=25, tokens=20, ms=500.0)]
    return [run("poisson+gate", "10%", 0, a, "a"), run("poisson+gate", "10%", 0, b, "b"),
            run("poisson+gate", "10%", 1, b, "b"), run("full", "100%", 0, b, "b")]


def test_summary_of_one_run() -> None:
    s = _runs()[0]["summary"]
    assert s["n_probes"] == 2 and s["recall"] == 0.5
    assert s["n_probes_distance_ge_25"] == 1 and s["recall_distance_ge_25"] == 0.0
    assert s["gate_rate"] == 0.25 and s["gate_rate_fillers"] == 1.0 and s["gate_rate_probes"] == 0.0
    assert s["reprefill_tokens"] == 200 and s["reprefill_tokens_every_turn"] == 1000
    assert s["decode_tok_s"] == pytest.approx(20.0) and s["peak_live_cells"] == 300


def test_aggregate_pools_scripts_per_policy_budget_seed() -> None:
    rows = aggregate.aggregate(_runs())
    # full first (budget-free), then by budget and policy
    assert [(r["policy"], r["budget"], r["seed"]) for r in rows] == [
        ("full", "100%", 0), ("poisson+gate", "10%", 0), ("poisson+gate", "10%", 1)]
    first = rows[1]
    assert first["n_probes"] == 3 and first["recall"] == pytest.approx(2 / 3)
    assert first["recall_distance_ge_25"] == pytest.approx(0.5) and first["n_scripts"] == 2
    assert first["decode_tok_s"] == pytest.approx(40 / 1.5)
    line = json.loads(aggregate.json_line(rows))
    assert list(line) == ["runs"]
    assert list(line["runs"][0])[:len(aggregate.JSON_KEYS)] == list(aggregate.JSON_KEYS)


def test_table_averages_seeds() -> None:
    t = aggregate.table(aggregate.aggregate(_runs()))
    gated = next(r for r in t if r["policy"] == "poisson+gate")
    assert gated["seeds"] == 2 and gated["recall"] == pytest.approx((2 / 3 + 1.0) / 2)
    assert gated["recall_sd"] is not None


def test_merge_deduplicates_and_refuses_mixed_models(tmp_path: Path) -> None:
    runs = _runs()
    meta = {"model": "m", "shard": "1/2"}
    aggregate.write_results(tmp_path / "s1" / "results-shard-1-of-2.json", meta, runs[:2])
    aggregate.write_results(tmp_path / "s2" / "results-shard-2-of-2.json", {**meta, "shard": "2/2"}, runs[1:])
    files = aggregate.result_files([tmp_path / "s1", tmp_path / "s2"])
    merged_meta, merged = aggregate.merge([aggregate.read_results(f) for f in files])
    assert len(merged) == 4 and merged_meta["merged_from"] == ["1/2", "2/2"] and "shard" not in merged_meta
    aggregate.write_results(tmp_path / "s3" / "results.json", {"model": "other"}, runs[:1])
    with pytest.raises(ResultsError, match="different models"):
        aggregate.merge([aggregate.read_results(f) for f in aggregate.result_files([tmp_path / "s1", tmp_path / "s3"])])


def test_a_gzip_compressed_results_file_reads_as_the_plain_one(tmp_path: Path) -> None:
    import gzip
    import shutil

    aggregate.write_results(tmp_path / "plain" / "results.json", {"model": "m"}, _runs())
    (tmp_path / "packed").mkdir()
    with open(tmp_path / "plain" / "results.json", "rb") as src, gzip.open(tmp_path / "packed" / "results.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    [packed] = aggregate.result_files([tmp_path / "packed"])
    assert packed.name == "results.json.gz"
    assert aggregate.read_results(packed) == aggregate.read_results(tmp_path / "plain" / "results.json")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ResultsError, match="not a readable results file"):
        aggregate.read_results(tmp_path / "bad.json.gz")


def test_results_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text('{"runs": []}')
    with pytest.raises(ResultsError, match="not a certchat replay results file"):
        aggregate.read_results(tmp_path / "results.json")
    with pytest.raises(ResultsError, match="no such file or folder"):
        aggregate.result_files([tmp_path / "nothing-here"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResultsError, match="no results"):
        aggregate.result_files([tmp_path / "empty"])


def test_markdown_table_states_its_provenance_and_plots_are_written(tmp_path: Path) -> None:
    meta = {"model": "qwen", "machine": "2 CPU cores", "budgets": ["10%"], "seeds": 2, "command": "certchat replay x"}
    doc = aggregate.results_document(meta, _runs())
    md = report.markdown_table(doc["aggregate"], meta)
    assert "| poisson+gate (certchat) | 10% | 0.83 ± 0.24 |" in md
    assert "model `qwen`" in md and "2 CPU cores" in md and "`certchat replay x`" in md
    files = report.plots(doc, tmp_path)
    assert {f.name for f in files} == {"recall.png", "recall_by_distance.png", "certificate_by_turn.png"}
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
