"""`certchat bench`: the speed claims, measured with both sides printed in one run.

- decode tokens/s with a long history: `full` (the whole history in the cache) against
  `poisson` at a 10% budget after eviction + compaction, and against a fresh context
  holding only the budget's worth of tokens (the best eviction can do);
- the in-graph certificate's cost on decode (on vs off at the same live cells);
- the per-turn overhead of eviction + certificate + store writes in a real session turn, for
  both eviction timings (config `evict_at`: after the question, or at the end of the turn);
- the design core's time for one eviction round at 32k cells;
- a gated turn against a steady-state turn, for each re-read mode: the default gate on a question about an
  evicted fact (a targeted re-read of the messages it points at), a forced re-prefill of the whole history,
  and the next gated turn, which restores the first re-read's copy (config ``reread_copy``) and prefills only
  what came after it;
- the evicted-key sketch in those turns (``--sketch-layers``): the gate's read of it (scoring + per-message
  shares) and each round's quantisation, as a share of the steady turn, and its bytes per evicted token.
- turn time and time to first token by history length (1k … 16k), the full cache against a 10% cache
  side by side: where eviction starts to pay on this machine (config ``evict_from``).

Numbers depend on the machine: the report names the model, threads and sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from agent import models
from agent.config import EVICT_AT, Config
from agent.llm.engine import Engine, EngineSettings
from native import llama, poisson, sketch

SKETCH_LAYERS = "3,11"
"""The sketch's layers when the config has none: the calibrated set for qwen (agent/gate/gate_calibration.json)."""


def _say(text: str) -> None:
    """Progress on stderr, so the report on stdout stays clean."""
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def _history_tokens(model: llama.Model, n: int) -> list[int]:
    """Real conversational text (LoCoMo if the shared data is there), tokenized, n tokens."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "data" / "locomo"
    text = ""
    if shared.exists():
        for path in sorted(shared.glob("*.json")):
            data = json.loads(path.read_text())
            conv = data.get("conversation", data)
            for key in sorted(k for k in conv if k.startswith("session_") and k[8:].isdigit()):
                for turn in conv[key]:
                    text += f"{turn.get('speaker', '')}: {turn.get('text', '')}\n"
    if not text:
        text = "The lighthouse keeper wrote the weather down every evening, as her mother had. " * 64
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    while len(tokens) < n:
        tokens = tokens + tokens
    return tokens[:n]


def _record_decode(out: dict[str, Any], name: str, engine: Engine, steps: int, repeats: int = 3) -> None:
    """``out[f"decode_tok_s_{name}"]``: the median of ``repeats`` runs of ``_decode_rate`` (one run of 32 steps
    varies by ±5% on a quiet 2-core machine, so a ratio of single runs can move by a tenth), the runs beside it."""
    runs = [_decode_rate(engine, steps) for _ in range(repeats)]
    out[f"decode_tok_s_{name}_runs"] = runs
    out[f"decode_tok_s_{name}"] = float(np.median(runs))


def _decode_rate(engine: Engine, steps: int) -> float:
    """Greedy decode ``steps`` tokens; tokens/s. The cache is put back afterwards."""
    start_pos = engine.next_pos
    sampler = llama.Sampler(llama.SamplerParams(), engine.info.n_vocab)
    try:
        gen = engine.generate(sampler, steps, segment=-1)
    finally:
        sampler.close()
    engine.truncate(start_pos)
    # Fresh logits for the last position, so the next measurement starts the same way.
    last = engine.cache.tokens[-1]
    engine.truncate(start_pos - 1)
    engine.feed([last], segment=-1)
    return len(gen.tokens) / (gen.decode_ms / 1000.0) if gen.decode_ms > 0 else 0.0


def design_ms(n: int = 32768, repeats: int = 20) -> float:
    """Median ms of one eviction round's design (probabilities + draws + bias) at n cells."""
    rng = np.random.default_rng(0)
    scores = rng.pareto(1.5, n)
    protected = np.zeros(n, dtype=bool)
    protected[:4] = True
    protected[-32:] = True
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        poisson.plan_eviction(scores, protected, 0.1 * n, method="poisson", page_size=8, top_share=0.5,
                              seed=1, round=r)
        times.append((time.perf_counter() - t) * 1000.0)
    return float(np.median(times))


def run(model_name: str, history: int, budget_share: float, threads: int, steps: int) -> dict[str, Any]:
    path = models.resolve(model_name)
    out: dict[str, Any] = {"model": model_name, "threads": threads, "history_tokens": history,
                           "budget_share": budget_share, "decode_steps": steps, "cpu_count": os.cpu_count()}
    budget = int(history * budget_share)

    # 1. long history: full vs poisson-after-compaction, same engine, same prefill.
    eng = Engine(EngineSettings(model_path=path, n_ctx=history + 512, n_batch=512, threads=threads))
    eng.set_readout(True, 32)
    toks = _history_tokens(eng.model, history)
    _say(f"prefilling {history} tokens of {model_name} ({threads} threads)")
    out["prefill_ms_history"] = eng.feed(toks, segment=0)
    importance = eng.read_importance().per_position(eng.cache.positions)
    eng.set_readout(False, 32)
    _say("decode with the full cache")
    _record_decode(out, "full", eng, steps)
    positions = np.asarray(eng.cache.positions)
    protected = np.zeros(len(positions), dtype=bool)
    protected[:4] = True
    protected[-32:] = True
    t = time.perf_counter()
    plan = poisson.plan_eviction(importance, protected, float(budget), method="poisson", page_size=8,
                                 top_share=0.5, seed=0, round=0, positions=positions)
    out["design_ms_history"] = (time.perf_counter() - t) * 1000.0
    t = time.perf_counter()
    # removal of the evicted runs, the survivors' biases and the compaction, as a turn's eviction does them
    eng.evict(np.asarray(plan.keep, dtype=bool), plan.cum_logpi)
    out["evict_ms"] = (time.perf_counter() - t) * 1000.0
    out["live_cells_after"] = len(eng.cache)
    _say(f"decode after evicting to {len(eng.cache)} cells and compacting")
    _record_decode(out, "poisson", eng, steps)
    eng.close()

    # 2. a fresh context with only the budget's tokens: the ceiling for an evicted cache.
    fresh = Engine(EngineSettings(model_path=path, n_ctx=budget + 512, n_batch=512, threads=threads))
    fresh.feed(_history_tokens(fresh.model, budget), segment=0)
    _say(f"decode with a fresh {budget}-token context")
    _record_decode(out, "fresh_budget", fresh, steps)

    # 3. certificate cost at the same live cells.
    rates: dict[bool, list[float]] = {}
    for on in (False, True, False, True):
        fresh.set_readout(on, 1)
        rates.setdefault(on, []).append(_decode_rate(fresh, steps))
    off, on_ = max(rates[False]), max(rates[True])
    out["decode_tok_s_cert_off"] = off
    out["decode_tok_s_cert_on"] = on_
    out["certificate_overhead"] = off / on_ - 1.0 if on_ > 0 else None
    fresh.close()

    out["design_ms_32k"] = design_ms(32768)
    return out


FACT = "My gym locker code is 4172."
PROBE = "What was my gym locker code again?"


def _turn_overhead(path: Path, model_name: str, threads: int, history: int, evict_at: str,
                   gated: bool = True, sketch_layers: str = "", sketch_bits: int = 8) -> dict[str, Any]:
    """Real session turns at a ``history``-token conversation: where the time goes.

    The overhead the issue bounds is eviction + certificate + store writes (the phases the
    session times, ``TurnResult.timings``), as a share of the turn's wall time. Reported for
    the first eviction (4k → budget, the largest) and for steady-state turns (each evicts
    about what the previous turn added, as in a long chat). ``evict_at`` chooses when turns evict
    (config ``evict_at``); ``gated`` adds one turn whose gate is forced to fire. With ``sketch_layers`` the
    turns keep the evicted-key sketch: its read by the gate (inside "certificate") and its quantisation (inside
    "evict") are timed on their own as well."""
    from agent import events as ev  # noqa: PLC0415
    from agent.chat.session import ChatSession  # noqa: PLC0415
    from agent.lab.replay import drive  # noqa: PLC0415
    from memory_store.store import Store  # noqa: PLC0415

    cfg = Config(model=model_name, n_ctx=history + 1024, policy="poisson", budget="10%", max_tokens=48, evict_from=0,
                 gate="off", threads=threads, evict_at=evict_at, sketch_layers=sketch_layers, sketch_bits=sketch_bits)
    eng = Engine(EngineSettings(model_path=path, n_ctx=cfg.n_ctx, n_batch=512, threads=threads))
    overhead_phases = ("evict", "certificate", "store")

    def share(r: ev.TurnResult, wall: float) -> float:
        return sum(r.timings.get(k, 0.0) for k in overhead_phases) / wall if wall else float("nan")

    with tempfile.TemporaryDirectory() as tmp:
        session = ChatSession(cfg.replace(policy="full"), Store(Path(tmp) / "bench.db"), eng, model_name)
        # a fact at the start, for the gated turn that asks for it once it is evicted
        drive.forced(session, FACT, "Noted.")
        filler = eng.model.detokenize(_history_tokens(eng.model, 400))
        while eng.next_pos < history:
            drive.forced(session, filler, "I see.")
        session.reconfigure(policy="poisson")
        # the gate's whole read of the sketch (scoring, per-message shares, baselines): its own running total
        gate = session.gate
        sketch_ms: list[dict[str, float]] = []

        def timed(text: str) -> tuple[ev.TurnResult, float]:
            sk = eng.sketch
            before = (gate.sketch_read_ms, 0.0 if sk is None else sk.timing.score_ms,
                      0.0 if sk is None else sk.timing.append_ms, 0 if sk is None else sk.timing.append_tokens)
            t = time.perf_counter()
            r = session.send(text)
            wall = (time.perf_counter() - t) * 1000.0
            sk = eng.sketch if eng.sketch is sk or sk is None else None  # a restore replaces it: not a steady turn
            sketch_ms.append({"read": gate.sketch_read_ms - before[0],
                              "score": 0.0 if sk is None else sk.timing.score_ms - before[1],
                              "quantise": 0.0 if sk is None else sk.timing.append_ms - before[2],
                              "quantised_tokens": 0 if sk is None else sk.timing.append_tokens - before[3],
                              "evicted_tokens": 0 if sk is None else sk.n_tokens})
            return r, wall

        first, first_wall = timed("Summarise what we talked about in one sentence.")
        steady = [timed(q) for q in ("And in three words?", "Which names came up most?",
                                     "Was anything said about travel?", "Anything about work?")]
        if gated:
            # A question about the evicted fact, gated on sketch.max just under the value it reads (measured on a
            # rolled-back copy of the turn first), so the gate fires on the message it points at most: the cost of a
            # targeted re-read, whether or not the calibrated τ would have fired here.
            # A threshold no turn reaches: the probe only reads sketch.max (under "auto", a model the gate is not
            # calibrated for would keep the full cache, agent/eviction/budget.py).
            session.reconfigure(gate="1e30", gate_stat="sketch.max")
            seen = drive.independent(session, PROBE).certificate_detail.get("sketch.max")
            if seen:
                session.reconfigure(gate=f"{0.999 * float(seen):.6g}")
            targeted: tuple[ev.TurnResult, float] | None = timed(PROBE)
            # τ = 0 on the certificate forces the re-prefill of the whole history from the log, and keeps its copy
            session.reconfigure(gate="0", gate_stat="question.max", reread_copy=True)
            gated_turn: tuple[ev.TurnResult, float] | None = timed("One more time, briefly?")
            # fires again: restores the copy the first re-read left, prefills the turn since (config reread_copy)
            gated_again: tuple[ev.TurnResult, float] | None = timed("And the names, briefly?")
        else:
            targeted = gated_turn = gated_again = None
        session.close()
    sketch_keys: dict[str, Any] = {}
    if sketch_layers and eng.sketch is not None:
        sk = eng.sketch
        steady_sk = sketch_ms[1:5]
        read = [x["read"] for x in steady_sk]
        sketch_keys = {
            "sketch_layers": ",".join(str(x) for x in sk.layers), "sketch_bits": sketch_bits,
            "sketch_bytes_per_token": sk.bytes_per_token,
            "sketch_full_row_bytes": 2 * eng.info.n_layer * sk.n_kv_head * sk.head_dim * 2,
            "sketch_evicted_tokens": float(np.median([x["evicted_tokens"] for x in steady_sk])),
            "sketch_read_ms": float(np.median(read)),
            "sketch_score_ms": float(np.median([x["score"] for x in steady_sk])),
            "sketch_quantise_ms": float(np.median([x["quantise"] for x in steady_sk])),
            "sketch_round_tokens": float(np.median([x["quantised_tokens"] for x in steady_sk])),
            "sketch_share": float(np.median([(x["read"] + x["quantise"]) / w
                                             for x, (_, w) in zip(steady_sk, steady)])),
            "first_turn_sketch_quantise_ms": sketch_ms[0]["quantise"],
            "first_turn_sketch_tokens": sketch_ms[0]["quantised_tokens"],
            "sketch_fits": {str(bits): _layers_that_fit(sk.n_kv_head, sk.head_dim, bits,
                                                        2 * eng.info.n_layer * sk.n_kv_head * sk.head_dim * 2 // 16)
                            for bits in (8, 4)},
        }
    eng.close()
    walls = [w for _, w in steady]
    phases = {k: float(np.median([r.timings.get(k, 0.0) for r, _ in steady])) for k in
              (*overhead_phases, "closing", "reprefill")}
    targeted_keys = {} if targeted is None else {
        "targeted_turn_ms": targeted[1], "targeted_path": targeted[0].reread_path or "no re-read",
        "targeted_reprefill_tokens": targeted[0].reprefill_tokens,
        "targeted_reread_messages": len(targeted[0].reread_messages),
        "targeted_reprefill_ms": targeted[0].timings.get("reprefill", 0.0),
        "targeted_recalled": "4172" in targeted[0].answer}
    gated_keys = {} if gated_turn is None or gated_again is None else {
        "gated_turn_ms": gated_turn[1], "gated_reprefill_tokens": gated_turn[0].reprefill_tokens,
        "gated_reprefill_ms": gated_turn[0].timings.get("reprefill", 0.0),
        "gated_again_turn_ms": gated_again[1], "gated_again_reprefill_tokens": gated_again[0].reprefill_tokens,
        "gated_again_restored_tokens": gated_again[0].restored_tokens,
        "gated_again_reprefill_ms": gated_again[0].timings.get("reprefill", 0.0)}
    return {
        "turn_evict_at": evict_at,
        "turn_history_tokens": history,
        "turn_overhead": float(np.median([share(r, w) for r, w in steady])),
        "turn_wall_ms": float(np.median(walls)),
        "turn_prefill_ms": float(np.median([r.prefill_ms for r, _ in steady])),
        "turn_decode_ms": float(np.median([r.decode_ms for r, _ in steady])),
        "turn_answer_tokens": float(np.median([r.answer_tokens for r, _ in steady])),
        **{f"turn_{k}_ms": v for k, v in phases.items()},
        "steady_turn_live_cells": steady[-1][0].live_cells,
        "first_turn_overhead": share(first, first_wall), "first_turn_wall_ms": first_wall,
        **{f"first_turn_{k}_ms": first.timings.get(k, 0.0) for k in overhead_phases},
        "steady_turn_ms": float(np.median(walls)),
        **gated_keys, **targeted_keys,
        **sketch_keys,
    }


def _layers_that_fit(n_kv_head: int, head_dim: int, bits: int, limit: int) -> int:
    """The most sketch layers whose bytes per evicted token stay within ``limit``."""
    n = 0
    while sketch.bytes_per_token(n + 1, n_kv_head, head_dim, bits) <= limit:
        n += 1
    return n
LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048, 4096)
TTFT_LENGTHS = (4096, 16384)
"""The histories at which the user-facing time to first token is printed side by side."""
LENGTH_TURNS = 3
"""Steady turns timed per arm and length (after a first turn, which for an evicting arm is the big first
eviction from the full history)."""
NORMAL_ANSWER = 48
"""Answer length the turn times are compared at: each turn's decode, stretched or cut to this many tokens at
its own measured rate (greedy answers end where they end, and a shorter answer is not a faster chat)."""
QUESTIONS = ("List, one per line, every person mentioned so far and what they did.",
             "Summarise what we talked about, in detail, as a numbered list.",
             "Which places and dates came up? Give each with a sentence of context.",
             "What plans were made, and by whom? Answer in full sentences.",
             "Describe the last three things that were said, one paragraph each.")


@dataclass(frozen=True)
class Arm:
    """One way to run the turns of the length sweep: config changes over the full-cache session that built the
    history. Another arm (a gated turn under some re-read mode) is one more entry in :data:`ARMS`."""

    name: str
    changes: dict[str, Any]


ARMS = (
    Arm("full", {"policy": "full", "gate": "off"}),
    # gate off: eviction rounds and the certificate are paid every turn, no re-read (a firing is its own arm)
    Arm("evicted 10%", {"policy": "poisson", "budget": "10%", "gate": "off", "evict_from": 0}),
)


def _timed_turn(session: Any, text: str) -> dict[str, Any]:
    """One real turn: wall and time to first token (from the call to the first streamed text), its phases."""
    from agent import events as ev  # noqa: PLC0415

    first: list[float] = []

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.TextDelta) and not first:
            first.append(time.perf_counter())

    start = time.perf_counter()
    r = session.send(text, on_event=on_event)
    wall = (time.perf_counter() - start) * 1000.0
    ttft = (first[0] - start) * 1000.0 if first else wall
    per_token = r.decode_ms / r.answer_tokens if r.answer_tokens else 0.0
    return {"wall_ms": wall, "ttft_ms": ttft, "answer_tokens": r.answer_tokens, "decode_ms": r.decode_ms,
            "prefill_ms": r.prefill_ms,
            "decode_ms_per_token": per_token, "live_cells": r.live_cells,
            # the same turn with an answer of NORMAL_ANSWER tokens at its own decode rate
            "turn_ms_normal": wall - r.decode_ms + NORMAL_ANSWER * per_token,
            **{f"{k}_ms": v for k, v in r.timings.items()},
            "ids": (r.user_message_id, r.assistant_message_id)}


def length_sweep(path: Path, model_name: str, threads: int, lengths: tuple[int, ...],
                 arms: tuple[Arm, ...] = ARMS, say: Callable[[str], None] = lambda text: None) -> list[dict[str, Any]]:
    """For each history length: a real conversation forced to that length under the full cache, then, from that
    same state (checkpoint and rollback), each arm's first turn and LENGTH_TURNS steady turns. One row per
    (length, arm) with medians over the steady turns."""
    from agent.chat.session import ChatSession  # noqa: PLC0415
    from agent.lab.replay import drive  # noqa: PLC0415
    from memory_store.store import Store  # noqa: PLC0415

    rows: list[dict[str, Any]] = []
    for history in lengths:
        cfg = Config(model=model_name, n_ctx=history + 1024, max_tokens=NORMAL_ANSWER, threads=threads,
                     policy="full", gate="off")
        eng = Engine(EngineSettings.from_config(cfg, path))
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "bench.db")
            session = ChatSession(cfg, store, eng, model_name)
            text = _history_tokens(eng.model, history)
            say(f"length sweep: building a {history}-token history")
            while eng.next_pos < history - 64:
                # chunks of ≤ 400 tokens, the last cut so the history ends within a few dozen tokens of the length
                take = min(400, history - 32 - eng.next_pos)
                drive.forced(session, eng.model.detokenize(text[:take]), "I see.")
                text = text[take:]
            built = session.checkpoint()
            actual = eng.next_pos
            for arm in arms:
                say(f"length sweep: {history} tokens, {arm.name}")
                session.reconfigure(**{**{"policy": "full", "gate": "off", "budget": "10%",
                                          "evict_from": cfg.evict_from}, **arm.changes})
                turns = [_timed_turn(session, q) for q in QUESTIONS[:LENGTH_TURNS + 1]]
                rows.append({**_length_row(history, arm.name, turns), "history_actual": actual})
                # the next arm starts from the same history: this arm's turns leave the cache and the log
                rounds = session.memory.round
                session.rollback(built)
                session.memory.round = rounds  # eviction rounds are numbered once per conversation in the log
                for t in turns:
                    for mid in t["ids"]:
                        store.update_message_meta(mid, {"discarded": True})
            session.close()
            store.close()
        eng.close()
    return rows


def _length_row(history: int, arm: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    first, steady = turns[0], turns[1:]

    def med(key: str) -> float:
        return float(np.median([t.get(key, 0.0) for t in steady]))
    return {"history": history, "arm": arm, "turns": len(steady),
            **{k: med(k) for k in ("wall_ms", "ttft_ms", "turn_ms_normal", "decode_ms_per_token", "answer_tokens",
                                   "prefill_ms", "evict_ms", "certificate_ms", "closing_ms", "store_ms")},
            "live_cells": steady[-1]["live_cells"],
            "first_turn_ms_normal": first["turn_ms_normal"], "first_turn_evict_ms": first.get("evict_ms", 0.0)}


PAYS_MARGIN = 0.10
"""Eviction pays at a length when its steady turn takes at most (1 − this) of the full cache's: one decode
measurement varies by about ±5% on a quiet 2-core machine (``_record_decode``), so a ratio of two by about ±10%."""


def crossover(rows: list[dict[str, Any]], base: str = "full", other: str = "evicted 10%",
              margin: float = PAYS_MARGIN) -> int | None:
    """The shortest measured history from which ``other``'s steady turn (at NORMAL_ANSWER tokens) beats
    ``base``'s by at least ``margin`` at every longer measured history too; None if it never does."""
    by = {(r["history"], r["arm"]): r["turn_ms_normal"] for r in rows}
    lengths = sorted({r["history"] for r in rows})
    wins = [h for h in lengths
            if (h, base) in by and (h, other) in by and by[(h, other)] <= (1.0 - margin) * by[(h, base)]]
    for i, h in enumerate(lengths):
        if all(x in wins for x in lengths[i:]):
            return h
    return None


def _length_lines(out: dict[str, Any]) -> list[str]:
    rows = out.get("length_sweep") or []
    if not rows:
        return []
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["history"], r["arm"]): r for r in rows}
    lengths = sorted({r["history"] for r in rows})
    lines = ["", f"turn time by history length (steady turns, median of {LENGTH_TURNS}; turn compared at a "
                 f"{NORMAL_ANSWER}-token answer: wall − decode + {NORMAL_ANSWER} × ms/token)",
             "history │ " + " │ ".join(f"{a}: turn / TTFT / ms per token / evict+cert ms" for a in arms)
             + " │ " + " │ ".join(f"{a} / {arms[0]}" for a in arms[1:])]
    for h in lengths:
        cells = []
        for a in arms:
            r = by.get((h, a))
            cells.append("—" if r is None else f"{r['turn_ms_normal']:.0f} / {r['ttft_ms']:.0f} / "
                         f"{r['decode_ms_per_token']:.1f} / {r['evict_ms'] + r['certificate_ms']:.0f}")
        ratios = [f"×{by[(h, a)]['turn_ms_normal'] / by[(h, arms[0])]['turn_ms_normal']:.2f}"
                  if (h, a) in by and (h, arms[0]) in by else "—" for a in arms[1:]]
        lines.append(f"{h:>7} │ " + " │ ".join(cells) + " │ " + " │ ".join(ratios))
    if len(arms) > 1:
        at = crossover(rows, arms[0], arms[1])
        lines.append(f"{arms[1]} faster than {arms[0]} by ≥ {PAYS_MARGIN:.0%} of a turn from: "
                     + (f"{at} tokens of history on (config evict_from)" if at is not None
                        else "never, at these lengths"))
    ttft = [h for h in TTFT_LENGTHS if any(r["history"] == h for r in rows)]
    for h in ttft:
        lines.append(f"time to first token at {h // 1024}k: " + ", ".join(
            f"{a} {by[(h, a)]['ttft_ms']:.0f} ms" for a in arms if (h, a) in by))
    return lines


def _formatter(out: dict[str, Any]) -> Callable[..., str]:
    """``f(key, fmt)``: ``out[key]`` formatted, or "—" when it was not measured."""
    def f(key: str, fmt: str = "{:.1f}") -> str:
        value = out.get(key)
        return fmt.format(value) if isinstance(value, (int, float)) else "—"
    return f


def render(out: dict[str, Any]) -> str:
    f = _formatter(out)
    h = out["history_tokens"]

    def runs(name: str) -> str:
        rates = out.get(f"decode_tok_s_{name}_runs") or []
        return f"  (median of {' / '.join(f'{r:.1f}' for r in rates)})" if len(rates) > 1 else ""
    head = [f"certchat bench — {out['model']}, {out['threads']} threads, {out['cpu_count']} CPUs visible"]
    if "decode_tok_s_full" not in out:
        return "\n".join(head + ([""] + _turn_lines(out) if "turn_wall_ms" in out else []) + _length_lines(out))
    lines = head + [
        f"history {h} tokens, budget {int(out['budget_share'] * 100)}% → {out['live_cells_after']} live cells",
        "",
        f"decode tok/s, full cache ({h} cells)            : {f('decode_tok_s_full')}{runs('full')}",
        f"decode tok/s, poisson after compaction          : {f('decode_tok_s_poisson')}{runs('poisson')}"
        f"   (×{out['decode_tok_s_poisson'] / out['decode_tok_s_full']:.2f} vs full)",
        f"decode tok/s, fresh context at the budget       : {f('decode_tok_s_fresh_budget')}{runs('fresh_budget')}",
        f"evict ms (remove, bias, compact) / design ms    : {f('evict_ms')} / {f('design_ms_history', '{:.2f}')}",
        f"certificate off / on tok/s (overhead)           : {f('decode_tok_s_cert_off')} / "
        f"{f('decode_tok_s_cert_on')} ({f('certificate_overhead', '{:+.1%}')})",
        f"design core, one round at 32k cells             : {f('design_ms_32k', '{:.2f}')} ms",
    ]
    if "turn_wall_ms" in out:
        lines += _turn_lines(out)
    return "\n".join(lines + _length_lines(out))


def _turn_lines(out: dict[str, Any]) -> list[str]:
    lines = _turn_mode_lines(out)
    for mode, other in out.get("turn_by_evict_at", {}).items():
        if mode != out.get("turn_evict_at"):
            lines += _turn_mode_lines(other)
    return lines


def _turn_mode_lines(out: dict[str, Any]) -> list[str]:
    f = _formatter(out)
    lines = [
        f"steady turn at {out['turn_history_tokens']} tokens, evict_at={out.get('turn_evict_at')} (median of 4): "
        f"wall {f('turn_wall_ms', '{:.0f}')} ms = "
        f"prefill {f('turn_prefill_ms', '{:.0f}')} + decode {f('turn_decode_ms', '{:.0f}')} "
        f"({f('turn_answer_tokens', '{:.0f}')} tokens) + evict {f('turn_evict_ms', '{:.0f}')} + certificate "
        f"{f('turn_certificate_ms', '{:.0f}')} + store {f('turn_store_ms', '{:.0f}')} + closing "
        f"{f('turn_closing_ms', '{:.0f}')} ms",
        f"  overhead (evict + certificate + store) / wall    : {f('turn_overhead', '{:.1%}')}   "
        f"first eviction from the full history: {f('first_turn_overhead', '{:.1%}')} of "
        f"{f('first_turn_wall_ms', '{:.0f}')} ms",
    ]
    if "targeted_turn_ms" in out:
        lines.append(f"steady-state turn {f('steady_turn_ms', '{:.0f}')} ms vs a question about an evicted fact "
                     f"(sketch gate at its own value) {f('targeted_turn_ms', '{:.0f}')} ms = ×"
                     f"{out['targeted_turn_ms'] / out['steady_turn_ms']:.2f}: {out.get('targeted_path')} re-read of "
                     f"{out.get('targeted_reread_messages')} messages, {out.get('targeted_reprefill_tokens')} tokens "
                     f"in {f('targeted_reprefill_ms', '{:.0f}')} ms; recalled: {out.get('targeted_recalled')}")
    if "gated_turn_ms" in out:
        lines.append(f"steady-state turn {f('steady_turn_ms', '{:.0f}')} ms vs gated turn "
                     f"{f('gated_turn_ms', '{:.0f}')} ms (re-prefilled {out.get('gated_reprefill_tokens')} tokens in "
                     f"{f('gated_reprefill_ms', '{:.0f}')} ms)")
    if "gated_again_turn_ms" in out:
        lines.append(f"  the next gated turn {f('gated_again_turn_ms', '{:.0f}')} ms: restored "
                     f"{out.get('gated_again_restored_tokens')} tokens from the first re-read's copy, prefilled "
                     f"{out.get('gated_again_reprefill_tokens')} in {f('gated_again_reprefill_ms', '{:.0f}')} ms")
    if "sketch_share" in out:
        n_layers = len(str(out["sketch_layers"]).split(","))
        fits = out.get("sketch_fits", {})
        limit = out["sketch_full_row_bytes"] // 16
        lines += [
            f"  sketch (layers {out['sketch_layers']}, int{out['sketch_bits']}, {f('sketch_evicted_tokens', '{:.0f}')} "
            f"evicted tokens): gate's read {f('sketch_read_ms', '{:.1f}')} ms "
            f"(scoring {f('sketch_score_ms', '{:.1f}')}) "
            f"+ quantise {f('sketch_quantise_ms', '{:.1f}')} ms ({f('sketch_round_tokens', '{:.0f}')} tokens) "
            f"= {f('sketch_share', '{:.2%}')} of the steady turn (target ≤ 5%); first eviction quantised "
            f"{out.get('first_turn_sketch_tokens')} tokens in {f('first_turn_sketch_quantise_ms', '{:.1f}')} ms",
            f"  sketch bytes per evicted token: {out['sketch_bytes_per_token']} for {n_layers} layers "
            f"int{out['sketch_bits']} (target ≤ {limit} = 1/16 of a full K+V row of {out['sketch_full_row_bytes']} B; "
            f"fits: up to {fits.get('8', '—')} layers int8, {fits.get('4', '—')} layers int4)",
        ]
    return lines


def main(args: argparse.Namespace) -> int:
    history = 4096 if args.quick else args.history
    turn_history = 1024 if args.quick else 4096
    out: dict[str, Any] = {"model": args.model, "threads": args.threads, "history_tokens": history,
                           "budget_share": args.budget, "cpu_count": os.cpu_count()}
    keyed: dict[str, Any] = {}
    if args.only in ("all", "decode"):
        out.update(run(args.model, history, args.budget, args.threads, 16 if args.quick else args.steps))
        keyed[f"decode_tok_s_full_{history // 1024}k"] = out["decode_tok_s_full"]
        keyed[f"decode_tok_s_poisson_{history // 1024}k_{int(args.budget * 100)}pct"] = out["decode_tok_s_poisson"]
    if args.only in ("all", "turn"):
        # both eviction timings, side by side; the configured default's figures are the top-level keys
        default = Config().evict_at
        by_mode: dict[str, Any] = {}
        for mode in sorted(EVICT_AT, key=lambda m: m != default):
            by_mode[mode] = _turn_overhead(models.resolve(args.model), args.model, args.threads, turn_history,
                                           evict_at=mode, gated=mode == default, sketch_layers=args.sketch_layers,
                                           sketch_bits=args.sketch_bits)
        out.update(by_mode[default])
        out["turn_by_evict_at"] = by_mode
        for mode, res in by_mode.items():
            out[f"turn_overhead_{mode.replace('-', '_')}"] = res["turn_overhead"]
    if args.only in ("all", "length"):
        lengths = QUICK_LENGTHS if args.quick else LENGTHS
        rows = length_sweep(models.resolve(args.model), args.model, args.threads, lengths, say=_say)
        out["length_sweep"] = rows
        keyed["evict_from_crossover"] = crossover(rows)
        for r in rows:
            if r["history"] in TTFT_LENGTHS:
                arm = "full" if r["arm"] == "full" else "evicted"
                keyed[f"ttft_ms_{arm}_{r['history'] // 1024}k"] = r["ttft_ms"]
    if args.only == "resume":
        from agent.lab import resume_bench  # noqa: PLC0415 — its own figures, printed on their own
        resume_lengths = resume_bench.QUICK_LENGTHS if args.quick else resume_bench.LENGTHS
        rows = resume_bench.run(args.model, resume_lengths, args.threads, _say)
        print(resume_bench.render(args.model, args.threads, rows))
        if args.json:
            print(json.dumps({"model": args.model, "threads": args.threads, "resume": rows}))
        return 0
    keyed = {**out, **keyed}
    print(render(out))
    if args.json:
        print(json.dumps(keyed))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="decode speed with and without eviction, certificate and turn overheads")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--history", type=int, default=16384)
    p.add_argument("--budget", type=float, default=0.10, help="share of the history kept (0.10 = 10%%)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--quick", action="store_true",
                   help="4k history, 1k-token turn, lengths to 4k: a few minutes")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--sketch-layers", dest="sketch_layers", default=Config().sketch_layers or SKETCH_LAYERS,
                   help="the session turns keep an evicted-key sketch of these layers and time it (\"\": none; "
                        f"default: the config's, else {SKETCH_LAYERS})")
    p.add_argument("--sketch-bits", dest="sketch_bits", type=int, default=Config().sketch_bits, choices=(4, 8, 32))
    p.add_argument("--only", choices=("all", "decode", "turn", "length", "resume"), default="all",
                   help="decode: the long-history decode and certificate figures; turn: the session-turn overheads; "
                        "length: turn time and time to first token by history length, full against a 10%% cache "
                        "(1k–16k; --quick: to 4k); resume: continuing a logged chat of 4k, 16k and 32k tokens from "
                        "its saved state against re-reading its log (--quick: 1k, 4k; not part of all)")
    p.set_defaults(func=main)
