"""The sidebar: the logged conversations, newest first, with full-text search.

An empty search lists every conversation; a search lists the conversations whose
title or messages match (the store's FTS index), with the best message snippet.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Input, OptionList
from textual.widgets.option_list import Option

from memory_store.records import Conversation, SearchHit


@dataclass(frozen=True)
class Entry:
    conversation_id: int
    title: str
    detail: str


def _count(n: int) -> str:
    return f"{n} message" if n == 1 else f"{n} messages"


def entries(conversations: list[Conversation], hits: list[SearchHit] | None, query: str) -> list[Entry]:
    """The rows to list: all conversations, or those matching ``query`` (title or messages)."""
    if hits is None:
        return [Entry(c.id, c.title or f"Conversation {c.id}", _count(c.message_count)) for c in conversations]
    by_id = {c.id: c for c in conversations}
    out: dict[int, Entry] = {}
    words = query.lower().split()
    for c in conversations:
        if words and all(w in c.title.lower() for w in words):
            out[c.id] = Entry(c.id, c.title, "title matches")
    for h in hits:
        if h.conversation_id not in out and h.conversation_id in by_id:
            out[h.conversation_id] = Entry(h.conversation_id, h.title or f"Conversation {h.conversation_id}",
                                           f"{h.role}: {h.snippet}")
    return list(out.values())


class ConversationList(Vertical):
    """Search box above a list of conversations; selecting one asks the app to open it."""

    @dataclass
    class Chosen(Message):
        conversation_id: int

    @dataclass
    class SearchChanged(Message):
        query: str

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search chats", id="search")
        yield OptionList(id="chats")

    def show(self, rows: list[Entry], current: int | None) -> None:
        options = self.query_one("#chats", OptionList)
        highlighted = None
        opts: list[Option] = []
        for n, row in enumerate(rows):
            if row.conversation_id == current:
                highlighted = n
            label = Content.assemble((row.title, "bold" if row.conversation_id == current else ""), "\n",
                                     (row.detail, "$text-muted"))
            opts.append(Option(label, id=str(row.conversation_id)))
        options.set_options(opts)
        if opts:
            options.highlighted = highlighted if highlighted is not None else 0

    @property
    def query_text(self) -> str:
        return self.query_one("#search", Input).value

    def focus_search(self) -> None:
        self.query_one("#search", Input).focus()

    def clear_search(self) -> None:
        self.query_one("#search", Input).value = ""

    def highlighted_id(self) -> int | None:
        options = self.query_one("#chats", OptionList)
        if options.highlighted is None:
            return None
        option = options.get_option_at_index(options.highlighted)
        return int(option.id) if option.id is not None else None

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one("#chats", OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.Chosen(int(event.option.id)))
