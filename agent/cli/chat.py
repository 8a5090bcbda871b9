"""`certchat ask | repl`: the line-mode conversational commands, and the flags every chat command shares
(`certchat chat`, the Textual UI, is registered by ``tui.cli``)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any

from agent import config as config_mod
from agent import events as ev
from agent import models, paths
from agent.cli import errors as cli_errors


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """Flags every conversational command shares; each overrides the config file."""
    p.add_argument("--model", help="registry name or path to a GGUF file")
    p.add_argument("--policy", choices=config_mod.POLICIES)
    p.add_argument("--budget", help="KV budget: 'auto' (the budget the model's record certifies for the risk), "
                                    "tokens (1024) or share of the history (10%%)")
    p.add_argument("--risk", help="under budget auto, the share of the full cache's right answers it may lose "
                                  "(10%%)")
    p.add_argument("--gate", help="gate threshold τ, 'auto' or 'off'")
    p.add_argument("--evict-from", type=int, dest="evict_from", metavar="TOKENS",
                   help="history length below which the full cache is kept (0: evict from the first turn)")
    p.add_argument("--seed", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int, dest="max_tokens")
    p.add_argument("--n-ctx", type=int, dest="n_ctx")
    p.add_argument("--gpu-layers", type=int, dest="gpu_layers")
    p.add_argument("--threads", type=int)
    p.add_argument("--db", type=Path, help="conversation database (default: under the data dir)")


def config_from_args(args: argparse.Namespace) -> config_mod.Config:
    cfg = config_mod.load()
    keys = ("model", "policy", "budget", "risk", "gate", "evict_from", "seed", "temperature", "max_tokens", "n_ctx",
            "gpu_layers", "threads")
    return cfg.replace(**{k: getattr(args, k, None) for k in keys})


def open_session(cfg: config_mod.Config, db: Path | None, conversation_id: int | None) -> Any:
    """Load the model and the log, and bind them into a ChatSession."""
    from agent.chat.session import ChatSession  # noqa: PLC0415 — loads llama.cpp
    from memory_store.store import Store  # noqa: PLC0415

    model_path = models.resolve(cfg.model)
    store = Store(db or paths.db_path())
    return ChatSession.start(cfg, store, model_path, models.display_name(cfg.model, model_path),
                             conversation_id=conversation_id)


def _print_event(event: ev.Event) -> None:
    if isinstance(event, ev.TextDelta):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    elif isinstance(event, ev.GateFired):
        why = ev.gate_reason(event)
        print(f"\n[gate: {why} — {ev.gate_words(event)}]", file=sys.stderr)
    elif isinstance(event, ev.Restored):
        print(f"\n[restore: {ev.restored_words(event)}]", file=sys.stderr)
    elif isinstance(event, ev.GateDeferred):
        print(f"\n[gate: {ev.deferred_words(event)}]", file=sys.stderr)
    elif isinstance(event, ev.Regenerating):
        print("\n[answer discarded after a mid-answer gate breach; answering again from the full history]",
              file=sys.stderr)
    elif isinstance(event, ev.Notice):
        print(f"\n[{event.level}] {event.text}", file=sys.stderr)


def _cmd_ask(args: argparse.Namespace) -> int:
    from agent.chat.session import InputError  # noqa: PLC0415

    cfg = config_from_args(args)
    text = " ".join(args.text) if args.text else cli_errors.read_stdin("ask")
    if not text.strip():
        print("certchat ask: empty message; pass the text as arguments or on stdin", file=sys.stderr)
        return 2
    session = open_session(cfg, args.db, None if args.new else args.conversation)
    sink = (lambda e: None) if args.json else _print_event
    try:
        result = session.send(text, on_event=sink)
    except InputError as err:
        print(f"certchat ask: {err}", file=sys.stderr)
        return 1
    if args.json:
        # the status beside the turn: below config evict_from, on a model the gate is not calibrated for, or where
        # budget auto certifies no budget, the chat runs the full cache (ev.MemoryView); the budget in force and the
        # loss it is certified at (null: not certified), with the configured risk
        opened = session.opened
        memory = session.memory
        print(json.dumps({**result.as_json(), "full_cache_until": memory.full_until,
                          "budget": str(memory.budget) if memory.budget is not None else None,
                          "risk": memory.settings.risk, "certified_risk": memory.certified_risk,
                          "budget_notice": session.budget_notice,
                          "full_cache_reason": session.full_cache_notice,
                          "resumed": opened.resumed if opened is not None else None,
                          "resume_reason": opened.reason if opened is not None else None,
                          "open_ms": round(opened.ms, 1) if opened is not None else None}))
    else:
        print()
        if session.opened is not None:
            # after the answer: a refused message's error stays the one line a failed command prints
            print(f"[{session.opened.words()}]", file=sys.stderr)
    return 0


def _cmd_repl(args: argparse.Namespace) -> int:
    from agent.chat.session import InputError  # noqa: PLC0415

    cfg = config_from_args(args)
    session = open_session(cfg, args.db, args.conversation)
    tty = sys.stdin.isatty()
    cli_errors.tolerant_stdin()
    if tty:
        print(f"certchat — conversation {session.conversation_id}, policy {cfg.policy}, budget "
              f"{session.memory.budget_words}. Ctrl-D quits, Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        line = cli_errors.clean_line(line, "repl")
        if not line.strip():
            continue
        try:
            result = _send_interruptibly(session, line)
        except InputError as err:
            print(f"certchat: {err}", file=sys.stderr)
            continue
        except InterruptedError:
            print("\n[stopped during the prefill; the message is in the log, unanswered]", file=sys.stderr)
            continue
        print()
        if result.stop == "cancelled":
            print("[stopped; the partial answer is in the log, marked interrupted]", file=sys.stderr)
        elif tty:
            cert = f"{result.certificate:.3f}" if result.certificate is not None else "—"
            until, reason = session.memory.full_until, session.memory.full_reason
            full = f", {ev.full_cache_words(until)}" if until is not None else f", {reason}" if reason else ""
            print(f"  [{result.live_cells}/{result.allocated_cells} cells{full}, cert {cert}, "
                  f"{result.decode_tok_s:.1f} tok/s]", file=sys.stderr)


def _send_interruptibly(session: Any, line: str) -> Any:
    """Run the turn in a worker so Ctrl-C becomes a cancel between tokens (or prefill chunks),
    never an exception in the middle of a llama.cpp call or a log write."""
    cancel = threading.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = session.send(line, on_event=_print_event, cancel=cancel)
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=work, name="certchat-turn", daemon=True)
    worker.start()
    while worker.is_alive():
        try:
            worker.join(0.1)
        except KeyboardInterrupt:
            cancel.set()
    if "error" in box:
        raise box["error"]
    return box["result"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="run one turn and stream the answer to stdout")
    add_common_flags(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--new", action="store_true", help="start a new conversation (default)")
    group.add_argument("--conversation", type=int, help="continue a logged conversation")
    p.add_argument("--json", action="store_true", help="end with one JSON object describing the turn")
    p.add_argument("text", nargs="*")
    p.set_defaults(func=cli_errors.guard(_cmd_ask))

    p = sub.add_parser("repl", help="plain line-mode chat, for pipes and terminals without a TUI")
    add_common_flags(p)
    p.add_argument("--conversation", type=int, help="continue a logged conversation")
    p.set_defaults(func=cli_errors.guard(_cmd_repl))
