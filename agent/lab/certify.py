"""``certchat calibrate``'s certification: long calibration chats replayed under the full cache and each budget.

Each chat is replayed once with the full cache and once per budget with the chat's own policy (Poisson eviction
under the model's gate, at the chat's ``evict_from`` and copy-back settings), greedy, so every probe is answered
twice after the same chat. The pairs become one :class:`agent.gate.certification.Trial` per budget, and the trials
the record's ``certification`` (the bound, the fixed sequence and why they are valid are in that module).

The chats are calibration data only: the long-chat generator at seeds no study uses for evaluation
(:data:`LONG_CHATS`) and the shared LoCoMo conversations (:data:`LOCOMO`). Every run keeps its results in its own
folder of the work folder, so an interrupted certification resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from agent import config as config_mod
from agent import models
from agent.gate import certification
from agent.gate.certification import Trial

LONG_CHATS: tuple[tuple[str, int, int], ...] = (("8k", 80, 20), ("16k", 82, 40))
"""(size, seed, probes) of the generated long chats: seeds 80–89 are calibration's, never an evaluation's."""
QUICK_LONG_CHATS: tuple[tuple[str, int, int], ...] = (("8k", 80, 20),)
LOCOMO = ("26", "30", "41", "42", "43")
"""The shared LoCoMo conversations, as the project's LoCoMo studies replay them (their first three sessions,
temporal and single-hop questions)."""
LOCOMO_CATEGORIES = (2, 4)
LOCOMO_SESSIONS = 3
BUDGETS = ("50%", "25%", "10%")
MAX_TOKENS = 32
POLICY = "poisson+gate"
SECONDS_PER_TOKEN = {"full": 0.024, POLICY: 0.017}
"""A run's seconds per history token for qwen2.5-coder-0.5b on 2 threads (the 16k yardstick on a 2-core EPYC),
scaled by the GGUF's size for the estimate shown before a certification starts."""
REFERENCE_BYTES = 491_400_032
"""qwen2.5-coder-0.5b's GGUF (q8_0), the estimate's reference."""


@dataclass(frozen=True)
class Job:
    """One replay: a chat under the full cache (``budget`` None) or the policy at a budget."""

    chat: str
    budget: str | None

    @property
    def label(self) -> str:
        return "full" if self.budget is None else f"{POLICY}-{self.budget.rstrip('%')}pct"

    def folder(self, work: Path) -> Path:
        return work / self.chat / self.label


def _say(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)


def chats(model: str, work: Path, quick: bool = False) -> list[Any]:
    """The calibration chats: the generated long chats (the committed fixtures; a missing one is generated once into
    ``work/scripts`` and read back from there on a resumed run) and the LoCoMo conversations."""
    from agent.lab.replay import locomo, longchat  # noqa: PLC0415

    scripts: list[Any] = []
    folder = work / "scripts"
    wanted = QUICK_LONG_CHATS if quick else LONG_CHATS
    counter = None
    try:
        for size, seed, probes in wanted:
            path = longchat.fixture_path(size, seed)  # committed: every certification replays the same chat
            if not path.exists():
                path = folder / path.name
            if not path.exists():
                counter = counter or longchat.counter_for(model)
                s = longchat.generate(seed, longchat.parse_size(size), counter, longchat.source_files(None),
                                      probes=probes)
                s.meta["tokenizer"] = model
                path = longchat.save(s, folder, model)
            scripts.append(longchat.load(path))
    finally:
        if counter is not None:
            counter.close()
    options = locomo.Options(categories=LOCOMO_CATEGORIES, max_sessions=LOCOMO_SESSIONS)
    for name in LOCOMO:
        scripts += locomo.load(longchat.SHARED_LOCOMO / f"{name}.json", options)
    return scripts


def plan(scripts: Sequence[Any], budgets: Sequence[str]) -> list[Job]:
    """Every chat's full run, then every chat at each budget, largest first: the fixed sequence's order, so a
    certification cut short has already measured the budgets it would test first."""
    order = sorted(budgets, key=lambda b: -_share(b))
    return [Job(s.name, b) for b in (None, *order) for s in scripts]


def _share(budget: str) -> float:
    return config_mod.Budget.parse(budget).share or 0.0


def estimate_s(scripts: Sequence[Any], jobs: Sequence[Job], model_path: Path, tokens: Callable[[Any], int]) -> float:
    """A rough estimate of the replays' seconds, from each chat's length and the model's size."""
    scale = max(model_path.stat().st_size / REFERENCE_BYTES, 0.25)
    length = {s.name: tokens(s) for s in scripts}
    return sum(length[j.chat] * SECONDS_PER_TOKEN["full" if j.budget is None else POLICY] * scale for j in jobs)


def _finished(job: Job, work: Path, sha: str) -> dict[str, Any] | None:
    """The results of ``job`` when an earlier run finished it for this model (None otherwise)."""
    path = job.folder(work) / "results.json"
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if doc.get("meta", {}).get("model_sha256") != sha or not doc.get("runs"):
        return None
    return doc


def run(model: str, work: Path, budgets: Sequence[str] = BUDGETS, threads: int | None = None, quick: bool = False,
        progress: bool = True, command: str = "") -> tuple[list[Trial], dict[str, Any]]:
    """Replay every job not yet finished in ``work`` and pair the probes: the trials and the provenance the
    record keeps beside them."""
    from agent.lab.replay import batch, longdemo  # noqa: PLC0415

    started = time.monotonic()
    path = models.resolve(model)
    sha = models.gguf_sha256(path)
    display = models.display_name(model, path)
    scripts = chats(model, work, quick)
    jobs = plan(scripts, budgets)
    done = {j: d for j in jobs if (d := _finished(j, work, sha)) is not None}
    todo = [j for j in jobs if j not in done]
    history = {s.name: _history_tokens(s) for s in scripts}
    guess = estimate_s(scripts, todo, path, lambda s: history[s.name])
    _say(f"certifying {display} on {len(scripts)} long chats ({sum(len(s.probes) for s in scripts)} questions) under "
         f"the full cache and {', '.join(budgets)}: {len(jobs)} runs, {len(done)} already done in {work}; "
         f"about {guess / 60:.0f} min on {threads or config_mod.load().threads} threads")
    base = config_mod.load().replace(model=model)
    by_name = {s.name: s for s in scripts}
    spent = 0.0
    for i, job in enumerate(todo):
        t0 = time.monotonic()
        settings = batch.Settings(out=job.folder(work), policies=["full" if job.budget is None else POLICY],
                                  budgets=[job.budget or "100%"], gate="auto", model=model, max_tokens=MAX_TOKENS,
                                  threads=threads, plots=False, progress=progress, command=command)
        done[job] = longdemo.run([by_name[job.chat]], settings, base, log=_say if progress else lambda _: None)
        spent += time.monotonic() - t0
        left = sum(history[j.chat] for j in todo[i + 1:])
        rate = spent / max(1, sum(history[j.chat] for j in todo[:i + 1]))
        _say(f"{i + 1}/{len(todo)} runs: {job.chat} {job.label} ({time.monotonic() - t0:.0f} s); "
             f"about {left * rate / 60:.0f} min left")
    trials = pair_all(scripts, budgets, done)
    meta = {"chats": [{"name": s.name, "kind": "locomo" if s.name.startswith("locomo") else "long",
                       "tokens": history[s.name], "probes": len(s.probes)} for s in scripts],
            "policy": POLICY, "max_tokens": MAX_TOKENS, "quick": quick, "command": command,
            "replay_s": sum(float(r.get("wall_s") or 0.0) for d in done.values() for r in d["runs"]),
            "wall_s": time.monotonic() - started}
    return trials, meta


def _history_tokens(script: Any) -> int:
    """The chat's length as its script records it (0 where it does not)."""
    meta = getattr(script, "meta", {}) or {}
    for key in ("tokens", "history_tokens"):
        if isinstance(meta.get(key), int):
            return int(meta[key])
    # about four characters a token: enough for an estimate of the time
    return sum(len(st.user) + len(st.assistant or "") for st in script.steps) // 4


Key = tuple[str, int, int]
"""A probe: (chat, turn, line in its script). Independent questions share the turn they follow (LoCoMo's do)."""


def correct(doc: dict[str, Any]) -> dict[Key, bool]:
    """Each probe's right-or-wrong in a results document."""
    return {(run["script"], int(s["turn"]), int(s.get("lineno") or 0)): bool(s.get("correct"))
            for run in doc["runs"] for s in run["steps"] if s.get("kind") == "probe"}


def trial(budget: str, full: dict[Key, bool], other: dict[Key, bool]) -> Trial:
    """``budget``'s trial: the probes of each chat paired between the full run and the run at that budget."""
    by_chat: dict[str, dict[str, int]] = {}
    for chat in sorted({k[0] for k in other}):
        counts = certification.pair({k: v for k, v in full.items() if k[0] == chat},
                                    {k: v for k, v in other.items() if k[0] == chat})
        by_chat[chat] = dict(zip(("kept", "lost", "gained", "neither"), counts))
    kept, lost, gained, neither = certification.pair(full, other)
    return Trial(budget, kept, lost, gained, neither, by_chat=by_chat)


def pair_all(scripts: Sequence[Any], budgets: Sequence[str], done: dict[Job, dict[str, Any]]) -> list[Trial]:
    """One trial per budget from the runs of :func:`run`."""
    full: dict[Key, bool] = {}
    for s in scripts:
        full.update(correct(done[Job(s.name, None)]) if Job(s.name, None) in done else {})
    return [trial(b, full, {k: v for s in scripts if Job(s.name, b) in done
                            for k, v in correct(done[Job(s.name, b)]).items()}) for b in budgets]


def from_results(folders: Sequence[Path], budgets: Sequence[str] | None = None,
                 chats: list[dict[str, Any]] | None = None) -> list[Trial]:
    """Trials from results documents any replay wrote (``certchat replay``/``demo long`` with the full cache and
    ``poisson+gate`` at budgets), pairing each chat's probes between its full run and each budget's run; the chats
    they replayed are added to ``chats`` when given."""
    from agent.lab.replay import aggregate  # noqa: PLC0415

    full: dict[Key, bool] = {}
    by_budget: dict[str, dict[Key, bool]] = {}
    for folder in folders:
        for f in aggregate.result_files([folder]):
            doc = aggregate.read_results(f)
            for s in doc["meta"].get("scripts") or []:
                if chats is not None and s.get("name") not in {c["name"] for c in chats}:
                    tokens = (s.get("meta") or {}).get("tokens")
                    chats.append({"name": s["name"], "kind": "locomo" if s["name"].startswith("locomo") else "long",
                                  "tokens": tokens, "probes": s.get("probes"),
                                  "replayed_by": doc["meta"].get("command"), "commit": doc["meta"].get("commit")})
            for run_ in doc["runs"]:
                one = correct({"runs": [run_]})
                if run_["policy"] == "full":
                    full.update(one)
                elif run_["policy"] == POLICY:
                    by_budget.setdefault(str(run_["budget"]), {}).update(one)
    order = budgets or sorted(by_budget, key=lambda b: -_share(b))
    return [trial(b, full, by_budget.get(b, {})) for b in order]


def document(trials: Sequence[Trial], meta: dict[str, Any]) -> dict[str, Any]:
    """The record's ``certification``: the trials with their bounds and certified risks, and what they came from."""
    from agent.lab.replay.report import git_commit, machine  # noqa: PLC0415

    return certification.Certification(tuple(trials), record={**meta, "machine": machine(),
                                                              "commit": git_commit()}).to_json()


def summary(cert: dict[str, Any], model: str, risk: float) -> str:
    """What the certification found, in a few lines."""
    parsed = certification.Certification.from_record(cert)
    assert parsed is not None
    lines = [f"{model}: certification on {len(cert.get('chats', []))} long chats "
             f"({cert['confidence']:.0%} confidence, {cert['bound']})"]
    for row in cert["budgets"]:
        risk_text = "—" if row["certified_risk"] is None else f"≤ {certification.percent(row['certified_risk'])}"
        loss = "—" if row["loss"] is None else certification.percent(row["loss"], up=False)
        lines.append(f"  {row['budget']}: lost {row['lost']} of the full cache's {row['n']} right answers "
                     f"({loss}; gained {row['gained']}), bound {certification.percent(row['bound'])}, "
                     f"certified risk {risk_text}")
    choice = parsed.choose(risk, model)
    lines.append(f"  at risk {certification.percent(risk)}: "
                 + (f"budget {choice.budget}" if choice.budget else choice.reason or "full cache"))
    return "\n".join(lines)

