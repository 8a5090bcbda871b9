"""`certchat chat`: the Textual UI's command, contributed to the console script through the
``certchat.commands`` entry point, so the agent's command line never imports the UI."""

from __future__ import annotations

import argparse

from agent.cli import chat as cli_chat
from agent.cli import errors as cli_errors


def _cmd_chat(args: argparse.Namespace) -> int:
    from tui import app  # noqa: PLC0415 — Textual loads only for the chat

    return app.run(cli_chat.config_from_args(args), conversation_id=args.conversation, db=args.db)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="open the chat (Textual UI)")
    cli_chat.add_common_flags(p)
    p.add_argument("--conversation", type=int, help="continue a logged conversation")
    p.set_defaults(func=cli_errors.guard(_cmd_chat))
