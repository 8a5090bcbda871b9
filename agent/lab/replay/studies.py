"""Certificate studies over replay results: attribution, gating (and calibration), coverage.

- **attribution**: a probe the evicted run got wrong is *eviction-induced* when the full
  cache got it right, *inherent* when the full cache failed too. How well does each
  candidate statistic separate the two (ROC AUC), against output confidence (−mean log-prob)?
- **gating**: at matched recompute rates, the recall a gate buys over no gate, for the
  certificate statistics, random gating and confidence gating, and the ratio of the gains.
  Gating a turn means answering it from the full history, so a gated probe scores what the
  full-cache run scored (exact for independent probes and in the one-shot protocol; in the
  multi-round protocol it ignores that a re-prefill also refreshes the cache for later
  turns). Rates are counted over probes (all gates comparable) and over all turns (the
  certificate against random: a gate also pays for every filler it fires on; confidence
  needs a generated answer, which teacher-forced fillers do not have).
- **calibration**: the default τ for a statistic, by one of two rules — the smallest
  threshold whose gate rate on filler turns stays at or below a target, or the largest that
  still gates every eviction-broken probe — with leave-one-script-out figures. Two
  baselines ride along: output confidence, and ``turn_index`` (gate the latest turns),
  which shows how much of a statistic's gain is only "late in the conversation".
- **coverage**: per (layer, head) cell, whether the certificate at nominal 1 − δ covers the
  realized attention-output error; the cells come from :mod:`agent.lab.replay.capture`.

Every comparison is made within one budget and protocol (pooling budgets makes any
statistic look good by tracking the budget, DESIGN.md §7).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from agent.gate import calibration, certificate
from agent.lab.replay.rank_stats import auc, auc_ci, in_later_half

RATES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
FILLER_TARGET = 0.1
"""Calibration target: the default τ lets the gate fire on at most this share of filler turns."""
ADAPTIVE = (2.0, 20)
"""The adaptive τ's factor and window (agent.gate.calibration.adaptive_tau), chosen on the calibration replays by
``agent/lab/fits/adaptive_gate_grid.py``: the middle of the settings that keep every calibration probe's recall."""
ADAPTIVE_FILLER_TARGET = 0.025
"""The adaptive τ's floor: the filler rule at this share of calibration fillers (a quiet chat's bar; a loud one
raises its own)."""


# -- statistics --------------------------------------------------------------------------
def statistics_of(step: dict[str, Any]) -> dict[str, float]:
    """Every candidate gate statistic of a step: the turn certificate and the question./answer./sketch. details
    (the sketch speaks for every evicted cell, so an uncertified turn leaves its statistics as they are)."""
    out: dict[str, float] = {}
    detail = step.get("certificate_detail") or {}
    # an eviction with no room to sample has no certificate: the agent's gate fires on it whatever the
    # value, so every question statistic counts as unbounded (+inf: fired at any τ, gated first at any rate)
    uncertified = bool(detail.get("uncertified"))
    if step.get("certificate") is not None:
        out["turn"] = math.inf if uncertified else float(step["certificate"])
    for key, value in detail.items():
        if not key.startswith(("question.", "answer.", "sketch.")):
            continue  # counts and per-layer lists are not gate statistics
        if uncertified and key.startswith("question."):
            out[key] = math.inf
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


def _full_index(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(script, protocol, turn·line) → the full-cache run's step (full is seed- and budget-free)."""
    index: dict[tuple[str, str, int], dict[str, Any]] = {}
    for run in runs:
        if run["policy"].split("@", 1)[0] != "full":
            continue
        for step in run["steps"]:
            index[(run["script"], run.get("protocol", "multi-round"), step["lineno"])] = step
    return index


def paired_steps(doc: dict[str, Any], policies: tuple[str, ...] = ("topk", "random", "poisson", "window"),
                 ) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """(policy, budget, protocol) → steps of the ungated evicted runs, each with its full-cache twin."""
    full = _full_index(doc["runs"])
    if not full:
        raise ValueError("the studies need a `full` run of the same scripts (add full to --policy)")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in doc["runs"]:
        if run["policy"].split("@", 1)[0] not in policies:
            continue
        protocol = run.get("protocol", "multi-round")
        for step in run["steps"]:
            twin = full.get((run["script"], protocol, step["lineno"]))
            if twin is None:
                continue
            groups[(run["policy"], run["budget"], protocol)].append(
                {**step, "script": run["script"], "seed": run["seed"], "full": twin})
    return dict(groups)


# -- attribution ---------------------------------------------------------------------------
def attribution(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (policy, budget, protocol): AUC of each statistic and of −log-prob for induced vs inherent."""
    rows = []
    for (policy, budget, protocol), steps in sorted(paired_steps(doc).items()):
        fails = [s for s in steps if s["kind"] == "probe" and s.get("correct") is False
                 and s["full"].get("correct") is not None]
        induced = [s for s in fails if s["full"]["correct"]]
        inherent = [s for s in fails if not s["full"]["correct"]]
        names = sorted({k for s in fails for k in statistics_of(s)})
        stats = {}
        for name in names:
            pos = [statistics_of(s).get(name) for s in induced]
            neg = [statistics_of(s).get(name) for s in inherent]
            lo, hi = auc_ci(pos, neg)
            stats[name] = {"auc": auc(pos, neg), "ci95": [lo, hi]}
        conf_pos = [-s["logprob_mean"] for s in induced if s.get("logprob_mean") is not None]
        conf_neg = [-s["logprob_mean"] for s in inherent if s.get("logprob_mean") is not None]
        lo, hi = auc_ci(conf_pos, conf_neg)
        rows.append({"policy": policy, "budget": budget, "protocol": protocol, "n_failures": len(fails),
                     "n_induced": len(induced), "n_inherent": len(inherent), "statistics": stats,
                     "confidence": {"auc": auc(conf_pos, conf_neg), "ci95": [lo, hi]}})
    return rows


# -- gating ----------------------------------------------------------------------------------
def _gate_curve(probes: list[dict[str, Any]], scores: list[float | None], pool: list[float | None],
                rates: tuple[float, ...]) -> list[dict[str, Any]]:
    """Recall when the top ``rate`` of ``pool`` by score is gated.

    Items tied at the threshold are gated with the probability that fills the rate exactly
    (the expectation of breaking ties at random), so every gate is compared at the same rate.
    """
    # None/NaN (not computed) rank last; +inf (uncertified: always gated) ranks first
    values = np.asarray([-math.inf if p is None or math.isnan(p) else p for p in pool], dtype=np.float64)
    out = []
    for rate in rates:
        k = int(round(rate * len(pool)))
        if len(pool) == 0 or k == 0 or not (values > -math.inf).any():
            out.append({"rate": rate, "threshold": None, "recall": None, "realized_rate": None})
            continue
        tau = float(np.sort(values)[::-1][k - 1])
        if tau == -math.inf:
            tau = float(values[values > -math.inf].min())
        above = int((values > tau).sum())
        tied = int((values == tau).sum())
        share = min(1.0, (k - above) / tied) if tied else 0.0

        def weight(sc: float | None) -> float:
            if sc is None or math.isnan(sc) or sc == -math.inf:
                return 0.0
            return 1.0 if sc > tau else share if sc == tau else 0.0

        recall = float(np.mean([weight(sc) * bool(p["full"]["correct"]) + (1 - weight(sc)) * bool(p["correct"])
                                for p, sc in zip(probes, scores)]))
        realized = (above + share * tied) / len(pool)
        out.append({"rate": rate, "threshold": tau, "tie_share": share, "recall": recall,
                    "realized_rate": realized})
    return out


def _confidence(step: dict[str, Any]) -> float | None:
    """Output uncertainty: −mean log-prob of the generated answer (None for teacher-forced turns)."""
    return -step["logprob_mean"] if step.get("logprob_mean") is not None else None


def _ratios(curve: list[dict[str, Any]], random_curve: list[dict[str, Any]], base: float) -> list[float | None]:
    out = []
    for point, rnd in zip(curve, random_curve):
        gain_r = rnd["recall"] - base
        out.append(None if point["recall"] is None or gain_r <= 0 else (point["recall"] - base) / gain_r)
    return out


def gating(doc: dict[str, Any], rates: tuple[float, ...] = RATES) -> list[dict[str, Any]]:
    """Per (policy, budget, protocol) of the evicting designs: recall against recompute rate for each gate.

    The recompute rate counts every user turn (a gate pays for each filler it fires on);
    ``over_probes`` counts probes only (which probes a gate picks, ignoring filler cost).
    Random gating at rate r recomputes each turn with probability r.
    """
    rows = []
    for (policy, budget, protocol), steps in sorted(paired_steps(doc, ("poisson", "random", "topk")).items()):
        probes = [s for s in steps if s["kind"] == "probe" and s.get("correct") is not None
                  and s["full"].get("correct") is not None]
        if not probes:
            continue
        fillers = [s for s in steps if s["kind"] == "filler"]
        # fillers in the later half of their script: against these, separation by turn position alone (the
        # history and the number of eviction rounds grow with it) no longer counts
        last_turn: dict[str, int] = defaultdict(int)
        for s in steps:
            last_turn[s["script"]] = max(last_turn[s["script"]], int(s["turn"]))
        late = [in_later_half(f["turn"], last_turn[f["script"]]) for f in fillers]
        base = float(np.mean([bool(p["correct"]) for p in probes]))
        full = float(np.mean([bool(p["full"]["correct"]) for p in probes]))
        random_curve = [{"rate": r, "recall": float(np.mean([r * bool(p["full"]["correct"])
                                                             + (1 - r) * bool(p["correct"]) for p in probes]))}
                        for r in rates]
        gates: dict[str, tuple[list[float | None], list[float | None]]] = {}
        for name in sorted({k for s in steps for k in statistics_of(s)}):
            gates[name] = ([statistics_of(p).get(name) for p in probes], [statistics_of(s).get(name) for s in steps])
        gates["confidence"] = ([_confidence(p) for p in probes], [_confidence(s) for s in steps])
        # a trivial baseline: gate the latest turns (the certificate is 0 while nothing is sampled,
        # so part of its gain is just "late in the conversation")
        gates["turn_index"] = ([float(p["turn"]) for p in probes], [float(s["turn"]) for s in steps])
        stats = {}
        for name, (probe_scores, turn_scores) in gates.items():
            # a gate that cannot be computed on some turns (forced fillers have no answer) is not
            # comparable at a turn rate: say so instead of counting those turns as quiet
            turn_complete = all(v is not None for v in turn_scores)
            over_probes = _gate_curve(probes, probe_scores, probe_scores, rates)
            over_turns = _gate_curve(probes, probe_scores, turn_scores, rates) if turn_complete else []
            vals = [_confidence(f) if name == "confidence" else float(f["turn"]) if name == "turn_index"
                    else statistics_of(f).get(name) for f in fillers]
            for point in over_turns:
                tau = point["threshold"]
                point["filler_rate"] = None if tau is None or not vals else float(np.mean(
                    [0.0 if v is None else 1.0 if v > tau else point["tie_share"] if v == tau else 0.0
                     for v in vals]))
            stats[name] = {
                "over_probes": over_probes, "over_turns": over_turns,
                "gain_ratio_vs_random": _ratios(over_turns, random_curve, base) if over_turns else None,
                "gain_ratio_vs_random_over_probes": _ratios(over_probes, random_curve, base),
                "auc_probe_vs_filler": auc(probe_scores, vals) if vals else None,
                "auc_probe_vs_late_filler": auc(probe_scores, [v for v, is_late in zip(vals, late) if is_late])
                if any(late) else None,
                "auc_induced_vs_rest": auc([sc for p, sc in zip(probes, probe_scores)
                                            if p["full"]["correct"] and not p["correct"]],
                                           [sc for p, sc in zip(probes, probe_scores)
                                            if not (p["full"]["correct"] and not p["correct"])]),
            }
        rows.append({"policy": policy, "budget": budget, "protocol": protocol, "n_probes": len(probes),
                     "n_fillers": len(fillers), "n_turns": len(steps), "recall_no_gate": base, "recall_full": full,
                     "random": random_curve, "statistics": stats})
    return rows


def adaptive_thresholds(steps: list[dict[str, Any]], statistic: str, tau: float | None,
                        rule: Any) -> list[float | None]:
    """The threshold each step met, as the agent's gate sets it (agent.gate.calibration.adaptive_tau): per run, in
    turn order, τ raised to the rule's factor × the median of the run's earlier turn statistics (an independent
    probe's, rolled back, not among them). Without a rule, τ throughout."""
    from agent.gate import calibration  # noqa: PLC0415

    out: list[float | None] = [tau] * len(steps)
    if tau is None or rule is None:
        return out
    runs: dict[Any, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        runs[s.get("_run", (s["script"], s.get("seed")))].append(i)
    for order in runs.values():
        recent: list[float] = []
        for i in sorted(order, key=lambda i: (steps[i]["turn"], steps[i]["lineno"])):
            out[i] = calibration.adaptive_tau(tau, recent, rule)
            v = statistics_of(steps[i]).get(statistic)
            if v is not None and math.isfinite(v) and not steps[i].get("independent"):
                recent.append(v)
    return out


def fired_steps(sample: list[dict[str, Any]], statistic: str, tau: float | None, adaptive: Any = None) -> list[bool]:
    """Whether a gate on ``statistic`` at τ (adaptive or not) fires on each step, as the agent's gate would."""
    bars = adaptive_thresholds(sample, statistic, tau, adaptive)
    return [bar is not None and (v := statistics_of(s).get(statistic)) is not None and v >= bar
            for s, bar in zip(sample, bars)]


def filler_tau(values: list[float], target: float) -> float | None:
    """The smallest τ whose gate (value ≥ τ) fires on at most ``target`` of the filler ``values``: just above their
    (1 − target) quantile. None without values."""
    vals = sorted(values)
    if not vals:
        return None
    allowed = int(math.floor(target * len(vals)))
    return float(np.nextafter(vals[len(vals) - allowed - 1], math.inf))


def gate_figures(sample: list[dict[str, Any]], statistic: str, tau: float | None,
                 adaptive: Any = None) -> dict[str, Any]:
    """Recall and gate rates of a gate on ``statistic`` at τ (adaptive or not) over paired steps: a gated probe
    answers as the full cache did."""
    fired = fired_steps(sample, statistic, tau, adaptive)
    probes = [(s, f) for s, f in zip(sample, fired) if s["kind"] == "probe" and s.get("correct") is not None]
    fillers = [f for s, f in zip(sample, fired) if s["kind"] == "filler"]
    return {"recall": float(np.mean([bool(p["full"]["correct"]) if f else bool(p["correct"])
                                     for p, f in probes])) if probes else None,
            "probe_gate_rate": float(np.mean([f for _, f in probes])) if probes else None,
            "filler_gate_rate": float(np.mean(fillers)) if fillers else None,
            "turn_gate_rate": float(np.mean(fired)) if sample else None}


def calibrate(doc: dict[str, Any], statistic: str, policy: str = "poisson", budget: str | None = None,
              protocol: str = "multi-round", filler_target: float = FILLER_TARGET,
              probe_target: float | None = None, adaptive: Any = None) -> dict[str, Any]:
    """τ for ``statistic``, with leave-one-script-out figures, by one of three rules:

    - ``filler_target`` (default): the smallest τ whose gate fires on at most that share of
      filler turns (the cost-bounded rule);
    - ``probe_target``: the largest τ that still fires on at least that share of the probes
      whose answer eviction broke (the recall-bounded rule; fillers pay what they pay);
    - ``adaptive`` (an agent.gate.calibration.Adaptive): τ by the filler rule is the floor, and each turn's
      threshold rises with its conversation's recent statistics (:func:`adaptive_thresholds`); the figures
      are those of the gate as the agent runs it.
    """
    groups = paired_steps(doc, (policy.split("@", 1)[0],))
    keys = [k for k in groups if k[0] == policy and k[2] == protocol and (budget is None or k[1] == budget)]
    if not keys:
        raise ValueError(f"no {policy} runs{' at ' + budget if budget else ''} ({protocol}) to calibrate on")
    steps = [{**s, "_run": (k, s["script"], s["seed"])} for k in keys for s in groups[k]]

    def tau_for(sample: list[dict[str, Any]]) -> float | None:
        if probe_target is not None:
            need = sorted(v for s in sample if s["kind"] == "probe" and s.get("correct") is False
                          and s["full"].get("correct") and (v := statistics_of(s).get(statistic)) is not None)
            if not need:
                return None
            return float(need[int(math.floor((1 - probe_target) * (len(need) - 1) + 1e-9))])
        return filler_tau([v for s in sample if s["kind"] == "filler"
                           and (v := statistics_of(s).get(statistic)) is not None], filler_target)

    def apply(sample: list[dict[str, Any]], tau: float | None) -> dict[str, Any]:
        return gate_figures(sample, statistic, tau, adaptive)

    tau = tau_for(steps)
    scripts = sorted({s["script"] for s in steps})
    held_out = []
    if len(scripts) > 1:
        for name in scripts:
            train = [s for s in steps if s["script"] != name]
            test = [s for s in steps if s["script"] == name]
            t = tau_for(train)
            held_out.append({"script": name, "tau": t, **apply(test, t)})
    rule = "probes" if probe_target is not None else "adaptive" if adaptive is not None else "fillers"
    return {"statistic": statistic, "policy": policy, "budgets": sorted({k[1] for k in keys}),
            "protocol": protocol, "rule": rule,
            "filler_target": None if probe_target is not None else filler_target, "probe_target": probe_target,
            **({"adaptive": {"factor": adaptive.factor, "window": adaptive.window}} if adaptive is not None else {}),
            "tau": tau, "in_sample": apply(steps, tau),
            "leave_one_script_out": held_out}


def _adaptive_rule(statistic: str) -> list[dict[str, Any]]:
    """The adaptive rule's calibrate() arguments for a sketch statistic (the only kind it is fitted for)."""
    if not statistic.startswith("sketch."):
        return []
    from agent.gate.calibration import Adaptive  # noqa: PLC0415

    return [{"filler_target": ADAPTIVE_FILLER_TARGET, "adaptive": Adaptive(*ADAPTIVE)}]


# -- running and rendering -----------------------------------------------------------------
def analyse(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    meta = doc["meta"]
    if name == "attribution":
        return {"study": name, "meta": meta, "rows": attribution(doc)}
    if name == "gating":
        rows = gating(doc)
        calibrations = []
        for row in rows:
            if row["policy"].split("@", 1)[0] != "poisson":
                continue
            for statistic in row["statistics"]:
                if statistic in ("confidence", "turn_index"):
                    continue  # baselines, not gate statistics the agent computes
                for rule in ({}, {"probe_target": 1.0}, *_adaptive_rule(statistic)):
                    try:
                        calibrations.append(calibrate(doc, statistic, row["policy"], row["budget"], row["protocol"],
                                                      **rule))
                    except ValueError:
                        continue
        # one τ for every budget (the agent has one default): pooled over the budgets measured
        sampled = [r for r in rows if r["policy"].split("@", 1)[0] == "poisson"]
        for policy, protocol in sorted({(r["policy"], r["protocol"]) for r in sampled}):
            mine = [r for r in sampled if r["policy"] == policy and r["protocol"] == protocol]
            if len({r["budget"] for r in mine}) > 1:
                for statistic in sorted({n for r in mine for n in r["statistics"]} - {"confidence", "turn_index"}):
                    calibrations.append(calibrate(doc, statistic, policy, None, protocol))
                    calibrations.append(calibrate(doc, statistic, policy, None, protocol, probe_target=1.0))
                    for rule in _adaptive_rule(statistic):
                        calibrations.append(calibrate(doc, statistic, policy, None, protocol, **rule))
        return {"study": name, "meta": meta, "rows": rows, "calibration": calibrations}
    raise ValueError(f"unknown study {name!r}")




def calibration_record(result: dict[str, Any], statistic: str, protocol: str = "multi-round",
                       rule: str = "fillers") -> dict[str, Any]:
    """The default-τ record for the agent: the pooled (or only) calibration of ``statistic`` by ``rule``."""
    matches = [c for c in result.get("calibration", []) if c["statistic"] == statistic and c["protocol"] == protocol
               and c["policy"] == "poisson" and c.get("rule", "fillers") == rule]
    if not matches:
        raise ValueError(f"no calibration of {statistic} ({protocol}) in this study")
    best = max(matches, key=lambda c: len(c["budgets"]))

    # the certificate calibration the replayed statistics were read in (the one shipped when they ran): the gate
    # reads a certificate statistic in it, whatever the certificate shown becomes (calibration.tau_form)
    shown = certificate.shipped_records() if calibration.is_certificate_statistic(statistic) else None
    return {"statistic": statistic, "tau": best["tau"], "certificate": shown, "rule": rule,
            "filler_target": best["filler_target"],
            **({"adaptive": best["adaptive"]} if best.get("adaptive") else {}),
            # the replays' eviction timing (results without it predate the setting: "question")
            "evict_at": result["meta"].get("design", {}).get("evict_at", "question"),
            "probe_target": best.get("probe_target"),
            "budgets": best["budgets"], "protocol": protocol, "in_sample": best["in_sample"],
            "leave_one_script_out": best["leave_one_script_out"],
            **({"sketch": _sketch_spec(result["meta"])} if statistic.startswith("sketch.") else {}),
            "model": result["meta"].get("model"),
            # the GGUF the record holds for (agent.gate.calibration.covers): on another model the gate keeps the
            # cache full
            "model_sha256": result["meta"].get("model_sha256"), "command": result["meta"].get("command"),
            "study_command": result.get("command"), "machine": result["meta"].get("machine"),
            # the other rule's threshold for the same statistic, so the choice is visible
            "alternatives": [{"rule": c.get("rule", "fillers"), "tau": c["tau"], "budgets": c["budgets"],
                              "in_sample": c["in_sample"]}
                             for c in result.get("calibration", []) if c["statistic"] == statistic
                             and c["protocol"] == protocol and c["policy"] == "poisson"
                             and c.get("rule", "fillers") != rule]}


def _sketch_spec(meta: dict[str, Any]) -> dict[str, Any]:
    """The sketch the replays scored (its layers, bits and the model's depth), for ``sketch_layers = "auto"``."""
    design = meta.get("design", {})
    layers = design.get("sketch_layers")
    if not layers:  # results from before the design recorded it: the replay command names them
        words = str(meta.get("command", "")).split()
        layers = words[words.index("--sketch-layers") + 1] if "--sketch-layers" in words else ""
    return {"layers": [int(x) for x in str(layers).split(",") if x.strip()], "bits": int(design.get("sketch_bits", 8)),
            "n_layer": meta.get("n_layer")}


def write_calibration(record: dict[str, Any], path: Path | None = None) -> Path:
    from agent.gate import calibration  # noqa: PLC0415

    return calibration.write(record, path or calibration.PATH)


def run_study(name: str, scripts: list[Any], settings: Any, base: Any) -> dict[str, Any]:
    """Replay what the study needs (full + ungated designs, both protocols), then analyse."""
    from agent.lab.replay import batch  # noqa: PLC0415

    if name == "coverage":
        from agent.lab.replay import capture  # noqa: PLC0415

        result = capture.run_coverage(scripts, settings, base)
    else:
        needed = ["full", "topk", "random", "poisson"] if name == "attribution" else ["full", "random", "poisson"]
        settings.policies = list(dict.fromkeys(["full", *[p for p in settings.policies if p in needed]]))
        if settings.policies == ["full"]:
            settings.policies = needed
        if settings.protocols == ("multi-round",):
            settings.protocols = ("multi-round", "one-shot")
        settings.generate_fillers = True
        doc = batch.run(scripts, settings, base)
        result = analyse(name, doc)
    result["command"] = settings.command
    path = Path(settings.out) / f"study-{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    result["path"] = str(path)
    return result


def _f(v: Any, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def render(result: dict[str, Any]) -> str:
    """A study as Markdown."""
    from agent.lab.replay.report import provenance  # noqa: PLC0415

    lines: list[str] = []
    study = result["study"]
    if study == "attribution":
        lines += ["| policy | budget | protocol | failures (induced / inherent) | best statistic (AUC [95% CI]) "
                  "| all statistics | −log-prob AUC |", "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            stats = {k: v for k, v in r["statistics"].items() if v["auc"] is not None}
            best = max(stats.items(), key=lambda kv: kv[1]["auc"], default=None)
            best_text = (f"{best[0]} {_f(best[1]['auc'])} [{_f(best[1]['ci95'][0])}, {_f(best[1]['ci95'][1])}]"
                         if best else "—")
            every = ", ".join(f"{k} {_f(v['auc'])}" for k, v in stats.items()) or "—"
            conf = r["confidence"]
            lines.append(f"| {r['policy']} | {r['budget']} | {r['protocol']} | {r['n_failures']} "
                         f"({r['n_induced']} / {r['n_inherent']}) | {best_text} | {every} | {_f(conf['auc'])} |")
    elif study == "gating":
        lines += ["Recompute rate r counts every user turn; the gain ratio is (recall gated − recall ungated) / "
                  "(the same for random gating at r). 'over probes' ignores the cost of firing on fillers.", "",
                  "Probe-vs-filler AUC: against all fillers, and against the fillers in the later half of their "
                  "script (where turn position alone no longer separates; the turn_index row shows how much it "
                  "does over all).", "",
                  "| policy | budget | protocol | recall no gate → full | gate | probe-vs-filler AUC (later half) "
                  "| gain ratio at r = 10 / 25 / 50% | recall at r = 25% (filler rate) | ratio over probes at 25% |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            idx = [RATES.index(x) for x in (0.1, 0.25, 0.5) if x in RATES]
            i25 = RATES.index(0.25) if 0.25 in RATES else None
            for name, s in r["statistics"].items():
                ratios = " / ".join(_f(s["gain_ratio_vs_random"][i]) for i in idx) if s["gain_ratio_vs_random"] \
                    else "n/a (not on every turn)"
                at = s["over_turns"][i25] if s["over_turns"] and i25 is not None else None
                at_text = f"{_f(at['recall'])} ({_f(at.get('filler_rate'))})" if at else "—"
                over_p = _f(s["gain_ratio_vs_random_over_probes"][i25]) if i25 is not None else "—"
                lines.append(f"| {r['policy']} | {r['budget']} | {r['protocol']} | {_f(r['recall_no_gate'])} → "
                             f"{_f(r['recall_full'])} | {name} | {_f(s['auc_probe_vs_filler'])} "
                             f"({_f(s.get('auc_probe_vs_late_filler'))}) | {ratios} "
                             f"| {at_text} | {over_p} |")
        if result.get("calibration"):
            lines += ["", "Calibration (rule 'fillers': the smallest τ with filler gate rate ≤ target; rule "
                      "'probes': the largest τ that gates that share of the eviction-broken probes; rule "
                      "'adaptive': each turn's bar rises with its conversation's recent statistics above a floor "
                      "τ; last column: leave-one-script-out mean):", "",
                      "| statistic | rule | budget | protocol | τ | recall | probe gate rate | filler gate rate "
                      "| held-out recall / filler rate |", "|---|---|---|---|---|---|---|---|---|"]
            for c in result["calibration"]:
                ho = c["leave_one_script_out"]
                ho_recall = [h["recall"] for h in ho if h["recall"] is not None]
                ho_filler = [h["filler_gate_rate"] for h in ho if h["filler_gate_rate"] is not None]
                ho_text = (f"{_f(float(np.mean(ho_recall)))} / {_f(float(np.mean(ho_filler)))}"
                           if ho_recall and ho_filler else "—")
                ins = c["in_sample"]
                kind = c.get("rule", "fillers")
                rule = (f"fillers ≤ {c['filler_target']:.0%}" if kind == "fillers"
                        else f"probes ≥ {c['probe_target']:.0%}" if kind == "probes"
                        else f"adaptive: max(τ, {c['adaptive']['factor']:g} × median of the last "
                             f"{c['adaptive']['window']}), τ at fillers ≤ {c['filler_target']:.1%}")
                lines.append(f"| {c['statistic']} | {rule} | {', '.join(c['budgets'])} | {c['protocol']} "
                             f"| {_f(c['tau'], 4)} "
                             f"| {_f(ins['recall'])} | {_f(ins['probe_gate_rate'])} | {_f(ins['filler_gate_rate'])} "
                             f"| {ho_text} |")
    elif study == "coverage" and "rows" in result:
        lines += [f"Certificate shown by the gate and the TUI: {result['certificate']}.", "",
                  f"Headline ({result['design']}, {result['protocol']}): coverage at nominal "
                  f"{result['nominal']:.0%} {_f(result['coverage'], 3)} over {result['n_cells']} cells "
                  f"(question row × layer × head), Spearman(certificate, error) {_f(result['spearman'])}, "
                  f"k = {_f(result['multiplier'], 3)}.", "",
                  "| design | protocol | turns (uncertified) | form | cells | coverage | Spearman "
                  "| median error / certificate |", "|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            for form, v in r["forms"].items():
                lines.append(f"| {r['design']} | {r['protocol']} | {r['turns']} ({r['uncertified_turns']}) | {form} "
                             f"| {v['n_cells']} | {v['coverage']:.3f} | {_f(v['spearman'])} "
                             f"| {_f(v['median_ratio_error_to_certificate'])} |")
        lines += ["", "Per script (shipped form):", "", "| design | protocol | script | cells | coverage |",
                  "|---|---|---|---|---|"]
        for r in result["rows"]:
            for name, v in r["by_script"].items():
                lines.append(f"| {r['design']} | {r['protocol']} | {name} | {v['n_cells']} | {v['coverage']:.3f} |")
    elif study == "coverage":
        c = result["coverage"]
        lines += [f"Protocol: {result.get('protocol')}; {result.get('draws')} draws of the design per probe.", "",
                  f"Coverage at nominal {result.get('nominal', 0.95):.0%} ({result.get('design')}, F-form, cluster "
                  f"variance): {c['coverage']:.3f} over {c['n_cells']} cells; Spearman(certificate, error) "
                  f"{_f(c['spearman'])}.", "",
                  "| design | certificate form | cells | coverage | Spearman | median error / certificate |",
                  "|---|---|---|---|---|---|"]
        for label, forms in result.get("by_design", {"": result.get("forms", {})}).items():
            for form, v in forms.items():
                lines.append(f"| {label} | {form} | {v['n_cells']} | {v['coverage']:.3f} | {_f(v['spearman'])} "
                             f"| {_f(v['median_ratio_error_to_certificate'])} |")
        lines += ["", "Per layer (first design, F-form):", "", "| layer | coverage |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in c["per_layer"].items()]
    lines += ["", "Runs: " + provenance(result["meta"])]
    if result.get("command") and result["command"] != result["meta"].get("command"):
        lines.append(f"Study: `{result['command']}`")
    return "\n".join(lines) + "\n"


def json_line(result: dict[str, Any]) -> str:
    return json.dumps(result, ensure_ascii=False)
