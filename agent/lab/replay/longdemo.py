"""`certchat demo long`: long scripts under several policies in one process, measured as a user feels them.

Each job goes through the replay ``Runner``'s public calls only. Around them this module
times every turn (each ``JobRun.advance``), samples the process's resident memory after each
turn, and keeps both in the run record (``turn_wall_s``, ``rss_bytes``), so shard files merged
by ``certchat replay merge`` still carry them. With ``--lockstep`` a script's jobs run side by
side, each on an engine of its own, a turn of each in turn, so the machine's drift over minutes
falls on every policy alike and the time bar compares like with like.

:func:`rows` turns runs into one column per (policy, budget): recall (overall, by distance,
verbatim / paraphrased), the gate's rate on probes, question fillers and the other turns,
tokens re-read and restored, mean and p95 turn time, decode speed, peak KV cells and host
memory; each column's probes paired with the full cache's on the same script (both right /
full only / this only / neither, and the difference with its 95% interval), and a gated
column's mean turn time against the bar ungated eviction sets (ungated + 0.10 × full).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from agent import models
from agent.config import Config
from agent.lab.replay import aggregate, figures, report
from agent.lab.replay.batch import Settings, results_path
from agent.lab.replay.rank_stats import paired_difference
from agent.lab.replay.runner import Job, Runner, default_store_path, plan_jobs, shard, unique_names
from agent.lab.replay.script import Script

POLICIES = "full,topk,poisson,poisson+gate"
DISTANCE_BUCKETS: tuple[tuple[int, int | None], ...] = ((2, 9), (10, 49), (50, 149), (150, None))
MIB = 1 << 20
TIME_BAR_SHARE = 0.10
"""A gated chat's mean turn time may exceed ungated eviction's by this share of the full cache's (issue 35)."""
POSITION_BAND = 16_384
"""Width, in tokens of the conversation, of the bands the scripted replies' log-probability is reported in."""


def rss_bytes() -> int:
    """This process's resident set size now (0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _identity(name_or_path: str) -> tuple[Path, str, str]:
    """(path, display name, sha256); a registry model verified when pulled is not re-parsed (seconds)."""
    if name_or_path in models.REGISTRY:
        path = models.model_file(name_or_path) if models.is_pulled(name_or_path) else models.resolve(name_or_path)
        return path, name_or_path, models.REGISTRY[name_or_path].sha256
    path = models.resolve(name_or_path)
    return path, models.display_name(name_or_path, path), models.sha256_of(name_or_path, path)


def context_for(scripts: list[Script], model_path: Path, max_tokens: int) -> int:
    """KV cells for the longest script's whole history under this model's template, plus one answer; at most the
    model's trained context."""
    from agent.lab.replay.longchat import TokenCounter  # noqa: PLC0415

    counter = TokenCounter(model_path)
    try:
        need = 0
        for s in scripts:
            extra = sum(max_tokens + 2 * counter.per_message for st in s.steps
                        if st.assistant is None and not st.independent)
            longest_aside = max((counter.text(st.user) + counter.per_message for st in s.steps if st.independent),
                                default=0)
            need = max(need, counter.history(s) + extra + longest_aside)
        trained = counter.context_length()
    finally:
        counter.close()
    n_ctx = ((need + max_tokens + 256 + 255) // 256) * 256
    if trained and n_ctx > trained:
        # past the trained context the full cache shifts its context (the oldest half dropped, as llama.cpp's
        # does); evicting policies keep their budget, their positions running on
        n_ctx = trained
    return max(1024, n_ctx)


def run(scripts: list[Script], settings: Settings, base: Config,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Every job, one engine; the results document (also written after each job)."""
    from agent.llm.engine import Engine, EngineSettings  # noqa: PLC0415 — loads llama.cpp
    from memory_store.store import Store  # noqa: PLC0415

    scripts = unique_names(scripts)
    by_name = {s.name: s for s in scripts}
    model_path, display, sha = _identity(settings.model or base.model)
    cfg = base.replace(temperature=0.0, max_tokens=settings.max_tokens, threads=settings.threads,
                       answer_certificate=True)
    n_ctx = settings.n_ctx or context_for(scripts, model_path, cfg.max_tokens)
    cfg = cfg.replace(n_ctx=n_ctx)
    jobs = shard(plan_jobs(scripts, settings.policies, settings.budgets, settings.seeds), settings.shard)
    meta = {
        "model": display, "model_sha256": sha, "machine": report.machine(),
        "machine_short": report.machine().split(" (")[0], "command": settings.command,
        "policies": settings.policies, "budgets": settings.budgets, "seeds": settings.seeds,
        "protocols": ["multi-round"], "gate": settings.gate, "temperature": 0.0, "max_tokens": cfg.max_tokens,
        "n_ctx": n_ctx, "threads": cfg.threads, "shard": settings.shard, "commit": report.git_commit(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "scripts": [{"name": s.name, "source": s.source, "steps": len(s.steps), "probes": len(s.probes),
                     **({"meta": s.meta} if s.meta else {})} for s in scripts],
        "jobs": len(jobs), "demo": "long", "lockstep": settings.lockstep, "generate_fillers": settings.generate_fillers,
        "score_replies": settings.score_replies,
        "host_memory": "resident set size sampled after each turn (/proc/self/statm): its peak in the run, "
                       "and that peak less the resident size when the run started",
        "design": {k: getattr(cfg, k) for k in ("sinks", "recent", "page_size", "top_share", "floor",
                                                 "question_window", "cert_window", "gate_stat", "evict_at",
                                                 "evict_from", "reread_copy") if hasattr(cfg, k)},
        **settings.extra_meta,
    }
    settings.out.mkdir(parents=True, exist_ok=True)
    out_path = results_path(settings)
    log(f"demo long: {len(jobs)} jobs on {', '.join(s.name for s in scripts)}; model {display}, "
        f"{cfg.threads} threads, n_ctx {n_ctx}, max_tokens {cfg.max_tokens}"
        + (", each script's jobs in lockstep" if settings.lockstep else ""))
    store = Store(default_store_path(settings.out, settings.shard))
    runs: list[dict[str, Any]] = []

    def make_engine() -> Any:
        return Engine(EngineSettings.from_config(cfg, model_path, n_ctx=n_ctx))

    def finished(timing: _Timing, record: dict[str, Any]) -> None:
        record.update(timing.fields())
        record.update(fact_ages(by_name[record["script"]]))
        runs.append(record)
        if settings.progress:
            col = _column([record])
            log(f"{timing.label}: recall {col['n_correct']}/{col['n_probes']}, mean turn {col['turn_s_mean']:.2f} s, "
                f"gate rate {_pct(col['gate_probes'])} probes / {_pct(col['gate_qfillers'])} question "
                f"fillers, {record['wall_s']:.0f} s")
        aggregate.write_results(out_path, meta, runs)

    try:
        if settings.lockstep:
            meta["host_memory"] = ("resident set size of the whole process, which holds every engine of a lockstep "
                                   "group, sampled after each turn")
            for group in lockstep_groups(jobs):
                _run_lockstep(group, by_name, len(jobs), runs, make_engine, lambda engine: Runner(
                    cfg, engine, display, store, gate=settings.gate, generate_fillers=settings.generate_fillers,
                    score_replies=settings.score_replies), settings.progress, log, finished)
        else:
            engine = make_engine()
            try:
                runner = Runner(cfg, engine, display, store, gate=settings.gate,
                                generate_fillers=settings.generate_fillers, score_replies=settings.score_replies)
                for n, job in enumerate(jobs, start=1):
                    timing = _Timing(f"[{n}/{len(jobs)}] {_job_words(job)}", len(by_name[job.script].steps))
                    job_run = runner.start(job, by_name[job.script])
                    try:
                        while not job_run.done:
                            timing.turn(job_run.advance(), settings.progress, log)
                    finally:
                        job_run.close()
                    finished(timing, job_run.result())
            finally:
                engine.close()
    finally:
        store.close()
    return aggregate.write_results(out_path, meta, runs)


def _job_words(job: Job) -> str:
    return f"{job.script} · {job.policy} {job.budget} · seed {job.seed}"


def lockstep_groups(jobs: list[Job]) -> list[list[Job]]:
    """The jobs of each script together, in the order the scripts first appear (a lockstep group)."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.script, []).append(job)
    return list(groups.values())


def _run_lockstep(group: list[Job], by_name: dict[str, Script], n_jobs: int, runs: list[dict[str, Any]],
                  make_engine: Callable[[], Any], make_runner: Callable[[Any], Runner], progress: bool,
                  log: Callable[[str], None], finished: Callable[[_Timing, dict[str, Any]], None]) -> None:
    """One script's jobs, each on an engine of its own, a turn of each in turn: every policy's turn k runs within
    seconds of the others', so the machine's drift between jobs (llama.cpp's prefill speed wanders by 10–15 % over
    minutes here) falls on all of them alike. Which job goes first rotates turn by turn."""
    script = by_name[group[0].script]
    engines: list[Any] = []
    job_runs: list[Any] = []
    try:
        for job in group:
            engines.append(make_engine())
            job_runs.append(make_runner(engines[-1]).start(job, script))
        timings = [_Timing(f"[{len(runs) + i + 1}/{n_jobs}] {_job_words(job)}", len(script.steps))
                   for i, job in enumerate(group)]
        for turn in range(len(script.steps)):
            for k in range(len(group)):
                i = (turn + k) % len(group)
                timings[i].turn(job_runs[i].advance(), progress and k == len(group) - 1, log)
        for timing, job_run in zip(timings, job_runs):
            finished(timing, job_run.result(interleaved=True))
    finally:
        for job_run in job_runs:
            job_run.close()
        for engine in engines:
            engine.close()


class _Timing:
    """One job's turn times and the process's resident memory after each turn."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.every = max(1, total // 10)
        self.walls: list[float] = []
        self.rss: list[int] = []
        self.rss_start = rss_bytes()

    def turn(self, seconds: float, say: bool, log: Callable[[str], None]) -> None:
        self.walls.append(seconds)
        self.rss.append(rss_bytes())
        done = len(self.walls)
        if say and (done == self.total or done % self.every == 0):
            log(f"  {self.label}: turn {done}/{self.total}, last turn {seconds:.2f} s, {sum(self.walls):.0f} s so far")

    def fields(self) -> dict[str, Any]:
        return {"turn_wall_s": list(self.walls), "rss_bytes": list(self.rss), "rss_start_bytes": self.rss_start}


# -- the side-by-side table ------------------------------------------------------------------------
def fact_ages(script: Script) -> dict[str, Any]:
    """For a script past the model's trained context (``meta["beyond"]``): each probe's fact's age in tokens when
    asked about (``fact_age_tokens``, by turn) and that context (``beyond``); else nothing."""
    offsets, beyond = script.meta.get("turn_tokens"), script.meta.get("beyond")
    if not offsets or not beyond:
        return {}
    ages = {str(st.turn): int(offsets[st.turn - 1] - offsets[st.probe.fact_turn - 1]) for st in script.steps
            if st.probe is not None and st.probe.fact_turn is not None and st.turn <= len(offsets)}
    return {"beyond": int(beyond), "fact_age_tokens": ages}


def _age(run: dict[str, Any], turn: int) -> str | None:
    age = run.get("fact_age_tokens", {}).get(str(turn))
    if age is None:
        return None
    return f"older than {run['beyond']:,} tokens" if age > run["beyond"] else f"within {run['beyond']:,} tokens"


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(0.95 * len(ordered))) - 1))]


def _bucket(distance: int) -> str:
    for lo, hi in DISTANCE_BUCKETS:
        if distance >= lo and (hi is None or distance <= hi):
            return f"{lo}–{hi}" if hi is not None else f"≥{lo}"
    return f"<{DISTANCE_BUCKETS[0][0]}"


def _band(index: int) -> str:
    lo, hi = index * POSITION_BAND, (index + 1) * POSITION_BAND
    return f"{lo // 1024}k–{hi // 1024}k"


def _column(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One (policy, budget) pooled over its runs (scripts and seeds)."""
    probes, qfill, other, times, probe_times = [], [], [], [], []
    for run in members:
        fill = set(run.get("question_fillers", []))
        walls = run.get("turn_wall_s") or []
        for i, s in enumerate(run["steps"]):
            t = walls[i] if i < len(walls) else None
            if t is not None:
                times.append(t)
            if s["kind"] == "probe":
                probes.append(s)
                if t is not None:
                    probe_times.append(t)
            elif s["turn"] in fill and not s["independent"]:
                qfill.append(s)
            else:
                other.append(s)
    scored = [p for p in probes if p.get("correct") is not None]
    answers = {(run["script"], run["seed"], s["turn"]): bool(s["correct"]) for run in members for s in run["steps"]
               if s["kind"] == "probe" and s.get("correct") is not None}
    by_distance: dict[str, list[bool]] = defaultdict(list)
    by_category: dict[str, list[bool]] = defaultdict(list)
    by_age: dict[str, list[bool]] = defaultdict(list)
    for run in members:
        for st in run["steps"]:
            age = _age(run, st["turn"]) if st["kind"] == "probe" and st.get("correct") is not None else None
            if age is not None:
                by_age[age].append(bool(st["correct"]))
    for p in scored:
        if p.get("distance") is not None:
            by_distance[_bucket(p["distance"])].append(bool(p["correct"]))
        if p.get("category"):
            by_category[p["category"]].append(bool(p["correct"]))
    sums = [r["summary"] for r in members]
    decode_s = sum(s["decode_s"] for s in sums)
    decode_tokens = sum(s["decode_tokens"] for s in sums)
    rss = [b for r in members for b in r.get("rss_bytes", [])]
    fit: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for run in members:
        for st in run["steps"]:
            if st.get("reply_scored_tokens"):
                band = fit[int(st["history_tokens"]) // POSITION_BAND]
                band[0] += float(st["reply_logprob_sum"])
                band[1] += int(st["reply_scored_tokens"])
    deltas = [max(r["rss_bytes"]) - r.get("rss_start_bytes", 0) for r in members if r.get("rss_bytes")]
    return {
        "n_probes": len(scored), "n_correct": sum(bool(p["correct"]) for p in scored), "answers": answers,
        "turn_walls": {(r["script"], r["seed"]): list(r["turn_wall_s"]) for r in members if r.get("turn_wall_s")},
        "recall": _rate([bool(p["correct"]) for p in scored]),
        "recall_by_distance": {k: (sum(v), len(v)) for k, v in by_distance.items()},
        "recall_by_category": {k: (sum(v), len(v)) for k, v in by_category.items()},
        "recall_by_age": {k: (sum(v), len(v)) for k, v in sorted(by_age.items(), reverse=True)},
        "reply_logprob_by_position": {_band(b): (total / n, int(n)) for b, (total, n) in sorted(fit.items()) if n},
        "gate_probes": _rate([bool(s["gate_fired"]) for s in probes]),
        "gate_qfillers": _rate([bool(s["gate_fired"]) for s in qfill]),
        "gate_other": _rate([bool(s["gate_fired"]) for s in other]),
        "reprefill_tokens": sum(s["reprefill_tokens"] for r in members for s in r["steps"]),
        "restored_tokens": sum(s.get("restored_tokens", 0) for r in members for s in r["steps"]),
        "turn_s_mean": sum(times) / len(times) if times else None, "turn_s_p95": _p95(times),
        "probe_turn_s_mean": sum(probe_times) / len(probe_times) if probe_times else None,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "peak_cells": max((s["peak_live_cells"] for s in sums), default=0),
        "rss_peak_mib": max(rss) / MIB if rss else None,
        "rss_delta_mib": max(deltas) / MIB if deltas else None,
        "wall_s": sum(r["wall_s"] for r in members),
        "wall_s_per_script": sum(r["wall_s"] for r in members) / len({r["script"] for r in members}),
        "history_tokens": max((s["history_tokens"] for s in sums), default=0),
        "turns": max(len(r["steps"]) for r in members), "scripts": len({r["script"] for r in members}),
        "seeds": len({r["seed"] for r in members}),
    }


def _columns(runs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """:func:`_column` of each (policy, budget, protocol) among ``runs``."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run["policy"], run["budget"], run.get("protocol", "multi-round"))].append(run)
    return {k: _column(v) for k, v in groups.items()}


def rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One column per (policy, budget, protocol), in the aggregate's order."""
    columns = _columns(doc["runs"])
    order = [(r["policy"], r["budget"], r["protocol"]) for r in aggregate.table(doc["aggregate"])]
    return [{"policy": k[0], "budget": k[1], "protocol": k[2], **columns[k]} for k in order if k in columns]


def paired(full: dict[str, Any], column: dict[str, Any]) -> dict[str, Any] | None:
    """``column``'s probes against the full cache's on the same script and turn (each seed of a sampled policy
    against the full cache's one run): counts, and the recall difference with its 95% interval."""
    truth = {(script, turn): ok for (script, _, turn), ok in full["answers"].items()}
    pairs = [(truth[(script, turn)], ok) for (script, _, turn), ok in column["answers"].items()
             if (script, turn) in truth]
    if not pairs:
        return None
    both = sum(f and c for f, c in pairs)
    full_only = sum(f and not c for f, c in pairs)
    this_only = sum(c and not f for f, c in pairs)
    return {"both": both, "full_only": full_only, "this_only": this_only,
            "neither": len(pairs) - both - full_only - this_only, "n": len(pairs),
            "difference_ci95": paired_difference(full_only, this_only, len(pairs))}


def time_bar(full: dict[str, Any] | None, ungated: dict[str, Any] | None) -> float | None:
    """The mean turn time a gated column must keep under: ungated eviction's plus :data:`TIME_BAR_SHARE` of the
    full cache's, both from the same run."""
    if not full or not ungated or full["turn_s_mean"] is None or ungated["turn_s_mean"] is None:
        return None
    return float(ungated["turn_s_mean"]) + TIME_BAR_SHARE * float(full["turn_s_mean"])


def time_bar_by_turn(full: dict[str, Any], ungated: dict[str, Any], column: dict[str, Any]
                     ) -> tuple[float, float, float, int] | None:
    """``column``'s turns against the bar on the same turns: each turn's time less ungated eviction's and
    :data:`TIME_BAR_SHARE` × the full cache's on that script's turn (the same seed, else seed 0), as (mean, 95% low,
    95% high, turns). Meaningful where the runs took turns side by side (``--lockstep``); None without a pairing."""
    diffs: list[float] = []
    for (script, seed), walls in column.get("turn_walls", {}).items():
        f = full.get("turn_walls", {}).get((script, seed)) or full.get("turn_walls", {}).get((script, 0))
        u = ungated.get("turn_walls", {}).get((script, seed)) or ungated.get("turn_walls", {}).get((script, 0))
        if f is None or u is None or not len(f) == len(u) == len(walls):
            continue
        diffs += [c - b - TIME_BAR_SHARE * a for a, b, c in zip(f, u, walls)]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
    half = 1.96 * sd / len(diffs) ** 0.5
    return mean, mean - half, mean + half, len(diffs)


def _paired_words(full: dict[str, Any] | None, column: dict[str, Any]) -> tuple[str, str]:
    got = paired(full, column) if full is not None and not _is_full(column["policy"]) else None
    if got is None:
        return "—", "—"
    d, lo, hi = got["difference_ci95"]
    return (f"{got['both']} / {got['full_only']} / {got['this_only']} / {got['neither']}",
            f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] (n={got['n']})")


def _ungated(cols: list[dict[str, Any]], column: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in cols if c["policy"].split("@")[0] == "poisson" and c["budget"] == column["budget"]), None)


def _bar_by_turn_words(cols: list[dict[str, Any]], full: dict[str, Any] | None, column: dict[str, Any]) -> str:
    ungated = _ungated(cols, column)
    if column["policy"].split("@")[0] != "poisson+gate" or full is None or ungated is None:
        return "—"
    got = time_bar_by_turn(full, ungated, column)
    if got is None:
        return "—"
    mean, lo, hi, n = got
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] s (n={n})"


def _bar_words(cols: list[dict[str, Any]], full: dict[str, Any] | None, column: dict[str, Any]) -> str:
    if column["policy"].split("@")[0] != "poisson+gate":
        return "—"
    bar = time_bar(full, _ungated(cols, column))
    if bar is None or column["turn_s_mean"] is None:
        return "—"
    return f"{column['turn_s_mean']:.2f} against {bar:.2f} s: {'met' if column['turn_s_mean'] <= bar else 'not met'}"


def _is_full(policy: str) -> bool:
    return policy.split("@")[0] == "full"


def _heading(column: dict[str, Any]) -> str:
    return report.POLICY_LABEL.get(column["policy"], column["policy"]) + (
        "" if column["policy"] == "full" else f" {column['budget']}")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, digits: int = 0, unit: str = "") -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def _frac(pair: tuple[int, int] | None) -> str:
    if not pair or not pair[1]:
        return "—"
    return f"{pair[0] / pair[1]:.2f} ({pair[0]}/{pair[1]})"


def table(doc: dict[str, Any], footer: bool = True) -> str:
    """The side-by-side Markdown table: a column per policy, a row per measure; ``footer``: the scripts, host
    memory and provenance lines under it."""
    cols = rows(doc)
    if not cols:
        return "(no runs)\n"
    full = next((c for c in cols if _is_full(c["policy"])), None)
    head = [_heading(c) for c in cols]
    buckets = [_bucket(lo) for lo, _ in DISTANCE_BUCKETS]
    cats = sorted({k for c in cols for k in c["recall_by_category"]})
    ages = sorted({k for c in cols for k in c.get("recall_by_age", {})}, reverse=True)
    bands = sorted({k for c in cols for k in c.get("reply_logprob_by_position", {})},
                   key=lambda k: int(k.split("k")[0]))
    body: list[tuple[str, list[str]]] = [
        ("recall", [_frac((c["n_correct"], c["n_probes"])) for c in cols]),
        ("paired with full: both / full only / this only / neither", [_paired_words(full, c)[0] for c in cols]),
        ("recall − full [95% CI]", [_paired_words(full, c)[1] for c in cols]),
        *[(f"recall, distance {b}", [_frac(c["recall_by_distance"].get(b)) for c in cols]) for b in buckets
          if any(b in c["recall_by_distance"] for c in cols)],
        *[(f"recall, {k} probes", [_frac(c["recall_by_category"].get(k)) for c in cols]) for k in cats],
        *[(f"recall, facts {k}", [_frac(c["recall_by_age"].get(k)) for c in cols]) for k in ages],
        *[(f"scripted replies' log-prob per token, conversation tokens {k}",
           [_num(c["reply_logprob_by_position"][k][0], 3) if k in c.get("reply_logprob_by_position", {}) else "—"
            for c in cols]) for k in bands],
        ("gate rate: probes / question fillers / other turns",
         [f"{_pct(c['gate_probes'])} / {_pct(c['gate_qfillers'])} / {_pct(c['gate_other'])}" for c in cols]),
        ("tokens re-read (re-prefilled)", [_num(c["reprefill_tokens"]) for c in cols]),
        ("tokens restored from host memory", [_num(c["restored_tokens"]) for c in cols]),
        ("turn time, mean / p95 (s)", [f"{_num(c['turn_s_mean'], 2)} / {_num(c['turn_s_p95'], 2)}" for c in cols]),
        (f"mean turn time against ungated + {TIME_BAR_SHARE:.2f} × full", [_bar_words(cols, full, c) for c in cols]),
        ("the same bar turn by turn: mean over it [95% CI] (lockstep runs)",
         [_bar_by_turn_words(cols, full, c) for c in cols]),
        ("turn time vs full (mean)", [_num(c["turn_s_mean"] / full["turn_s_mean"], 2, "×")
                                      if full and full["turn_s_mean"] and c["turn_s_mean"] else "—" for c in cols]),
        ("probe turn time, mean (s)", [_num(c["probe_turn_s_mean"], 2) for c in cols]),
        ("decode tok/s", [_num(c["decode_tok_s"], 1) for c in cols]),
        ("peak KV cells", [_num(c["peak_cells"]) for c in cols]),
        ("host RSS peak / growth in the run (MiB)",
         [f"{_num(c['rss_peak_mib'])} / {_num(c['rss_delta_mib'])}" for c in cols]),
        ("wall time per script (s)", [_num(c["wall_s_per_script"]) for c in cols]),
    ]
    out = ["| measure | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
    out += ["| " + name + " | " + " | ".join(cells) + " |" for name, cells in body]
    if not footer:
        return "\n".join(out) + "\n"
    meta = doc["meta"]
    first = cols[0]
    scripts = ", ".join(s["name"] for s in meta.get("scripts", []))
    out.append("")
    out.append(f"Scripts: {scripts} ({first['turns']} turns, {first['history_tokens']:,} history tokens at the end "
               f"under `{meta.get('model')}`, {first['n_probes']} probes). Host memory: "
               f"{meta.get('host_memory', 'resident set size sampled after each turn')}.")
    out.append(report.provenance(meta))
    return "\n".join(out) + "\n"


def by_script_table(doc: dict[str, Any]) -> str:
    """A row per script and one pooled row, a column per (policy, budget): what each conversation gave a user.

    Each cell reads "recall · mean turn · question wait · wall time"; the mean turn is in seconds for ``full`` and
    relative to the same script's ``full`` run for the others (a script without one shows seconds). Columns come from
    runs merged from several folders (e.g. one process per budget), so every script's ``full`` serves all budgets."""
    cols = rows(doc)
    if not cols:
        return "(no runs)\n"
    keys = [(c["policy"], c["budget"], c["protocol"]) for c in cols]

    def cell(c: dict[str, Any] | None, full: dict[str, Any] | None, is_full: bool) -> str:
        if c is None:
            return "—"
        recall = f"{c['recall']:.2f}" if c["recall"] is not None else "—"
        if is_full or not (full and full["turn_s_mean"]) or c["turn_s_mean"] is None:
            turn = _num(c["turn_s_mean"], 2, " s")
        else:
            turn = _num(c["turn_s_mean"] / full["turn_s_mean"], 2, "×")
        return f"{recall} · {turn} · {_num(c['probe_turn_s_mean'], 2, ' s')} · {_num(c['wall_s'] / 60, 1, ' min')}"

    def line(label: str, by: dict[tuple[str, str, str], dict[str, Any]], tokens: int, n_probes: int) -> str:
        full = next((by[k] for k in keys if _is_full(k[0]) and k in by), None)
        cells = [cell(by.get(k), full, _is_full(k[0])) for k in keys]
        return f"| {label} | {tokens:,} | {n_probes} | " + " | ".join(cells) + " |"

    out = ["| script | history tokens | probes | " + " | ".join(_heading(c) for c in cols) + " |",
           "|---|---|---|" + "---|" * len(cols)]
    per_script: list[tuple[str, dict[tuple[str, str, str], dict[str, Any]], int, int]] = []
    for name in dict.fromkeys(r["script"] for r in doc["runs"]):
        runs = [r for r in doc["runs"] if r["script"] == name]
        by = _columns(runs)
        per_script.append((name, by, max(r["summary"]["history_tokens"] for r in runs),
                           max(c["n_probes"] for c in by.values())))
    out += [line(*row) for row in per_script]
    if len(per_script) > 1:
        out.append(line(f"all {len(per_script)} (pooled)", dict(zip(keys, cols)),
                        sum(row[2] for row in per_script), sum(row[3] for row in per_script)))
    out.append("")
    out.append("Each cell: recall · mean turn time (seconds for full; for the others, a multiple of the same "
               "script's full run) · mean time of a probe turn, what a user waits for an answer · wall time of the "
               "whole run.")
    return "\n".join(out) + "\n"


def json_line(doc: dict[str, Any]) -> str:
    cols = rows(doc)
    full = next((c for c in cols if _is_full(c["policy"])), None)
    out = [{**{k: v for k, v in c.items() if k not in ("answers", "turn_walls")},
            "paired_with_full": paired(full, c) if full is not None and c is not full else None} for c in cols]
    return json.dumps({"columns": out}, ensure_ascii=False)


# -- plots -------------------------------------------------------------------------------------
def plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Turn wall time by turn, and the certificate by turn, one line per policy (per script)."""
    plt = figures.pyplot()

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = list(dict.fromkeys(r["script"] for r in doc["runs"]))
    tail = f"{doc['meta'].get('model')} · {doc['meta'].get('machine_short', '')}".rstrip(" ·")
    for name in names[:5]:
        runs = [r for r in doc["runs"] if r["script"] == name and r.get("turn_wall_s")]
        if not runs:
            continue
        prefix = f"{name}-" if len(names) > 1 else ""
        fig, ax = plt.subplots(figsize=(9, 4))
        for i, r in enumerate(runs):
            turns = [s["turn"] for s in r["steps"]][:len(r["turn_wall_s"])]
            ax.plot(turns, r["turn_wall_s"], lw=0.9, color=f"C{i}",
                    label=f"{report.POLICY_LABEL.get(r['policy'], r['policy'])} "
                          f"{'' if r['policy'] == 'full' else r['budget']}".strip())
        probe_turns = sorted({s["turn"] for s in runs[0]["steps"] if s["kind"] == "probe"})
        for t in probe_turns:
            ax.axvline(t, color="0.85", lw=0.6, zorder=0)
        ax.set_yscale("log")
        written.append(figures.save(fig, ax, out_dir / f"{prefix}long-turn_time.png",
                                    xlabel="user turn (grey lines: probes)", ylabel="turn wall time (s, log)",
                                    title=f"Turn time by turn: {name} ({tail})"))

        cert = [r for r in runs if report.certified(r["policy"].split("@")[0])
                and any(s["certificate"] is not None for s in r["steps"])]
        if not cert:
            continue
        fig, ax = plt.subplots(figsize=(9, 4))
        for i, r in enumerate(cert):
            pts = [(s["turn"], s["certificate"], s["kind"] == "probe", s["gate_fired"]) for s in r["steps"]
                   if s["certificate"] is not None]
            color = f"C{runs.index(r)}"
            label = f"{report.POLICY_LABEL.get(r['policy'], r['policy'])} {r['budget']}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.7, color=color, label=label)
            probes = [p for p in pts if p[2]]
            if probes:
                ax.scatter([p[0] for p in probes], [p[1] for p in probes], marker="x", s=22, color=color,
                           label=f"{label}: probes")
            fired = [p for p in pts if p[3]]
            if fired:
                ax.scatter([p[0] for p in fired], [p[1] for p in fired], marker="o", s=16, facecolors="none",
                           edgecolors="k", lw=0.6, label="gate fired" if i == len(cert) - 1 else None)
        report.plot_thresholds(ax, cert)
        # the sketch's anomaly spans 1 to hundreds: linear below 1 (a certificate's range), logarithmic above
        ax.set_yscale("symlog", linthresh=1.0)
        written.append(figures.save(fig, ax, out_dir / f"{prefix}long-certificate_by_turn.png", xlabel="user turn",
                                    ylabel="turn certificate (gate statistic)",
                                    title=f"Certificate by turn: {name} ({tail}); dashed: τ"))
    return written


def write_reports(doc: dict[str, Any], out: Path, plot: bool = True) -> list[Path]:
    """long-table.md (and the plots) beside the results; the standard replay table and plots too."""
    from agent.lab.replay import batch  # noqa: PLC0415

    path = out / "long-table.md"
    path.write_text(table(doc), encoding="utf-8")
    written = [path] + batch.write_reports(doc, out, plots=plot)
    if plot and doc["runs"]:
        written += plots(doc, out)
    return written
