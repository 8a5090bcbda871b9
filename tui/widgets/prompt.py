"""The multi-line prompt: Enter sends, Shift+Enter or Ctrl+J starts a new line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

# Terminals without the kitty keyboard protocol send Shift+Enter as plain Enter; Ctrl+J
# (a bare line feed) always arrives distinctly, so it is the newline key that always works.
NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptArea(TextArea):
    """A TextArea that posts ``Submitted`` on Enter instead of inserting a newline."""

    @dataclass
    class Submitted(Message):
        prompt: PromptArea
        text: str

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         **kwargs)  # type: ignore[arg-type]

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
