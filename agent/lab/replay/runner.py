"""Drive a ``ChatSession`` through a script under one policy, budget, seed and protocol.

A *job* is (script, policy, budget, seed, protocol). The runner maps each script step to
one session call and records what the session measured:

- user + assistant line → ``drive.forced`` (teacher-forced);
- probe + assistant line → ``drive.replaced``: the answer is generated and scored, then the
  script's text replaces it so every policy continues from the same history;
- independent message → ``drive.independent``;
- anything else → ``send(user)`` (the generated answer stays in the history).

With ``generate_fillers`` a scripted (user + assistant) turn is answered like a probe —
generated, then replaced — so the answer-phase certificate and the output confidence exist
on fillers too (the studies need a gate's rate on the turns that do not need old context).

Protocols (DESIGN.md §7 says why both): ``multi-round`` evicts every turn, as a live chat
does (after the user message or at the turn's end, as ``evict_at`` says); ``one-shot`` keeps
the full cache for the history and evicts once, from the full history, at each probe (the
probe is answered independently under the policy, then re-entered under ``full``; with
``generate_fillers`` every scripted turn is).

Policies are the agent's (full, window, topk, random, poisson) plus ``poisson+gate``, the
gated system: Poisson eviction with the gate's threshold. The others run with the gate
off, so their recall is what eviction alone leaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent import events as ev
from agent.config import Budget, Config
from agent.errors import ExplainedError
from agent.eviction import policies
from agent.lab.replay import scoring
from agent.lab.replay.aggregate import summarize
from agent.lab.replay.script import Script, Step

POLICY_NAMES = policies.REPLAY_NAMES
PROTOCOLS = ("multi-round", "one-shot")
GATED = policies.GATED


class RunError(ExplainedError, RuntimeError):
    """A job that cannot be run (the message names the script line or the setting)."""


FIXED_KEYS = ("policy", "budget", "seed", "model", "n_ctx", "threads", "system_prompt")
"""Config fields a policy variant may not override (the run sets them). ``gate`` may be set, for
``poisson+gate`` only (e.g. ``poisson+gate@gate=0.4`` compares thresholds in one run)."""


def base_policy(name: str) -> str:
    """``poisson@page_size=1`` → ``poisson``."""
    return name.split("@", 1)[0]


def variant_overrides(name: str) -> dict[str, Any]:
    """``poisson@page_size=1@top_share=0`` → {"page_size": 1, "top_share": 0.0}, typed by the Config field."""
    import dataclasses  # noqa: PLC0415
    from typing import get_type_hints  # noqa: PLC0415

    hints = get_type_hints(Config)
    fields = {f.name for f in dataclasses.fields(Config)}
    out: dict[str, Any] = {}
    for part in name.split("@")[1:]:
        key, sep, raw = part.partition("=")
        if not sep or key not in fields or key in FIXED_KEYS:
            allowed = ", ".join(sorted(fields - set(FIXED_KEYS) - {"keys", "theme"}))
            raise RunError(f"--policy {name!r}: a variant is NAME@KEY=VALUE with KEY one of {allowed}")
        kind = hints[key]
        try:
            out[key] = _flag(raw) if kind is bool else int(raw) if kind is int else float(raw) if kind is float else raw
        except ValueError:
            need = "true or false" if kind is bool else f"a {kind.__name__}"
            raise RunError(f"--policy {name!r}: {key} needs {need}, got {raw!r}") from None
    return out


def _flag(raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("true", "on", "yes", "1"):
        return True
    if word in ("false", "off", "no", "0"):
        return False
    raise ValueError(raw)


def parse_policies(text: str) -> list[str]:
    """Policy names, each optionally a variant ``NAME@KEY=VALUE@…`` (e.g. ``poisson@page_size=1``)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if base_policy(p) not in POLICY_NAMES]
    if bad or not names:
        raise RunError(f"--policy: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(POLICY_NAMES)} "
                       "(a variant: NAME@KEY=VALUE, e.g. poisson@page_size=1)")
    for name in names:
        overrides = variant_overrides(name)
        if "gate" in overrides and base_policy(name) != GATED:
            raise RunError(f"--policy {name!r}: only poisson+gate takes a gate threshold")
        Config().replace(**overrides)  # ConfigError names a bad value
    return list(dict.fromkeys(names))


def parse_budgets(text: str) -> list[str]:
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    for b in budgets:
        Budget.parse(b)  # ConfigError names the bad value
    if not budgets:
        raise RunError("--budget: give at least one budget, e.g. 10% or 10%,25%")
    return list(dict.fromkeys(budgets))


def seed_dependent(policy: str, temperature: float) -> bool:
    """Whether seeds change a run: randomised designs, or any sampling temperature."""
    base = base_policy(policy)
    return base == GATED or (base in policies.POLICIES and policies.POLICIES[base].sampled) or temperature > 0


@dataclass(frozen=True)
class Job:
    script: str
    """The script's name (unique within a run: see :func:`unique_names`)."""
    policy: str
    budget: str
    seed: int
    protocol: str = "multi-round"

    @property
    def key(self) -> tuple[str, str, str, int, str]:
        return (self.script, self.policy, self.budget, self.seed, self.protocol)


def plan_jobs(scripts: list[Script], policies: list[str], budgets: list[str], seeds: int,
              temperature: float = 0.0, protocols: tuple[str, ...] = ("multi-round",)) -> list[Job]:
    """Every script × policy × budget × seed × protocol, without runs that could not differ.

    ``full`` does not depend on the budget (it runs once, labelled "100%"), and the
    deterministic policies under greedy decoding do not depend on the seed (seed 0 only).
    """
    jobs: list[Job] = []
    for protocol in protocols:
        for script in scripts:
            for policy in policies:
                for budget in (["100%"] if base_policy(policy) == "full" else budgets):
                    for seed in range(seeds if seed_dependent(policy, temperature) else 1):
                        jobs.append(Job(script.name, policy, budget, seed, protocol))
    return list(dict.fromkeys(jobs))


def shard(jobs: list[Job], spec: str | None) -> list[Job]:
    """The jobs of shard ``i/n`` (1-based i): every n-th job starting at i − 1."""
    if not spec:
        return jobs
    try:
        i_text, n_text = spec.split("/")
        i, n = int(i_text), int(n_text)
        if not (n >= 1 and 1 <= i <= n):
            raise ValueError
    except ValueError:
        raise RunError(f"--shard: expected i/n with 1 ≤ i ≤ n, e.g. 2/4; got {spec!r}") from None
    return jobs[i - 1::n]


def unique_names(scripts: list[Script]) -> list[Script]:
    """Rename scripts whose names collide (same stem in different folders): name, name~2, …"""
    seen: dict[str, int] = {}
    out = []
    for s in scripts:
        count = seen.get(s.name, 0) + 1
        seen[s.name] = count
        out.append(s if count == 1 else Script(f"{s.name}~{count}", s.system, s.steps, s.source, s.meta))
    return out


def policy_config(base: Config, job: Job, gate: str) -> Config:
    """The session config of a job: the policy, its budget, the gate only for the gated system."""
    name = base_policy(job.policy)
    overrides = variant_overrides(job.policy)
    gate = str(overrides.pop("gate", gate))
    cfg = base.replace(**overrides)
    if name == GATED:
        return cfg.replace(policy="poisson", budget=job.budget, gate=gate, seed=job.seed)
    return cfg.replace(policy=name, budget=job.budget if name != "full" else base.budget, gate="off", seed=job.seed)


@dataclass
class _Watch:
    """Counters the session's events feed during one step."""

    peak_cells: int = 0
    evictions: int = 0
    gate_events: list[dict[str, Any]] = field(default_factory=list)


def estimate_n_ctx(scripts: list[Script], count_tokens: Callable[[str], int], max_tokens: int,
                   system_prompt: str, n_ctx_train: int) -> int:
    """KV cells for the longest script's full history (a gate re-prefill needs all of it), at most the model's
    trained context."""
    need = 0
    for s in scripts:
        system = s.system if s.system is not None else system_prompt
        total = count_tokens(system) + 16 if system else 0
        for step in s.steps:
            if step.independent:
                continue
            total += count_tokens(step.user) + 16
            total += count_tokens(step.assistant) + 16 if step.assistant is not None else max_tokens + 16
        need = max(need, total)
    n_ctx = need + max_tokens + 512
    n_ctx = ((n_ctx + 255) // 256) * 256
    if n_ctx_train > 0 and n_ctx > n_ctx_train:
        # a longer history runs past the trained context: the full cache shifts its context (the oldest half
        # dropped), evicting policies keep their budget
        return n_ctx_train
    return max(1024, n_ctx)


class Runner:
    """Runs jobs on one engine (loaded once) and one SQLite log."""

    def __init__(self, base: Config, engine: Any, model_name: str, store: Any, gate: str = "auto",
                 on_step: Callable[[Job, Step], None] | None = None, generate_fillers: bool = False,
                 score_replies: bool = False) -> None:
        self.base = base
        self.engine = engine
        self.model_name = model_name
        self.store = store
        self.gate = gate
        self.on_step = on_step or (lambda job, step: None)
        self.generate_fillers = generate_fillers
        """Answer every user line (then put the script's reply in its place), not only probes: the
        answer-phase certificate and the output confidence then exist on filler turns too."""
        self.score_replies = score_replies
        """Record the model's teacher-forced log-probability of every scripted reply (``reply_logprob_sum`` over
        ``reply_scored_tokens``, each token after the reply's first): how well the model still predicts the
        conversation at each position. Every reply row's logits are computed, so turns are slower."""
        self.template: Any = None
        """The chat markup each session uses when not the model's own (a study gives a base model one)."""
        self.job_started: ev.Hook[[Job, Script]] = ev.Hook()
        """Heard as each job starts, before its session opens."""
        self.session_opened: ev.Hook[[Any]] = ev.Hook()
        """Heard with each job's new ``ChatSession`` (its engine, cache manager and gate have hooks of their own)."""
        self.sending: ev.Hook[[Step]] = ev.Hook()
        """Heard as each script step goes to the session."""
        self._user_ids: dict[int, int] = {}
        """The running job's logged user message of each script turn (a probe records its fact's)."""

    def run(self, job: Job, script: Script) -> dict[str, Any]:
        """One job: its per-step records and its summary."""
        job_run = self.start(job, script)
        try:
            while not job_run.done:
                job_run.advance()
        finally:
            job_run.close()
        return job_run.result()

    def start(self, job: Job, script: Script) -> JobRun:
        """Open ``job``'s session; its steps then run one :meth:`JobRun.advance` at a time, so several jobs, each on
        a runner and engine of its own, can take turns step by step (``certchat demo long --lockstep``)."""
        from agent.chat.session import ChatSession  # noqa: PLC0415 — loads llama.cpp

        self.job_started(job, script)
        self._user_ids = {}
        cfg = policy_config(self.base, job, self.gate)
        if script.system is not None:
            cfg = cfg.replace(system_prompt=script.system)
        full_cfg = cfg.replace(policy="full", gate="off")
        one_shot = job.protocol == "one-shot"
        session = ChatSession(full_cfg if one_shot else cfg, self.store, self.engine, self.model_name,
                              template=self.template)
        self.session_opened(session)
        self.store.rename_conversation(session.conversation_id,
                                       f"replay {script.name} · {job.policy} {job.budget} seed {job.seed} "
                                       f"{job.protocol}")
        return JobRun(self, job, script, session, cfg, full_cfg)

    # -- one step ----------------------------------------------------------------------
    def _advance(self, job_run: JobRun, step: Step) -> dict[str, Any]:
        """``step`` of ``job_run``: its record."""
        # one-shot evaluates probes under eviction; with generate_fillers the scripted
        # turns too, so the gate's filler rate exists in this protocol as well
        evaluate = step.probe is not None or (self.generate_fillers and step.assistant is not None
                                               and not step.independent)
        if job_run.job.protocol == "one-shot" and evaluate:
            return self._one_shot_probe(job_run.session, step, job_run.cfg, job_run.full_cfg, job_run.script)
        return self._step(job_run.session, step, job_run.script)

    def _send(self, session: Any, step: Step, script: Script, mode: str = "send",
              answer: str | None = None, scores: list[float] | None = None) -> tuple[Any, _Watch]:
        """One step on the session: ``mode`` is send, forced, replaced or independent (see ``agent.lab.replay.drive``);
        ``answer``: the text a forced or replaced answer becomes (default: the script's)."""
        from agent.chat.session import InputError  # noqa: PLC0415
        from agent.lab.replay import drive  # noqa: PLC0415 — loads llama.cpp

        self.sending(step)
        watch = _Watch(peak_cells=self.engine.live_cells)

        def sink(event: ev.Event) -> None:
            # Events arrive on this thread between engine calls, so the cell count is exact here.
            watch.peak_cells = max(watch.peak_cells, self.engine.live_cells)
            if isinstance(event, ev.Evicted):
                watch.evictions += 1
                watch.peak_cells = max(watch.peak_cells, event.cells_before)
            elif isinstance(event, ev.GateFired):
                watch.gate_events.append({"phase": event.phase, "value": event.value,
                                          "threshold": event.threshold, "tokens": event.reprefill_tokens,
                                          "targeted": bool(event.reread), "why_full": event.why_full,
                                          **({"second": event.second} if event.second else {})})

        try:
            text = answer if answer is not None else step.assistant or ""
            if mode == "forced":
                result = drive.forced(session, step.user, text, on_event=sink, scores=scores)
            elif mode == "replaced":
                result = drive.replaced(session, step.user, text, on_event=sink, scores=scores)
            elif mode == "independent":
                result = drive.independent(session, step.user, on_event=sink)
            else:
                result = session.send(step.user, on_event=sink)
        except InputError as err:
            raise RunError(f"{script.source or script.name}:{step.lineno}: {err}") from None
        watch.peak_cells = max(watch.peak_cells, self.engine.live_cells)  # after a replaced answer
        return result, watch

    def _step(self, session: Any, step: Step, script: Script) -> dict[str, Any]:
        history = self.engine.log_position(self.engine.next_pos)
        scoring = self.score_replies and step.assistant is not None and not step.independent
        scores: list[float] | None = [] if scoring else None
        if step.independent:
            result, watch = self._send(session, step, script, "independent")
        elif step.assistant is not None and (step.probe is not None or self.generate_fillers):
            result, watch = self._send(session, step, script, "replaced", scores=scores)
        elif step.assistant is not None:
            result, watch = self._send(session, step, script, "forced", scores=scores)
        else:
            result, watch = self._send(session, step, script)
        if not step.independent:
            self._user_ids[step.turn] = result.user_message_id
        record = self._record(step, script, result, watch, history)
        if scores is not None:
            record.update(reply_logprob_sum=float(sum(scores)), reply_scored_tokens=len(scores))
        return record

    def _one_shot_probe(self, session: Any, step: Step, cfg: Config, full_cfg: Config,
                        script: Script) -> dict[str, Any]:
        """Evict once from the full history at this probe, answer, then continue under ``full``.

        The one eviction happens after the probe is prefilled whatever ``evict_at`` says: a
        turn-end eviction would come after the answer, leaving the probe answered from the full cache."""
        history = self.engine.log_position(self.engine.next_pos)
        session.reconfigure(policy=cfg.policy, budget=cfg.budget, gate=cfg.gate, evict_at="question")
        try:
            result, watch = self._send(session, step, script, "independent")
        finally:
            session.reconfigure(policy="full", gate="off", budget=full_cfg.budget, evict_at=full_cfg.evict_at)
        record = self._record(step, script, result, watch, history)
        if not step.independent:
            # Re-enter the probe under the full cache with the script's answer (or the one
            # just generated), so the history stays what every policy sees.
            self._send(session, step, script, "forced", answer=step.assistant or result.answer)
        return record

    def _record(self, step: Step, script: Script, result: ev.TurnResult, watch: _Watch,
                history_before: int) -> dict[str, Any]:
        user_msg = self.store.get_message(result.user_message_id)
        user_tokens = len(user_msg.tokens) if user_msg.tokens is not None else 0
        forced = result.stop == "forced"
        kind = "probe" if step.probe is not None else "fact" if step.turn in script.fact_turns else "filler"
        record: dict[str, Any] = {
            "turn": step.turn, "lineno": step.lineno, "kind": kind, "independent": step.independent,
            "forced": forced, "user_tokens": user_tokens, "history_tokens": history_before + user_tokens,
            "live_cells": result.live_cells, "budget_cells": result.budget_cells,
            "peak_cells": max(watch.peak_cells, result.live_cells), "evictions": watch.evictions,
            "certificate": result.certificate,
            "certificate_detail": _plain(result.certificate_detail),
            "gate_threshold": result.gate_threshold, "gate_fired": result.gate_fired,
            "gate_deferred": result.gate_deferred,
            "gate_events": watch.gate_events, "reprefill_tokens": result.reprefill_tokens,
            "restored_tokens": result.restored_tokens,
            "reread_path": result.reread_path, "reread_messages": list(result.reread_messages),
            "restore_indices": list(result.restore_indices), "restore_best": result.restore_best,
            "answer_tokens": 0 if forced else result.answer_tokens,
            "decode_ms": 0.0 if forced else result.decode_ms,
            "prefill_ms": result.prefill_ms, "logprob_mean": None if forced else result.logprob_mean,
            "stop": result.stop,
        }
        if not forced and step.probe is None:
            record["answer"] = result.answer
        if step.probe is not None:
            probe = step.probe
            record.update({
                "question": step.user, "expected": list(probe.expect), "answer": result.answer,
                # Agreement probes (a logged chat without probes) have no expected strings: F1 only.
                "correct": scoring.contains(result.answer, probe.expect) if probe.expect else None,
                "f1": scoring.token_f1(result.answer, probe.reference) if probe.reference is not None else None,
                "reference": probe.reference, "fact_turn": probe.fact_turn, "distance": step.distance,
                "category": probe.category,
                # the logged message that stated the fact: what a re-read must bring back (agent.lab.lost_probes)
                "fact_message": self._user_ids.get(probe.fact_turn) if probe.fact_turn is not None else None,
            })
        return record


class JobRun:
    """One job under way on its runner: the session open, the steps run so far and their records."""

    def __init__(self, runner: Runner, job: Job, script: Script, session: Any, cfg: Config,
                 full_cfg: Config) -> None:
        self.runner = runner
        self.job = job
        self.script = script
        self.session = session
        self.cfg = cfg
        self.full_cfg = full_cfg
        self.records: list[dict[str, Any]] = []
        self._started = time.perf_counter()
        self._wall = 0.0
        """Seconds in this job's own steps."""
        self._span = 0.0
        """Seconds from the session's opening to its closing."""
        self._closed = False

    @property
    def done(self) -> bool:
        """Every step has run."""
        return len(self.records) >= len(self.script.steps)

    def advance(self) -> float:
        """Run the next step; its seconds on the clock."""
        step = self.script.steps[len(self.records)]
        started = time.perf_counter()
        record = self.runner._advance(self, step)
        seconds = time.perf_counter() - started
        self._wall += seconds
        self.records.append(record)
        self.runner.on_step(self.job, step)
        return seconds

    def close(self) -> None:
        """Close the session (again: nothing). The job's wall time counts from :meth:`Runner.start` to here unless
        the steps were interleaved with other jobs' (``interleaved``), where it is the sum of its own steps."""
        if not self._closed:
            self._closed = True
            self.session.close()
            self._span = time.perf_counter() - self._started

    def result(self, interleaved: bool = False) -> dict[str, Any]:
        """The job's run record: per-step records, summary and wall time."""
        self.close()
        records = self.records
        run = {"script": self.script.name, "source": self.script.source, "policy": self.job.policy,
               "budget": self.job.budget, "seed": self.job.seed, "protocol": self.job.protocol,
               "conversation_id": self.session.conversation_id,
               "gate_threshold": next((r["gate_threshold"] for r in records if r["gate_threshold"] is not None),
                                      None),
               "wall_s": self._wall if interleaved else self._span, "steps": records}
        run["summary"] = summarize(run, self.script)
        if self.script.meta.get("question_fillers"):
            # a long-chat script's question-shaped fillers (turn numbers), for the studies and tables that split them
            run["question_fillers"] = [int(t) for t in self.script.meta["question_fillers"]]
        return run


def _plain(value: Any) -> Any:
    """JSON-safe copy of a certificate detail (numpy scalars and arrays become lists/floats)."""
    try:
        import numpy as np  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        np = None  # type: ignore[assignment]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if np is not None and isinstance(value, np.ndarray):
        return value.tolist()
    if np is not None and isinstance(value, np.generic):
        return value.item()
    return value


def default_store_path(out: Path, shard_spec: str | None) -> Path:
    suffix = f"-shard-{shard_spec.replace('/', '-of-')}" if shard_spec else ""
    return out / f"replay{suffix}.db"
