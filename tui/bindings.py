"""Key bindings, each with a stable id that the config's ``keys`` table can remap.

``keys = { new_chat = "ctrl+n", toggle_memory = "f4" }`` in config.toml replaces the
default key of a binding id (several keys: "f4,ctrl+t"). Unknown ids are reported, not
ignored, so a typo in the config shows up as a notification at start.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding, BindingType


@dataclass(frozen=True)
class Key:
    """One remappable binding."""

    id: str
    key: str
    action: str
    description: str
    show: bool = False
    priority: bool = False


# Keys are chosen not to clash with the prompt's TextArea editing keys
# (ctrl+a/e/d/k/u/w/x/c/v/z/y, f6, f7), so the prompt can keep focus while they work.
APP_KEYS: tuple[Key, ...] = (
    Key("command_palette", "ctrl+p", "command_palette", "Commands", priority=True),
    Key("new_chat", "ctrl+n", "new_chat", "New chat", show=True),
    Key("cancel", "escape", "cancel_reply", "Cancel reply"),
    Key("regenerate", "ctrl+r", "regenerate", "Regenerate", show=True),
    Key("copy_last", "f3", "copy_last", "Copy answer"),
    Key("rename_chat", "f2", "rename_chat", "Rename chat"),
    Key("delete_chat", "f8", "delete_chat", "Delete chat"),
    Key("search_chats", "ctrl+f", "search_chats", "Search chats"),
    Key("toggle_sidebar", "ctrl+b", "toggle_sidebar", "Chats"),
    Key("toggle_memory", "ctrl+t", "toggle_memory", "Memory", show=True),
    Key("switch_policy", "f5", "pick_policy", "Policy", show=True),
    Key("set_budget", "f4", "set_budget", "Budget"),
    Key("set_gate", "ctrl+g", "set_gate", "Gate"),
    Key("export_markdown", "ctrl+s", "export('markdown')", "Export Markdown"),
    Key("export_jsonl", "f9", "export('jsonl')", "Export JSONL"),
    Key("replay", "f10", "replay", "Replay script"),
    Key("show_logs", "ctrl+l", "show_logs", "Logs"),
    Key("help", "f1", "help", "Help", show=True),
    Key("quit", "ctrl+q", "quit", "Quit", show=True, priority=True),
)

MESSAGE_KEYS: tuple[Key, ...] = (
    Key("copy_message", "c", "copy", "Copy message", show=True),
)

ALL_KEYS: tuple[Key, ...] = APP_KEYS + MESSAGE_KEYS


def bindings(keys: tuple[Key, ...]) -> list[BindingType]:
    return [Binding(k.key, k.action, k.description, show=k.show, priority=k.priority, id=k.id) for k in keys]


def keymap(overrides: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The config's ``keys`` table as a Textual keymap, plus one-line problems found in it."""
    known = {k.id for k in ALL_KEYS}
    good: dict[str, str] = {}
    problems: list[str] = []
    for binding_id, key in overrides.items():
        if binding_id not in known:
            problems.append(f"keys: unknown binding id {binding_id!r} (known: {', '.join(sorted(known))})")
        elif not str(key).strip():
            problems.append(f"keys: {binding_id} has an empty key")
        else:
            good[binding_id] = str(key).replace(" ", "")
    return good, problems


def key_for(binding_id: str, overrides: dict[str, str]) -> str:
    """The key a binding id currently answers to (for help texts)."""
    if binding_id in overrides:
        return overrides[binding_id]
    return next(k.key for k in ALL_KEYS if k.id == binding_id)
