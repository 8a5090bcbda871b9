"""Which layers should the evicted-key sketch keep? ``sketch.max`` recomputed offline for layer subsets.

Input: a replay ``results.json`` (or ``results.json.gz``) recorded with a sketch of many layers (ideally all:
``--sketch-layers 0,…,23``).
Each turn's ``certificate_detail`` holds, per earlier message with evicted cells, its share of the question's
attention and its baseline (median over earlier questions) per sketch layer, and its evicted and live cell
counts (``sketch.messages``, ``sketch.layers``; agent/gate/decision.py ``Gate.read_sketch``). A message's share in one
layer does not depend on the other layers, so ``sketch.max`` for a subset S is exactly

    max over messages more than half evicted, with a baseline, of  max_{l in S} share_l / max(base_l, SHARE_FLOOR)

(up to the detail's 4-digit rounding). For every subset that fits the byte budget (``--max-bytes``, 768 B per
evicted token for qwen2.5-coder-0.5b = 1/16 of a full K+V row) the script prints the probe-vs-filler AUC against
all fillers and against the later-half fillers — on the calibration scripts (choose there) and on the held-out
ones (check there) — beside the turn-index baseline, the recorded ``sketch.max`` and fixed reference sets.
Subsets: exhaustive up to ``--exhaustive`` layers, then a greedy forward search up to the most layers that fit.
The AUCs are those of the recorded bits (an int4 subset chosen on an int8 recording is to be re-checked at int4).

    python -m agent.lab.fits.sketch_layers DIR/results.json --calibrate seed-02,seed-03,seed-04,seed-05 \\
        --check seed-00,seed-01 --budget 10%
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from agent.lab.fits.sketch_records import recorded_ratios
from agent.lab.replay import aggregate
from agent.lab.replay.rank_stats import auc, in_later_half
from native import sketch

REFERENCE_SETS = {"DESIGN §8 / sixth session (11,13–16,20–23)": (11, 13, 14, 15, 16, 20, 21, 22, 23),
                  "11–23": tuple(range(11, 24))}


@dataclass
class Turn:
    """One user turn of an evicting run: per sketch layer, the largest anomaly over mostly evicted messages."""

    script: str
    turn: int
    kind: str
    late: bool
    """A filler in the later half of its script (where the turn position alone no longer separates)."""
    layer_max: np.ndarray
    """[n recorded layers] max over the messages of share / max(base, floor); 0 where no message qualifies."""
    recorded: float | None
    """The run's own sketch.max (with the recorded layers)."""


def load_turns(paths: Sequence[Path], policy: str, budget: str) -> tuple[list[int], list[Turn]]:
    layers: list[int] | None = None
    turns: list[Turn] = []
    for path in aggregate.result_files(paths):
        for run in aggregate.read_results(path)["runs"]:
            if run["policy"].split("@", 1)[0] != policy or run["budget"] != budget:
                continue
            steps = run["steps"]
            last = max((int(s["turn"]) for s in steps), default=0)
            for s in steps:
                if s.get("kind") not in ("probe", "filler"):
                    continue
                detail = s.get("certificate_detail") or {}
                rec_layers = detail.get("sketch.layers")
                if rec_layers is None:
                    if "sketch.max" in detail:
                        raise SystemExit(f"{path}: a turn has sketch.max but no sketch.messages: record it again with "
                                         "this tree (agent/gate/decision.py records the per-message shares)")
                    row = None
                else:
                    if layers is None:
                        layers = [int(x) for x in rec_layers]
                    elif [int(x) for x in rec_layers] != layers:
                        raise SystemExit(f"{path}: runs recorded different sketch layers ({rec_layers} vs {layers})")
                    row = np.zeros(len(layers))
                    for ratio in recorded_ratios(detail.get("sketch.messages") or {}).values():
                        row = np.maximum(row, ratio)
                turns.append(Turn(run["script"], int(s["turn"]), s["kind"],
                                  s["kind"] == "filler" and in_later_half(s["turn"], last),
                                  row if row is not None else np.zeros(0),
                                  detail.get("sketch.max")))
    if layers is None:
        raise SystemExit(f"no turn with sketch.messages for policy {policy} at budget {budget} in {paths}")
    for t in turns:
        if not len(t.layer_max):
            t.layer_max = np.zeros(len(layers))  # nothing evicted yet: the sketch is silent (0)
    return layers, turns


def aucs(turns: list[Turn], values: Iterable[float]) -> tuple[float | None, float | None]:
    """(probe vs all fillers, probe vs later-half fillers)."""
    v = list(values)
    probes = [x for t, x in zip(turns, v) if t.kind == "probe"]
    fillers = [x for t, x in zip(turns, v) if t.kind == "filler"]
    late = [x for t, x in zip(turns, v) if t.kind == "filler" and t.late]
    return auc(probes, fillers), auc(probes, late)


class Scorer:
    """AUCs of subsets on one set of turns, vectorised over the turns."""

    def __init__(self, turns: list[Turn], n_layers: int) -> None:
        self.turns = turns
        self.m = np.stack([t.layer_max for t in turns]) if turns else np.zeros((0, n_layers))
        self.is_probe = np.array([t.kind == "probe" for t in turns], dtype=bool)
        self.is_filler = np.array([t.kind == "filler" for t in turns], dtype=bool)
        self.is_late = np.array([t.late for t in turns], dtype=bool)

    def values(self, idx: Sequence[int]) -> np.ndarray:
        return self.m[:, list(idx)].max(axis=1)

    def auc_pair(self, idx: Sequence[int]) -> tuple[float, float]:
        v = self.values(idx)
        return _auc(v[self.is_probe], v[self.is_filler]), _auc(v[self.is_probe], v[self.is_late])

    def margin(self, idx: Sequence[int]) -> float:
        """log(median probe / 90th percentile of the later-half fillers): how far apart, where the AUCs tie."""
        v = self.values(idx)
        p, f = v[self.is_probe], v[self.is_late]
        if not len(p) or not len(f):
            return math.nan
        return float(np.log(max(np.median(p), 1e-9)) - np.log(max(np.quantile(f, 0.9), 1e-9)))


def ranking(scorer: Scorer) -> Callable[[tuple[int, ...]], tuple[float, float, float, int]]:
    """The order subsets are chosen in, best last: the AUC against the later-half fillers first (the harder test:
    the turn's position no longer separates there), then against all fillers, then the margin, then fewer layers.
    AUCs are compared to 3 decimals: a difference of a pair or two of turns in a thousand is no difference, and the
    margin (how far the probes sit above the fillers' tail, what a threshold needs) decides."""
    memo: dict[tuple[int, ...], tuple[float, float, float, int]] = {}

    def key(idx: tuple[int, ...]) -> tuple[float, float, float, int]:
        if idx not in memo:
            a_all, a_late = scorer.auc_pair(idx)
            memo[idx] = (round(a_late, 3), round(a_all, 3), scorer.margin(idx), -len(idx))
        return memo[idx]

    return key


def readable(scorer: Scorer) -> list[int]:
    """The recorded layers (indices) whose reading is finite on every turn. A layer whose attention logits overflow
    the sketch's scoring reads NaN, and a gate reading NaN fails closed: it would fire on every turn."""
    return [i for i in range(scorer.m.shape[1]) if np.isfinite(scorer.m[:, i]).all()]


def ranked(scorer: Scorer, candidates: Sequence[int], max_layers: int) -> list[tuple[int, ...]]:
    """Every subset of at most ``max_layers`` of the ``candidates`` (recorded layers' indices), best first."""
    subsets = [idx for k in range(1, max_layers + 1) for idx in itertools.combinations(candidates, k)]
    return sorted(subsets, key=ranking(scorer), reverse=True)


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    if not len(pos) or not len(neg):
        return math.nan
    d = pos[:, None] - neg[None, :]
    return float(((d > 0).sum() + 0.5 * (d == 0).sum()) / d.size)


def _fmt(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _name(layers: Sequence[int]) -> str:
    return ",".join(str(x) for x in layers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="results.json files or replay --out folders")
    ap.add_argument("--calibrate", default="seed-02,seed-03,seed-04,seed-05", help="scripts to choose the layers on")
    ap.add_argument("--check", default="seed-00,seed-01", help="held-out scripts to check the choice on")
    ap.add_argument("--policy", default="poisson")
    ap.add_argument("--budget", default="10%")
    ap.add_argument("--max-bytes", type=int, default=768, help="bytes per evicted token allowed")
    ap.add_argument("--n-kv-head", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--exhaustive", type=int, default=5, help="try every subset up to this many layers")
    ap.add_argument("--top", type=int, default=12, help="subsets to print")
    ap.add_argument("--subsets", default="", help="more subsets to print, e.g. \"11;3,11;3,9,11\"")
    args = ap.parse_args()

    layers, turns = load_turns(args.results, args.policy, args.budget)
    cal_names, check_names = set(args.calibrate.split(",")), set(args.check.split(","))
    cal = Scorer([t for t in turns if t.script in cal_names], len(layers))
    held = Scorer([t for t in turns if t.script in check_names], len(layers))
    pos = {x: i for i, x in enumerate(layers)}
    fit = {bits: max((n for n in range(1, len(layers) + 1)
                      if sketch.bytes_per_token(n, args.n_kv_head, args.head_dim, bits) <= args.max_bytes), default=0)
           for bits in (8, 4)}
    print(f"sketch layer subsets — {args.policy} at {args.budget}, recorded layers {_name(layers)}; calibration "
          f"{len(cal.turns)} turns ({int(cal.is_probe.sum())} probes, {int(cal.is_filler.sum())} fillers, "
          f"{int(cal.is_late.sum())} later-half), held out {len(held.turns)} turns ({int(held.is_probe.sum())} probes, "
          f"{int(held.is_filler.sum())} fillers); ≤ {args.max_bytes} B per evicted token: up to {fit[8]} layers int8, "
          f"{fit[4]} layers int4")
    print("AUC = probe vs all fillers / vs later-half fillers")
    print()
    print("| subset | layers | B/token int8 / int4 | calibration AUC | held-out AUC |")
    print("|---|---|---|---|---|")

    def row(label: str, idx: Sequence[int] | None, cal_auc: tuple[Any, Any], held_auc: tuple[Any, Any]) -> None:
        n = len(idx) if idx is not None else 0
        size = (f"{sketch.bytes_per_token(n, args.n_kv_head, args.head_dim, 8)} / "
                f"{sketch.bytes_per_token(n, args.n_kv_head, args.head_dim, 4)}") if n else "—"
        print(f"| {label} | {n or '—'} | {size} | {_fmt(cal_auc[0])} / {_fmt(cal_auc[1])} | "
              f"{_fmt(held_auc[0])} / {_fmt(held_auc[1])} |")

    # baselines: the turn index, the run's own sketch.max, every recorded layer, the reference sets
    row("turn index", None, aucs(cal.turns, [t.turn for t in cal.turns]),
        aucs(held.turns, [t.turn for t in held.turns]))
    row("recorded sketch.max", None, aucs(cal.turns, [t.recorded or 0.0 for t in cal.turns]),
        aucs(held.turns, [t.recorded or 0.0 for t in held.turns]))
    everything = list(range(len(layers)))
    row(f"all recorded ({_name(layers)})", everything, cal.auc_pair(everything), held.auc_pair(everything))
    named = dict(REFERENCE_SETS)
    for text in filter(None, args.subsets.split(";")):
        named[text] = tuple(int(x) for x in text.split(","))
    for label, ref in named.items():
        if all(x in pos for x in ref):
            ref_idx = [pos[x] for x in ref]
            row(label, ref_idx, cal.auc_pair(ref_idx), held.auc_pair(ref_idx))
    # candidates: every subset up to --exhaustive layers, then greedy forward steps up to the most that fit
    n_max = max(fit.values())
    scored: dict[tuple[int, ...], tuple[float, float]] = {}
    for k in range(1, min(args.exhaustive, n_max) + 1):
        for idx in itertools.combinations(everything, k):
            scored[idx] = cal.auc_pair(idx)

    key = ranking(cal)

    current = max((i for i in scored if len(i) == min(args.exhaustive, n_max)), key=key, default=())
    while len(current) < n_max:
        options = [tuple(sorted(current + (j,))) for j in everything if j not in current]
        for idx in options:
            scored.setdefault(idx, cal.auc_pair(idx))
        current = max(options, key=key)
    for bits in (8, 4):
        best = sorted((i for i in scored if len(i) <= fit[bits]), key=key, reverse=True)[: args.top]
        print()
        print(f"best on calibration within {args.max_bytes} B at int{bits} (≤ {fit[bits]} layers; ties: the larger "
              "log(median probe / 90th percentile of later fillers), then fewer layers):")
        print()
        print("| subset | layers | B/token int8 / int4 | calibration AUC | held-out AUC |")
        print("|---|---|---|---|---|")
        for idx in best:
            row(f"{_name([layers[i] for i in idx])} (margin {key(idx)[2]:.2f})", idx, scored[idx], held.auc_pair(idx))
    # per layer alone: where the signal is
    print()
    print("single layers (calibration later-half AUC): " + ", ".join(
        f"{layers[i]}: {scored[(i,)][1]:.2f}" for i in everything if (i,) in scored))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
