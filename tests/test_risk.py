"""The user names a risk, not a budget (issue 56): config ``risk`` and ``budget = "auto"``, resolved by the cache
manager from the model's record (its ``certification``): the cheapest certified budget, or the full cache with one
line why; an explicit budget runs with one line when it is not certified. The rule itself (bounds, the sequence) is
agent/gate/certification.py's; here its use. Model-free tests first, then the fast model (smollm2-135m) end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from agent import config, models
from agent.config import Budget, Config, ConfigError
from agent.eviction import budget as budget_mod
from agent.gate import calibration, certification
from agent.gate.calibration import ModelCalibration
from agent.gate.certification import Certification, Trial

SMOLLM = models.REGISTRY["smollm2-135m"].sha256
# 50% and 25% are certified at 10% (bounds of 0/100 and 1/100 lost, about 3% and 4.7%), 10% is not (30 of 100)
CERTIFIES = Certification((Trial("50%", kept=100, lost=0), Trial("25%", kept=99, lost=1),
                           Trial("10%", kept=70, lost=30)))
# nothing is certified at 10%: a fifth of the full cache's right answers lost at each budget
NOTHING = Certification((Trial("50%", kept=40, lost=10), Trial("25%", kept=30, lost=20)))


def _model(cert: Certification | None, tmp_path: Path, sha: str = "ab" * 32) -> ModelCalibration:
    return ModelCalibration(sha, tmp_path / "record.json", (), certification=cert)


# -- the setting ----------------------------------------------------------------------------------------------------
def test_the_defaults_are_a_risk_and_an_auto_budget() -> None:
    cfg = Config()
    assert (cfg.budget, cfg.risk) == ("auto", "10%")
    assert cfg.kv_budget == Budget(auto=True) and cfg.loss_risk == pytest.approx(0.1)
    assert "risk" in config.field_docs() and "59" in config.field_docs()["risk"], "the docstring says why 10%"


@pytest.mark.parametrize("text, share", [("10%", 0.1), (" 2.5 % ", 0.025), ("99.9%", 0.999), ("20%", 0.2)])
def test_good_risks_parse(text: str, share: float) -> None:
    assert config.parse_risk(text) == pytest.approx(share)
    assert Config(risk=text).loss_risk == pytest.approx(share)


@pytest.mark.parametrize("text", ["abc", "10", "0.1", "0%", "100%", "150%", "-5%", "nan%", "inf%", "", "%", "ten%"])
def test_bad_risks_are_one_line_naming_the_key(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config(risk=text).validate()
    message = str(err.value)
    assert message.startswith("risk:") and "\n" not in message and repr(text) in message


@pytest.mark.parametrize("line", ['risk = "abc"', "risk = 0.1", 'risk = "0%"', "risk = 5"])
def test_a_bad_risk_in_the_file_names_the_key(tmp_path: Path, line: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert str(err.value).startswith("risk:") and "\n" not in str(err.value)


def test_auto_is_a_budget_everywhere_a_budget_is(tmp_path: Path) -> None:
    from tui import settings

    for text in ("auto", " AUTO ", "Auto"):
        assert Budget.parse(text) == Budget(auto=True) and str(Budget.parse(text)) == "auto"
    assert Budget.parse("25%") != Budget(auto=True) and not Budget.parse("25%").auto
    assert Config(budget="25%").replace(budget="auto").kv_budget.auto
    assert settings.budget_problem("auto") is None  # the TUI's budget dialog
    with pytest.raises(ValueError):
        Budget(auto=True).cells(1000)  # resolved before it allows cells
    path = tmp_path / "c.toml"
    path.write_text('budget = "auto"\nrisk = "20%"\n', encoding="utf-8")
    cfg = config.load(path)
    assert cfg.kv_budget.auto and cfg.loss_risk == pytest.approx(0.2)
    assert config.load(config.save(cfg, tmp_path / "saved.toml")) == cfg
    with pytest.raises(ConfigError, match="^budget: .*auto"):
        Budget.parse("automatic")


def test_the_command_line_takes_risk_and_auto() -> None:
    import argparse

    from agent.cli import chat

    parser = argparse.ArgumentParser()
    chat.add_common_flags(parser)
    cfg = chat.config_from_args(parser.parse_args(["--budget", "auto", "--risk", "20%"]))
    assert cfg.kv_budget.auto and cfg.loss_risk == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="^risk:"):
        chat.config_from_args(parser.parse_args(["--risk", "0.2"]))


# -- resolution on constructed records --------------------------------------------------------------------------------
def test_auto_runs_the_cheapest_certified_budget(tmp_path: Path) -> None:
    got = budget_mod.resolve(Budget(auto=True), 0.1, True, _model(CERTIFIES, tmp_path), "m")
    assert got.budget == Budget.parse("25%"), "50% holds too, but 25% is cheaper; 10% does not hold"
    assert got.certified_risk == pytest.approx(CERTIFIES.certified_risk("25%")) and got.certified_risk <= 0.1
    assert got.reason is None and got.notice is None and got.certified
    assert got.words() == f"25% · certified ≤ {certification.percent(got.certified_risk)} loss"
    # a tighter risk: only the largest budget holds
    tight = budget_mod.resolve(Budget(auto=True), 0.04, True, _model(CERTIFIES, tmp_path), "m")
    assert tight.budget == Budget.parse("50%") and tight.certified_risk <= 0.04


def test_auto_keeps_the_full_cache_where_no_budget_is_certified(tmp_path: Path) -> None:
    got = budget_mod.resolve(Budget(auto=True), 0.1, True, _model(NOTHING, tmp_path), "qwen2.5-coder-1.5b")
    assert got.budget is None and got.certified_risk is None and got.notice is None
    assert got.reason == certification.NO_BUDGET.format(model="qwen2.5-coder-1.5b", risk="10%")
    assert got.words() == "full cache"


def test_auto_keeps_the_full_cache_without_a_certification(tmp_path: Path) -> None:
    for model in (_model(None, tmp_path), None):
        got = budget_mod.resolve(Budget(auto=True), 0.1, True, model, "m")
        assert got.budget is None and got.reason == certification.NOT_CERTIFIED.format(model="m")


def test_an_explicit_budget_runs_with_one_line_when_not_certified(tmp_path: Path) -> None:
    model = _model(CERTIFIES, tmp_path)
    got = budget_mod.resolve(Budget.parse("10%"), 0.1, True, model, "m")
    assert got.budget == Budget.parse("10%") and got.reason is None, "a notice, not the full cache"
    assert got.notice == CERTIFIES.explain("10%", 0.1, "m") and got.notice is not None and "\n" not in got.notice
    assert got.certified_risk == CERTIFIES.certified_risk("10%") and not got.certified
    # a token count was never measured
    tokens = budget_mod.resolve(Budget.parse("1024"), 0.1, True, model, "m")
    assert tokens.budget == Budget(tokens=1024) and tokens.notice is not None and "not measured" in tokens.notice
    assert tokens.words() == "1024 · not certified"
    # without any certification: the line says so for the model
    bare = budget_mod.resolve(Budget.parse("25%"), 0.1, True, _model(None, tmp_path), "m")
    assert bare.budget == Budget.parse("25%") and bare.reason is None
    assert bare.notice == certification.UNCERTIFIED_BUDGET.format(model="m", budget="25%",
                                                                 detail="the model's record has no certification")
    assert bare.words() == "25% · not certified"
    # a certified explicit budget needs no line
    ok = budget_mod.resolve(Budget.parse("25%"), 0.1, True, model, "m")
    assert ok.notice is None and ok.certified and ok.words().startswith("25% · certified ≤ ")


def test_a_policy_that_never_evicts_needs_no_budget(tmp_path: Path) -> None:
    for configured in (Budget(auto=True), Budget.parse("25%")):
        got = budget_mod.resolve(configured, 0.1, False, _model(NOTHING, tmp_path), "m")
        assert got.budget is None and got.reason is None and got.notice is None


def test_the_record_on_disk_carries_the_certification(tmp_path: Path) -> None:
    shipped = json.loads(calibration.PATH.read_text(encoding="utf-8"))["calibrations"]
    path = calibration.record_path(SMOLLM)
    calibration.write_model({"model": "smollm2-135m", "model_sha256": SMOLLM, "certification": NOTHING.to_json(),
                             "calibrations": [{**r, "model": "smollm2-135m", "model_sha256": SMOLLM} for r in shipped]},
                            path)
    found = calibration.for_model(SMOLLM)
    assert found is not None and found.certification is not None and found.gate("turn-end") is not None
    assert [(t.budget, t.kept, t.lost) for t in found.certification.trials] == [("50%", 40, 10), ("25%", 30, 20)]
    name = budget_mod.model_name(found, Path("/elsewhere/renamed.gguf"))
    assert name == "smollm2-135m", "a registry model is named by the registry, found by its hash"
    got = budget_mod.resolve(Budget(auto=True), 0.1, True, found, name)
    assert got.reason == certification.NO_BUDGET.format(model="smollm2-135m", risk="10%")
    # a record without one: as before certification
    calibration.write_model({"calibrations": [{**r, "model": "smollm2-135m", "model_sha256": SMOLLM}
                                              for r in shipped]}, path)
    assert calibration.for_model(SMOLLM).certification is None  # type: ignore[union-attr]
    assert budget_mod.model_name(None, Path("/x/my-own-model.Q4.gguf")) == "my-own-model.Q4"


def test_doctor_prints_the_budget_in_force_and_its_line(calibrated_for: Callable[..., None]) -> None:
    from agent.cli import doctor

    config_file = Path(os.environ["CERTCHAT_CONFIG"])
    config_file.write_text('model = "smollm2-135m"\n', encoding="utf-8")
    calibrated_for("smollm2-135m", certification=NOTHING.to_json())
    gate = doctor.report()["gate"]
    line = certification.NO_BUDGET.format(model="smollm2-135m", risk="10%")
    assert gate["budget_line"] == line and gate["budget_in_force"] is None and gate["certified_risk"] is None
    assert line in doctor.render(doctor.report())
    calibrated_for("smollm2-135m", certification=CERTIFIES.to_json())
    gate = doctor.report()["gate"]
    assert gate["budget_in_force"] == "25%" and gate["certified_risk"] == pytest.approx(
        CERTIFIES.certified_risk("25%"))
    assert gate["budget_line"].startswith("25% · certified ≤ ")
    assert [(c["budget"], c["lost"], c["n"]) for c in gate["certified"]] == [("50%", 0, 100), ("25%", 1, 100),
                                                                             ("10%", 30, 100)]
    assert "certified         : on long chats, 50% lost 0 of 100 (≤ 3%)" in doctor.render(doctor.report())


def test_replays_without_a_budget_run_what_the_chat_runs(calibrated_for: Callable[..., None],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from agent.lab import cli_replay

    parser = argparse.ArgumentParser(prog="certchat")
    cli_replay.register(parser.add_subparsers(dest="command"))
    gated = ["full", "poisson+gate"]

    def planned(*argv: str) -> tuple[list[str], list[str]]:
        args = parser.parse_args(["replay", "s.jsonl", "--model", "smollm2-135m", *argv])
        return cli_replay.chat_budgets(args, args.model, gated)

    calibrated_for("smollm2-135m", certification=CERTIFIES.to_json())
    assert planned() == (gated, ["25%"]), "the cheapest budget certified at the configured risk"
    assert "25% · certified ≤ " in capsys.readouterr().err
    assert planned("--budget", "10%,50%") == (gated, ["10%", "50%"]), "--budget as today"
    calibrated_for("smollm2-135m", certification=NOTHING.to_json())
    assert planned() == (["full"], []), "no budget certified: the full cache only, as the chat runs it"
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(certification.NO_BUDGET.format(model="smollm2-135m", risk="10%"))
    # the demo's default is the same (its flags are the replay's)
    args = parser.parse_args(["demo", "long", "--quick"])
    assert args.budget is None
    assert parser.parse_args(["demo", "recall30"]).budget == "10%", "recall30 stays a 10% demo"


# -- end to end on the fast model --------------------------------------------------------------------------------------
TURNS = ["My locker code is 4172.", "My cat is called Purrnickel.", "I was born in Tromsø in 1987.",
         "Give me one short sentence about the sea.", "What is my locker code?"]


def _session(engine: Any, tmp_path: Path, name: str, **changes: object) -> Any:
    from agent.chat.session import ChatSession
    from memory_store.store import Store

    # evicting from the first turn, under the defaults: budget "auto", risk 10%, gate "auto"
    cfg = Config(model="smollm2-135m", n_ctx=2048, n_batch=256, evict_from=0, policy="poisson", max_tokens=8,
                 page_size=4, seed=3).replace(**changes)
    return ChatSession(cfg, Store(tmp_path / f"{name}.db"), engine, "smollm2-135m")


def _chat(s: Any, texts: list[str]) -> list[Any]:
    events: list[Any] = []
    for text in texts:
        s.send(text, on_event=events.append)
    return events


def _notices(events: list[Any]) -> list[str]:
    from agent import events as ev

    return [e.text for e in events if isinstance(e, ev.Notice)]


def test_no_certified_budget_keeps_every_cell_and_says_why(engine: Any, tmp_path: Path,
                                                            calibrated_for: Callable[..., None]) -> None:
    from tui import render

    calibrated_for("smollm2-135m", certification=NOTHING.to_json())  # the gate is calibrated: only the budget holds
    s = _session(engine, tmp_path, "nothing")
    events = _chat(s, TURNS)
    line = certification.NO_BUDGET.format(model="smollm2-135m", risk="10%")
    assert s.memory.full_reason == line and s.memory.budget is None
    assert engine.live_cells == engine.next_pos, "past evict_from, nothing was evicted"
    assert s.store.next_eviction_round(s.conversation_id) == 0 and not engine.readout[0]
    view = s.memory_view()
    assert view.full_cache_reason == line and view.budget_cells is None and view.certified_risk is None
    assert view.budget_words == "full cache" and view.full_cache_until is None
    said = _notices(events)
    assert said == [s.full_cache_notice] and said[0].startswith(line) and "--budget" in said[0], "said once"
    info = render.StatusInfo(model="smollm2-135m", policy="poisson", budget="auto", gate="auto", phase="ready",
                             memory=view)
    assert line in render.status_line(info).plain


def test_a_certified_budget_evicts_at_it(engine: Any, tmp_path: Path, calibrated_for: Callable[..., None]) -> None:
    from tui import render

    calibrated_for("smollm2-135m", certification=CERTIFIES.to_json())
    s = _session(engine, tmp_path, "certified")
    events = _chat(s, TURNS)
    assert s.memory.full_reason is None and s.memory.budget == Budget.parse("25%")
    assert s.gate.settings.budget == Budget.parse("25%"), "the gate reads the certificate of the budget run"
    assert engine.live_cells < engine.next_pos and s.store.next_eviction_round(s.conversation_id) > 0
    view = s.memory_view()
    assert view.certified_risk == pytest.approx(CERTIFIES.certified_risk("25%"))
    assert view.budget_words is not None and view.budget_words.startswith("25% · certified ≤ ")
    assert not _notices(events)
    info = render.StatusInfo(model="smollm2-135m", policy="poisson", budget="auto", gate="auto", phase="ready",
                             memory=view)
    assert f"budget {view.budget_words}" in render.status_line(info).plain


def test_an_explicit_uncertified_budget_evicts_with_a_notice(engine: Any, tmp_path: Path,
                                                            calibrated_for: Callable[..., None]) -> None:
    calibrated_for("smollm2-135m", certification=NOTHING.to_json())
    s = _session(engine, tmp_path, "explicit", budget="48")
    events = _chat(s, TURNS)
    assert s.memory.full_reason is None and s.memory.budget == Budget(tokens=48)
    assert engine.live_cells <= 48 < engine.next_pos, "honoured: it evicts"
    notice = NOTHING.explain("48", 0.1, "smollm2-135m")
    assert notice is not None and s.budget_notice == notice and _notices(events) == [notice], "said once"
    view = s.memory_view()
    assert view.budget_notice == notice and view.budget_words == "48 · not certified" and view.certified_risk is None


def test_ask_json_carries_the_budget_risk_and_reason(small_model: Path, calibrated_for: Callable[..., None]) -> None:
    from tests.reliability_support import cli

    calibrated_for("smollm2-135m", certification=NOTHING.to_json())
    fast = ["--model", "smollm2-135m", "--max-tokens", "4", "--threads", "1", "--n-ctx", "1024", "--policy",
            "poisson", "--evict-from", "0", "--json"]
    r = cli("ask", *fast, "hello")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["full_cache_reason"].startswith(certification.NO_BUDGET.format(model="smollm2-135m", risk="10%"))
    assert line["budget"] is None and line["certified_risk"] is None and line["risk"] == pytest.approx(0.1)
    assert line["budget_cells"] is None and line["live_cells"] > 0
    r = cli("ask", *fast, "--risk", "60%", "hello")  # a risk the record certifies: its cheapest budget
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["full_cache_reason"] is None and line["budget"] == "25%" and line["risk"] == pytest.approx(0.6)
    assert line["certified_risk"] == pytest.approx(NOTHING.certified_risk("25%")) and line["budget_notice"] is None
    r = cli("ask", *fast, "--budget", "10%", "hello")  # explicit, never measured: honoured, with the line
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["full_cache_reason"] is None and line["budget"] == "10%" and line["certified_risk"] is None
    assert "not measured" in line["budget_notice"]
