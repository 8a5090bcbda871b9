"""The typed config: TOML file, flag overrides, one-line errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import config


def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = config.load(tmp_path / "missing.toml")
    assert cfg.policy == "poisson" and (cfg.budget, cfg.risk) == ("auto", "10%") and cfg.copy_back == "auto"


def test_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('policy = "topk"\nbudget = "25%"\nthreads = 3\nkeys = { new_chat = "ctrl+n" }\n')
    cfg = config.load(path)
    assert (cfg.policy, cfg.budget, cfg.threads, cfg.keys) == ("topk", "25%", 3, {"new_chat": "ctrl+n"})
    cfg2 = cfg.replace(policy="window", budget=None)
    assert cfg2.policy == "window" and cfg2.budget == "25%"


@pytest.mark.parametrize(
    "text, key",
    [('policy = "lru"', "policy"), ('budget = "ten"', "budget"), ("threads = 0", "threads"),
     ('gate = "sometimes"', "gate"), ("n_ctx = 12", "n_ctx"), ('colour = "blue"', "colour"),
     ('temperature = "hot"', "temperature"), ('evict_at = "later"', "evict_at"),
     ("reread_refeed = -8", "reread_refeed")],
)
def test_invalid_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(config.ConfigError) as err:
        config.load(path)
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


def test_save_round_trips(tmp_path: Path) -> None:
    cfg = config.Config(policy="topk", budget="1024", gate="0.25", keys={"help": "f1"})
    path = config.save(cfg, tmp_path / "c.toml")
    assert config.load(path) == cfg


def test_budget_and_gate_parsing() -> None:
    assert config.Budget.parse("10%") == config.Budget(share=0.1) == config.Budget.parse(" 10.0% ")
    assert config.Budget.parse("1024") == config.Budget(tokens=1024)
    assert config.Budget.parse("10%").cells(2000) == 200 and config.Budget.parse("1024").cells(50) == 1024
    assert str(config.Budget.parse("10%")) == "10%" and str(config.Budget.parse("1024")) == "1024"
    assert config.GateThreshold.parse("off").off and config.GateThreshold.parse("0.3").tau == 0.3
    assert config.GateThreshold.parse("auto").auto and config.Config(gate="0.3").gate_threshold.tau == 0.3
    assert set(config.field_docs()) >= {"policy", "budget", "gate", "model"}


def test_auto_gate_reads_the_calibration_that_chose_it(tmp_path: Path) -> None:
    from agent.gate import calibration

    cal = calibration.load()
    assert cal is not None, "agent/gate/gate_calibration.json ships with the package"
    # the default cites the data that chose it
    assert cal.command and "replay" in cal.command and cal.study_command and "--study gating" in cal.study_command
    assert cal.record["in_sample"]["probe_gate_rate"] >= 0 and cal.tau > 0
    from agent.gate.decision import Gate

    shipped = calibration.for_model(cal.model_sha256)
    assert shipped is not None
    mine = shipped.gate(cal.record["evict_at"])
    # the model's own record (`certchat calibrate`, agent/gate/calibrations/) before the gating study's file
    assert mine is not None and mine.record.get("accepted") and calibration.SHIPPED_DIR in shipped.path.parents
    assert shipped.gate("question") == calibration.load(calibration.PATH, "question"), "a timing only the study has"
    gate = Gate(config.Config(), shipped)
    assert gate.statistic == mine.statistic and gate.threshold() == mine.tau
    assert Gate(config.Config(), None).threshold() is None, "a model without a calibration: 'auto' is off"
    other = "answer.q" if cal.statistic != "answer.q" else "question.q"
    assert cal.tau_for(other) is None  # calibrated for another statistic: the gate stays off
    assert Gate(config.Config(gate_stat=other), shipped).threshold() is None
    assert cal.record["evict_at"] == config.Config().evict_at, "the shipped default is calibrated for the default timing"
    path = calibration.write({**cal.record, "evict_at": "question", "statistic": "question.q", "tau": 0.5},
                             tmp_path / "cal.json")
    assert calibration.load(path, "question").tau == 0.5 and calibration.load(path, "question").statistic == "question.q"
    # one record per eviction timing: a turn-end calibration sits beside the question one
    calibration.write({**cal.record, "evict_at": "turn-end", "tau": 0.9}, path)
    assert calibration.load(path, "turn-end").tau == 0.9 and calibration.load(path, "question").tau == 0.5
    calibration.write({**cal.record, "evict_at": "turn-end", "tau": 0.8}, path)
    assert calibration.load(path, "turn-end").tau == 0.8 and calibration.load(path, "question").tau == 0.5
    # a file from before the setting holds one record: the question-timing calibration
    (tmp_path / "old.json").write_text('{"statistic": "question.max", "tau": 0.7}', encoding="utf-8")
    assert calibration.load(tmp_path / "old.json", "question").tau == 0.7
    assert calibration.load(tmp_path / "old.json", "turn-end") is None
    assert calibration.load(tmp_path / "missing.json", "question") is None
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    assert calibration.load(tmp_path / "bad.json") is None


def test_adaptive_tau_follows_the_conversation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adaptive calibration raises a turn's bar to factor × the median of the conversation's recent sketch
    statistics, never below τ; a rolled-back turn's statistic is not among them, a new conversation starts at τ,
    and an explicit threshold stays fixed."""
    from agent.gate import calibration
    from agent.gate.decision import Gate

    path = tmp_path / "gate_calibration.json"
    path.write_text(json.dumps({"calibrations": [{"statistic": "sketch.max", "tau": 5.0, "evict_at": "turn-end",
                                                  "adaptive": {"factor": 2.0, "window": 3},
                                                  "model_sha256": "ab" * 32}]}))
    [model] = calibration.read(path)
    try:
        assert calibration.adaptive_tau(5.0, [], calibration.Adaptive(2.0, 3)) == 5.0
        assert calibration.adaptive_tau(5.0, [9.0, 1.0, 4.0, 6.0], calibration.Adaptive(2.0, 3)) == 8.0
        assert calibration.adaptive_tau(5.0, [9.0, 1.0, 4.0, 6.0], None) == 5.0
        gate = Gate(config.Config(gate="auto", gate_stat="sketch.max", evict_at="turn-end"), model)

        def turn(value: float) -> None:
            gate.begin_turn()
            gate.turn.sketch = {"sketch.max": value}

        assert gate.threshold() == 5.0
        for value in (1.0, 2.0, 1.5):  # a quiet chat: the floor holds
            turn(value)
        assert gate.threshold() == 5.0 and gate.implicating_level(5.0) == 5.0
        decision = gate.question_decision()
        assert decision.threshold == 5.0 and not decision.fire
        for value in (12.0, 14.0, 10.0):  # a chat whose ordinary turns read high raises its own bar
            turn(value)
        gate.begin_turn()
        assert gate.threshold() == pytest.approx(24.0)
        gate.turn.sketch = {"sketch.max": 20.0}
        assert not gate.question_decision().fire  # 20 would pass a fixed τ of 5
        gate.turn.sketch = {"sketch.max": 30.0}
        assert gate.question_decision().fire
        # the messages it brings back: those above the chat's ordinary peak (the median 12), not only the bar
        assert gate.implicating_level(24.0) == pytest.approx(12.0)
        gate.discard_turn()  # an independent probe, rolled back
        gate.begin_turn()
        assert gate.threshold() == pytest.approx(24.0)
        gate.new_conversation()
        assert gate.threshold() == 5.0
        fixed = Gate(config.Config(gate="7.5", gate_stat="sketch.max", evict_at="turn-end"), model)
        for value in (12.0, 14.0, 10.0):
            fixed.begin_turn()
            fixed.turn.sketch = {"sketch.max": value}
        fixed.begin_turn()
        assert fixed.threshold() == 7.5 and fixed.implicating_level(7.5) == 7.5
    finally:
        calibration.load.cache_clear()


def test_a_second_signal_fires_where_the_sketch_stays_quiet(tmp_path: Path) -> None:
    """A calibrated second signal (record ``second``) fires a turn whose sketch reads under the bar when its own
    statistic reaches its τ, only where the kept sample holds ``min_sampled`` cells; the decision says which
    statistic fired, a targeted re-read still names messages at the sketch's bar, the turn's certificate stays the
    gate's statistic, and ``gate_second = "off"`` or an explicit threshold reads the sketch alone."""
    import numpy as np

    from agent.gate import calibration
    from agent.gate.decision import Gate

    path = tmp_path / "gate_calibration.json"
    path.write_text(json.dumps({"calibrations": [{
        "statistic": "sketch.max", "tau": 5.0, "evict_at": "turn-end", "model_sha256": "ab" * 32,
        "second": {"statistic": "question.mean", "tau": 0.95, "min_sampled": 200}}]}))
    [model] = calibration.read(path)
    assert model.gate("turn-end").second() == calibration.SecondSignal("question.mean", 0.95, 200)

    def decide(gate: Gate, sketch: float, qmean: float, sampled: int):  # type: ignore[no-untyped-def]
        gate.begin_turn()
        gate.turn.sketch = {"sketch.max": sketch}
        gate.turn.question = np.full((4, 2, 3), qmean)
        gate.turn.sampled_cells = sampled
        assert gate.turn.statistics()["question.mean"] == pytest.approx(qmean)
        return gate.question_decision()

    gate = Gate(config.Config(gate="auto", gate_stat="sketch.max", evict_at="turn-end"), model)
    quiet = decide(gate, 2.0, 0.90, 500)
    assert not quiet.fire and quiet.value == 2.0 and quiet.threshold == 5.0
    fired = decide(gate, 2.0, 0.97, 500)
    assert fired.fire and fired.second == "question.mean"
    assert fired.value == pytest.approx(0.97) and fired.threshold == 0.95
    gate.turn.anomalies = {3: 6.0, 4: 2.5}
    gate.record_firing(fired)
    assert gate.turn_certificate() == 2.0  # the sketch's reading, not the second signal's
    assert not decide(gate, 2.0, 0.97, 150).fire  # too small a sample: the statistic reads on another scale
    sketch_first = decide(gate, 9.0, 0.97, 500)
    assert sketch_first.fire and not sketch_first.second
    for cfg in (config.Config(gate="auto", gate_stat="sketch.max", evict_at="turn-end", gate_second="off"),
                config.Config(gate="5", gate_stat="sketch.max", evict_at="turn-end")):
        assert not decide(Gate(cfg, model), 2.0, 0.99, 500).fire
    with pytest.raises(config.ConfigError, match="gate_second"):
        config.Config(gate_second="on").validate()
