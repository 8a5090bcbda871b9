"""`certchat bench --only resume`: continuing a logged chat from its saved state against re-reading its log.

For each history length, a long chat (``agent.lab.replay.longchat``'s generator: LoCoMo dialogue with facts) is
logged with its exact token ids, then continued three times by `certchat ask` processes, each timed from its
start to the first answer token on stdout:

1. a new chat (the floor: loading the model, a one-message prefill, one decode step);
2. ``--conversation ID`` with no saved state: today's path, the whole log re-read, then evicted to budget (the
   session saves its state after the turn);
3. ``--conversation ID`` again: it resumes from the state the second run saved.

Beside them, the state's size on disk and what the full cache of that history would take. Every process runs
the chat's defaults (policy, budget, gate) with a context that holds the whole history.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from agent import models
from agent.chat.saved_state import SavedStates, read_header
from agent.config import Config

LENGTHS = (4096, 16384, 32768)
QUICK_LENGTHS = (1024, 4096)
QUESTION = "In one short sentence, what did we talk about last?"


def _log_chat(db: Path, model: str, history: int, threads: int) -> tuple[int, int]:
    """A generated long chat of about ``history`` tokens, logged with its exact token ids; (conversation, tokens)."""
    from agent.chat.session import ChatSession  # noqa: PLC0415
    from agent.lab.replay import longchat  # noqa: PLC0415
    from agent.llm.engine import Engine, EngineSettings  # noqa: PLC0415 — loads llama.cpp
    from memory_store.store import Store  # noqa: PLC0415

    script = longchat.generate(0, history, longchat.counter_for(model))
    messages = [{"role": "system", "content": script.system or Config().system_prompt}]
    for step in script.steps:
        if step.independent or step.assistant is None:
            continue
        messages += [{"role": "user", "content": step.user}, {"role": "assistant", "content": step.assistant}]
    store = Store(db)
    conv = store.import_messages(f"{history}-token chat", messages, model=model)
    engine = Engine(EngineSettings(model_path=models.resolve(model), n_ctx=512, threads=threads))
    try:
        session = ChatSession(Config(model=model, n_ctx=512, max_tokens=64), store, engine, model)
        tokens = session.tokenize_log(conv.id)
        store.delete_conversation(session.conversation_id)
    finally:
        engine.close()
        store.close()
    return conv.id, tokens


def _ask(db: Path, model: str, n_ctx: int, threads: int, conversation: int | None) -> dict[str, Any]:
    """One `certchat ask` process: seconds from its start to the first answer byte, and how it opened."""
    cmd = [sys.executable, "-m", "agent.cli", "ask", "--db", str(db), "--model", model, "--n-ctx", str(n_ctx),
           "--threads", str(threads), "--max-tokens", "8"]
    cmd += ["--new"] if conversation is None else ["--conversation", str(conversation)]
    env = {**os.environ, "CERTCHAT_CONFIG": str(db.with_name("no-config.toml"))}
    start = time.perf_counter()
    proc = subprocess.Popen([*cmd, QUESTION], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start
    rest, err = proc.communicate()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"certchat ask failed ({proc.returncode}): {err.decode(errors='replace')[-400:]}")
    opened = re.search(r"^\[(resumed|re-read [^\]]*)\]$", err.decode(errors="replace"), re.M)
    return {"first_token_s": ttft, "total_s": time.perf_counter() - start,
            "opened": opened.group(1) if opened else "new chat",
            "answer": (first + rest).decode(errors="replace").strip()}


def run(model: str, lengths: tuple[int, ...], threads: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="certchat-resume-bench-") as tmp:
        for history in lengths:
            db = Path(tmp) / f"chat-{history}.db"
            say(f"{history} tokens: logging a generated chat")
            cid, tokens = _log_chat(db, model, history, threads)
            n_ctx = tokens + 2048
            say(f"{history} tokens: a new chat (the floor)")
            new = _ask(db, model, n_ctx, threads, None)
            say(f"{history} tokens: continuing it with no saved state (re-reading {tokens} tokens)")
            reread = _ask(db, model, n_ctx, threads, cid)
            states = SavedStates.beside(db)
            header = read_header(states.path(cid))
            say(f"{history} tokens: continuing it from the saved state")
            resumed = _ask(db, model, n_ctx, threads, cid)
            size = states.sizes()[cid]
            cells = _cells(header)
            seq_bytes = next(a["nbytes"] for a in header["arrays"] if a["name"] == "seq_state")
            rows.append({"history": history, "tokens": tokens, "new_s": new["first_token_s"],
                         "reread_s": reread["first_token_s"], "resumed_s": resumed["first_token_s"],
                         "reread_opened": reread["opened"], "resumed_opened": resumed["opened"],
                         "state_bytes": size, "live_cells": cells,
                         "full_cache_bytes": int(seq_bytes / max(cells, 1) * tokens)})
    return rows


def _cells(header: dict[str, Any]) -> int:
    spec = next(a for a in header["arrays"] if a["name"] == "positions")
    return int(spec["shape"][0])


def render(model: str, threads: int, rows: list[dict[str, Any]]) -> str:
    lines = [f"continuing a logged chat ({model}, {threads} threads, the chat's defaults: policy "
             f"{Config().policy}, budget {Config().budget}); seconds from process start to the first answer token",
             f"{'history':>8}  {'new chat':>8}  {'re-read':>8}  {'resumed':>8}  {'speed-up':>8}  "
             f"{'state':>9}  {'full cache':>10}  {'share':>6}"]
    for r in rows:
        lines.append(f"{r['tokens']:>8}  {r['new_s']:>8.2f}  {r['reread_s']:>8.2f}  {r['resumed_s']:>8.2f}  "
                     f"{r['reread_s'] / r['resumed_s']:>7.1f}×  {r['state_bytes'] / 2**20:>7.1f}MB  "
                     f"{r['full_cache_bytes'] / 2**20:>8.1f}MB  {r['state_bytes'] / r['full_cache_bytes']:>6.1%}")
    for r in rows:
        lines.append(f"  {r['tokens']} tokens: the second run said [{r['reread_opened']}], "
                     f"the third [{r['resumed_opened']}]")
    lines.append("new chat: model load + a one-message prefill + one decode step, the floor a resume is held to "
                 "(target: resumed ≤ model load + 1 s)")
    return "\n".join(lines)
