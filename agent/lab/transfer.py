"""Does a model's calibration transfer? Its gate and certificate on scripts the calibration never saw.

Per model and budget, beside what ``certchat calibrate`` fitted on the calibration split: recall of the default
chat (Poisson eviction under the calibrated gate) against the full cache on the held-out recall30 scripts, paired
per probe; the share of probes and of ordinary turns (all, and the later half) the gate fired on; and the coverage
of the certificate the chat shows, in the multi-round and one-shot protocols (a ``replay --study coverage`` folder).

    python -m agent.lab.transfer 'qwen2.5-coder-1.5b=CALIBRATION.json,HELDOUT_DIR[+HELDOUT_DIR],COVERAGE_DIR' … \\
        --out docs/results/data/calibration/transfer.json

Each model's spec is its calibration record, then optionally held-out replay folders (``--policy
full,poisson+gate``; several joined by ``+``, each its own rows, named by its scripts) and a coverage study folder;
an empty field skips that part. ``render`` prints the table (``scripts/make_results.py --transfer``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from agent.lab.replay import aggregate
from agent.lab.replay.rank_stats import in_later_half, paired_difference


def _share(xs: list[bool]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def heldout(folder: Path) -> dict[str, dict[str, Any]]:
    """Per budget: recall of the gated chat and of the full cache on the same probes, paired, and the gate's
    firings on probes and fillers."""
    doc = aggregate.read_results(aggregate.result_files([folder])[0])
    full: dict[tuple[str, int], bool] = {}
    for run in doc["runs"]:
        if run["policy"] == "full":
            for s in run["steps"]:
                if s.get("kind") == "probe" and s.get("correct") is not None:
                    full[(run["script"], int(s["lineno"]))] = bool(s["correct"])
    out: dict[str, dict[str, Any]] = {}
    for run in doc["runs"]:
        if run["policy"] != "poisson+gate":
            continue
        row = out.setdefault(run["budget"], {"pairs": [], "probe_fired": [], "filler_fired": [], "late_fired": [],
                                             "scripts": set()})
        row["scripts"].add(run["script"])
        last = max((int(s["turn"]) for s in run["steps"]), default=0)
        for s in run["steps"]:
            if s.get("kind") == "probe" and s.get("correct") is not None:
                twin = full.get((run["script"], int(s["lineno"])))
                if twin is not None:
                    row["pairs"].append((twin, bool(s["correct"])))
                row["probe_fired"].append(bool(s.get("gate_fired")))
            elif s.get("kind") == "filler":
                row["filler_fired"].append(bool(s.get("gate_fired")))
                if in_later_half(s["turn"], last):
                    row["late_fired"].append(bool(s.get("gate_fired")))
    result = {}
    for budget, row in out.items():
        pairs = row["pairs"]
        n = len(pairs)
        both = sum(f and g for f, g in pairs)
        full_only = sum(f and not g for f, g in pairs)
        gate_only = sum(g and not f for f, g in pairs)
        result[budget] = {
            "n_probes": n, "scripts": sorted(row["scripts"]),
            "recall_full": sum(f for f, _ in pairs) / n if n else None,
            "recall_default": sum(g for _, g in pairs) / n if n else None,
            "paired": {"both": both, "full_only": full_only, "default_only": gate_only,
                       "neither": n - both - full_only - gate_only},
            "difference_ci95": paired_difference(full_only, gate_only, n),
            "probes_gated": _share(row["probe_fired"]), "fillers_gated": _share(row["filler_fired"]),
            "later_fillers_gated": _share(row["late_fired"]), "n_fillers": len(row["filler_fired"]),
            "command": doc["meta"].get("command"), "commit": doc["meta"].get("commit"),
            "machine": doc["meta"].get("machine")}
    return result


def coverage(folder: Path) -> dict[str, Any]:
    """Per budget and protocol: the coverage of the certificate the chat shows, with its Wilson interval."""
    study = json.loads((folder / "study-coverage.json").read_text(encoding="utf-8"))
    out: dict[str, dict[str, Any]] = {}
    for row in study["rows"]:
        shown = row["forms"].get("shipped") or {}
        n, cov = shown.get("n_cells"), shown.get("coverage")
        if n and cov is not None:
            out.setdefault(row["budget"], {})[row["protocol"]] = {
                "coverage": cov, "n_cells": n, "turns": row["turns"], "multiplier": shown.get("multiplier"),
                "by_script": {k: v.get("coverage") for k, v in (row.get("by_script") or {}).items()}}
    return {"rows": out, "command": study.get("command") or study["meta"].get("command"),
            "commit": study["meta"].get("commit")}


def _multipliers(record: dict[str, Any], rounds: str) -> dict[str, float]:
    """The record's k per budget for a rounds class ("2+" the multi-round protocol's, "1" the one-shot's; a record
    without rounds classes fitted the multi-round one)."""
    return {m["budget"]: m["multiplier"] for m in record.get("multipliers") or [] if m.get("rounds", "2+") == rounds}


def model_entry(spec: str) -> dict[str, Any]:
    name, _, paths = spec.partition("=")
    parts = paths.split(",") + ["", ""]
    record = json.loads(Path(parts[0]).read_text(encoding="utf-8"))
    gate = record["calibrations"][0]
    return {"model": name, "calibration": {
        "file": parts[0], "accepted": gate.get("accepted", True), "rejected_because": gate.get("rejected_because"),
        "layers": gate["sketch"]["layers"], "tau": gate["tau"], "in_sample": gate["in_sample"],
        "separation": gate.get("separation"), "wall_s": record.get("wall_s"), "command": record.get("command"),
        "coverage_in_sample": record.get("coverage_in_sample"), "threads": record.get("threads"),
        "multipliers": _multipliers(record, "2+"), "multipliers_one_shot": _multipliers(record, "1"),
        "scripts": [Path(x).stem for x in record.get("scripts") or []],
        "rule": {"filler_target": gate.get("filler_target"), **(gate.get("adaptive") or {})},
        "held_out_probe_rate": gate.get("held_out_probe_rate")},
        "heldout": [heldout(Path(folder)) for folder in parts[1].split("+")] if parts[1] else None,
        "coverage": coverage(Path(parts[2])) if parts[2] else None}


def _pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0%}"


def _cov(entry: dict[str, Any], budget: str, protocol: str) -> str:
    rows = (entry.get("coverage") or {}).get("rows", {})
    got = rows.get(budget, {}).get(protocol)
    return f"{got['coverage']:.3f}" if got else "—"


def seeds_label(names: list[str]) -> str:
    """``seed-00, seed-01, seed-06 … seed-09`` as "seeds 00, 01, 06–09"; other names as they are."""
    nums = sorted(int(n[5:]) for n in names if n.startswith("seed-") and n[5:].isdigit())
    others = sorted(n for n in names if not (n.startswith("seed-") and n[5:].isdigit()))
    runs: list[list[int]] = []
    for n in nums:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [f"{r[0]:02d}" if len(r) == 1 else f"{r[0]:02d}, {r[1]:02d}" if len(r) == 2 else f"{r[0]:02d}–{r[-1]:02d}"
             for r in runs]
    return ", ".join(([f"seeds {', '.join(parts)}"] if parts else []) + others)


def stale_coverage(entry: dict[str, Any]) -> str:
    """Where the coverage study ran under a multiplier k other than the record's (an earlier calibration of the
    model), which: a larger k only widens the certificate, so its coverage can only rise."""
    mine = {"multi-round": entry["calibration"].get("multipliers") or {},
            "one-shot": entry["calibration"].get("multipliers_one_shot") or {}}
    out = []
    for budget, protocols in ((entry.get("coverage") or {}).get("rows") or {}).items():
        for protocol, got in protocols.items():
            k, ours = got.get("multiplier"), mine.get(protocol, {}).get(budget)
            if k is not None and ours is not None and abs(k - ours) > 1e-6:
                out.append(f"{budget} {protocol} k {k:.2f} (this record's {ours:.2f})")
    return "; ".join(out)


def render(doc: dict[str, Any]) -> str:
    lines = ["Calibration (`certchat calibrate`: ungated Poisson replays of the calibration scripts at 10% and 25%; "
             "the floor's filler share and the bar's factor chosen per model by the probes caught on scripts left "
             "out of the floor's fit; the certificate's k per budget and rounds class, by the coverage of "
             "conversations left out of its fit):", "",
             "| model | calibration scripts | verdict | sketch layers | floor τ (filler share) | bar factor | "
             "probes gated (left-out scripts) | fillers gated (later half) | "
             "AUC sketch / turn index (later-half fillers) | took |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["models"]:
        c = e["calibration"]
        ins, sep = c["in_sample"], c.get("separation") or {}
        auc_s = (sep.get("sketch.max") or {}).get("auc_later_fillers")
        auc_t = (sep.get("turn_index") or {}).get("auc_later_fillers")
        took = (c.get("wall_s") or {}).get("total")
        rule = c.get("rule") or {}
        lines.append(f"| {e['model']} | {seeds_label(c.get('scripts') or []) or '—'} | "
                     f"{'calibrated' if c['accepted'] else 'rejected'} | "
                     f"{','.join(map(str, c['layers']))} | {c['tau']:.2f} ({_pct(rule.get('filler_target'))}) | "
                     f"{rule.get('factor', '—')} | {_pct(ins['probe_gate_rate'])} of {ins['n_probes']} "
                     f"({_pct(c.get('held_out_probe_rate'))}) | "
                     f"{_pct(ins['filler_gate_rate'])} ({_pct(ins['late_filler_gate_rate'])}) of "
                     f"{ins['n_fillers']} | {auc_s if auc_s is None else f'{auc_s:.3f}'} / "
                     f"{auc_t if auc_t is None else f'{auc_t:.3f}'} | "
                     f"{'—' if not took else f'{took / 60:.1f} min'} |")
    lines += ["", "Held out (recall30 scripts no calibration saw; the default chat = Poisson eviction under the "
                  "model's calibrated gate; coverage of the certificate shown, nominal 95%):", "",
              "| model | held-out scripts | budget | recall full | recall default | paired: both / full only / "
              "default only / neither | default − full [95% CI] | probes gated | fillers gated (later half) | "
              "coverage multi-round | coverage one-shot |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["models"]:
        cov_rows = (e.get("coverage") or {}).get("rows") or {}
        cov_label = seeds_label(sorted({name for protocols in cov_rows.values() for got in protocols.values()
                                        for name in got.get("by_script") or {}}))
        mark = " †" if stale_coverage(e) else ""

        def cov(budget: str, entry: dict[str, Any] = e, mark: str = mark) -> str:
            multi, one = _cov(entry, budget, "multi-round"), _cov(entry, budget, "one-shot")
            return f"{multi}{mark if multi != '—' else ''} | {one}{mark if one != '—' else ''}"

        shown = False
        for hs in e.get("heldout") or []:
            for b in sorted(hs):
                h = hs[b]
                label = seeds_label(h["scripts"])
                p, ci = h["paired"], h.get("difference_ci95")
                diff = f"{ci[0]:+.2f} [{ci[1]:+.2f}, {ci[2]:+.2f}]" if ci else "—"
                same = label == cov_label and b in cov_rows
                shown = shown or same
                lines.append(f"| {e['model']} | {label or '—'} | {b} | {h['recall_full']:.2f} | "
                             f"{h['recall_default']:.2f} | {p['both']} / {p['full_only']} / {p['default_only']} / "
                             f"{p['neither']} of {h['n_probes']} | {diff} | {_pct(h['probes_gated'])} | "
                             f"{_pct(h['fillers_gated'])} ({_pct(h['later_fillers_gated'])}) of {h['n_fillers']} | "
                             f"{cov(b) if same else '— | —'} |")
        if not shown:  # the coverage study ran on other scripts: its own rows
            for b in sorted(cov_rows):
                lines.append(f"| {e['model']} | {cov_label or '—'} | {b} | — | — | — | — | — | — | {cov(b)} |")
    cmds = []
    for e in doc["models"]:
        cmds.append(f"- {e['model']}: calibration `{e['calibration']['command']}`")
        for hs in e.get("heldout") or []:
            for h in list(hs.values())[:1]:
                cmds.append(f"  held out `{h['command']}` (commit {h['commit']}, {h['machine']})")
        if e.get("coverage"):
            cmds.append(f"  coverage `{e['coverage']['command']}` (commit {e['coverage']['commit']})")
            stale = stale_coverage(e)
            if stale:
                cmds.append(f"  † coverage measured under another certificate than this record's: {stale}; a "
                            "larger k only widens the certificate, so coverage under this record's can only be higher")
    lines += ["", "Commands:", "", *cmds, "", f"Table: `{doc['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", metavar="NAME=CALIBRATION[,HELDOUT][,COVERAGE]")
    ap.add_argument("--out", type=Path, required=True, help="the table's JSON (scripts/make_results.py --transfer)")
    args = ap.parse_args(argv)
    doc = {"models": [model_entry(spec) for spec in args.models],
           "command": "python -m agent.lab.transfer " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
