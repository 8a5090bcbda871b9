"""Other turn statistics from the same sketch reading: does any separate the recall questions where sketch.max does not?

Input: replay or ``certchat demo long`` results (results.json[.gz], shards or folders) holding an evicting run without
the gate (``--policy``, ``--budget``; default poisson at 10%) and, for the induced-failure column, the full run of the
same scripts. Each turn's recorded ``sketch.messages`` (agent/gate/decision.py ``Gate.read_sketch``) gives, per message
with evicted cells, its share of the question's attention and its baseline in each sketch layer. Over the messages more
than half evicted with a baseline, per turn:

- ``sketch.max``: max over messages and layers of share / max(base, SHARE_FLOOR) — the shipped statistic;
- ``excess.max``: max over messages and layers of share − base — the attention above what earlier questions paid;
- ``excess.sum``: the sum over messages of max(0, that message's largest share − base) — the implicated mass;
- ``log-anomaly × share``: max over messages of log(max(anomaly, 1)) × the message's largest share;
- ``turn index``: the position baseline every separation is checked against.

Per statistic the script prints the AUC of the probes against the question-shaped fillers (long-chat scripts), against
the other turns and against the other turns of the later half of their script, the AUC of the eviction-induced
failures (full right, evicted wrong) against the other probes, and the statistic's Spearman correlation with the turn
index over the non-probe turns (a statistic that grows along the chat separates end-of-chat probes by position).

    python -m agent.lab.fits.sketch_statistics docs/results/data/longchat-8k-adaptive

It reads each turn's ``certificate_detail``: of the committed recordings only longchat-8k-adaptive keeps it; the others
are in git as they were recorded (docs/results/data/README.md).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from agent.gate.decision import SHARE_FLOOR
from agent.lab.fits.sketch_records import recorded_shares
from agent.lab.replay import aggregate
from agent.lab.replay.rank_stats import auc, spearman

Rows = list[tuple[np.ndarray, np.ndarray]]
"""Per mostly evicted message with a baseline: (share per layer, baseline per layer)."""


def _anomalies(rows: Rows) -> np.ndarray:
    return np.array([(s / np.maximum(b, SHARE_FLOOR)).max() for s, b in rows])


def _excess(rows: Rows) -> np.ndarray:
    return np.array([(s - b).max() for s, b in rows])


STATISTICS: dict[str, Callable[[Rows], float]] = {
    "sketch.max": lambda rows: float(_anomalies(rows).max()),
    "excess.max": lambda rows: float(_excess(rows).max()),
    "excess.sum": lambda rows: float(np.clip(_excess(rows), 0.0, None).sum()),
    "log-anomaly × share": lambda rows: float((np.log(np.maximum(_anomalies(rows), 1.0))
                                               * np.array([s.max() for s, _ in rows])).max()),
}


def message_rows(detail: dict[str, Any]) -> Rows:
    """The messages ``sketch.max`` ranges over: more than half evicted, with a baseline."""
    return list(recorded_shares(detail.get("sketch.messages") or {}).values())


@dataclass
class Turn:
    script: str
    index: int
    """The step's position in its run (independent probes share a turn number; this does not)."""
    turn: int
    kind: str
    """probe, question filler, or other."""
    late: bool
    values: dict[str, float] = field(default_factory=dict)
    induced: bool | None = None
    """A probe the full run answered and this run did not (None: not a probe, or no full run)."""


def load(paths: Sequence[Path], policy: str, budget: str) -> list[Turn]:
    runs = [run for path in aggregate.result_files(paths) for run in aggregate.read_results(path)["runs"]]
    full = {(run["script"], i): bool(s.get("correct")) for run in runs if run["policy"].split("@", 1)[0] == "full"
            for i, s in enumerate(run["steps"]) if s.get("kind") == "probe"}
    turns: list[Turn] = []
    for run in runs:
        if run["policy"].split("@", 1)[0] != policy or run["budget"] != budget:
            continue
        questions = set(run.get("question_fillers", []))
        last = max((int(s["turn"]) for s in run["steps"]), default=0)
        for i, s in enumerate(run["steps"]):
            rows = message_rows(s.get("certificate_detail") or {})
            if not rows:
                continue  # nothing evicted yet, or no baselines: the sketch is silent
            kind = "probe" if s["kind"] == "probe" else "question filler" if s["turn"] in questions else "other"
            t = Turn(run["script"], i, int(s["turn"]), kind, int(s["turn"]) * 2 >= last,
                     {name: f(rows) for name, f in STATISTICS.items()})
            t.values["turn index"] = float(t.turn)
            if kind == "probe" and (run["script"], i) in full:
                t.induced = full[(run["script"], i)] and not s.get("correct")
            turns.append(t)
    if not turns:
        raise SystemExit(f"no turn with sketch.messages for policy {policy} at budget {budget} in "
                         f"{', '.join(map(str, paths))}: record it with an evicting run (the ungated policy)")
    return turns


def separations(turns: list[Turn], name: str) -> dict[str, Any]:
    def vals(pred: Callable[[Turn], bool]) -> list[float]:
        return [t.values[name] for t in turns if pred(t)]

    probes = vals(lambda t: t.kind == "probe")
    induced = vals(lambda t: t.induced is True)
    rest = vals(lambda t: t.induced is False)
    others = [t for t in turns if t.kind != "probe"]
    return {
        "question fillers": auc(probes, vals(lambda t: t.kind == "question filler")),
        "other turns": auc(probes, vals(lambda t: t.kind == "other")),
        "later-half other turns": auc(probes, vals(lambda t: t.kind == "other" and t.late)),
        "induced vs rest": auc(induced, rest), "n_induced": len(induced),
        "spearman with turn": spearman([t.turn for t in others], [t.values[name] for t in others])
        if len(others) > 2 else None,
    }


def _f(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def table(turns: list[Turn]) -> str:
    kinds = {k: sum(t.kind == k for t in turns) for k in ("probe", "question filler", "other")}
    n_late = sum(t.kind == "other" and t.late for t in turns)
    lines = [f"{kinds['probe']} probes, {kinds['question filler']} question fillers, {kinds['other']} other turns "
             f"({n_late} in the later half)", "",
             "| statistic | probes vs question fillers | vs other turns | vs later-half other turns "
             "| induced failures vs other probes (n) | Spearman with turn (non-probes) |",
             "|---|---|---|---|---|---|"]
    for name in [*STATISTICS, "turn index"]:
        s = separations(turns, name)
        lines.append(f"| {name} | {_f(s['question fillers'])} | {_f(s['other turns'])} | "
                     f"{_f(s['later-half other turns'])} | {_f(s['induced vs rest'])} ({s['n_induced']}) | "
                     f"{_f(s['spearman with turn'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="results files or folders; each is reported on its own")
    ap.add_argument("--policy", default="poisson", help="the evicting run without the gate (default poisson)")
    ap.add_argument("--budget", default="10%")
    args = ap.parse_args(argv)
    for path in args.results:
        try:
            turns = load([path], args.policy, args.budget)
        except aggregate.ResultsError as err:
            raise SystemExit(f"{path}: {err}") from None
        print(f"## {path} — {args.policy} at {args.budget}\n")
        print(table(turns) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
