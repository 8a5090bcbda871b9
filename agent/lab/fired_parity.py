"""Does a fired turn answer as the state it claims? A gated chat and a full-cache chat replay one script in
lockstep (teacher-forced, greedy); at each probe the gated chat's answer is compared token for token with the full
cache's, with the top-2 logit gap where they part, and the K/V rows the gated chat holds for the history (live and
evicted) are compared byte for byte with the full cache's at the same positions.

    python -m agent.lab.fired_parity SCRIPT… [--model qwen2.5-coder-0.5b] [--budget 25%] [--gate auto|0]
        [--copy-back all|auto|named] [--max-tokens 40] [--threads 2] [--evict-from 0] [--json OUT]

A row computed after the first eviction attended to the evicted cache, not to the full history, so it differs from
the full cache's; a copied firing restores the rows as the chat computed them. The table separates the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent import events as ev
from agent import models, paths
from agent.config import Config
from agent.lab.replay import drive
from agent.lab.replay import script as scripts


class LogitTap:
    """A sampler that records the logits it samples from, and otherwise is the session's sampler."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[np.ndarray] = []

    def sample(self, ctx: Any, index: int, logits: np.ndarray) -> int:
        self.steps.append(np.array(logits, dtype=np.float32, copy=True))
        return int(self.inner.sample(ctx, index, logits))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class ProbeParity:
    """One probe: what the gated chat did, and where its answer parts from the full cache's."""

    script: str
    turn: int
    fired: bool
    path: str
    restored_tokens: int
    homeless: int
    same_answer: bool
    first_diff: int | None
    """Index of the first differing answer token (None where the answers are equal)."""
    gap_full: float | None
    """Full cache's logit of its own token minus that of the gated chat's token, at ``first_diff``."""
    gap_gated: float | None
    """The gated chat's logit of its own token minus that of the full cache's token, at ``first_diff``."""
    rows_same_evicted: float
    """Share of the evicted positions whose host row equals the full cache's row, byte for byte."""
    rows_same_live: float
    """Share of the live positions whose row equals the full cache's row."""
    full_answer: str = ""
    gated_answer: str = ""
    correct_full: bool = False
    correct_gated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _row_agreement(full: Any, gated: Any) -> tuple[float, float]:
    """(evicted, live) shares of positions whose row in ``gated`` equals ``full``'s (both engines at one step)."""
    live = np.asarray(gated.cache.positions, dtype=np.int32)
    full_pos = np.asarray(full.cache.positions, dtype=np.int32)
    if len(live):
        mine = gated.ctx.kv_rows(gated.SEQ, live)
        theirs = full.ctx.kv_rows(full.SEQ, live)
        live_same = float(np.mean(np.all(mine == theirs, axis=1)))
    else:
        live_same = 1.0
    rows = gated.rows
    known = set(full_pos.tolist())
    kept = [p for p in (rows.positions() if rows is not None else []) if p in known]
    if rows is None or not kept:
        return 1.0, live_same
    theirs = full.ctx.kv_rows(full.SEQ, np.asarray(kept, dtype=np.int32))
    same = []
    for i, p in enumerate(kept):
        row = rows.get(p)
        same.append(row is not None and row[1].tobytes() == theirs[i].tobytes())
    return float(np.mean(same)), live_same


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(script_paths: list[Path], model: str, budget: str, gate: str, copy_back: str, max_tokens: int,
        threads: int, n_ctx: int, evict_from: int = 0, out: Path | None = None) -> list[ProbeParity]:
    from agent.chat.session import ChatSession  # noqa: PLC0415 — loads llama.cpp
    from agent.llm.engine import Engine, EngineSettings  # noqa: PLC0415
    from memory_store.store import Store  # noqa: PLC0415

    model_path = models.resolve(model)
    settings = EngineSettings(model_path=Path(model_path), n_ctx=n_ctx, n_batch=512, threads=threads)
    base = Config(model=model, n_ctx=n_ctx, max_tokens=max_tokens, temperature=0.0, seed=0, evict_from=evict_from)
    work = out or paths.data_dir() / "fired-parity"
    work.mkdir(parents=True, exist_ok=True)
    results: list[ProbeParity] = []
    full_engine, gated_engine = Engine(settings), Engine(settings)
    try:
        for path in script_paths:
            script = scripts.load(path)
            cfg = base.replace(system_prompt=script.system) if script.system is not None else base
            db = work / f"{path.stem}.db"
            db.unlink(missing_ok=True)
            store = Store(db)
            full_engine.reset()
            gated_engine.reset()
            full = ChatSession(cfg.replace(policy="full", gate="off"), store, full_engine, model)
            gated = ChatSession(cfg.replace(policy="poisson", budget=budget, gate=gate, copy_back=copy_back),
                                store, gated_engine, model)
            for step in script.steps:
                if step.probe is None or step.assistant is None:
                    for session in (full, gated):
                        if step.assistant is None:
                            session.send(step.user)
                        else:
                            drive.forced(session, step.user, step.assistant)
                    continue
                rows_evicted, rows_live = _row_agreement(full_engine, gated_engine)
                answers = []
                fired: list[ev.Event] = []
                for session in (full, gated):
                    tap = LogitTap(session.sampler)
                    session.sampler = tap  # type: ignore[assignment]
                    turn = session.begin_turn(step.user, fired.append if session is gated else drive._ignore)
                    session.answer(turn, fired.append if session is gated else drive._ignore)
                    gen = turn.generation
                    result = session.finish_turn(turn, evict=False)
                    session.replace_answer(turn, step.assistant)
                    session.evict_turn_end(turn)
                    session.sampler = tap.inner
                    answers.append((list(gen.tokens) if gen is not None else [], tap.steps, result))
                (ft, fl, fres), (gt, gl, gres) = answers
                diff = _first_diff(ft, gt)
                gap_full = gap_gated = None
                if diff is not None and diff < len(fl) and diff < len(gl):
                    a = int(np.argmax(fl[diff]))
                    b = int(np.argmax(gl[diff]))
                    gap_full = float(fl[diff][a] - fl[diff][b])
                    gap_gated = float(gl[diff][b] - gl[diff][a])
                expect = [e.lower() for e in step.probe.expect]
                results.append(ProbeParity(
                    script=path.stem, turn=step.turn, fired=bool(gres.gate_fired), path=gres.reread_path,
                    restored_tokens=sum(e.restored_tokens for e in fired if isinstance(e, ev.GateFired)),
                    homeless=len(gated_engine.homeless),
                    same_answer=diff is None, first_diff=diff, gap_full=gap_full, gap_gated=gap_gated,
                    rows_same_evicted=rows_evicted, rows_same_live=rows_live, full_answer=fres.answer,
                    gated_answer=gres.answer, correct_full=any(e in fres.answer.lower() for e in expect),
                    correct_gated=any(e in gres.answer.lower() for e in expect)))
                r = results[-1]
                print(f"{r.script} turn {r.turn:>3}  fired={r.fired!s:<5} path={r.path or '-':<8} "
                      f"same={r.same_answer!s:<5} diff@{r.first_diff} gap_full={r.gap_full} "
                      f"rows evicted={r.rows_same_evicted:.2f} live={r.rows_same_live:.2f}\n"
                      f"    full : {r.full_answer[:90]!r}\n    gated: {r.gated_answer[:90]!r}", flush=True)
            full.close()
            gated.close()
    finally:
        full_engine.close()
        gated_engine.close()
    return results


def summary(results: list[ProbeParity]) -> str:
    fired = [r for r in results if r.fired]
    copied = [r for r in fired if r.path == "copied" and r.homeless == 0]
    differ = [r for r in copied if not r.same_answer]
    by_path = {path: [r for r in fired if r.path == path] for path in sorted({r.path for r in fired})}
    lines = [f"probes {len(results)} · fired {len(fired)} · copied with every evicted message back {len(copied)} · "
             f"of those, answer differs from the full cache's {len(differ)}",
             "fired, by path: " + ", ".join(f"{path} {len(rs)} (answer differs {sum(not r.same_answer for r in rs)})"
                                            for path, rs in by_path.items()),
             f"recall: full {sum(r.correct_full for r in results)} · gated {sum(r.correct_gated for r in results)}"]
    for r in differ:
        lines.append(f"  {r.script} turn {r.turn}: first differing token {r.first_diff}, full's top-2 gap "
                     f"{r.gap_full}, gated's {r.gap_gated}; rows equal to full's: evicted "
                     f"{r.rows_same_evicted:.2f}, live {r.rows_same_live:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.lab.fired_parity", description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="+", type=Path)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--budget", default="25%")
    parser.add_argument("--gate", default="auto")
    parser.add_argument("--copy-back", default="all")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--evict-from", type=int, default=0, help="tokens before eviction starts (0: every turn)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = run(args.scripts, args.model, args.budget, args.gate, args.copy_back, args.max_tokens, args.threads,
                  args.n_ctx, args.evict_from)
    print(summary(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
