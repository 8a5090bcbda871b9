"""From per-step records to per-run summaries, per-(policy, budget, seed) aggregates, tables.

A run is one script under one policy/budget/seed/protocol. The aggregate pools the
probes of every script of a (policy, budget, seed, protocol) — what ``--json`` prints —
and the table averages those over seeds (mean ± standard deviation). Shard files merge
by job key, so a run present in two shards counts once.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from agent.errors import ExplainedError
from agent.eviction import policies

FORMAT = "certchat-replay-results"
VERSION = 1
FAR = 25
"""Distance (turns) from which a probe counts as a long-range recall."""


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def summarize(run: dict[str, Any], script: Any = None) -> dict[str, Any]:
    """Recall, gate rates, re-prefill cost and speed of one run (script unused: kinds are in the steps)."""
    steps = run["steps"]
    probes = [s for s in steps if s["kind"] == "probe" and s.get("correct") is not None]
    far = [p for p in probes if p.get("distance") is not None and p["distance"] >= FAR]
    f1 = [s["f1"] for s in steps if s["kind"] == "probe" and s.get("f1") is not None]
    fillers = [s for s in steps if s["kind"] == "filler"]
    generated = [s for s in steps if s["answer_tokens"] > 0]
    decode_s = sum(s["decode_ms"] for s in generated) / 1000.0
    decode_tokens = sum(s["answer_tokens"] for s in generated)
    return {
        "n_probes": len(probes),
        "n_correct": sum(bool(p["correct"]) for p in probes),
        "recall": _rate([bool(p["correct"]) for p in probes]),
        "n_probes_distance_ge_25": len(far),
        "recall_distance_ge_25": _rate([bool(p["correct"]) for p in far]),
        "f1": _mean(f1),
        "n_turns": len(steps),
        "gate_rate": _rate([bool(s["gate_fired"]) for s in steps]),
        "gate_rate_probes": _rate([bool(s["gate_fired"]) for s in steps if s["kind"] == "probe"]),
        "gate_rate_fillers": _rate([bool(s["gate_fired"]) for s in fillers]),
        "reprefill_tokens": sum(s["reprefill_tokens"] for s in steps),
        "restored_tokens": sum(s.get("restored_tokens", 0) for s in steps),
        "reread_messages": sum(len(s.get("reread_messages", [])) for s in steps),
        "targeted_rereads": sum(s.get("reread_path") == "targeted" for s in steps),
        "reprefill_tokens_every_turn": sum(s["history_tokens"] for s in steps),
        "history_tokens": max((s["history_tokens"] for s in steps), default=0),
        "wall_s": run.get("wall_s", 0.0),
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "peak_live_cells": max((s["peak_cells"] for s in steps), default=0),
    }


def _group_key(run: dict[str, Any]) -> tuple[str, str, int, str]:
    return (run["policy"], run["budget"], run["seed"], run.get("protocol", "multi-round"))


def aggregate(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, budget, seed, protocol), pooling the probes of all scripts."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[_group_key(run)].append(run)
    rows = []
    for (policy, budget, seed, protocol), members in groups.items():
        sums = [m["summary"] for m in members]
        n = sum(s["n_probes"] for s in sums)
        correct = sum(s["n_correct"] for s in sums)
        far_n = sum(s["n_probes_distance_ge_25"] for s in sums)
        far_correct = sum(sum(bool(p["correct"]) for p in m["steps"] if p["kind"] == "probe"
                              and p.get("correct") is not None and p.get("distance") is not None
                              and p["distance"] >= FAR) for m in members)
        steps = [s for m in members for s in m["steps"]]
        f1 = [p["f1"] for p in steps if p["kind"] == "probe" and p.get("f1") is not None]
        decode_s = sum(s["decode_s"] for s in sums)
        decode_tokens = sum(s["decode_tokens"] for s in sums)
        rows.append({
            "policy": policy, "budget": budget, "seed": seed, "protocol": protocol,
            "recall": correct / n if n else None,
            "recall_distance_ge_25": far_correct / far_n if far_n else None,
            "n_probes": n, "n_probes_distance_ge_25": far_n,
            "f1": _mean(f1),
            "gate_rate": _rate([bool(s["gate_fired"]) for s in steps]),
            "gate_rate_probes": _rate([bool(s["gate_fired"]) for s in steps if s["kind"] == "probe"]),
            "gate_rate_fillers": _rate([bool(s["gate_fired"]) for s in steps if s["kind"] == "filler"]),
            "reprefill_tokens": sum(s["reprefill_tokens"] for s in sums),
            "restored_tokens": sum(s.get("restored_tokens", 0) for s in sums),
            "reread_messages": sum(s.get("reread_messages", 0) for s in sums),
            "targeted_rereads": sum(s.get("targeted_rereads", 0) for s in sums),
            "reprefill_tokens_every_turn": sum(s["reprefill_tokens_every_turn"] for s in sums),
            "wall_s": sum(s["wall_s"] for s in sums),
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "peak_live_cells": max(s["peak_live_cells"] for s in sums),
            "n_scripts": len(members),
        })
    rows.sort(key=lambda r: (r["protocol"], _policy_sort(r["policy"])[0] > 0, _budget_sort(r["budget"]),
                             _policy_sort(r["policy"]), r["seed"]))
    return rows


_ORDER = policies.REPLAY_NAMES


def _policy_sort(policy: str) -> tuple[int, str]:
    base = policy.split("@", 1)[0]
    return (_ORDER.index(base) if base in _ORDER else len(_ORDER), policy)


def _budget_sort(budget: str) -> float:
    return float(budget[:-1]) / 100 if budget.endswith("%") else float(budget) * 1e6


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate rows averaged over seeds: one row per (protocol, budget, policy)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["protocol"], r["budget"], r["policy"])].append(r)
    out = []
    for (protocol, budget, policy), members in groups.items():
        def stat(key: str) -> tuple[float | None, float | None]:
            vals = [m[key] for m in members if m[key] is not None]
            if not vals:
                return None, None
            mean = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
            return mean, sd

        row: dict[str, Any] = {"protocol": protocol, "budget": budget, "policy": policy, "seeds": len(members),
                               "n_probes": members[0]["n_probes"]}
        for key in ("recall", "recall_distance_ge_25", "f1", "gate_rate", "gate_rate_probes", "gate_rate_fillers",
                    "reprefill_tokens", "reprefill_tokens_every_turn", "decode_tok_s", "peak_live_cells", "wall_s"):
            row[key], row[key + "_sd"] = stat(key)
        row["n_probes_distance_ge_25"] = members[0]["n_probes_distance_ge_25"]
        out.append(row)
    # full first (it is budget-free), then by budget and policy
    out.sort(key=lambda r: (r["protocol"], _policy_sort(r["policy"])[0] > 0, _budget_sort(r["budget"]),
                            _policy_sort(r["policy"])))
    return out


JSON_KEYS = ("policy", "budget", "seed", "recall", "recall_distance_ge_25", "n_probes", "gate_rate",
             "reprefill_tokens", "reprefill_tokens_every_turn", "wall_s", "decode_tok_s", "peak_live_cells")


def json_line(rows: list[dict[str, Any]]) -> str:
    """The ``--json`` aggregate: the documented keys first, then the extras."""
    runs = [{**{k: r[k] for k in JSON_KEYS}, **{k: v for k, v in r.items() if k not in JSON_KEYS}} for r in rows]
    return json.dumps({"runs": runs}, ensure_ascii=False)


# -- result files ----------------------------------------------------------------------------
def results_document(meta: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "meta": meta, "runs": runs, "aggregate": aggregate(runs)}


def write_results(path: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    doc = results_document(meta, runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return doc


class ResultsError(ExplainedError, ValueError):
    """A file that is not a certchat replay results file."""


def read_results(path: Path) -> dict[str, Any]:
    """A results file, plain or gzip-compressed (``results.json.gz``: how the larger recordings are kept in
    docs/results/data)."""
    try:
        if Path(path).suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                doc = json.load(fh)
        else:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResultsError(f"{path}: not a readable results file ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ResultsError(f"{path}: not a certchat replay results file (no \"format\": \"{FORMAT}\")")
    if doc.get("version", 0) > VERSION:
        raise ResultsError(f"{path}: written by a newer certchat (results version {doc['version']})")
    return doc


def result_files(paths: Iterable[Path]) -> list[Path]:
    """Results files named directly or found in the given folders (results*.json, results*.json.gz)."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found.extend(sorted([*p.glob("results*.json"), *p.glob("results*.json.gz")]))
        elif p.is_file():
            found.append(p)
        else:
            raise ResultsError(f"{p}: no such file or folder")
    if not found:
        raise ResultsError("no results*.json(.gz) files in " + ", ".join(str(p) for p in paths))
    return found


def merge(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Combine shard documents: runs deduplicated by job key; meta from the first, shards listed."""
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    for doc in docs:
        for run in doc["runs"]:
            key = (run["script"], run["policy"], run["budget"], run["seed"], run.get("protocol", "multi-round"))
            runs.setdefault(key, run)
    meta = dict(docs[0]["meta"]) if docs else {}
    meta["merged_from"] = [d["meta"].get("shard") for d in docs]
    commands = list(dict.fromkeys(d["meta"].get("command") for d in docs if d["meta"].get("command")))
    if len(commands) > 1:
        meta["commands"] = commands
    merged = list(runs.values())
    # what the merged runs cover, not what the first file asked for
    meta["budgets"] = sorted({r["budget"] for r in merged if r["policy"].split("@")[0] != "full"}, key=_budget_sort)
    meta["policies"] = list(dict.fromkeys(r["policy"] for r in merged))
    meta["protocols"] = sorted({r.get("protocol", "multi-round") for r in merged})
    meta["seeds"] = max((d["meta"].get("seeds") or 1 for d in docs), default=1)
    scripts = {s["name"]: s for d in docs for s in d["meta"].get("scripts", [])}
    if scripts:
        meta["scripts"] = list(scripts.values())
    meta.pop("shard", None)
    models = {d["meta"].get("model") for d in docs}
    if len(models) > 1:
        raise ResultsError(f"the shards were run with different models: {', '.join(map(str, sorted(models)))}")
    return meta, merged
