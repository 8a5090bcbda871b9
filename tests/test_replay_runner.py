"""The runner and the CLI on the real small model and a real SQLite log (policy `full`, and one evicting run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from agent.config import Config
from agent.lab import cli_replay
from agent.lab.replay import runner, script
from agent.lab.replay.runner import Job, Runner
from agent.llm.engine import Engine, _log_softmax_at
from memory_store.store import Store

LINES = [
    {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
    {"role": "user", "content": "My locker code is 4172. Please remember it."},
    {"role": "assistant", "content": "Got it: your locker code is 4172."},
    {"role": "user", "content": "Say hello."},
    {"role": "user", "content": "What is my locker code?", "probe": {"expect": ["4172"], "fact_turn": 1}},
    {"role": "assistant", "content": "Your locker code is 4172."},
    {"role": "user", "content": "Repeat my locker code.", "probe": {"expect": ["4172"], "fact_turn": 1},
     "independent": True},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


ENGINE = {"n_ctx": 1024, "threads": 1}
"""The module's engine (conftest's ``engine``): a smaller context, one thread as the runner's config."""


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n", encoding="utf-8")
    return path


def _runner(engine: Engine, tmp_path: Path) -> Runner:
    cfg = Config(model="smollm2-135m", n_ctx=1024, max_tokens=16, threads=1, evict_from=0)
    return Runner(cfg, engine, "smollm2-135m", Store(tmp_path / "replay.db"))


def test_a_script_replays_with_the_same_history_for_every_policy(engine: Engine, tmp_path: Path, tiny: Path) -> None:
    s = script.load(tiny)
    r = _runner(engine, tmp_path)
    run = r.run(Job(s.name, "full", "100%", 0), s)
    steps = run["steps"]
    assert [x["kind"] for x in steps] == ["fact", "filler", "probe", "probe", "filler"]
    assert [x["forced"] for x in steps] == [True, False, False, False, True]
    probe = steps[2]
    assert probe["distance"] == 2 and probe["expected"] == ["4172"] and probe["answer_tokens"] > 0
    assert probe["correct"] == ("4172" in probe["answer"].lower())
    # the generated probe answer was replaced by the script's text, and the independent probe discarded
    history = r.store.history(run["conversation_id"])
    kept = [m for m in history.messages if not m.meta.get("discarded")]
    assert [m.content for m in kept if m.role == "assistant"][0] == "Got it: your locker code is 4172."
    assert "Your locker code is 4172." in [m.content for m in kept]
    assert "Repeat my locker code." not in [m.content for m in kept]
    # each probe names the logged message that stated its fact (the lost-probe account checks re-reads against it)
    fact = next(m for m in kept if m.role == "user" and m.content.startswith("My locker code"))
    assert steps[2]["fact_message"] == fact.id and steps[3]["fact_message"] == fact.id
    tokens = [int(t) for m in kept for t in m.tokens]
    assert engine.cache.tokens == tokens  # the cache holds exactly the shared history
    summary = run["summary"]
    assert summary["n_probes"] == 2 and summary["gate_rate"] == 0.0 and summary["reprefill_tokens"] == 0
    assert summary["reprefill_tokens_every_turn"] == sum(x["history_tokens"] for x in steps)
    assert summary["peak_live_cells"] >= len(tokens)


def test_runs_are_deterministic(engine: Engine, tmp_path: Path, tiny: Path) -> None:
    s = script.load(tiny)
    a = _runner(engine, tmp_path / "a").run(Job(s.name, "full", "100%", 0), s)
    b = _runner(engine, tmp_path / "b").run(Job(s.name, "full", "100%", 0), s)
    assert [x.get("answer") for x in a["steps"]] == [x.get("answer") for x in b["steps"]]


def test_one_shot_protocol_keeps_the_history_full(engine: Engine, tmp_path: Path, tiny: Path) -> None:
    s = script.load(tiny)
    r = _runner(engine, tmp_path)
    multi = r.run(Job(s.name, "full", "100%", 0, "multi-round"), s)
    one = r.run(Job(s.name, "full", "100%", 0, "one-shot"), s)
    # under `full` both protocols see the same history, so the answers agree
    assert [x.get("answer") for x in one["steps"]] == [x.get("answer") for x in multi["steps"]]
    # with generate_fillers the scripted turns are answered (then replaced) in both protocols
    r.generate_fillers = True
    filled = [r.run(Job(s.name, "full", "100%", 0, p), s) for p in ("multi-round", "one-shot")]
    for run in filled:
        assert not run["steps"][0]["forced"] and run["steps"][0]["answer_tokens"] > 0
        assert run["steps"][0]["answer"] != "Got it: your locker code is 4172."
    assert filled[0]["steps"][0]["answer"] == filled[1]["steps"][0]["answer"]
    history = [m.content for m in r.store.history(filled[1]["conversation_id"]).messages
               if not m.meta.get("discarded")]
    assert "Got it: your locker code is 4172." in history


def test_scored_replies_are_the_models_teacher_forced_log_probabilities(engine: Engine, tmp_path: Path,
                                                                        tiny: Path) -> None:
    """``score_replies`` records each scripted reply's log-probability (forced and replacing a probe's answer);
    it equals one-token-at-a-time decoding of the same history and changes nothing else in the run."""
    s = script.load(tiny)
    plain = _runner(engine, tmp_path / "plain").run(Job(s.name, "full", "100%", 0), s)
    r = _runner(engine, tmp_path / "scored")
    r.score_replies = True
    run = r.run(Job(s.name, "full", "100%", 0), s)
    scored = {x["turn"]: x for x in run["steps"] if "reply_scored_tokens" in x}
    # the independent probe and the reply the model wrote are not scored
    assert sorted(scored) == [st.turn for st in s.steps if st.assistant is not None and not st.independent]
    assert len(scored) == 3
    assert [x.get("answer") for x in run["steps"]] == [x.get("answer") for x in plain["steps"]]
    assert all(x["logprob_mean"] is None for x in run["steps"] if x["forced"])
    kept = [m for m in r.store.history(run["conversation_id"]).messages if not m.meta.get("discarded")]
    tokens = [int(t) for m in kept for t in m.tokens]
    assert engine.cache.tokens == tokens
    reply = next(m for m in kept if m.role == "assistant")  # turn 1's reply
    assert scored[1]["reply_scored_tokens"] > 3
    first = sum(len(m.tokens) for m in kept[:kept.index(reply)])
    reply_tokens = tokens[first:first + scored[1]["reply_scored_tokens"] + 1]
    engine.reset()
    engine.feed(tokens[:first + 1], segment=0)
    total = 0.0
    for token in reply_tokens[1:]:
        total += _log_softmax_at(engine.ctx.logits(-1), token)
        engine.feed([token], segment=0)
    assert scored[1]["reply_logprob_sum"] == pytest.approx(total, abs=0.02 * len(reply_tokens))
    assert total / len(reply_tokens) > -8  # a fitting reply, not noise: ln(vocab) ≈ −11


def test_jobs_plan_and_shard() -> None:
    s1 = script.Script("a", None, (script.Step(1, "hi", 1),))
    s2 = script.Script("b", None, (script.Step(1, "hi", 1),))
    jobs = runner.plan_jobs([s1, s2], ["full", "topk", "poisson+gate"], ["10%", "25%"], seeds=3)
    # full once (budget-free), topk once per budget (seed-free), the gated system per budget and seed
    assert len(jobs) == 2 * (1 + 2 + 2 * 3)
    parts = [runner.shard(jobs, f"{i}/3") for i in (1, 2, 3)]
    assert sorted(sum(parts, []), key=jobs.index) == jobs
    for bad in ("0/2", "3/2", "x", "1-2"):
        with pytest.raises(runner.RunError, match="--shard"):
            runner.shard(jobs, bad)
    with pytest.raises(runner.RunError, match="unknown lru"):
        runner.parse_policies("full,lru")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="certchat")
    sub = parser.add_subparsers(dest="command")
    cli_replay.register(sub)
    return parser


def _cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.argv = argv  # as agent.cli.main.main records what was typed
    return args.func(args)


def test_cli_json_shards_and_merge(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps(x) for x in LINES[:6]) + "\n", encoding="utf-8")
    common = ["--policy", "full", "--model", "smollm2-135m", "--max-tokens", "8", "--threads", "1",
              "--no-progress", "--json"]
    assert _cli(["replay", str(tiny), str(other), *common, "--out", str(tmp_path / "all")]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(runner_keys := whole["runs"][0]) >= set(("policy", "budget", "seed", "recall", "recall_distance_ge_25",
                                                        "n_probes", "gate_rate", "reprefill_tokens",
                                                        "reprefill_tokens_every_turn", "wall_s", "decode_tok_s",
                                                        "peak_live_cells")), runner_keys
    assert whole["runs"][0]["n_probes"] == 3
    for i in (1, 2):
        assert _cli(["replay", str(tiny), str(other), *common, "--shard", f"{i}/2", "--no-plots",
                     "--out", str(tmp_path / f"shard{i}")]) == 0
        capsys.readouterr()
    assert _cli(["replay", "merge", str(tmp_path / "shard1"), str(tmp_path / "shard2"), "--json", "--no-plots",
                 "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert merged["runs"][0]["recall"] == whole["runs"][0]["recall"]
    assert merged["runs"][0]["n_probes"] == 3
    out = tmp_path / "all"
    assert (out / "results.json").exists() and (out / "table.md").exists() and (out / "recall.png").exists()
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["model"] == "smollm2-135m" and "replay" in doc["meta"]["command"]


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "x"}\n{"role": "assistant"}\n')
    assert _cli(["replay", str(bad), "--policy", "full"]) == 1
    assert capsys.readouterr().err.strip() == f"certchat replay: {bad}:2: \"content\" must be a string, got NoneType"
    assert _cli(["replay", str(bad), "--policy", "lru"]) == 1
    assert "unknown lru" in capsys.readouterr().err
    assert _cli(["replay"]) == 1
    assert "give SCRIPT files" in capsys.readouterr().err


def test_logged_conversation_replays_as_agreement_probes(engine: Engine, tmp_path: Path, tiny: Path) -> None:
    from agent.lab.replay import logged

    s = script.load(tiny)
    r = _runner(engine, tmp_path)
    run = r.run(Job(s.name, "full", "100%", 0), s)
    again = logged.from_store(r.store, run["conversation_id"])
    # the probe metadata is not in a chat log: answered turns become agreement probes
    assert [st.user for st in again.steps] == [st.user for st in s.steps]
    assert again.steps[3].independent and again.steps[0].probe.expect == ()
    assert again.steps[2].assistant == "Your locker code is 4172."
    replayed = r.run(Job(again.name, "full", "100%", 0), again)
    assert replayed["steps"][0]["f1"] is not None and replayed["summary"]["n_probes"] == 0


def test_policies_other_than_full_go_through_the_cache_manager(engine: Engine, tmp_path: Path, tiny: Path) -> None:
    s = script.load(tiny)
    r = _runner(engine, tmp_path)
    run = r.run(Job(s.name, "poisson", "10%", 0), s)
    assert run["summary"]["peak_live_cells"] > 0
    assert any(x["evictions"] for x in run["steps"])


def test_policy_variants() -> None:
    assert runner.parse_policies("poisson,poisson@page_size=1@top_share=0") == [
        "poisson", "poisson@page_size=1@top_share=0"]
    base = Config()
    cfg = runner.policy_config(base, Job("s", "poisson+gate@page_size=1", "10%", 2), gate="0.3")
    assert (cfg.policy, cfg.page_size, cfg.gate, cfg.seed) == ("poisson", 1, "0.3", 2)
    for bad in ("poisson@budget=5%", "poisson@nope=1", "poisson@page_size=x", "poisson@page_size",
                "poisson@gate=0.3"):
        with pytest.raises(runner.RunError, match="variant|needs a int|only poisson\\+gate"):
            runner.parse_policies(bad)
    cfg = runner.policy_config(base, Job("s", "poisson+gate@gate=0.45", "10%", 0), gate="0.3")
    assert cfg.gate == "0.45"
    # a switch is parsed, not kept as a (truthy) string
    for word, on in (("false", False), ("off", False), ("true", True), ("1", True)):
        cfg = runner.policy_config(base, Job("s", f"poisson+gate@frame_shift={word}", "10%", 0), gate="0.3")
        assert cfg.frame_shift is on
    with pytest.raises(runner.RunError, match="frame_shift needs true or false, got 'maybe'"):
        runner.parse_policies("poisson@frame_shift=maybe")
    jobs = runner.plan_jobs([script.Script("a", None, (script.Step(1, "hi", 1),))],
                            ["full@max_tokens=8", "topk"], ["10%"], seeds=2)
    assert [(j.policy, j.budget) for j in jobs] == [("full@max_tokens=8", "100%"), ("topk", "10%")]


SHARED_LOCOMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "30.json"


@pytest.mark.skipif(not SHARED_LOCOMO.exists(), reason="the shared LoCoMo data is not in this checkout")
def test_cli_locomo_quick_run_and_converter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["replay", "convert-locomo", str(SHARED_LOCOMO), "--qa-category", "2,4", "--max-sessions", "1",
                 "--out", str(tmp_path / "scripts")]) == 0
    converted = script.load(tmp_path / "scripts" / "locomo-30-s1.jsonl")
    assert converted.probes and all(p.independent for p in converted.probes)
    capsys.readouterr()
    assert _cli(["replay", "--locomo", str(SHARED_LOCOMO), "--qa-category", "2,4", "--max-sessions", "1",
                 "--max-probes", "2", "--policy", "full", "--model", "smollm2-135m", "--max-tokens", "8",
                 "--threads", "1", "--no-progress", "--no-plots", "--json", "--out", str(tmp_path / "run")]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert row["n_probes"] == 2 and row["f1"] is not None and 0.0 <= row["f1"] <= 1.0
