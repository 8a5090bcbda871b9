"""Run a long replay script through the chat UI's backend, as the TUI's F10 replay does, and say what happened.

The TUI's ``Backend`` (the same object the Textual app drives from its workers, without the widgets) replays the
script into a new chat under the chat's own settings (the config file's, or the defaults; ``--set KEY=VALUE``
overrides): scripted replies go in as written, the model answers the probes. Every event the UI would render is
heard here: the run reports turns done, errors, notices (frame and context shifts), gate firings, the probes'
answers against the script's expected strings, the largest cache position and the log's, and the wall time.

    python scripts/tui_backend_long.py SCRIPT.jsonl [--model NAME] [--threads 2] [--set budget=25%] [--db PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import get_type_hints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent import config as config_mod  # noqa: E402
from agent import events as ev  # noqa: E402
from agent import logs, models  # noqa: E402
from agent.lab.replay import scoring  # noqa: E402
from memory_store import export  # noqa: E402
from memory_store.store import Store  # noqa: E402
from tui import backend as be  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    logs.configure()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("script", type=Path)
    p.add_argument("--model", help="registry name or GGUF path (default: the configured model)")
    p.add_argument("--threads", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--db", type=Path, help="the chat log to write (default: a temporary file)")
    args = p.parse_args(argv)

    cfg = config_mod.load()
    overrides: dict[str, object] = {"threads": args.threads, "model": args.model}
    hints = get_type_hints(config_mod.Config)
    for item in args.set:
        key, _, value = item.partition("=")
        kind = hints.get(key)
        if kind is None:
            p.error(f"--set {item!r}: no setting {key!r}")
        try:
            overrides[key] = (value.lower() in ("true", "on", "yes", "1") if kind is bool else
                              int(value) if kind is int else float(value) if kind is float else value)
        except ValueError:
            p.error(f"--set {item!r}: {key} needs a {getattr(kind, '__name__', kind)}")
    cfg = cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
    model_path = models.resolve(cfg.model)
    _, items = export.read_jsonl(args.script)
    turns = be.replay_turns(items)
    probes = [(i["content"], i["meta"]["probe"]) for i in items
              if i["role"] == "user" and "probe" in (i.get("meta") or {})]
    db = args.db or Path(tempfile.mkdtemp(prefix="certchat-tui-long-")) / "chat.db"
    backend = be.Backend(cfg, Store(db), model_path, cfg.model)
    heard: Counter[str] = Counter()
    notices: list[str] = []
    errors: list[str] = []
    started = time.perf_counter()

    def emit(item: object) -> None:
        heard[type(item).__name__] += 1
        if isinstance(item, ev.Notice):
            notices.append(item.text)
        elif isinstance(item, be.TurnBegins) and item.replay_step and item.replay_step % 50 == 0:
            print(f"  turn {item.replay_step}/{item.replay_total}, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)

    finished: be.ReplayFinished | None = None
    try:
        backend.load(None, emit)
        finished = backend.replay(args.script, emit, threading.Event())
    except Exception as err:  # noqa: BLE001 — the run reports what broke, as the app would show it
        errors.append(f"{type(err).__name__}: {err}")
    wall = time.perf_counter() - started
    session = backend.session
    report: dict[str, object] = {"script": str(args.script), "turns": len(turns), "model": cfg.model,
                                 "policy": cfg.policy, "budget": cfg.budget, "gate": cfg.gate, "n_ctx": cfg.n_ctx,
                                 "threads": cfg.threads, "db": str(db), "wall_s": round(wall, 1), "errors": errors}
    if finished is not None and session is not None:
        messages = backend.store.messages(finished.conversation_id)
        asked = {m.content: n for n, m in enumerate(messages) if m.role == "user"}
        answers = []
        for question, probe in probes:
            n = asked.get(question)
            reply = messages[n + 1].content if n is not None and n + 1 < len(messages) else ""
            answers.append(scoring.contains(reply, probe["expect"]))
        tokens, positions = backend.store.history(finished.conversation_id).flatten()
        engine = session.engine
        report.update({
            "turns_done": finished.turns, "cancelled": finished.cancelled,
            "probes_recalled": f"{sum(answers)}/{len(answers)}",
            "gate_fired": heard["GateFired"], "log_tokens": len(tokens),
            "log_last_position": int(positions[-1]) if len(positions) else 0,
            "cache_next_position": engine.next_pos, "frame_offset": engine.frame_offset,
            "trained_context": engine.info.n_ctx_train, "live_cells": engine.live_cells,
            "shift_notices": [n for n in notices if "shift" in n or "trained context" in n][:3],
            "notices": len(notices), "events": dict(heard),
        })
    backend.close()
    print(json.dumps(report, indent=1))
    return 0 if not errors and finished is not None and not finished.cancelled else 1


if __name__ == "__main__":
    sys.exit(main())
