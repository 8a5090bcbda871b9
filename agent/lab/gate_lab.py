"""The gate lab: score a gate rule offline on long-chat runs in seconds, before a replay confirms it.

Each results folder (``certchat demo long … --policy full,poisson,poisson+gate``) gives, per script, what a rule
needs: the ungated run's per-turn ``sketch.max`` (what the gate reads while it has not fired), each probe's answer
under the full cache and under ungated eviction, and each turn's time under both. A rule (floor τ, factor, window)
is replayed over the ungated readings: a turn fires when it is uncertified or its reading reaches the bar,
max(floor, factor × median of the last ``window`` readings), or a second statistic reaches its own τ
(``--second``: τ at given percentiles of the ordinary turns' readings; ``--write`` puts one into a model's gate
record). Predicted: a fired probe answers as the full cache did,
an unfired one as ungated eviction did; a fired turn costs the full cache's turn plus the overhead a firing added in
the gated run, an unfired one ungated eviction's. Beside the prediction, what the gated run measured: how often a
fired probe did answer as the full cache, and its recall and mean turn time. A gated chat's readings drift from
the ungated run's once it has fired, so the lab ranks rules and a replay confirms the winner.

    python -m agent.lab.gate_lab DIR… [--floors 4,6,8] [--factors 1.5,2,3] [--window 20] [--model NAME]
        [--second question.mean --percentiles 90,95,97 [--write RECORD --percentile 95]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agent.config import DEFAULT_EVICT_AT
from agent.gate import calibration
from agent.lab.replay import aggregate
from agent.lab.replay.longdemo import TIME_BAR_SHARE
from agent.lab.replay.rank_stats import paired_difference


@dataclass
class Turn:
    """One turn of a script as the lab sees it."""

    kind: str
    """"probe", "qfiller" (a question filler), or "other"."""
    reading: float | None
    """The ungated run's ``sketch.max`` (None: no reading, below ``evict_from``)."""
    uncertified: bool
    full_s: float
    ungated_s: float
    full_ok: bool | None = None
    ungated_ok: bool | None = None
    second: float | None = None
    """The ungated run's reading of the second statistic (``--second``), where the results kept it."""
    sampled: int = 0
    """Cells the kept sample held (π < 1) when the question was read."""


@dataclass
class Script:
    name: str
    turns: list[Turn]
    gated: dict[str, Any] = field(default_factory=dict)
    """What the gated run measured: fired probes answered as the full cache (agree, n), recall, mean turn, and
    the mean seconds a firing added over the full cache's turn."""


@dataclass(frozen=True)
class Rule:
    """A candidate gate rule; it fires through the product's own rule (:mod:`agent.gate.calibration`)."""

    floor: float
    factor: float
    window: int
    second_tau: float = math.inf
    """τ of the second statistic (inf: none)."""
    min_sampled: int = 0
    """The second statistic is read only where the kept sample holds at least this many cells."""

    @classmethod
    def of(cls, gate: calibration.GateCalibration) -> "Rule":
        """A calibrated gate's rule: its floor, its adaptive rule and its second signal."""
        adaptive, second = gate.adaptive(gate.statistic), gate.second()
        return cls(gate.tau, adaptive.factor if adaptive else 0.0, adaptive.window if adaptive else 1,
                   second.tau if second else math.inf, second.min_sampled if second else 0)

    def fires(self, readings: Sequence[tuple[float | None, bool, float | None, int]]) -> list[bool]:
        adaptive = calibration.Adaptive(self.factor, self.window) if self.factor > 0 else None
        second = calibration.SecondSignal("", self.second_tau, self.min_sampled)
        recent: list[float] = []
        out = []
        for value, uncertified, other, sampled in readings:
            bar = calibration.adaptive_tau(self.floor, recent, adaptive)
            out.append(uncertified or calibration.breach(value, bar) or second.fires(other, sampled))
            if value is not None:
                recent.append(value)
        return out


def load(folder: Path, gated: str = "poisson+gate", second: str = "") -> list[Script]:
    """The scripts of one results folder that hold a full and an ungated Poisson run (``gated``: the column whose
    measurements stand beside the prediction; ``second``: the second statistic to read)."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    runs_in = [run for f in aggregate.result_files([folder]) for run in aggregate.read_results(f)["runs"]]
    for run in runs_in:
        if run.get("seed", 0) == 0:
            by.setdefault(run["script"], {})[str(run["policy"])] = run
    out = []
    for name, runs in by.items():
        full, ungated = runs.get("full"), runs.get("poisson")
        if full is None or ungated is None:
            continue
        fillers = set(ungated.get("question_fillers", []))
        turns = []
        for i, (f, u) in enumerate(zip(full["steps"], ungated["steps"])):
            detail = u.get("certificate_detail") or {}
            value = detail.get("sketch.max")
            kind = "probe" if u["kind"] == "probe" else "qfiller" if u["turn"] in fillers else "other"
            turns.append(Turn(kind, float(value) if value is not None and math.isfinite(value) else None,
                              bool(detail.get("uncertified")), full["turn_wall_s"][i], ungated["turn_wall_s"][i],
                              f.get("correct") if kind == "probe" else None,
                              u.get("correct") if kind == "probe" else None,
                              finite(detail.get(second)) if second else None,
                              int(detail.get("sampled_cells") or 0)))
        out.append(Script(Path(name).stem, turns, _gated(runs.get(gated), full)))
    return out


def finite(value: Any) -> float | None:
    """A reading as a float, or None where it is missing or not finite (NaN, inf)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def second_tau(scripts: Sequence[Script], percentile: float, min_sampled: int = 0) -> float | None:
    """τ of the second statistic at ``percentile`` of the readings of ordinary turns whose kept sample held at least
    ``min_sampled`` cells (None: no readings)."""
    values = [t.second for s in scripts for t in s.turns
              if t.kind == "other" and t.second is not None and t.sampled >= min_sampled]
    return float(np.percentile(values, percentile)) if values else None


def _gated(run: dict[str, Any] | None, full: dict[str, Any]) -> dict[str, Any]:
    if run is None:
        return {}
    agree = n = 0
    extra: list[float] = []
    correct = []
    for i, (g, f) in enumerate(zip(run["steps"], full["steps"])):
        if g["kind"] == "probe":
            correct.append(bool(g.get("correct")))
        if g.get("gate_fired"):
            extra.append(run["turn_wall_s"][i] - full["turn_wall_s"][i])
            if g["kind"] == "probe":
                n += 1
                agree += bool(g.get("correct")) == bool(f.get("correct"))
    walls = run["turn_wall_s"]
    return {"agree": agree, "fired_probes": n, "recall": (sum(correct), len(correct)),
            "turn_s": sum(walls) / len(walls), "firing_extra_s": sum(extra) / len(extra) if extra else 0.0}


@dataclass
class Score:
    rule: Rule
    right: int
    n: int
    both: int
    full_only: int
    this_only: int
    fired: dict[str, float]
    turn_s: float
    full_s: float
    ungated_s: float

    @property
    def bar_s(self) -> float:
        return self.ungated_s + TIME_BAR_SHARE * self.full_s


def score(scripts: Sequence[Script], rule: Rule, extra_s: float) -> Score:
    """The rule's predicted recall, firings and mean turn time over ``scripts`` (pooled)."""
    right = n = both = full_only = this_only = 0
    counts = {k: [0, 0] for k in ("probe", "qfiller", "other")}
    time = full_t = ungated_t = 0.0
    turns = 0
    for s in scripts:
        fired = rule.fires([(t.reading, t.uncertified, t.second, t.sampled) for t in s.turns])
        for t, f in zip(s.turns, fired):
            counts[t.kind][0] += f
            counts[t.kind][1] += 1
            time += t.full_s + extra_s if f else t.ungated_s
            full_t += t.full_s
            ungated_t += t.ungated_s
            turns += 1
            if t.kind == "probe" and t.full_ok is not None:
                ok = bool(t.full_ok if f else t.ungated_ok)
                n += 1
                right += ok
                both += ok and bool(t.full_ok)
                full_only += bool(t.full_ok) and not ok
                this_only += ok and not t.full_ok
    return Score(rule, right, n, both, full_only, this_only,
                 {k: c[0] / c[1] if c[1] else math.nan for k, c in counts.items()},
                 time / turns, full_t / turns, ungated_t / turns)


def table(scripts: Sequence[Script], rules: Sequence[Rule], shipped: Rule | None) -> str:
    gated = [s.gated for s in scripts if s.gated]
    extras = [g["firing_extra_s"] for g in gated]
    extra = sum(extras) / len(extras) if extras else 0.0
    lines = [f"Scripts: {', '.join(s.name for s in scripts)}; a firing adds {extra:.2f} s over the full cache's turn "
             f"(the gated runs' mean)."]
    if gated:
        agree = sum(g["agree"] for g in gated)
        fired = sum(g["fired_probes"] for g in gated)
        ok = sum(g["recall"][0] for g in gated)
        n = sum(g["recall"][1] for g in gated)
        turn = sum(g["turn_s"] for g in gated) / len(gated)
        lines.append(f"Measured, gated run: recall {ok}/{n}; a fired probe answered as the full cache on {agree} of "
                     f"{fired}; mean turn {turn:.2f} s.")
    lines += ["", "| floor | factor | window | second τ | recall | paired both / full only / this only / neither "
              "| − full [95% CI] | fired: probes / question fillers / other | mean turn (s) | bar (s) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for rule in rules:
        s = score(scripts, rule, extra)
        d = paired_difference(s.full_only, s.this_only, s.n)
        ci = f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]" if d else "—"
        mark = " (shipped)" if rule == shipped else ""
        fired = " / ".join(f"{s.fired[k]:.0%}" for k in ("probe", "qfiller", "other"))
        second = f"{rule.second_tau:.4g} (≥ {rule.min_sampled} cells)" if math.isfinite(rule.second_tau) else "—"
        lines.append(f"| {rule.floor:g}{mark} | {rule.factor:g} | {rule.window} | {second} | {s.right}/{s.n} | "
                     f"{s.both} / {s.full_only} / {s.this_only} / {s.n - s.both - s.full_only - s.this_only} | {ci} | "
                     f"{fired} | {s.turn_s:.2f} | {s.bar_s:.2f}{' ✓' if s.turn_s <= s.bar_s else ''} |")
    return "\n".join(lines) + "\n"


def shipped_rule(model: str) -> tuple[Rule | None, str]:
    """The model's shipped rule (for the default ``evict_at``, which the long-chat runs ran) and the statistic of
    its second signal ("" if none)."""
    gates = [g for m in calibration.read(calibration.SHIPPED_DIR / f"{model}.json") for g in m.gates
             if g.record.get("evict_at") == DEFAULT_EVICT_AT]
    if not gates:
        return None, ""
    second = gates[0].second()
    return Rule.of(gates[0]), second.statistic if second else ""


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.lab.gate_lab", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--floors", default="2,3,4,6,8,12")
    p.add_argument("--factors", default="1.5,2,3,4")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose shipped rule to mark and score")
    p.add_argument("--gated", default="poisson+gate", help="the gated column measured beside the prediction, e.g. "
                   "poisson+gate@copy_back=named")
    p.add_argument("--second", default="", help="a second statistic (e.g. question.mean): the shipped rule is also "
                   "scored with it firing at --percentiles of the ordinary turns' readings")
    p.add_argument("--percentiles", default="90,95,97,99")
    p.add_argument("--min-sampled", type=int, default=0, help="read the second statistic only where the kept sample "
                   "holds at least this many cells (its scale settles with the sample's size)")
    p.add_argument("--write", type=Path, help="a calibration record: give its gate (evict_at of the runs) the second "
                   "statistic at --percentile")
    p.add_argument("--percentile", type=float, default=95.0)
    args = p.parse_args(argv)
    shipped, shipped_second = shipped_rule(args.model)
    if args.second and shipped_second and args.second != shipped_second:
        shipped = dataclasses.replace(shipped, second_tau=math.inf) if shipped is not None else None
    scripts = [s for folder in args.folders for s in load(folder, args.gated, args.second or shipped_second)]
    if not scripts:
        print("gate_lab: no folder holds both a full and a poisson run of a script", file=sys.stderr)
        return 1
    rules = [Rule(f, k, args.window) for f in _floats(args.floors) for k in _floats(args.factors)]
    if shipped is not None and shipped not in rules:
        rules.insert(0, shipped)
    if args.second:
        base = dataclasses.replace(shipped, second_tau=math.inf) if shipped is not None else rules[0]
        for pct in _floats(args.percentiles):
            tau = second_tau(scripts, pct, args.min_sampled)
            if tau is None:
                print(f"gate_lab: the results keep no {args.second} readings (slimmed?)", file=sys.stderr)
                return 1
            rules.insert(1, Rule(base.floor, base.factor, base.window, tau, args.min_sampled))
    print(table(scripts, rules, shipped), end="")
    if args.write is not None:
        if not args.second:
            print("gate_lab: --write needs --second STATISTIC", file=sys.stderr)
            return 1
        tau = second_tau(scripts, args.percentile, args.min_sampled)
        assert tau is not None  # checked above
        write_second(args.write, args.second, tau, args.percentile, args.min_sampled, args.folders, argv)
        print(f"wrote second signal {args.second} ≥ {tau:.4g} (P{args.percentile:g} of ordinary turns) to {args.write}")
    return 0


def write_second(record: Path, statistic: str, tau: float, percentile: float, min_sampled: int,
                 folders: Sequence[Path], argv: list[str] | None) -> None:
    """Put the second signal into the record's gate for the runs' ``evict_at``, saying what fitted it."""
    data = json.loads(record.read_text(encoding="utf-8"))
    gates = [g for g in data["calibrations"] if g.get("evict_at", DEFAULT_EVICT_AT) == DEFAULT_EVICT_AT]
    if not gates:
        raise SystemExit(f"gate_lab: {record} has no gate for evict_at {DEFAULT_EVICT_AT!r}")
    args = " ".join(sys.argv[1:] if argv is None else argv)
    for gate in gates:
        gate["second"] = {"statistic": statistic, "tau": tau, "min_sampled": min_sampled, "percentile": percentile,
                          "fitted_on": [str(f) for f in folders],
                          "command": f"python -m agent.lab.gate_lab {args}"}
    record.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
