"""A replay batch: plan the jobs, load the model once, run them with a progress bar, write results.

Results are rewritten after every finished job, so an interrupted batch keeps what it
measured (and a shard's file can be merged as soon as it exists).
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent import models
from agent.config import Config
from agent.lab.replay import aggregate, report
from agent.lab.replay.runner import (
    PROTOCOLS,
    Job,
    RunError,
    Runner,
    default_store_path,
    estimate_n_ctx,
    plan_jobs,
    shard,
    unique_names,
)
from agent.lab.replay.script import Script, Step


@dataclass
class Settings:
    """What a batch runs (the CLI flags, resolved)."""

    out: Path
    policies: list[str]
    budgets: list[str]
    seeds: int = 1
    gate: str = "auto"
    protocols: tuple[str, ...] = ("multi-round",)
    model: str | None = None
    temperature: float = 0.0
    max_tokens: int = 64
    n_ctx: int | None = None
    threads: int | None = None
    shard: str | None = None
    plots: bool = True
    progress: bool = True
    generate_fillers: bool = False
    """Generate (then replace) the answer of every scripted turn, not only probes (for the studies)."""
    score_replies: bool = False
    """Record each scripted reply's teacher-forced log-probability (by position in the chat; slower turns)."""
    lockstep: bool = False
    """Run each script's jobs turn by turn side by side, each on an engine of its own, so a slower stretch of the
    machine falls on every policy's same turns (``certchat demo long``; the time bar compares turn times)."""
    command: str = ""
    extra_meta: dict[str, Any] = field(default_factory=dict)


def results_path(settings: Settings) -> Path:
    suffix = f"-shard-{settings.shard.replace('/', '-of-')}" if settings.shard else ""
    return settings.out / f"results{suffix}.json"


def _model_identity(name_or_path: str) -> tuple[Path, str, str]:
    """(path, display name, sha256) of the model a batch uses."""
    path = models.resolve(name_or_path)
    return path, models.display_name(name_or_path, path), models.sha256_of(name_or_path, path)


def run(scripts: list[Script], settings: Settings, base: Config,
        on_job: Callable[[Job, dict[str, Any]], None] | None = None,
        observe: Callable[[Runner], None] | None = None) -> dict[str, Any]:
    """Run every job of the batch; returns the results document (also written to ``settings.out``)."""
    from agent.llm.engine import Engine, EngineSettings  # noqa: PLC0415 — loads llama.cpp
    from memory_store.store import Store  # noqa: PLC0415
    from native import llama  # noqa: PLC0415

    for protocol in settings.protocols:
        if protocol not in PROTOCOLS:
            raise RunError(f"--protocol: unknown {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    scripts = unique_names(scripts)
    by_name = {s.name: s for s in scripts}
    model_name = settings.model or base.model
    model_path, display, sha = _model_identity(model_name)
    # replays record every candidate statistic, answer-step certificates included
    cfg = base.replace(temperature=settings.temperature, max_tokens=settings.max_tokens, threads=settings.threads,
                       answer_certificate=True)

    n_ctx = settings.n_ctx
    if n_ctx is None:
        vocab = llama.Model(model_path, vocab_only=True)
        # info() needs the weights; a vocab-only load still has the GGUF metadata.
        arch = vocab.meta("general.architecture") or ""
        trained = vocab.meta(f"{arch}.context_length") if arch else None
        n_ctx_train = int(trained) if trained and trained.isdigit() else 0
        n_ctx = estimate_n_ctx(scripts, lambda t: len(vocab.tokenize(t, add_special=False, parse_special=False)),
                               cfg.max_tokens, cfg.system_prompt, n_ctx_train)
        vocab.close()
    cfg = cfg.replace(n_ctx=n_ctx)

    jobs = shard(plan_jobs(scripts, settings.policies, settings.budgets, settings.seeds, settings.temperature,
                           settings.protocols), settings.shard)
    meta = {
        "model": display, "model_sha256": sha, "machine": report.machine(),
        "machine_short": report.machine().split(" (")[0], "command": settings.command,
        "policies": settings.policies, "budgets": settings.budgets, "seeds": settings.seeds,
        "protocols": list(settings.protocols), "gate": settings.gate, "temperature": settings.temperature,
        "max_tokens": settings.max_tokens, "n_ctx": n_ctx, "generate_fillers": settings.generate_fillers,
        "score_replies": settings.score_replies, "threads": cfg.threads, "shard": settings.shard,
        "commit": report.git_commit(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "scripts": [{"name": s.name, "source": s.source, "steps": len(s.steps), "probes": len(s.probes),
                     **({"meta": s.meta} if s.meta else {})} for s in scripts],
        "jobs": len(jobs),
        # the design settings every policy shares (from the config file unless a variant overrides them)
        "design": {k: getattr(cfg, k) for k in ("sinks", "recent", "page_size", "top_share", "floor",
                                                 "question_window", "cert_window", "gate_stat", "evict_at",
                                                 "evict_from", "sketch_layers", "sketch_bits", "system_prompt")
                   if hasattr(cfg, k)},
        **settings.extra_meta,
    }
    settings.out.mkdir(parents=True, exist_ok=True)
    out_path = results_path(settings)
    runs: list[dict[str, Any]] = []
    engine = Engine(EngineSettings.from_config(cfg, model_path, n_ctx=n_ctx))
    meta["n_layer"] = engine.info.n_layer
    store = Store(default_store_path(settings.out, settings.shard))
    total = sum(len(by_name[j.script].steps) for j in jobs)
    try:
        with _progress(settings.progress, total) as advance:
            def on_step(job: Job, step: Step) -> None:
                advance(f"{job.script} · {job.policy} {job.budget} · seed {job.seed}")

            runner = Runner(cfg, engine, display, store, gate=settings.gate, on_step=on_step,
                            generate_fillers=settings.generate_fillers, score_replies=settings.score_replies)
            if observe is not None:
                observe(runner)  # a study subscribes to the runner's, the engine's and each session's hooks
            for n, job in enumerate(jobs, start=1):
                run_record = runner.run(job, by_name[job.script])
                runs.append(run_record)
                if settings.progress and not sys.stderr.isatty():
                    # no live bar without a terminal: one line per finished job instead
                    s = run_record["summary"]
                    print(f"[{n}/{len(jobs)}] {job.script} · {job.policy} {job.budget} seed {job.seed} "
                          f"{job.protocol}: recall {s['n_correct']}/{s['n_probes']}, gate rate "
                          f"{s['gate_rate'] or 0:.2f}, {run_record['wall_s']:.1f} s", file=sys.stderr, flush=True)
                aggregate.write_results(out_path, meta, runs)
                if on_job is not None:
                    on_job(job, run_record)
    finally:
        store.close()
        engine.close()
    doc = aggregate.write_results(out_path, meta, runs)
    write_reports(doc, settings.out, plots=settings.plots)
    return doc


def write_reports(doc: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """table.md (and PNG plots) beside the results file."""
    written = []
    md = out / "table.md"
    md.write_text(report.markdown_table(doc["aggregate"], doc["meta"]), encoding="utf-8")
    written.append(md)
    if plots and doc["runs"]:
        written += report.plots(doc, out)
    return written


class _progress:
    """A rich progress bar on stderr (or nothing), as a context manager yielding ``advance(label)``."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self._bar: Any = None

    def __enter__(self) -> Callable[[str], None]:
        if not self.enabled:
            return lambda label: None
        from rich.console import Console  # noqa: PLC0415
        from rich.progress import (  # noqa: PLC0415
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                             transient=False)
        self._bar.start()
        task = self._bar.add_task("replay", total=self.total)

        def advance(label: str) -> None:
            self._bar.update(task, advance=1, description=label)

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
