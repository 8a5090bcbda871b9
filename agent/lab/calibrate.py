"""``certchat calibrate [MODEL]``: fit a model's gate and certificate on the calibration scripts, and write its record.

A model's gate floor τ, its sketch layers and its certificate's multiplier hold for the model they were fitted on
(agent/gate/calibration.py); a model without them keeps the full cache under ``gate = "auto"``. This command fits
all three, in one replay and three offline fits:

1. **Replay.** The calibration scripts (recall30 seeds 02–05 and 10–17 unless ``--scripts``) under ungated
   Poisson eviction at each budget, from the first turn, every scripted turn answered (fillers too, so the gate's
   false alarms are measured), the evicted-key sketch reading every full-attention layer, and the coverage
   observer capturing the certificate's cells at every probe (agent/lab/replay/capture.py).
2. **Sketch layers.** Of the recorded layers, the subset of at most ``--sketch-max-layers`` that best separates the
   probes from the fillers (agent/lab/fits/sketch_layers.py's ranking: AUC against later-half fillers first).
   ``sketch.max`` for a subset is recomputed exactly from the per-layer shares each turn recorded.
3. **Gate.** ``sketch.max`` in those layers under the adaptive rule of agent/lab/replay/studies.py: the bar
   max(τ, factor × the median of the chat's last 20 turns), τ the floor at a share of the calibration fillers. The
   share and the factor are chosen per model from a small grid by the probes caught on scripts left out of the
   floor's fit (leave one script out), within a cap on filler firings; a model whose questions read weakly against
   its ordinary turns gets a lower bar. The turn-index baseline is reported beside the separation.
4. **Certificate.** Per budget and rounds class, the drift λ per layer and the multiplier k
   (agent.gate.certificate.fit) on the captured cells: the multi-round replay's (the chat's steady state) and a
   one-shot pass's (each probe evicted once from the whole history: a chat's first eviction round). k is the least
   conservative of a few rules (``agent.gate.certificate.RULES``) that covers the calibration conversations at nominal
   when each is left out of the fit, so the coverage a new conversation sees is nominal, not what the largest of
   twelve conversations needed. The cells are kept in the work folder (``--from-results`` refits on them).

5. **Certification.** The long calibration chats (agent/lab/certify.py: generated 8k and 16k chats at
   calibration-only seeds, and the shared LoCoMo) replayed under the full cache and under the fitted gate at 50%,
   25% and 10%; per budget the paired counts, the exact bound on the loss and the certified risk
   (agent/gate/certification.py) go into the record's ``certification``, from which ``budget = "auto"`` takes the
   cheapest budget within the user's risk, or the full cache. ``--certify-only`` certifies the gate a model already
   has; ``--certify-from`` certifies from replays already recorded; the work folder keeps every run, so an
   interrupted certification resumes.

The record goes to the user's calibration dir, keyed by the GGUF's hash (``--ship`` writes the package's copy, for
a registry model). A fit whose gate does not catch at least ``--min-probe-rate`` of the calibration probes is
written as rejected: the model then keeps the full cache, and the record says why. Each script's probes
are scored at the floor fitted without that script, so a rule that only fits its own scripts is not accepted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agent import config as config_mod
from agent import models, paths
from agent.cli import errors as cli_errors
from agent.gate import calibration, certificate
from agent.gate.calibration import Adaptive
from agent.lab import certify
from agent.lab.fits.sketch_records import recorded_ratios
from agent.lab.replay.rank_stats import auc, in_later_half

FIXTURES = Path(__file__).parent / "replay" / "fixtures" / "recall30"
CALIBRATION_SEEDS = (2, 3, 4, 5, *range(10, 18))
"""recall30 seeds 02–05 and 10–17: the calibration split (00, 01, 06–09 and 18–23 are held out)."""
CALIBRATION_SCRIPTS = tuple(FIXTURES / f"seed-{n:02d}.jsonl" for n in CALIBRATION_SEEDS)
STATISTIC = "sketch.max"
FORMAT = "certchat-calibration"


class CalibrationError(cli_errors.UsageError):
    """A calibration that cannot run (no such model, no scripts, nothing recorded)."""


# -- the offline fits -------------------------------------------------------------------------
def _steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every evicting turn of the replay, with its run, script and seed (studies.adaptive_thresholds' shape)."""
    return [{**s, "script": run["script"], "seed": run["seed"], "budget": run["budget"],
             "_run": (run["script"], run["budget"], run["seed"])}
            for run in doc["runs"] for s in run["steps"] if s.get("kind") in ("probe", "filler")]


def rescore(steps: list[dict[str, Any]], layers: Sequence[int]) -> None:
    """Set each step's ``sketch.max`` to its value in ``layers`` (a subset of those it recorded): the largest share
    over baseline of any mostly evicted message in any of those layers, 0 where none qualifies."""
    for s in steps:
        detail = s.get("certificate_detail")
        if not detail or detail.get("sketch.layers") is None:
            continue
        recorded = [int(x) for x in detail["sketch.layers"]]
        idx = [recorded.index(x) for x in layers]
        ratios = recorded_ratios(detail.get("sketch.messages") or {})
        detail[STATISTIC] = max((float(np.max(r[idx])) for r in ratios.values()), default=0.0)


def _value(step: dict[str, Any]) -> float | None:
    from agent.lab.replay import studies  # noqa: PLC0415 — not at start-up: every `certchat` command registers this one

    return studies.statistics_of(step).get(STATISTIC)


def _later_half(steps: list[dict[str, Any]]) -> list[bool]:
    """Whether each step is a filler in the later half of its run (where the turn's position alone no longer tells
    it from a probe)."""
    last: dict[Any, int] = {}
    for s in steps:
        last[s["_run"]] = max(last.get(s["_run"], 0), int(s["turn"]))
    return [s["kind"] == "filler" and in_later_half(s["turn"], last[s["_run"]]) for s in steps]


def floor_tau(steps: list[dict[str, Any]], target: float) -> float | None:
    """The smallest τ whose gate fires on at most ``target`` of the fillers (fired: value ≥ τ)."""
    from agent.lab.replay import studies  # noqa: PLC0415 — not at start-up: every `certchat` command registers this one

    return studies.filler_tau([v for s in steps if s["kind"] == "filler" and (v := _value(s)) is not None], target)


def gate_rates(steps: list[dict[str, Any]], tau: float | None, rule: Adaptive) -> dict[str, Any]:
    """Probes and fillers the adaptive gate fires on, as the chat runs it (each run's bar follows its turns)."""
    from agent.lab.replay import studies  # noqa: PLC0415 — not at start-up: every `certchat` command registers this one

    fired = studies.fired_steps(steps, STATISTIC, tau, rule)
    probes = [f for s, f in zip(steps, fired) if s["kind"] == "probe"]
    fillers = [f for s, f in zip(steps, fired) if s["kind"] == "filler"]
    late = [f for f, later in zip(fired, _later_half(steps)) if later]

    def rate(xs: list[bool]) -> float | None:
        return float(np.mean(xs)) if xs else None

    return {"probe_gate_rate": rate(probes), "filler_gate_rate": rate(fillers), "late_filler_gate_rate": rate(late),
            "n_probes": len(probes), "n_fillers": len(fillers),
            "missed_probes": [f"{s['script']} {s['budget']} turn {s['turn']}" for s, f in zip(steps, fired)
                              if s["kind"] == "probe" and not f]}


def separation(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Probe-vs-filler AUCs of the statistic beside the turn-index baseline, against all and later-half fillers."""
    later = _later_half(steps)
    out: dict[str, Any] = {}
    for name, get in ((STATISTIC, lambda s: _value(s) or 0.0), ("turn_index", lambda s: float(s["turn"]))):
        probes = [get(s) for s in steps if s["kind"] == "probe"]
        fillers = [get(s) for s in steps if s["kind"] == "filler"]
        late = [get(s) for s, lt in zip(steps, later) if lt]
        out[name] = {"auc_all_fillers": auc(probes, fillers), "auc_later_fillers": auc(probes, late)}
    return out


def floors(steps: list[dict[str, Any]], target: float) -> tuple[float | None, dict[str, float | None]]:
    """The floor τ at ``target`` on every script, and each script's τ fitted without it (none for one script)."""
    scripts = sorted({s["script"] for s in steps})
    left_out = {name: floor_tau([s for s in steps if s["script"] != name], target)
                for name in scripts} if len(scripts) > 1 else {}
    return floor_tau(steps, target), left_out


def fit_gate(steps: list[dict[str, Any]], fitted: tuple[float | None, dict[str, float | None]],
             rule: Adaptive) -> dict[str, Any]:
    """The gate at the floors ``fitted`` (:func:`floors`) under ``rule``: its figures on every script, and each
    script's at the τ fitted without it."""
    tau, left_out = fitted
    held_out = [{"script": name, "tau": t, **gate_rates([s for s in steps if s["script"] == name], t, rule)}
                for name, t in left_out.items()]
    return {"tau": tau, "in_sample": gate_rates(steps, tau, rule), "leave_one_script_out": held_out}


def _pooled(rows: list[dict[str, Any]], rate: str, count: str) -> float | None:
    """A rate over several groups' rows, weighted by each row's count."""
    n = sum(int(r[count]) for r in rows if r[rate] is not None)
    return sum(float(r[rate]) * int(r[count]) for r in rows if r[rate] is not None) / n if n else None


def fit_rule(steps: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The floor's filler share and the bar's factor, of the grid, that catch the most probes of a script left out of
    the floor's fit, among those whose gate fires on at most FILLER_CAP of the fillers (LATE_FILLER_CAP of the
    later-half ones); ties go to fewer filler firings, then the higher bar. The fitted gate (with its probe-vs-filler
    separation), and every candidate's figures."""
    def within_caps(gate: dict[str, Any]) -> bool:
        ins = gate["in_sample"]
        return gate["tau"] is not None and (ins["filler_gate_rate"] or 0.0) <= FILLER_CAP + 1e-9 and \
            (ins["late_filler_gate_rate"] or 0.0) <= LATE_FILLER_CAP + 1e-9

    candidates = []
    for target in FILLER_TARGETS:
        fitted = floors(steps, target)  # the floor depends on the share only, not on the bar's factor
        for factor in FACTORS:
            gate = fit_gate(steps, fitted, Adaptive(factor, WINDOW))
            lo = gate["leave_one_script_out"]
            held = _pooled(lo, "probe_gate_rate", "n_probes") if lo else gate["in_sample"]["probe_gate_rate"]
            candidates.append({**gate, "filler_target": target, "factor": factor, "held_out_probe_rate": held,
                               "within_caps": within_caps(gate)})

    def preference(c: dict[str, Any]) -> tuple[float, float, float, float]:
        return (c["held_out_probe_rate"] or 0.0, -(c["in_sample"]["filler_gate_rate"] or 0.0), c["factor"],
                -c["filler_target"])

    chosen = max([c for c in candidates if c["within_caps"]] or candidates[:1], key=preference)
    table = [{"filler_target": c["filler_target"], "factor": c["factor"], "tau": c["tau"],
              "held_out_probe_rate": c["held_out_probe_rate"],
              "probe_gate_rate": c["in_sample"]["probe_gate_rate"],
              "filler_gate_rate": c["in_sample"]["filler_gate_rate"],
              "late_filler_gate_rate": c["in_sample"]["late_filler_gate_rate"], "within_caps": c["within_caps"]}
             for c in candidates]
    return {**chosen, "separation": separation(steps)}, table


def choose_layers(results: Path, budgets: Sequence[str],
                  max_layers: int) -> tuple[list[int], list[dict[str, Any]], list[int]]:
    """The best subset of the recorded layers pooled over the budgets, from a replay's results; the five best with
    their AUCs; the layers left out because their reading was not finite."""
    from agent.lab.fits import sketch_layers as fit  # noqa: PLC0415

    layers: list[int] = []
    turns: list[Any] = []
    for budget in budgets:
        try:
            layers, mine = fit.load_turns([results], "poisson", budget)
        except SystemExit as err:  # the fit script's own message, as a one-line error here
            raise CalibrationError(f"calibrate: {err}") from None
        turns += mine
    scorer = fit.Scorer(turns, len(layers))
    candidates = fit.readable(scorer)
    if not candidates:
        raise CalibrationError("calibrate: the sketch read no layer finitely on every turn; this model cannot be "
                               "calibrated (run it with the full cache, --policy full)")
    ranked = fit.ranked(scorer, candidates, max_layers)
    unreadable = [layers[i] for i in range(len(layers)) if i not in candidates]
    top = []
    for idx in ranked[:5]:
        a_all, a_late = scorer.auc_pair(idx)
        top.append({"layers": [layers[i] for i in idx], "auc_later_fillers": a_late, "auc_all_fillers": a_all,
                    "margin": scorer.margin(idx)})
    return [layers[i] for i in ranked[0]], top, unreadable


ONE_SHOT_MAX_TOKENS = 8
"""The one-shot pass's answer length: its certificate is read at the question, before the first answer token."""


def fit_certificate(arrays: dict[str, dict[str, np.ndarray]], turns: list[dict[str, Any]], model: str,
                    n_layer: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per budget and protocol (its rounds class), the certificate's λ and k fitted on the captured cells of
    certified turns (``arrays``: label → cells, ``turns``: the capture's turns), k by the rule
    agent.gate.certificate.choose_rule picks; as ``multipliers`` rows, with their coverage at nominal."""
    rows, checks = [], []
    for label, cells in arrays.items():
        policy, budget, protocol = label.rsplit(" ", 2)
        turn = cells["turn"].astype(int)
        keep = np.array([not turns[t]["uncertified"] for t in turn], dtype=bool)
        if not keep.any():
            continue
        script = np.array([turns[t]["script"] for t in turn])[keep]
        err, v_hat, o_norm2, layer = (cells[k][keep] for k in ("err", "v_hat", "o_norm2", "layer"))
        rule, table = certificate.choose_rule(err, v_hat, o_norm2, layer, n_layer, script)
        comp = certificate.fit_by_rule(err, v_hat, o_norm2, layer, n_layer, script, rule)
        rounds = certificate.rounds_class(certificate.PROTOCOL_ROUNDS.get(protocol, 2))
        left_out = next((r["coverage"] for r in table if (r["rule"], r["level"]) == rule), None)
        rows.append({"policy": policy, "model": model, "budget": budget, "rounds": rounds,
                     "multiplier": comp.multiplier, "drift": list(comp.drift), "n_layer": n_layer,
                     "n_calibration_cells": int(keep.sum()), "protocols": [protocol],
                     "rule": {"k": rule[0], "level": rule[1], "left_out_coverage": left_out, "candidates": table}})
        checks.append({"budget": budget, "protocol": protocol, "n_cells": int(keep.sum()),
                       "coverage": float(certificate.covered(err, v_hat, o_norm2, layer, comp).mean()),
                       "left_out_coverage": left_out,
                       "rule": f"{rule[0]} {rule[1]:g}", "nominal": certificate.NOMINAL})
    return rows, checks


CELLS = "certificate-cells.npz"
TURNS = "certificate-turns.json"
"""The captured certificate cells and their turns, kept in the work folder so a refit need not replay."""


def save_cells(out: Path, arrays: dict[str, dict[str, np.ndarray]], turns: list[dict[str, Any]]) -> None:
    flat = {f"{label}|{k}": v for label, a in arrays.items() for k, v in a.items()
            if k in ("err", "v_hat", "o_norm2", "layer", "turn")}
    # numpy's stub reads **kwds as if they could fill allow_pickle: bool; these keys are "label|field" names
    np.savez_compressed(out / CELLS, **flat)  # type: ignore[arg-type]
    (out / TURNS).write_text(json.dumps(turns) + "\n", encoding="utf-8")


def load_cells(out: Path) -> tuple[dict[str, dict[str, np.ndarray]], list[dict[str, Any]]] | None:
    if not (out / CELLS).exists() or not (out / TURNS).exists():
        return None
    with np.load(out / CELLS) as z:
        arrays: dict[str, dict[str, np.ndarray]] = {}
        for key in z.files:
            label, name = key.split("|")
            arrays.setdefault(label, {})[name] = z[key]
    return arrays, json.loads((out / TURNS).read_text(encoding="utf-8"))


def _shown(script_path: Path) -> str:
    """A script's path as a record names it: from the package's ``agent/`` on for the shipped fixtures (the same
    on every checkout), else as given."""
    parts = Path(script_path).parts
    for i in range(len(parts) - 1):
        if parts[i:i + 2] == ("agent", "lab") and FIXTURES.parts[-3:] == parts[i + 2:i + 5]:
            return str(Path(*parts[i:]))
    return str(script_path)


# -- the command --------------------------------------------------------------------------------
def _say(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)


def _full_attention_layers(path: Path) -> tuple[int, int, list[int]]:
    """(n_layer, n_ctx_train, the layers that see every earlier position) of the GGUF at ``path``."""
    from native import llama  # noqa: PLC0415 — loads llama.cpp

    model = llama.Model(path)
    try:
        info = model.info()
    finally:
        model.close()
    return info.n_layer, info.n_ctx_train, [il for il, w in enumerate(info.layer_windows) if w == 0]


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Replay, fit and return the model's calibration document (not yet written)."""
    from agent.lab.replay import aggregate, batch, runner, script  # noqa: PLC0415
    from agent.lab.replay.capture import ProductCoverage  # noqa: PLC0415
    from agent.lab.replay.report import command_line, git_commit, machine  # noqa: PLC0415

    started = time.monotonic()
    base = config_mod.load()
    name = args.model or base.model
    path = models.resolve(name)
    sha = models.gguf_sha256(path)
    display = models.display_name(name, path)
    sources = [Path(p) for p in args.scripts] if args.scripts else list(CALIBRATION_SCRIPTS)
    scripts = [script.load(p) for p in sources]
    budgets = runner.parse_budgets(args.budget)
    n_layer, _, full = _full_attention_layers(path)
    if not full:
        raise CalibrationError(f"calibrate: every layer of {display} attends through a sliding window, so no sketch "
                               "can read what eviction removed; run it with the full cache (--policy full)")
    out = args.from_results or args.out or Path(tempfile.mkdtemp(prefix="certchat-calibrate-"))
    settings = batch.Settings(out=out, policies=["poisson"], budgets=budgets, gate="off", model=name,
                              max_tokens=args.max_tokens, threads=args.threads, plots=False,
                              progress=not args.no_progress, generate_fillers=True,
                              command=command_line(getattr(args, "argv", None)))
    cfg = base.replace(model=name, threads=args.threads, evict_from=0,
                       sketch_layers=",".join(str(il) for il in full))
    fitted = out / "certificate-fit.json"
    if args.from_results:
        _say(f"{display}: refitting on the replay in {out}")
        doc = aggregate.read_results(batch.results_path(settings))
        if doc["meta"].get("model_sha256") != sha:
            raise CalibrationError(f"calibrate: {out} holds a replay of {doc['meta'].get('model')}, not {display}")
        kept = load_cells(out)
        if kept is not None:
            _say("refitting the certificate on the cells the replay captured")
            multipliers, coverage = fit_certificate(*kept, display, n_layer)
        else:
            multipliers, coverage = json.loads(fitted.read_text(encoding="utf-8")) if fitted.exists() else ([], [])
        settings.command = f"{doc['meta'].get('command')} && {settings.command}"
        sources = [Path(x["source"]) for x in doc["meta"].get("scripts") or []] or sources  # what was replayed
        budgets = settings.budgets = list(doc["meta"].get("budgets") or budgets)
        one_shot_results = batch.results_path(replace(settings, out=out / "one-shot"))
        replays = [doc, *([aggregate.read_results(one_shot_results)] if one_shot_results.exists() else [])]
        # the replays' own time counts
        started -= sum(float(run.get("wall_s") or 0.0) for d in replays for run in d["runs"])
    else:
        n_jobs = len(scripts) * len(budgets)
        captured = ", the certificate captured at every probe" if args.certificate else ""
        _say(f"{display} ({sha[:12]}…): replaying {len(scripts)} script(s) at {', '.join(budgets)} ({n_jobs} runs, "
             f"the sketch reading {len(full)} layers{captured}); work folder {out}")
        if args.certificate:
            with ProductCoverage(path, cfg.threads) as observed:
                doc = batch.run(scripts, settings, cfg, observe=observed.attach)
                # the first eviction round's certificate (rounds class "1": every kept cell decoded over the whole
                # history) is its own fit; the chat shows it until a second round, and the multi-round k over-covers it
                _say(f"{display}: the one-shot pass (each probe evicted once from the whole history), {n_jobs} runs")
                one_shot = replace(settings, out=out / "one-shot", protocols=("one-shot",), generate_fillers=False,
                                   max_tokens=min(args.max_tokens, ONE_SHOT_MAX_TOKENS))
                batch.run(scripts, one_shot, cfg, observe=observed.attach)
                arrays = {label: observed.arrays(label) for label in observed.seen.cells}
                turns = list(observed.seen.turns)
            save_cells(out, arrays, turns)
            multipliers, coverage = fit_certificate(arrays, turns, display, n_layer)
        else:
            doc = batch.run(scripts, settings, cfg)
            multipliers, coverage = [], []
        fitted.write_text(json.dumps([multipliers, coverage]) + "\n", encoding="utf-8")
    replayed = time.monotonic() - started  # with --from-results, the earlier replay's runs

    _say("choosing the sketch layers")
    layers, top, unreadable = choose_layers(batch.results_path(settings), budgets, args.sketch_max_layers)
    steps = _steps(doc)
    rescore(steps, layers)
    _say(f"fitting the gate on sketch layers {','.join(map(str, layers))}")
    gate, candidates = fit_rule(steps)
    probe_rate = gate["held_out_probe_rate"]
    accepted = gate["tau"] is not None and probe_rate is not None and probe_rate >= args.min_probe_rate
    left_out = " (each script scored at the floor fitted without it)" if gate["leave_one_script_out"] else ""
    record = {
        "statistic": STATISTIC, "tau": gate["tau"], "rule": "adaptive", "filler_target": gate["filler_target"],
        "adaptive": {"factor": gate["factor"], "window": WINDOW}, "evict_at": cfg.evict_at,
        "budgets": budgets, "protocol": "multi-round", "accepted": bool(accepted),
        **({} if accepted else {"rejected_because": f"the gate caught {probe_rate or 0:.0%} of the calibration "
                                                    f"probes{left_out}, under the {args.min_probe_rate:.0%} required"}),
        "in_sample": gate["in_sample"], "held_out_probe_rate": probe_rate,
        "leave_one_script_out": gate["leave_one_script_out"], "rule_candidates": candidates,
        "separation": gate["separation"],
        "sketch": {"layers": layers, "bits": cfg.sketch_bits, "n_layer": n_layer, "recorded": full,
                   "max_layers": args.sketch_max_layers, "best_subsets": top, "unreadable": unreadable},
        "model": display, "model_sha256": sha, "command": settings.command, "machine": machine(),
    }
    return {"format": FORMAT, "version": 1, "model": display, "model_sha256": sha,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "command": settings.command, "machine": machine(),
            "threads": cfg.threads, "max_tokens": args.max_tokens,
            "scripts": [_shown(p) for p in sources],
            "wall_s": {"replay": replayed, "total": time.monotonic() - started},
            "calibrations": [record], "multipliers": multipliers, "coverage_in_sample": coverage}


FILLER_TARGETS = (0.025, 0.05)
"""The floor τ's candidates: the gate fires on at most this share of the calibration fillers (a quiet chat's bar)."""
FACTORS = (2.0, 1.75, 1.5, 1.25)
"""The adaptive bar's candidates: max(τ, factor × the median of the chat's last WINDOW turn statistics)."""
WINDOW = 20
FILLER_CAP = 0.05
"""The most calibration fillers a chosen rule may fire on (a firing re-reads, so it costs a slower turn)."""
LATE_FILLER_CAP = 0.10
"""The same for later-half fillers, where the turn's position no longer tells a question from an ordinary turn."""


def summary(document: dict[str, Any], path: Path) -> str:
    """What a calibration found, in a few lines."""
    gate = document["calibrations"][0]
    ins, sep = gate["in_sample"], gate["separation"]

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:.0%}"

    def num(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    verdict = "calibrated" if gate["accepted"] else "NOT calibrated: " + gate["rejected_because"]
    lines = [f"{document['model']}: {verdict}",
             f"  sketch layers {','.join(map(str, gate['sketch']['layers']))} of {gate['sketch']['n_layer']}; "
             f"floor τ {num(gate['tau'])} (fillers at {pct(gate['filler_target'])}), bar max(τ, "
             f"{gate['adaptive']['factor']:g} × median of the last {gate['adaptive']['window']} turns)",
             f"  calibration scripts: probes gated {pct(ins['probe_gate_rate'])} of {ins['n_probes']} "
             f"({pct(gate.get('held_out_probe_rate'))} on scripts left out of the floor's fit), fillers "
             f"{pct(ins['filler_gate_rate'])} of {ins['n_fillers']} (later half {pct(ins['late_filler_gate_rate'])})",
             f"  probe-vs-filler AUC (all / later-half fillers): {STATISTIC} "
             f"{num(sep[STATISTIC]['auc_all_fillers'])} / {num(sep[STATISTIC]['auc_later_fillers'])}, turn index "
             f"{num(sep['turn_index']['auc_all_fillers'])} / {num(sep['turn_index']['auc_later_fillers'])}"]
    for row, check in zip(document["multipliers"], document["coverage_in_sample"]):
        left = check.get("left_out_coverage")
        left_text = "" if left is None else f", {left:.3f} on conversations left out of the fit"
        rule = f" ({check['rule']})" if check.get("rule") else ""
        lines.append(f"  certificate at {row['budget']}, {check['protocol']}: k {row['multiplier']:.2f}{rule}, "
                     f"coverage {check['coverage']:.3f} of {check['n_cells']} cells in sample{left_text} "
                     f"(nominal {check['nominal']:.2f})")
    lines.append(f"  took {document['wall_s']['total'] / 60:.1f} min; written to {path}")
    return "\n".join(lines)


def _risk() -> float:
    """The configured risk (what the summary's choice is shown at)."""
    return config_mod.load().loss_risk


def _certify(args: argparse.Namespace, document: dict[str, Any], work: Path) -> dict[str, Any]:
    """``document`` with its ``certification``: from recorded replays (``--certify-from``) or replayed now."""
    from agent.lab.replay import runner  # noqa: PLC0415
    from agent.lab.replay.report import command_line  # noqa: PLC0415

    budgets = runner.parse_budgets(args.certify_budgets)
    if args.certify_from:
        chats: list[dict[str, Any]] = []
        trials = certify.from_results(args.certify_from, budgets, chats)
        meta: dict[str, Any] = {"chats": chats, "from_results": [str(p) for p in args.certify_from],
                                "command": command_line(getattr(args, "argv", None))}
    else:
        name = args.model or config_mod.load().model
        trials, meta = certify.run(name, work, budgets, args.threads, args.quick, not args.no_progress,
                                   command_line(getattr(args, "argv", None)))
    return {**document, "certification": certify.document(trials, meta)}


def _record_in_force(name: str | None) -> tuple[dict[str, Any], str]:
    """The calibration document the model uses now, and its display name; CalibrationError when it has none."""
    cfg = config_mod.load()
    path = models.resolve(name or cfg.model)
    sha = models.gguf_sha256(path)
    found = calibration.for_model(sha)
    display = models.display_name(name or cfg.model, path)
    if found is None or not found.path.exists():
        raise CalibrationError(f"calibrate: {display} has no gate calibration to certify; run "
                               f"`certchat calibrate {name or cfg.model}` first (it certifies as well)")
    doc = json.loads(found.path.read_text(encoding="utf-8"))
    if "calibrations" not in doc or doc.get("model_sha256") != sha:
        raise CalibrationError(f"calibrate: {found.path} is not a record of {display}'s own calibration; run "
                               f"`certchat calibrate {name or cfg.model}`")
    return doc, display


def _destination(document: dict[str, Any], ship: bool) -> Path:
    if ship:
        if document["model"] not in models.REGISTRY:
            raise CalibrationError(f"calibrate: --ship is for registry models, not {document['model']}")
        return calibration.SHIPPED_DIR / f"{document['model']}.json"
    return calibration.record_path(document["model_sha256"])


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.sketch_max_layers < 1:
        raise CalibrationError("calibrate: --sketch-max-layers must be at least 1")
    if not 0.0 <= args.min_probe_rate <= 1.0:
        raise CalibrationError("calibrate: --min-probe-rate is a share between 0 and 1, e.g. 0.9")
    if args.certify_only or args.certify_from:
        document, display = _record_in_force(args.model)
        work = args.out or paths.cache_dir() / "calibrate" / document["model_sha256"][:16] / "certify"
        document = _certify(args, document, work)
        path = calibration.write_model(document, _destination(document, args.ship))
        print(certify.summary(document["certification"], display, _risk()))
        print(f"  written to {path}")
        return 0
    document = calibrate(args)
    path = calibration.write_model(document, _destination(document, args.ship))
    print(summary(document, path))
    if args.certify and not args.from_results and document["calibrations"][0]["accepted"]:
        # the replays run under the gate just written, as the chat will
        work = (args.out or paths.cache_dir() / "calibrate" / document["model_sha256"][:16]) / "certify"
        document = _certify(args, document, work)
        calibration.write_model(document, path)
        print(certify.summary(document["certification"], document["model"], _risk()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit a model's gate and certificate (minutes), so that it evicts safely",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="registry name or GGUF path (default: the configured model)")
    p.add_argument("--scripts", nargs="+", metavar="SCRIPT",
                   help="calibration scripts (default: recall30 seeds 02–05 and 10–17, the calibration split)")
    p.add_argument("--budget", default="10%,25%",
                   help="KV budgets to calibrate on (default 10%%,25%%; with --from-results, the replay's)")
    p.add_argument("--threads", type=int, help="CPU threads (default: the config's)")
    p.add_argument("--max-tokens", type=int, default=48, dest="max_tokens", help="longest generated answer")
    p.add_argument("--sketch-max-layers", type=int, default=2, dest="sketch_max_layers",
                   help="layers the sketch may keep (default 2: 1/8 of a K row per evicted token at int8)")
    p.add_argument("--min-probe-rate", type=float, default=0.9, dest="min_probe_rate",
                   help="share of calibration probes the gate must catch, each script scored at the floor fitted "
                        "without it, for the model to evict (default 0.9)")
    p.add_argument("--no-certificate", action="store_false", dest="certificate",
                   help="skip the certificate's fit (faster; the certificate shown stays the conservative default)")
    p.add_argument("--out", type=Path, help="keep the replay's results in this folder (default: a temporary one)")
    p.add_argument("--from-results", type=Path, dest="from_results", metavar="DIR",
                   help="refit on the replay an earlier calibration kept in DIR (its --out), without replaying")
    p.add_argument("--ship", action="store_true",
                   help="write the package's record (agent/gate/calibrations/NAME.json) for a registry model")
    p.add_argument("--no-certify", action="store_false", dest="certify",
                   help="fit the gate only: no long-chat certification (the model then keeps its full cache under "
                        "budget = auto); a refit --from-results never certifies")
    p.add_argument("--certify-only", action="store_true", dest="certify_only",
                   help="certify the gate the model has now on the long chats, without refitting it")
    p.add_argument("--certify-budgets", default=",".join(certify.BUDGETS), dest="certify_budgets",
                   help="budgets to certify, each paired against the full cache (default 50%%,25%%,10%%)")
    p.add_argument("--certify-from", type=Path, nargs="+", dest="certify_from", metavar="DIR",
                   help="certify from replays already recorded (full and poisson+gate runs of calibration chats), "
                        "without replaying")
    p.add_argument("--quick", action="store_true",
                   help="certify on the 8k chat and LoCoMo only (about half the time; fewer probes certify less)")
    p.add_argument("--no-progress", action="store_true", dest="no_progress")
    p.set_defaults(func=cli_errors.guard(_cmd_calibrate), command="calibrate")
