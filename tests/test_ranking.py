"""The ranking lab (agent/lab/ranking.py): each scorer on constructed inputs, the candidate rule, the metrics, and the
chat model's own embeddings (native/embedder.py) on the smallest registry model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from agent.lab import ranking
from agent.lab.replay import locomo, script


def _docs(*texts: str) -> list[Counter[str]]:
    return [Counter(ranking.words(t)) for t in texts]


def test_words_lowercase_and_drop_stopwords() -> None:
    assert ranking.words("What is MY bike-lock code?") == ["bike", "lock", "code"]


def test_bm25_ranks_the_message_sharing_rare_words_first() -> None:
    docs = _docs("I went to the shop today and the weather was nice today",
                 "My bike lock combination is 9305, by the way",
                 "Today the shop was closed and today I was sad",
                 "The weather today is nice")
    scores = ranking.bm25_scores(ranking.words("what is my bike lock combination today"), docs)
    assert int(np.argmax(scores)) == 1
    assert ranking.bm25_scores(["zebra"], docs).tolist() == [0.0] * 4


def test_bm25_prefers_the_shorter_of_two_messages_with_the_word() -> None:
    docs = _docs("piano", "piano " + " ".join(f"filler{i}" for i in range(30)), "other")
    scores = ranking.bm25_scores(["piano"], docs)
    assert scores[0] > scores[1] > scores[2] == 0.0


def test_recency_ranks_the_newest_candidate_first() -> None:
    cands = [0, 1, 2, 3, 4]
    assert ranking.order(ranking.recency_scores(cands), cands) == [4, 3, 2, 1, 0]


def test_ties_break_newest_first() -> None:
    cands = [0, 1, 2, 3]
    assert ranking.order(np.array([0.0, 5.0, 0.0, 0.0]), cands) == [1, 3, 2, 0]
    assert ranking.ranks_of(np.array([0.0, 5.0, 0.0, 0.0]), cands).tolist() == [4, 1, 3, 2]


def test_rrf_of_two_rankings_orders_by_summed_reciprocal_ranks() -> None:
    # mirrored rankings: the two ends tie, and the middle, second on both, trails them (1/x is convex)
    a = np.array([1, 2, 3])
    b = np.array([3, 2, 1])
    fused = ranking.rrf([a, b], k=60)
    assert fused[0] == pytest.approx(fused[2]) and fused[1] < fused[0]
    c = np.array([2, 1, 3])
    fused = ranking.rrf([np.array([1, 2, 3]), c], k=1)
    assert ranking.order(fused, [0, 1, 2]) == [1, 0, 2]  # the tie at the top goes to the newer
    assert fused.tolist() == pytest.approx([1 / 2 + 1 / 3, 1 / 3 + 1 / 2, 1 / 4 + 1 / 4])


def test_minmax_fusion_ignores_a_constant_signal() -> None:
    fused = ranking.minmax_fuse([np.array([1.0, 3.0, 2.0]), np.array([7.0, 7.0, 7.0])])
    assert fused.tolist() == pytest.approx([0.0, 0.5, 0.25])


def test_fact_rank_is_the_best_of_its_messages_or_none() -> None:
    cands = [0, 1, 2, 3]
    scores = np.array([0.1, 0.9, 0.5, 0.7])
    assert ranking.fact_rank(scores, cands, [2]) == 3
    assert ranking.fact_rank(scores, cands, [2, 3]) == 2
    assert ranking.fact_rank(scores, cands, [7]) is None


def test_recall_at_k_and_mrr_on_a_constructed_rank_list() -> None:
    ranks = [1, 2, 4, 10]
    assert [ranking.recall_at(ranks, k) for k in (1, 3, 5)] == [0.25, 0.5, 0.75]
    assert ranking.mrr(ranks) == pytest.approx((1 + 0.5 + 0.25 + 0.1) / 4)


def test_random_expectation() -> None:
    assert ranking.random_hit(10, 1, 3) == pytest.approx(0.3)
    assert ranking.random_hit(10, 2, 1) == pytest.approx(0.2)
    assert ranking.random_hit(4, 1, 5) == 1.0
    assert ranking.random_mrr(4, 1) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)


def test_candidates_leave_out_the_recent_window() -> None:
    assert ranking.candidates(10, recent=4) == [0, 1, 2, 3, 4, 5]
    assert ranking.candidates(3, recent=4) == []


def _script(tmp_path: Path) -> script.Script:
    lines = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Hi. By the way my locker code is 4172."},
             {"role": "assistant", "content": "Noted."}]
    for i in range(4):
        lines += [{"role": "user", "content": f"filler question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    lines += [{"role": "user", "content": "What is my locker code?", "probe": {"expect": ["4172"], "fact_turn": 1}},
              {"role": "assistant", "content": "4172."},
              {"role": "user", "content": "What did I just ask?", "probe": {"expect": ["locker"], "fact_turn": 5}}]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return script.load(path)


def test_a_scripts_probes_point_at_the_fact_turns_user_message(tmp_path: Path) -> None:
    chat = ranking.chat_of_script(_script(tmp_path), "long")
    first, second = chat.cases
    assert chat.messages[0].role == "system" and chat.messages[first.facts[0]].text.endswith("4172.")
    assert first.history == 11 and first.facts == (1,)
    assert second.history == 13 and chat.messages[second.facts[0]].text == "filler question 3"
    costs = ranking.Costs()
    rows = ranking.rank_chat(chat, [ranking.Recency(), ranking.BM25()], 4, costs)
    assert rows[0].ranks == {"recency": 6, "bm25": 1}
    assert rows[1].ranks == {"recency": None, "bm25": None}  # the fact sits in the recent window
    assert len(costs.per_turn["bm25"]) == 2 and len(costs.per_chat["bm25"]) == 1


def test_the_command_writes_the_table_and_every_probes_ranks(tmp_path: Path) -> None:
    s = _script(tmp_path)
    assert ranking.main(["--long", s.source, "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "ranking.json").read_text(encoding="utf-8"))
    assert doc["signals"] == ["recency", "bm25"]
    assert [p["ranks"] for p in doc["probes"]] == [{"recency": 6, "bm25": 1}, {"recency": None, "bm25": None}]
    lines = (tmp_path / "out" / "table.md").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("| bm25 | 1.00 | 1.00 | 1.00 | 1.00 |") for line in lines)
    assert lines[-1].startswith("`python -m agent.lab.ranking --long")


def test_the_encoder_finds_a_paraphrase_said_in_passing_by_its_best_sentence(tmp_path: Path) -> None:
    lines = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "We hiked all day along the ridge and the views were wide. Oh, and my "
                                         "cat is called Purrnickel. Then we cooked pasta at the hut and slept early."},
             {"role": "assistant", "content": "Sounds lovely."}]
    for i in range(4):
        lines += [{"role": "user", "content": f"Tell me a fact about the number {i}."},
                  {"role": "assistant", "content": f"{i} is a number."}]
    lines += [{"role": "user", "content": "What did I name my feline?", "probe": {"expect": ["Purrnickel"],
                                                                                  "fact_turn": 1}}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    chat = ranking.chat_of_script(script.load(path), "long")
    assert ranking.main(["--long", str(path), "--encoder", "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "ranking.json").read_text(encoding="utf-8"))
    ranks = doc["probes"][0]["ranks"]
    assert chat.cases[0].facts == (1,)
    assert ranks["minilm sent"] == 1 and ranks["bm25"] != 1  # no word in common: BM25 falls back to recency
    assert {"minilm", "minmax bm25+minilm sent"} <= set(ranks)


def test_recorded_sketch_ranks_by_anomaly_and_puts_unread_messages_last(tmp_path: Path) -> None:
    chat = ranking.chat_of_script(_script(tmp_path), "long")
    readings = {"1": {"anomaly": 0.5}, "3": {"anomaly": 4.0}, "5": {"anomaly": 2.0}}
    steps = [{"kind": "probe", "certificate_detail": {"sketch.messages": readings}}, {"kind": "probe"}]
    runs = [{"script": "s", "policy": "poisson", "steps": steps}, {"script": "s", "policy": "full", "steps": []}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {}, "runs": runs}), encoding="utf-8")
    sketch = ranking.RecordedSketch([path], "poisson")
    sketch.prepare(chat)
    cands = ranking.candidates(chat.cases[0].history)
    scores, _ = sketch.scores(chat.cases[0], cands)
    assert ranking.order(scores, cands)[:3] == [3, 5, 1] and ranking.order(scores, cands)[3] == 6
    assert ranking.fact_rank(scores, cands, chat.cases[0].facts) == 3


def test_locomo_evidence_names_the_assistant_message_that_holds_it() -> None:
    sample = {"conversation": {
        "speaker_a": "Ann", "speaker_b": "Bob", "session_1_date_time": "1 May",
        "session_1": [{"speaker": "Ann", "dia_id": "D1:1", "text": "Hello"},
                      {"speaker": "Bob", "dia_id": "D1:2", "text": "I adopted a dog named Rex"},
                      {"speaker": "Ann", "dia_id": "D1:3", "text": "Nice"},
                      {"speaker": "Bob", "dia_id": "D1:4", "text": "Thanks"}]},
        "qa": [{"question": "What is Bob's dog called?", "answer": "Rex", "evidence": ["D1:2"], "category": 4}]}
    options = locomo.Options(categories=(4,))
    s = locomo.convert("t", sample, options)
    chat = ranking.chat_of_script(s, "locomo", locomo.evidence_lines(sample, options))
    (case,) = chat.cases
    assert chat.messages[case.facts[0]] == ranking.Message("assistant", "Bob: I adopted a dog named Rex")
    assert case.question == "What is Bob's dog called?"


# -- the chat model's own embeddings ----------------------------------------------------------------------------------

def test_embeddings_have_the_models_width_are_deterministic_and_keep_near_texts_near(
        model_path: Callable[[str], Path]) -> None:
    from native.embedder import Embedder

    emb = Embedder(model_path("smollm2-135m"), n_ctx=256)
    try:
        arch = emb.model.meta("general.architecture")
        n_embd = int(emb.model.meta(f"{arch}.embedding_length") or 0)  # the GGUF's word, not the embedder's
        texts = ["My sister Odile lives in Lyon and teaches piano.",
                 "My sister Odile lives in Lyon and teaches violin.",
                 "The quarterly tax filing deadline moved to Friday."]
        packed = emb.embed(texts)
        assert packed.shape == (3, n_embd) and np.isfinite(packed).all()
        alone = np.stack([emb.embed([t])[0] for t in texts])
        # packing texts into one decode does not change a vector (beyond the summation order of a larger matmul)
        assert all(ranking.cosine_scores(a, p[None, :])[0] > 0.999 for a, p in zip(alone, packed))
        np.testing.assert_array_equal(emb.embed(texts[:1]), emb.embed(texts[:1]))
        sims = ranking.cosine_scores(packed[0], packed)
        assert sims[0] == pytest.approx(1.0, abs=1e-5)
        assert sims[1] > sims[2]
        assert emb.embed(["x" * 5000])[0].shape == (n_embd,)  # cut to n_ctx tokens, not refused
    finally:
        emb.close()
