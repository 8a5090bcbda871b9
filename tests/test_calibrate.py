"""`certchat calibrate` on a real model (smollm2-135m, which ships uncalibrated) and a tiny recall script: the record
it writes is the one the gate then reads, and a model without a record, or with a rejected one, keeps the full cache.
Real llama.cpp, real SQLite, the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import models
from agent.chat.session import ChatSession
from agent.config import Config
from agent.gate import calibration
from agent.lab.replay.script import load as load_script
from memory_store.store import Store
from tests.reliability_support import cli, one_line_error

RECALL = Path(__file__).resolve().parents[1] / "agent" / "lab" / "replay" / "fixtures" / "recall30" / "seed-02.jsonl"
SMOLLM = models.REGISTRY["smollm2-135m"].sha256


def _tiny_script(tmp_path: Path) -> Path:
    """Five facts, three ordinary turns, three questions about the facts: a recall30 calibration script, cut short."""
    lines = RECALL.read_text(encoding="utf-8").splitlines()
    probes = [i for i, line in enumerate(lines) if '"probe"' in line][:3]
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines[:17] + [x for i in probes for x in lines[i:i + 2]]) + "\n", encoding="utf-8")
    assert len(load_script(path).probes) == 3
    return path


def _session(small_model: Path, tmp_path: Path) -> ChatSession:
    config = Config(model="smollm2-135m", n_ctx=1024, n_batch=256, evict_from=0, policy="poisson", budget="48",
                    max_tokens=8, threads=2)
    return ChatSession.start(config, Store(tmp_path / "chat.db"), small_model, "smollm2-135m")


def test_calibrate_writes_the_record_the_gate_then_reads(small_model: Path, tmp_path: Path) -> None:
    before = _session(small_model, tmp_path)
    try:
        assert before.memory.full_reason == calibration.UNCALIBRATED, "smollm2 ships without a calibration"
        assert "certchat calibrate" in (before.full_cache_notice or "")
        assert before.engine.sketch_spec[0] == ()
    finally:
        before.close()

    done = cli("calibrate", "smollm2-135m", "--scripts", str(_tiny_script(tmp_path)), "--budget", "48",
               "--threads", "2", "--max-tokens", "8", "--min-probe-rate", "0", "--out", str(tmp_path / "work"),
               "--no-progress", "--no-certify", timeout=600)
    assert done.returncode == 0, done.stderr
    path = calibration.record_path(SMOLLM)
    assert str(path) in done.stdout and "smollm2-135m: calibrated" in done.stdout
    record = json.loads(path.read_text(encoding="utf-8"))
    # it says what produced it
    assert record["format"] == "certchat-calibration" and record["model_sha256"] == SMOLLM
    assert "certchat" in record["command"] and "calibrate" in record["command"] and record["machine"]
    [gate] = record["calibrations"]
    assert gate["statistic"] == "sketch.max" and gate["tau"] > 0 and gate["accepted"]
    assert gate["in_sample"]["n_probes"] == 3 and gate["in_sample"]["n_fillers"] > 0
    assert "turn_index" in gate["separation"], "the separation is reported beside the turn-index baseline"
    assert "certification" not in record, "--no-certify fits the gate only"
    layers = tuple(gate["sketch"]["layers"])
    assert 1 <= len(layers) <= 2 and set(layers) <= set(gate["sketch"]["recorded"])
    by_rounds = {row["rounds"]: row for row in record["multipliers"]}
    assert sorted(by_rounds) == ["1", "2+"], "the chat's first eviction round and its later ones each get a fit"
    for row in by_rounds.values():
        assert row["multiplier"] > 0 and len(row["drift"]) == gate["sketch"]["n_layer"]
        assert row["rule"]["k"] in ("pooled", "largest-group")
    cert = by_rounds["2+"]

    # the work folder keeps the captured cells: a refit reads them, without replaying, to the same certificate
    again = cli("calibrate", "smollm2-135m", "--from-results", str(tmp_path / "work"), "--min-probe-rate", "0",
                "--no-progress", timeout=300)
    assert again.returncode == 0, again.stderr
    assert "refitting the certificate on the cells" in again.stderr
    refit = json.loads(path.read_text(encoding="utf-8"))
    assert [r["multiplier"] for r in refit["multipliers"]] == [r["multiplier"] for r in record["multipliers"]]

    calibration.forget()
    found = calibration.for_model(SMOLLM)
    assert found is not None and found.path == path and found.user_made
    after = _session(small_model, tmp_path)
    try:
        assert after.memory.full_reason is None, "a calibrated model evicts"
        assert after.gate.settings.calibrated is not None and after.gate.settings.calibrated.tau == gate["tau"]
        assert after.gate.threshold() == gate["tau"], "a new chat's bar is the calibrated floor"
        assert after.engine.sketch_spec[0] == layers, "the sketch reads the calibrated layers"
        assert after.gate.certificate_form(2).multiplier == pytest.approx(cert["multiplier"])
        assert after.gate.certificate_form(1).multiplier == pytest.approx(by_rounds["1"]["multiplier"])
    finally:
        after.close()


def test_a_rejected_calibration_keeps_the_full_cache(small_model: Path, tmp_path: Path) -> None:
    shipped = json.loads(calibration.PATH.read_text(encoding="utf-8"))["calibrations"]
    records = [{**r, "model": "smollm2-135m", "model_sha256": SMOLLM, "accepted": False,
                "rejected_because": "the gate caught 10% of the calibration probes"} for r in shipped]
    calibration.write_model({"calibrations": records}, calibration.record_path(SMOLLM))
    assert calibration.for_model(SMOLLM) is not None and not calibration.covers(SMOLLM)
    s = _session(small_model, tmp_path)
    try:
        assert s.memory.full_reason == calibration.REJECTED.format(why="the gate caught 10% of the calibration probes")
        assert "certchat calibrate" in (s.full_cache_notice or "")
    finally:
        s.close()


def test_calibrate_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    done = cli("calibrate", "no-such-model")
    assert done.returncode == 1
    one_line_error(done.stderr, "unknown model")
    done = cli("calibrate", "smollm2-135m", "--min-probe-rate", "2")
    assert done.returncode == 1
    one_line_error(done.stderr, "--min-probe-rate")
    assert not calibration.record_path(SMOLLM).exists()


def test_the_rule_lowers_the_bar_for_a_model_whose_questions_read_weakly() -> None:
    """A model whose questions read only 1.7× its ordinary turns misses them under the bar at twice the chat's
    median; the fit then lowers the factor, judged on scripts left out of the floor's fit, and stays within the cap
    on filler firings. A model whose questions read far above its ordinary turns keeps the highest bar."""
    from agent.lab import calibrate

    def steps(probe_value: float) -> list[dict]:
        out = []
        for script in ("a", "b", "c", "d"):
            for turn in range(1, 31):
                kind = "probe" if turn > 25 else "filler"
                value = probe_value if kind == "probe" else 1.0 + 0.01 * ((turn * 7 + ord(script)) % 10)
                out.append({"script": script, "seed": 0, "budget": "10%", "_run": (script, "10%", 0), "turn": turn,
                            "lineno": turn, "kind": kind, "certificate_detail": {"sketch.max": value}})
        return out

    weak, candidates = calibrate.fit_rule(steps(1.7))
    assert weak["factor"] < 2.0 and weak["held_out_probe_rate"] == 1.0
    assert weak["in_sample"]["filler_gate_rate"] <= calibrate.FILLER_CAP
    at_two = next(c for c in candidates if c["factor"] == 2.0 and c["filler_target"] == 0.025)
    assert at_two["held_out_probe_rate"] == 0.0, "at 2 × the median (about 2.1) no question reading 1.7 fires"
    strong, _ = calibrate.fit_rule(steps(9.0))
    assert (strong["factor"], strong["filler_target"]) == (2.0, 0.025)


def test_the_layer_choice_skips_layers_whose_reading_is_not_finite() -> None:
    """A layer whose sketch reading overflows reads NaN on some turn; the gate would fail closed on it at every turn,
    so the calibration never chooses it, however well its finite turns separate."""
    import numpy as np

    from agent.lab.fits.sketch_layers import Scorer, Turn, ranked, readable

    def turn(i: int, kind: str, row: list[float]) -> Turn:
        return Turn("s", i, kind, kind == "filler" and i >= 4, np.array(row), None)

    # layer 0 separates perfectly but reads NaN once; layer 1 separates; layer 2 does not
    turns = [turn(1, "filler", [1.0, 1.0, 5.0]), turn(2, "filler", [1.2, 1.1, 1.0]),
             turn(4, "filler", [float("nan"), 1.3, 4.0]), turn(5, "filler", [1.1, 1.2, 1.0]),
             turn(6, "probe", [9.0, 6.0, 2.0]), turn(7, "probe", [8.0, 7.0, 3.0])]
    scorer = Scorer(turns, 3)
    assert readable(scorer) == [1, 2]
    best = ranked(scorer, readable(scorer), 2)
    assert best[0] == (1,), "the separating finite layer alone beats adding a useless one"
    assert all(0 not in idx for idx in best)


def test_the_transfer_table_pairs_each_probe_with_the_full_caches_answer(tmp_path: Path) -> None:
    """Held-out recall is paired per probe (the same script line under full and under the gate), and the difference
    comes with its paired interval; the gate's firings are counted on probes and on fillers apart."""
    from agent.lab import transfer
    from agent.lab.replay import aggregate, rank_stats

    def step(turn: int, kind: str, correct: bool | None = None, fired: bool = False) -> dict:
        return {"turn": turn, "lineno": 2 * turn, "kind": kind, "correct": correct, "gate_fired": fired}

    full = [step(1, "filler"), step(2, "probe", True), step(3, "probe", True), step(4, "probe", False)]
    gated = [step(1, "filler", fired=True), step(2, "probe", True, True), step(3, "probe", False),
             step(4, "probe", True, True)]
    runs = [{"script": "s", "policy": "full", "budget": "100%", "seed": 0, "steps": full},
            {"script": "s", "policy": "poisson+gate", "budget": "10%", "seed": 0, "steps": gated}]
    (tmp_path / "results.json").write_text(json.dumps({"format": aggregate.FORMAT, "meta": {"command": "x"},
                                                       "runs": runs}), encoding="utf-8")
    row = transfer.heldout(tmp_path)["10%"]
    assert row["paired"] == {"both": 1, "full_only": 1, "default_only": 1, "neither": 0}
    assert row["recall_full"] == row["recall_default"] == pytest.approx(2 / 3)
    assert row["probes_gated"] == pytest.approx(2 / 3) and row["fillers_gated"] == 1.0
    d, lo, hi = row["difference_ci95"]
    assert d == 0.0 and lo < 0 < hi
    assert rank_stats.paired_difference(0, 0, 10) == (0.0, 0.0, 0.0)
    # each held-out set is its own rows, named by its scripts
    assert transfer.seeds_label(["seed-00", "seed-01", "seed-06", "seed-07", "seed-08", "seed-09"]) == \
        "seeds 00, 01, 06–09"
    calibration = {"accepted": True, "layers": [3, 11], "tau": 4.8, "in_sample": {
        "probe_gate_rate": 1.0, "filler_gate_rate": 0.02, "late_filler_gate_rate": 0.05, "n_probes": 60,
        "n_fillers": 240}, "scripts": ["seed-02", "seed-03"], "rule": {"filler_target": 0.025, "factor": 2.0},
        "command": "certchat calibrate m"}
    first, second = transfer.heldout(tmp_path), {"10%": {**row, "scripts": ["seed-18", "seed-19"]}}
    page = transfer.render({"models": [{"model": "m", "calibration": calibration, "heldout": [first, second],
                                        "coverage": None}], "command": "python -m agent.lab.transfer"})
    assert "| m | seeds 02, 03 | calibrated | 3,11 | 4.80 (2%) | 2.0 |" in page
    assert "| m | s | 10% |" in page and "| m | seeds 18, 19 | 10% |" in page
    # the coverage study is checked against the record's k for each protocol's rounds class
    cal = {"multipliers": {"10%": 1.7}, "multipliers_one_shot": {"10%": 1.6}}
    rows = {"10%": {"multi-round": {"multiplier": 1.7}, "one-shot": {"multiplier": 1.6}}}
    assert transfer.stale_coverage({"calibration": cal, "coverage": {"rows": rows}}) == ""
    rows["10%"]["one-shot"]["multiplier"] = 1.86  # measured under the multi-round k of an earlier record
    assert "one-shot k 1.86 (this record's 1.60)" in transfer.stale_coverage({"calibration": cal,
                                                                             "coverage": {"rows": rows}})
