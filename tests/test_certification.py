"""The certification rule on constructed counts, and the pairing of recorded replays into trials."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agent.gate import certification
from agent.gate.certification import Certification, Trial, binomial_cdf, certified_risks, choose, upper_bound
from agent.lab import certify


@pytest.mark.parametrize("lost,n", [(0, 59), (1, 30), (3, 100), (16, 83), (9, 10)])
def test_the_bound_is_where_the_binomial_tail_reaches_one_minus_the_confidence(lost: int, n: int) -> None:
    u = upper_bound(lost, n)
    assert lost / n < u < 1
    assert binomial_cdf(lost, n, u) == pytest.approx(0.05, abs=1e-9)


def test_the_bound_at_zero_losses_is_the_closed_form() -> None:
    assert upper_bound(0, 59) == pytest.approx(1 - 0.05 ** (1 / 59))
    assert upper_bound(0, 59) < 0.05 < upper_bound(0, 58)


def test_the_bound_refuses_counts_that_cannot_be() -> None:
    with pytest.raises(ValueError):
        upper_bound(5, 4)
    with pytest.raises(ValueError):
        upper_bound(1, 4, confidence=1.0)
    assert upper_bound(0, 0) == 1.0 and upper_bound(4, 4) == 1.0


def test_the_binomial_tail_matches_a_direct_sum() -> None:
    n, p = 40, 0.13
    direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(4))
    assert binomial_cdf(3, n, p) == pytest.approx(direct, rel=1e-12)


def test_too_few_right_answers_certify_nothing_however_few_were_lost() -> None:
    trials = [Trial("50%", kept=20, lost=0), Trial("25%", kept=200, lost=0)]
    risks = certified_risks(trials)
    assert risks == {"50%": None, "25%": None}  # the sequence stops at its first budget
    assert choose(trials, 0.5, "m").budget is None


def test_the_cheapest_budget_within_the_risk_is_chosen() -> None:
    trials = [Trial("10%", kept=60, lost=30), Trial("50%", kept=120, lost=1), Trial("25%", kept=118, lost=3)]
    risks = certified_risks(trials)
    assert risks["50%"] == pytest.approx(upper_bound(1, 121))
    assert risks["25%"] == pytest.approx(upper_bound(3, 121))
    assert choose(trials, 0.10, "m").budget == "25%"
    assert choose(trials, 0.045, "m").budget == "50%"
    assert choose(trials, 0.9, "m").budget == "10%"


def test_a_cheaper_budget_is_never_certified_below_a_larger_one_before_it() -> None:
    # 25% measured luckier than 50%: under the fixed sequence it cannot be certified at less than 50%'s bound
    trials = [Trial("50%", kept=95, lost=5), Trial("25%", kept=100, lost=0)]
    risks = certified_risks(trials)
    assert risks["25%"] == risks["50%"] == pytest.approx(upper_bound(5, 100))
    assert choose(trials, 0.05, "m").budget is None


def test_where_none_certifies_the_choice_is_the_full_cache_with_one_line_why() -> None:
    choice = choose([Trial("50%", kept=50, lost=10)], 0.05, "qwen2.5-coder-1.5b")
    assert choice.budget is None
    assert choice.reason == "qwen2.5-coder-1.5b: no budget keeps the loss under 5% on long chats — full cache"
    assert "\n" not in choice.reason


def test_gains_are_not_set_against_losses() -> None:
    assert Trial("25%", kept=50, lost=5, gained=20).bound() == upper_bound(5, 55)


def test_a_record_round_trips_and_explains_an_uncertified_budget() -> None:
    cert = Certification((Trial("50%", kept=118, lost=2), Trial("25%", kept=100, lost=20)))
    data = json.loads(json.dumps(cert.to_json()))
    back = Certification.from_record(data)
    assert back is not None and back.trials == cert.trials
    assert [b["budget"] for b in data["budgets"]] == ["50%", "25%"]
    assert back.certified_risk("50 %") == pytest.approx(upper_bound(2, 120))
    assert back.explain("50%", 0.10, "m") is None
    line = back.explain("25%", 0.10, "m")
    assert line is not None and line.startswith("m: budget 25% is not certified") and "\n" not in line
    assert "not measured" in (back.explain("10%", 0.10, "m") or "")
    assert Certification.from_record(None) is None and Certification.from_record({"budgets": []}) is None


def test_certification_budgets_are_shares() -> None:
    with pytest.raises(ValueError):
        Trial("1024", kept=40, lost=0).share


def _results(path: Path, runs: list[tuple[str, str, str, dict[int, bool]]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    doc = {"format": "certchat-replay-results", "version": 1, "meta": {"model_sha256": "x"},
           "runs": [{"script": chat, "policy": policy, "budget": budget,
                     "steps": [{"turn": t, "kind": "probe", "correct": ok} for t, ok in probes.items()]
                     + [{"turn": 99, "kind": "filler"}]}
                    for chat, policy, budget, probes in runs]}
    (path / "results.json").write_text(json.dumps(doc), encoding="utf-8")


def test_recorded_replays_pair_probe_by_probe_within_each_chat(tmp_path: Path) -> None:
    _results(tmp_path / "a", [("a", "full", "100%", {1: True, 2: True, 3: False, 4: False}),
                              ("a", "poisson+gate", "25%", {1: True, 2: False, 3: True, 4: False})])
    _results(tmp_path / "b", [("b", "full", "100%", {1: True, 2: True}),
                              ("b", "poisson+gate", "25%", {1: True, 2: True}),
                              ("b", "poisson+gate", "50%", {1: True, 2: True}),
                              ("b", "poisson", "25%", {1: False, 2: False})])
    trials = {t.budget: t for t in certify.from_results([tmp_path / "a", tmp_path / "b"])}
    assert (trials["25%"].kept, trials["25%"].lost, trials["25%"].gained, trials["25%"].neither) == (3, 1, 1, 1)
    assert trials["25%"].by_chat["a"] == {"kept": 1, "lost": 1, "gained": 1, "neither": 1}
    assert (trials["50%"].kept, trials["50%"].lost) == (2, 0)  # only chat b ran at 50%
    assert list(trials) == ["50%", "25%"]


def test_the_plan_measures_every_chat_at_the_largest_budget_before_the_next() -> None:
    class S:
        def __init__(self, name: str) -> None:
            self.name = name

    jobs = certify.plan([S("x"), S("y")], ["10%", "50%", "25%"])
    assert [(j.chat, j.budget) for j in jobs] == [("x", None), ("y", None), ("x", "50%"), ("y", "50%"),
                                                  ("x", "25%"), ("y", "25%"), ("x", "10%"), ("y", "10%")]
    assert certification.percent(0.05) == "5%"


def test_the_setting_line_names_the_budget_or_why_the_full_cache() -> None:
    cert = Certification((Trial("50%", kept=118, lost=2), Trial("25%", kept=100, lost=20)))
    assert certification.setting_line(cert, 0.10, "m").startswith("50% · certified ≤ 5.2% loss (lost 2 of 120")
    line = certification.setting_line(cert, 0.03, "m")
    assert line.startswith("full cache: no budget certified ≤ 3% loss (50% lost 2 of 120 right answers, bound 5.2%")
    assert certification.setting_line(None, 0.10, "m") == "full cache: not certified on long chats"


@pytest.mark.parametrize("x,text", [(0.05, "5%"), (0.0515, "5.2%"), (0.231, "24%"), (0.1, "10%"), (0.025, "2.5%")])
def test_shares_print_rounded_up(x: float, text: str) -> None:
    assert certification.percent(x) == text


def test_independent_questions_after_the_same_turn_are_paired_one_by_one(tmp_path: Path) -> None:
    def doc(policy: str, budget: str, answers: list[bool]) -> dict:
        return {"script": "locomo-x", "policy": policy, "budget": budget,
                "steps": [{"turn": 30, "lineno": 58 + i, "kind": "probe", "correct": ok, "independent": True}
                          for i, ok in enumerate(answers)]}

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.json").write_text(json.dumps(
        {"format": "certchat-replay-results", "version": 1, "meta": {},
         "runs": [doc("full", "100%", [True, True, False]), doc("poisson+gate", "25%", [True, False, True])]}))
    (t,) = certify.from_results([tmp_path / "r"])
    assert (t.kept, t.lost, t.gained, t.neither) == (1, 1, 1, 0)


def test_an_interrupted_certification_resumes_without_replaying_finished_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent import models
    from agent.lab.replay import longdemo
    from agent.lab.replay.script import Probe, Script, Step

    scripts = [Script(name, "", (Step(1, "I have a cat called Tom.", 1, "Nice."),
                                 Step(2, "What is my cat called?", 2, probe=Probe(("Tom",), fact_turn=1))))
               for name in ("chat-a", "chat-b")]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(certify, "chats", lambda *_a, **_k: scripts)
    monkeypatch.setattr(models, "resolve", lambda _name: model)
    monkeypatch.setattr(models, "gguf_sha256", lambda _path: "sha")
    calls: list[tuple[str, str]] = []

    def replay(chat: list[Script], settings: object, _base: object, log: object = None) -> dict:
        budget = settings.budgets[0]  # type: ignore[attr-defined]
        calls.append((chat[0].name, budget))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user stops it during the third run
        right = budget != "25%" or chat[0].name == "chat-a"
        doc = {"format": "certchat-replay-results", "version": 1, "meta": {"model_sha256": "sha"},
               "runs": [{"script": chat[0].name, "policy": settings.policies[0], "budget": budget,  # type: ignore
                         "steps": [{"turn": 2, "lineno": 2, "kind": "probe", "correct": right}]}]}
        out = settings.out  # type: ignore[attr-defined]
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc))
        return doc

    monkeypatch.setattr(longdemo, "run", replay)
    with pytest.raises(KeyboardInterrupt):
        certify.run("m", tmp_path / "work", ["25%"], progress=False)
    assert calls == [("chat-a", "100%"), ("chat-b", "100%"), ("chat-a", "25%")]
    calls.clear()
    trials, meta = certify.run("m", tmp_path / "work", ["25%"], progress=False)
    assert calls == [("chat-a", "25%"), ("chat-b", "25%")]  # the two full runs were not redone
    (t,) = trials
    assert (t.kept, t.lost) == (1, 1) and t.by_chat["chat-b"]["lost"] == 1
    assert [c["name"] for c in meta["chats"]] == ["chat-a", "chat-b"]
