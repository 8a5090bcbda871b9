"""The certificate studies' statistics on constructed results whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agent.lab.replay import aggregate, rank_stats, studies


def test_auc_values() -> None:
    assert rank_stats.auc([3, 4, 5], [0, 1, 2]) == 1.0
    assert rank_stats.auc([0, 1], [2, 3]) == 0.0
    assert rank_stats.auc([1, 1], [1, 1]) == 0.5
    assert rank_stats.auc([2, 0], [1]) == 0.5
    assert rank_stats.auc([], [1]) is None and rank_stats.auc([1, None, math.nan], [0]) == 1.0
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(1, 1, 400), rng.normal(0, 1, 400)
    # the Mann-Whitney AUC of two unit normals one sd apart is Φ(1/√2) ≈ 0.76
    assert rank_stats.auc(pos, neg) == pytest.approx(0.76, abs=0.04)
    lo, hi = rank_stats.auc_ci(list(pos), list(neg), n_boot=200)
    assert lo < rank_stats.auc(pos, neg) < hi


def test_spearman() -> None:
    assert rank_stats.spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert rank_stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_stats.spearman([1, 1, 1], [1, 2, 3]) is None


def _step(lineno: int, kind: str, correct: bool | None, cert: float | None, logprob: float | None = None) -> dict:
    return {"turn": lineno, "lineno": lineno, "kind": kind, "correct": correct, "certificate": cert,
            "certificate_detail": {"question.q": cert, "answer.max": None if cert is None else -cert},
            "logprob_mean": logprob, "gate_fired": False, "history_tokens": 10, "reprefill_tokens": 0,
            "answer_tokens": 1, "decode_ms": 1.0, "peak_cells": 1, "distance": 25}


def _runs(full_steps: list[dict], pois_steps: list[dict]) -> dict:
    """A results document: one full run and one poisson run (10%) of script "s"."""
    runs = []
    for policy, steps in (("full", full_steps), ("poisson", pois_steps)):
        r = {"script": "s", "policy": policy, "budget": "100%" if policy == "full" else "10%", "seed": 0,
             "protocol": "multi-round", "steps": steps, "wall_s": 1.0}
        r["summary"] = aggregate.summarize(r)
        runs.append(r)
    return aggregate.results_document({"model": "m"}, runs)


def _doc() -> dict:
    """8 probes: full right on 0–5; poisson right on 0–1, wrong on 2–7 (2–5 induced, 6–7 inherent).
    The certificate is high exactly on the induced failures; fillers score low except one."""
    full_steps, pois_steps = [], []
    for i in range(8):
        full_steps.append(_step(i, "probe", i < 6, None, -0.1))
        induced = 2 <= i < 6
        pois_steps.append(_step(i, "probe", i < 2, 0.9 if induced else 0.1, -0.5 if i % 2 else -0.2))
    for j in range(8, 18):
        full_steps.append(_step(j, "filler", None, None))
        pois_steps.append(_step(j, "filler", None, 0.95 if j == 8 else 0.05))
    return _runs(full_steps, pois_steps)


def test_attribution_separates_induced_from_inherent() -> None:
    (row,) = studies.attribution(_doc())
    assert (row["n_induced"], row["n_inherent"]) == (4, 2)
    assert row["statistics"]["question.q"]["auc"] == 1.0
    assert row["statistics"]["answer.max"]["auc"] == 0.0
    assert row["confidence"]["auc"] == 0.5  # −log-prob alternates: no information


def test_gating_curves_against_random_and_confidence() -> None:
    (row,) = studies.gating(_doc(), rates=(0.25, 0.5, 1.0))
    assert row["recall_no_gate"] == 0.25 and row["recall_full"] == 0.75
    q = row["statistics"]["question.q"]
    # gating 50% of probes by the certificate picks the 4 induced failures: full-cache recall
    assert [p["recall"] for p in q["over_probes"]] == [0.5, 0.75, 0.75]
    assert [r["recall"] for r in row["random"]] == pytest.approx([0.375, 0.5, 0.75])
    assert q["gain_ratio_vs_random_over_probes"][1] == pytest.approx((0.75 - 0.25) / (0.5 - 0.25))
    # over all 18 turns at r = 0.25 (4 slots): the loud filler takes one, the four induced probes
    # (tied at 0.9) share three, so each is gated with probability 3/4
    assert q["over_turns"][0]["recall"] == pytest.approx(0.25 + 4 * (3 / 4) / 8)
    assert q["gain_ratio_vs_random"][0] == pytest.approx((q["over_turns"][0]["recall"] - 0.25) / (0.375 - 0.25))
    # confidence exists on probes only (fillers are teacher-forced): no turn-rate comparison
    assert row["statistics"]["confidence"]["over_turns"] == []
    assert row["statistics"]["confidence"]["gain_ratio_vs_random"] is None
    assert q["auc_probe_vs_filler"] == pytest.approx(
        rank_stats.auc([0.9] * 4 + [0.1] * 4, [0.95] + [0.05] * 9))
    # the later half of the script (turns 9–17 of 17) leaves out the loud filler at turn 8
    assert q["auc_probe_vs_late_filler"] == pytest.approx(rank_stats.auc([0.9] * 4 + [0.1] * 4, [0.05] * 9))
    # the fillers come after the probes here: turn position alone scores 0 against them either way
    assert row["statistics"]["turn_index"]["auc_probe_vs_late_filler"] == 0.0
    # over all turns the one loud filler takes a gate slot
    at = q["over_turns"][0]
    assert at["filler_rate"] == pytest.approx(0.1)


def test_calibration_caps_the_filler_rate() -> None:
    cal = studies.calibrate(_doc(), "question.q", filler_target=0.1)
    assert cal["tau"] is not None and 0.05 < cal["tau"] <= 0.95
    assert cal["in_sample"]["filler_gate_rate"] <= 0.1
    assert cal["in_sample"]["recall"] == 0.75
    by_probes = studies.calibrate(_doc(), "question.q", probe_target=1.0)
    # the largest τ that still gates every eviction-broken probe (all four sit at 0.9)
    assert by_probes["tau"] == 0.9 and by_probes["in_sample"]["recall"] == 0.75
    assert by_probes["in_sample"]["filler_gate_rate"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no topk runs"):
        studies.calibrate(_doc(), "question.q", policy="topk")


def _loud_doc() -> dict:
    """One conversation that turns loud: five quiet fillers (1), a broken probe (6), five loud fillers (10), a
    broken probe (25); full answers every probe right."""
    values = [(1.0, "filler")] * 5 + [(6.0, "probe")] + [(10.0, "filler")] * 5 + [(25.0, "probe")]
    full_steps, pois_steps = [], []
    for i, (value, kind) in enumerate(values):
        full_steps.append(_step(i, kind, True if kind == "probe" else None, None))
        pois_steps.append(_step(i, kind, False if kind == "probe" else None, value))
    return _runs(full_steps, pois_steps)


def test_adaptive_calibration_follows_each_conversation() -> None:
    from agent.gate.calibration import Adaptive

    rule = Adaptive(2.0, 5)
    (steps,) = studies.paired_steps(_loud_doc(), ("poisson",)).values()
    bars = studies.adaptive_thresholds(steps, "question.q", 5.0, rule)
    # τ while the chat is quiet (2 × 1 < 5), then 2 × the median of the last five as it turns loud
    assert bars[:8] == [5.0] * 8
    assert bars[8:] == [12.0, 20.0, 20.0, 20.0]
    fixed = studies.gate_figures(steps, "question.q", 5.0)
    adaptive = studies.gate_figures(steps, "question.q", 5.0, rule)
    assert fixed["recall"] == adaptive["recall"] == 1.0
    assert fixed["filler_gate_rate"] == pytest.approx(0.5) and adaptive["filler_gate_rate"] == pytest.approx(0.2)
    cal = studies.calibrate(_loud_doc(), "question.q", filler_target=0.0, adaptive=rule)
    assert cal["rule"] == "adaptive" and cal["adaptive"] == {"factor": 2.0, "window": 5}
    assert cal["tau"] == pytest.approx(10.0) and cal["in_sample"]["filler_gate_rate"] == 0.0
    # a rolled-back (independent) probe is not part of the conversation's recent statistics; another run
    # (another budget, another script) starts from τ
    quiet = [{**s, "_run": "a"} for s in steps[:2]]
    probe = {**steps[5], "_run": "a", "turn": 2, "lineno": 2, "independent": True,
             "certificate_detail": {"question.q": 100.0}}
    after = {**steps[0], "_run": "a", "turn": 3, "lineno": 3}
    other = {**steps[10], "_run": "b"}
    assert studies.adaptive_thresholds([*quiet, probe, after, other], "question.q", 1.0, Adaptive(2.0, 2)) == \
        [1.0, 2.0, 2.0, 2.0, 1.0]


def test_uncertified_turns_count_as_gated() -> None:
    """A turn whose eviction could not sample has no certificate; the agent's gate fires on it whatever its
    value, so the studies rank it first and fire it at any τ (and it sets no τ)."""
    doc = _doc()
    poisson = next(r for r in doc["runs"] if r["policy"] == "poisson")
    for step in poisson["steps"]:
        if step["lineno"] in (2, 3, 9):  # two induced probes and one filler, all with a certificate of 0
            step["certificate"] = 0.0
            step["certificate_detail"] = {"question.q": 0.0, "answer.max": 0.0, "uncertified": 1}
    assert studies.statistics_of(poisson["steps"][2])["question.q"] == math.inf
    assert studies.statistics_of(poisson["steps"][2])["answer.max"] == 0.0
    by_probes = studies.calibrate(doc, "question.q", probe_target=1.0)
    # τ comes from the certified broken probes (0.9); the uncertified ones fire anyway
    assert by_probes["tau"] == 0.9 and by_probes["in_sample"]["recall"] == 0.75
    assert by_probes["in_sample"]["filler_gate_rate"] == pytest.approx(0.2)  # the loud filler + the uncertified
    (row,) = studies.gating(doc, rates=(3 / 18,))
    q = row["statistics"]["question.q"]
    # three slots over all turns go to the three uncertified turns, two of them broken probes
    assert q["over_turns"][0]["recall"] == pytest.approx(0.25 + 2 / 8)


def test_studies_need_a_full_reference() -> None:
    doc = _doc()
    doc["runs"] = [r for r in doc["runs"] if r["policy"] != "full"]
    with pytest.raises(ValueError, match="need a `full` run"):
        studies.attribution(doc)


def test_coverage_summary() -> None:
    cells = [{"layer": layer, "head": h, "certificate": 1.0, "error": 0.5 if h else 2.0}
             for layer in range(2) for h in range(4)]
    c = rank_stats.coverage(cells)
    assert c["n_cells"] == 8 and c["coverage"] == 0.75 and c["per_layer"] == {"0": 0.75, "1": 0.75}


def test_render_tables() -> None:
    doc = _doc()
    for name in ("attribution", "gating"):
        text = studies.render(studies.analyse(name, doc))
        assert "| poisson | 10% | multi-round |" in text and "model `m`" in text


def test_study_from_results_on_disk_and_the_calibration_file(tmp_path, capsys) -> None:
    import argparse
    import json

    from agent.lab import cli_replay

    doc = _doc()
    doc["meta"].update({"machine": "2 CPU cores", "command": "certchat replay x"})
    aggregate.write_results(tmp_path / "run" / "results.json", doc["meta"], doc["runs"])
    parser = argparse.ArgumentParser(prog="certchat")
    cli_replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", "--study", "gating", "--from-results", str(tmp_path / "run"),
                              "--out", str(tmp_path / "study")])
    assert args.func(args) == 0
    assert "| poisson | 10% | multi-round |" in capsys.readouterr().out
    result = json.loads((tmp_path / "study" / "study-gating.json").read_text())
    record = studies.calibration_record(result, "question.q")
    assert record["tau"] == studies.calibrate(doc, "question.q")["tau"] and record["model"] == "m"
    path = studies.write_calibration(record, tmp_path / "cal.json")
    written = json.loads(path.read_text())["calibrations"]
    assert [(r["statistic"], r["evict_at"]) for r in written] == [("question.q", "question")]
    with pytest.raises(ValueError, match="no calibration of nothing"):
        studies.calibration_record(result, "nothing")
