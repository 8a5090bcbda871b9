"""Does the sketch point at the evidence? Per sketch layer, from a recording of many layers, on scripts with probes.

``agent/lab/fits/sketch_layers.py`` asks which layers separate probes from fillers. On LoCoMo that is not enough: a
probe there is a differently worded turn ("Question about our conversation: …"), so a layer can separate
probes by their form alone. This script prints, for each recorded layer, the largest anomaly over the mostly
evicted messages (share / max(baseline, SHARE_FLOOR), agent/gate/decision.py), leaving out ``--skip-messages`` (the
system prompt, whose sink cells stay live, and the first message draw a LoCoMo question's attention by form):

- AUC probes vs the other user turns, beside the turn-index baseline;
- AUC of the eviction-induced failures (the full run recalls the probe, the evicting run does not; ``--full``
  names the full runs' results) against every other turn, and against the other probes only (the form-free test);
- how often a message of the probe's evidence (``fact_turn``: its user line and the answer after it) is among
  the ``--top`` most anomalous messages.

    python -m agent.lab.fits.sketch_evidence DIR --full FULL_DIR --budget 10% --skip-messages 0,1

(The LoCoMo census recordings it was run on are in git, not in the tree: docs/results/data/README.md.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from agent.lab.fits.sketch_records import recorded_ratios
from agent.lab.replay import aggregate
from agent.lab.replay.rank_stats import auc


def _runs(paths: list[Path], policy: str, budget: str | None) -> list[dict[str, Any]]:
    return [run for path in aggregate.result_files(paths) for run in aggregate.read_results(path)["runs"]
            if run["policy"].split("@", 1)[0] == policy and (budget is None or run["budget"] == budget)]


def turns(paths: list[Path], full: list[Path], budget: str, skip: set[int]) -> tuple[list[int], list[dict[str, Any]]]:
    recalled = {(r["script"], s["turn"], s.get("question")): bool(s.get("correct"))
                for r in _runs(full, "full", None) for s in r["steps"] if s.get("kind") == "probe"}
    layers: list[int] | None = None
    out: list[dict[str, Any]] = []
    for run in _runs(paths, "poisson", budget):
        for s in run["steps"]:
            detail = s.get("certificate_detail") or {}
            messages = detail.get("sketch.messages")
            if not messages:
                continue
            layers = layers or list(detail["sketch.layers"])
            ratios = recorded_ratios(messages, skip)
            top = np.max(np.stack(list(ratios.values())), axis=0) if ratios else np.zeros(len(layers))
            probe = s.get("kind") == "probe"
            fact = s.get("fact_turn") if probe else None
            full_right = recalled.get((run["script"], s["turn"], s.get("question")))
            out.append({"probe": probe, "turn": s["turn"], "top": top, "ratios": ratios,
                        "induced": bool(probe and full_right and not s.get("correct")),
                        "evidence": [2 * fact - 1, 2 * fact] if fact else []})
    return layers or [], out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results of the evicting runs (many sketch layers)")
    ap.add_argument("--full", nargs="+", type=Path, required=True, help="results holding the full runs")
    ap.add_argument("--budget", default="10%")
    ap.add_argument("--skip-messages", default="0,1", help="message indices left out (comma-separated; '' none)")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    skip = {int(x) for x in args.skip_messages.split(",") if x.strip()}
    layers, rows = turns(args.results, args.full, args.budget, skip)
    if not rows:
        print(f"no turns with sketch detail at {args.budget} in {[str(p) for p in args.results]}", file=sys.stderr)
        return 1
    probes = [r for r in rows if r["probe"]]
    others = [r for r in rows if not r["probe"]]
    induced = [r for r in probes if r["induced"]]
    fine = [r for r in probes if not r["induced"]]
    rest = [r for r in rows if not r["induced"]]
    with_evidence = [r for r in probes if any(m in r["ratios"] for m in r["evidence"])]
    print(f"budget {args.budget}: {len(probes)} probes ({len(induced)} eviction-induced failures), {len(others)} other "
          f"turns; messages left out: {sorted(skip) or 'none'}")
    print(f"turn index: AUC probes vs others {auc([r['turn'] for r in probes], [r['turn'] for r in others]):.3f}")
    print(f"| layer | probes vs others | induced vs all other turns | induced vs other probes "
          f"| evidence in top {args.top} (of {len(with_evidence)}) |")
    print("|---|---|---|---|---|")

    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    for li, layer in enumerate(layers):
        hits = 0
        for r in with_evidence:
            order = sorted(r["ratios"], key=lambda m: -r["ratios"][m][li])
            hits += min(order.index(m) for m in r["evidence"] if m in r["ratios"]) < args.top
        print(f"| {layer} | {fmt(auc([r['top'][li] for r in probes], [r['top'][li] for r in others]))} | "
              f"{fmt(auc([r['top'][li] for r in induced], [r['top'][li] for r in rest]))} | "
              f"{fmt(auc([r['top'][li] for r in induced], [r['top'][li] for r in fine]))} | {hits} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
