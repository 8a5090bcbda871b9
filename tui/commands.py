"""Command palette (Ctrl+P): every chat command, policy, budget and gate choice.

``app_commands`` lists what the app can do (with the key each answers to, after the
config's remaps); ``CertchatCommands`` matches them against what the user types.
Textual's own system commands (themes, keys, quit) sit beside them in the palette.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

from agent.config import POLICIES
from tui import bindings
from tui.settings import POLICY_HELP

if TYPE_CHECKING:
    from tui.app import CertchatApp


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[], object]


def app_commands(app: CertchatApp) -> list[Command]:
    """The palette's entries, in the order they are listed before anything is typed."""
    c = app.config

    def key(binding_id: str) -> str:
        return f" ({bindings.key_for(binding_id, app.keymap_overrides)})"

    cmds = [
        Command("New chat", "start a new conversation" + key("new_chat"), app.action_new_chat),
        Command("Rename chat", "rename the open conversation" + key("rename_chat"), app.action_rename_chat),
        Command("Delete chat", "delete the open conversation" + key("delete_chat"), app.action_delete_chat),
        Command("Search chats", "full-text search over every conversation" + key("search_chats"),
                app.action_search_chats),
        Command("Regenerate last answer", "answer the last question again, in a branch" + key("regenerate"),
                app.action_regenerate),
        Command("Copy last answer", "to the clipboard" + key("copy_last"), app.action_copy_last),
        Command("Cancel reply", "stop the answer being written" + key("cancel"), app.action_cancel_reply),
        Command("Toggle memory panel", "what the model still remembers" + key("toggle_memory"),
                app.action_toggle_memory),
        Command("Toggle chat list", "the conversations sidebar" + key("toggle_sidebar"), app.action_toggle_sidebar),
    ]
    for policy in POLICIES:
        mark = " — current" if policy == c.policy else ""
        cmds.append(Command(f"Policy: {policy}", POLICY_HELP.get(policy, "") + mark,
                            lambda p=policy: app.reconfigure(policy=p)))
    cmds.append(Command("Budget…", f"KV budget, now {c.budget}" + key("set_budget"), app.action_set_budget))
    for budget in ("10%", "25%", "50%"):
        cmds.append(Command(f"Budget: {budget}", "keep this share of the history",
                            lambda b=budget: app.reconfigure(budget=b)))
    cmds.append(Command("Gate…", f"gate threshold τ, now {c.gate}" + key("set_gate"), app.action_set_gate))
    for gate, about in (("auto", "the calibrated default τ"), ("off", "never re-read the history")):
        cmds.append(Command(f"Gate: {gate}", about, lambda g=gate: app.reconfigure(gate=g)))
    cmds += [
        Command("Export Markdown", "write the conversation as Markdown" + key("export_markdown"),
                lambda: app.action_export("markdown")),
        Command("Export JSONL", "write the conversation as replay JSONL" + key("export_jsonl"),
                lambda: app.action_export("jsonl")),
        Command("Replay a script", "send a JSONL script's user lines into a new chat" + key("replay"),
                app.action_replay),
        Command("Show logs", "certchat's log and the build logs" + key("show_logs"), app.action_show_logs),
        Command("Help", "keys, binding ids and the memory panel" + key("help"), app.action_help),
    ]
    return cmds


class CertchatCommands(Provider):
    """Matches the app's commands by fuzzy name."""

    def _commands(self) -> list[Command]:
        app: CertchatApp = self.app  # type: ignore[assignment]
        return app.palette_commands()

    async def discover(self) -> Hits:
        for command in self._commands():
            yield DiscoveryHit(command.name, command.run, help=command.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in self._commands():
            score = matcher.match(command.name)
            if score > 0:
                yield Hit(score, matcher.highlight(command.name), command.run, help=command.help)
