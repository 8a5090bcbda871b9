"""The status line under the conversation: model, policy, budget, cells, speed, certificate."""

from __future__ import annotations

from dataclasses import replace

from textual.reactive import reactive
from textual.widgets import Static

from agent import events as ev
from tui import render


class StatusLine(Static):
    """One line, cropped (never wrapped) on narrow terminals."""

    info: reactive[render.StatusInfo | None] = reactive(None, always_update=True)

    def watch_info(self, info: render.StatusInfo | None) -> None:
        self.update(render.status_line(info) if info is not None else "")

    def set(self, **changes: object) -> None:
        if self.info is not None:
            self.info = replace(self.info, **changes)  # type: ignore[arg-type]

    def set_memory(self, memory: ev.MemoryView) -> None:
        self.set(memory=memory, policy=memory.policy)
