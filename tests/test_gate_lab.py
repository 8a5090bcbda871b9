"""The gate lab on constructed long-chat results: a rule's firings follow its bar over the ungated readings, a fired
probe is predicted as the full cache answered it and an unfired one as ungated eviction did, a firing costs the
full cache's turn plus what firings added in the gated run, and the table marks the shipped rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab import gate_lab
from agent.lab.replay import aggregate

# turn: (kind, ungated sketch.max, full right, ungated right)
TURNS = [("filler", None, None, None), ("filler", 1.0, None, None), ("filler", 1.2, None, None),
         ("probe", 9.0, True, False), ("filler", 1.1, None, None), ("probe", 2.0, True, False),
         ("filler", 30.0, None, None), ("probe", 5.0, False, True)]


# the second statistic's ungated readings and the kept sample's cells, per turn
SECOND = [None, 0.90, 0.91, 0.80, 0.92, 0.97, 0.93, 0.99]
SAMPLED = [0, 300, 300, 300, 300, 300, 300, 100]


def _steps(policy: str, fired: set[int] = frozenset()) -> list[dict]:  # type: ignore[assignment]
    out = []
    for i, (kind, reading, full_ok, ungated_ok) in enumerate(TURNS):
        ok = full_ok if policy == "full" else ungated_ok
        out.append({"turn": i + 1, "kind": kind, "correct": ok if kind == "probe" else None,
                    "gate_fired": i in fired,
                    "certificate_detail": {} if policy == "full" or reading is None else
                    {"sketch.max": reading, "question.mean": SECOND[i], "sampled_cells": SAMPLED[i]}})
    return out


def _doc(tmp_path: Path) -> Path:
    runs = [{"script": "s.jsonl", "policy": "full", "budget": "100%", "seed": 0, "steps": _steps("full"),
             "turn_wall_s": [2.0] * len(TURNS), "question_fillers": [5]},
            {"script": "s.jsonl", "policy": "poisson", "budget": "10%", "seed": 0, "steps": _steps("poisson"),
             "turn_wall_s": [1.0] * len(TURNS), "question_fillers": [5]},
            {"script": "s.jsonl", "policy": "poisson+gate", "budget": "10%", "seed": 0,
             "steps": [{**s, "correct": True if s["kind"] == "probe" else None} for s in _steps("gate", {3})],
             "turn_wall_s": [1.0, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0], "question_fillers": [5]}]
    (tmp_path / "results.json").write_text(json.dumps({"format": aggregate.FORMAT, "meta": {}, "runs": runs}),
                                           encoding="utf-8")
    return tmp_path


def test_a_rule_is_scored_from_the_ungated_readings(tmp_path: Path) -> None:
    (script,) = gate_lab.load(_doc(tmp_path))
    assert [t.kind for t in script.turns] == ["other", "other", "other", "probe", "qfiller", "probe", "other",
                                              "probe"]
    assert script.gated["firing_extra_s"] == pytest.approx(0.5) and script.gated["fired_probes"] == 1
    rule = gate_lab.Rule(floor=3.0, factor=2.0, window=20)
    # bars: 3, 3, max(3, 2·1.0)=3, max(3, 2·1.1)=3 → 9 fires; then 2.0 < 3; 30 fires; then 2·median(...) = 4 → 5 fires
    assert rule.fires([(t.reading, t.uncertified, t.second, t.sampled) for t in script.turns]) == \
        [False, False, False, True, False, False, True, True]
    s = gate_lab.score([script], rule, extra_s=0.5)
    # probe 4 fired: the full cache's right answer; probe 6 unfired: ungated wrong; probe 8 fired: full's wrong one
    assert (s.right, s.n, s.both, s.full_only, s.this_only) == (1, 3, 1, 1, 0)
    assert s.fired["probe"] == pytest.approx(2 / 3) and s.fired["qfiller"] == 0.0
    assert s.turn_s == pytest.approx((5 * 1.0 + 3 * 2.5) / 8)
    assert s.bar_s == pytest.approx(1.0 + 0.1 * 2.0)
    high = gate_lab.score([script], gate_lab.Rule(floor=100.0, factor=2.0, window=20), extra_s=0.5)
    assert high.right == 1 and high.turn_s == pytest.approx(1.0), "nothing fires: ungated eviction's answers and time"
    text = gate_lab.table([script], [rule, high.rule], shipped=rule)
    assert "| 3 (shipped) | 2 | 20 | — | 1/3 |" in text and "fired probe answered as the full cache on 1 of 1" in text


def test_the_command_needs_full_and_ungated_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"format": aggregate.FORMAT, "meta": {}, "runs": []}),
                                           encoding="utf-8")
    assert gate_lab.main([str(tmp_path)]) == 1
    assert "no folder holds both a full and a poisson run" in capsys.readouterr().err


def test_a_second_statistic_is_fitted_on_ordinary_turns_and_written_to_a_record(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """τ of the second statistic is a percentile of the ordinary turns' readings where the kept sample is large
    enough; with it, a probe under the sketch's bar fires; ``--write`` puts it into a record's gate, saying what
    fitted it, and the gate reads it back."""
    from agent.gate import calibration

    (script,) = gate_lab.load(_doc(tmp_path), second="question.mean")
    assert [t.second for t in script.turns] == SECOND and [t.sampled for t in script.turns] == SAMPLED
    # ordinary turns with ≥ 200 cells: 0.90, 0.91, 0.93 (the question filler and the probes are not ordinary)
    assert gate_lab.second_tau([script], 100, min_sampled=200) == pytest.approx(0.93)
    assert gate_lab.second_tau([script], 50, min_sampled=200) == pytest.approx(0.91)
    rule = gate_lab.Rule(floor=3.0, factor=2.0, window=20, second_tau=0.95, min_sampled=200)
    # probe 6 (sketch 2.0 under its bar) now fires on 0.97; the last probe's 0.99 is read on too small a sample
    assert rule.fires([(t.reading, t.uncertified, t.second, t.sampled) for t in script.turns]) == \
        [False, False, False, True, False, True, True, True]
    assert gate_lab.score([script], rule, extra_s=0.5).right == 2
    record = tmp_path / "model.json"
    record.write_text(json.dumps({"calibrations": [{"statistic": "sketch.max", "tau": 3.0, "evict_at": "turn-end",
                                                    "model_sha256": "cd" * 32}]}), encoding="utf-8")
    argv = [str(tmp_path), "--floors", "3", "--factors", "2", "--second", "question.mean", "--percentiles", "100",
            "--min-sampled", "200", "--write", str(record), "--percentile", "100"]
    assert gate_lab.main(argv) == 0
    assert "0.93 (≥ 200 cells)" in capsys.readouterr().out
    [model] = calibration.read(record)
    assert model.gate("turn-end").second() == calibration.SecondSignal("question.mean", pytest.approx(0.93), 200)
    assert "--min-sampled 200" in json.loads(record.read_text())["calibrations"][0]["second"]["command"]
