"""Choose the adaptive gate's factor and window on calibration replays; print the held-out figures beside them.

    python -m agent.lab.fits.adaptive_gate_grid --floor-from DIR --calibration NAME=DIR... [--held-out NAME=DIR...]
        [--statistic sketch.max] [--factors 1.5,2,2.5,3] [--windows 10,20,40]

Each DIR holds replay results (results*.json[.gz]) with a ``full`` run and an ungated ``poisson`` run of the same
scripts: the gate is simulated on the ungated run's recorded statistics, a gated probe answering as the full cache
did (agent.lab.replay.studies.gate_figures; a gated run follows the ungated one turn for turn since re-reads are
transient, docs/results/NOTES.md). The floor τ is the filler rule at ``ADAPTIVE_FILLER_TARGET`` over
``--floor-from`` (the calibration scripts), as the gating study fits it; each (factor, window) then raises every
turn's bar to factor × the median of its conversation's last ``window`` statistics. Printed per set: recall and
the share of non-probe turns gated, for a fixed τ (the floor, and --fixed) and for every setting.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from agent.gate.calibration import Adaptive
from agent.lab.replay import aggregate, studies


def steps_of(folder: Path) -> dict[str, list[dict]]:
    """Budget → paired poisson steps, tagged with their run (the adaptive bar follows one conversation)."""
    meta, runs = aggregate.merge([aggregate.read_results(f) for f in aggregate.result_files([folder])])
    groups = studies.paired_steps(aggregate.results_document(meta, runs), ("poisson",))
    out: dict[str, list[dict]] = {}
    for (policy, budget, protocol), steps in sorted(groups.items()):
        if policy == "poisson" and protocol == "multi-round":
            out[budget] = [{**s, "_run": (budget, s["script"], s["seed"])} for s in steps]
    return out


def parse_sets(items: list[str]) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        name, _, folder = item.partition("=")
        if not folder:
            raise SystemExit(f"expected NAME=DIR, got {item!r}")
        out.append((name, Path(folder)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floor-from", type=Path, required=True, dest="floor_from")
    ap.add_argument("--calibration", nargs="+", required=True)
    ap.add_argument("--held-out", nargs="*", default=[], dest="held_out")
    ap.add_argument("--statistic", default="sketch.max")
    ap.add_argument("--factors", default="1.5,2,2.5,3")
    ap.add_argument("--windows", default="10,20,40")
    ap.add_argument("--fixed", type=float, action="append", default=[], help="also a fixed τ (repeatable)")
    args = ap.parse_args()

    meta, runs = aggregate.merge([aggregate.read_results(f) for f in aggregate.result_files([args.floor_from])])
    floor = studies.calibrate(aggregate.results_document(meta, runs), args.statistic,
                              filler_target=studies.ADAPTIVE_FILLER_TARGET)["tau"]
    columns = []
    for split, items in (("cal", args.calibration), ("held-out", args.held_out)):
        for name, folder in parse_sets(items):
            for budget, steps in steps_of(folder).items():
                columns.append((f"{split}: {name} {budget}", steps))
    rules: list[tuple[str, float, Adaptive | None]] = [(f"fixed τ {t:.2f}", t, None) for t in [*args.fixed, floor]]
    for factor in (float(x) for x in args.factors.split(",")):
        for window in (int(x) for x in args.windows.split(",")):
            rules.append((f"×{factor:g}, last {window}", floor, Adaptive(factor, window)))
    print(f"{args.statistic}: floor τ = {floor:.3f} (fillers ≤ {studies.ADAPTIVE_FILLER_TARGET:.1%} of "
          f"{args.floor_from}); each cell: recall / share of non-probe turns gated\n")
    print("| rule | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, tau, rule in rules:
        cells = []
        for _, steps in columns:
            f = studies.gate_figures(steps, args.statistic, tau, rule)
            cells.append(f"{f['recall']:.2f} / {f['filler_gate_rate']:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
