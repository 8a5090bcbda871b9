"""The lost-probe account on constructed long-chat results: each probe the full cache answered and the gated run
did not is classed by what the gate did — never fired, fired on other messages, or brought the fact back and still
answered wrong — with the fact's message found from the step or from the run's replay.db."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.lab import lost_probes
from agent.lab.replay import aggregate
from memory_store.store import Store

# (turn, kind, full right, gated right, gate fired, re-read path, messages brought back, fact turn)
STEPS = [(1, "fact", None, None, False, "", [], None),
         (2, "probe", True, False, False, "", [], 1),  # never fired
         (3, "probe", True, False, True, "targeted", [900], 1),  # fired on another message
         (4, "probe", True, False, True, "targeted", ["FACT"], 1),  # the fact came back, still wrong
         (5, "probe", True, False, True, "copied", [], 1),  # everything came back, still wrong
         (6, "probe", True, True, True, "copied", [], 1),  # answered: not lost
         (7, "probe", False, False, False, "", [], 1)]  # the full cache missed it too: not lost


def _steps(policy: str, fact_id: int | None, with_fact_message: bool) -> list[dict]:
    out = []
    for turn, kind, full_ok, gated_ok, fired, path, back, fact in STEPS:
        gated = policy != "full"
        step = {"turn": turn, "kind": kind, "gate_fired": gated and fired, "reread_path": path if gated else "",
                "reread_messages": [fact_id if m == "FACT" else m for m in back] if gated else [],
                "gate_threshold": 20.0, "certificate_detail": {"sketch.max": 5.0} if gated else {}}
        if kind == "probe":
            step.update(correct=gated_ok if gated else full_ok, category="paraphrased" if turn % 2 else "verbatim",
                        distance=turn - 1, fact_turn=fact, answer=f"{policy} answer {turn}")
            if with_fact_message:
                step["fact_message"] = fact_id
        out.append(step)
    return out


def _folder(tmp_path: Path, with_fact_message: bool) -> Path:
    """Results of one script under full and poisson+gate; without ``fact_message`` the user messages come from
    a real log, as older runs' folders keep it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store(tmp_path / "replay.db")
    conv = store.create_conversation("replay", model="m").id
    ids = [store.append_message(conv, "user", f"turn {t}").id for t, *_ in STEPS]
    store.close()
    runs = [{"script": "chat.jsonl", "policy": policy, "budget": "10%", "seed": 0, "conversation_id": conv,
             "steps": _steps(policy, ids[0], with_fact_message)} for policy in ("full", "poisson+gate")]
    (tmp_path / "results.json").write_text(json.dumps({"format": aggregate.FORMAT, "meta": {}, "runs": runs}),
                                           encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("with_fact_message", [True, False], ids=["fact_message", "replay.db"])
def test_every_lost_probe_is_classed_by_what_the_gate_did(tmp_path: Path, with_fact_message: bool) -> None:
    lost = lost_probes.account([_folder(tmp_path, with_fact_message)])
    assert [(x.turn, x.cls) for x in lost] == [(2, lost_probes.NEVER), (3, lost_probes.OTHER),
                                               (4, lost_probes.STILL_WRONG), (5, lost_probes.STILL_WRONG)]
    assert lost[0].under == "5.0 / 20.0 (25%)" and lost[1].under == ""
    assert lost[0].answer == "poisson+gate answer 2" and lost[0].full_answer == "full answer 2"


def test_a_targeted_firing_without_the_facts_message_is_unknown_not_guessed(tmp_path: Path) -> None:
    folder = _folder(tmp_path, with_fact_message=False)
    (folder / "replay.db").unlink()
    assert [x.cls for x in lost_probes.account([folder])] == [lost_probes.NEVER, lost_probes.UNKNOWN,
                                                              lost_probes.UNKNOWN, lost_probes.STILL_WRONG]


def test_the_command_prints_the_counts_and_every_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert lost_probes.main([str(_folder(tmp_path, True))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 probes the full cache answered and poisson+gate did not.")
    assert "| never fired | 0 | 1 | 1 |" in out and "| fact back, still wrong | 1 | 1 | 2 |" in out
    assert out.count("| chat |") == 4
    assert lost_probes.main([str(tmp_path / "missing")]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_the_full_run_may_come_from_another_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "both", with_fact_message=False)
    doc = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "results.json").write_text(json.dumps({**doc, "runs": doc["runs"][:1]}), encoding="utf-8")
    (folder / "results.json").write_text(json.dumps({**doc, "runs": doc["runs"][1:]}), encoding="utf-8")
    assert lost_probes.account([folder]) == [], "no full run: nothing to account for"
    lost = lost_probes.account([tmp_path / "full", folder])
    assert [x.cls for x in lost] == [lost_probes.NEVER, lost_probes.OTHER, lost_probes.STILL_WRONG,
                                     lost_probes.STILL_WRONG], "the gated run's own replay.db names the fact"
