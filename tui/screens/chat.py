"""The chat screen: chats sidebar, conversation pane and prompt, memory panel, status line.

It renders what the agent reports (``apply`` takes the backend's messages and the
agent's events) and forwards what the user does to the app as messages; it never
calls the agent itself. Side panels hide themselves on narrow terminals (the toggles
bring them back) so a small window still has room to chat.
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Label

from agent import events as ev
from tui import backend as be
from tui import render
from tui.widgets.chat_log import ChatLog, MessageView
from tui.widgets.conversations import ConversationList
from tui.widgets.memory_panel import MemoryPanel
from tui.widgets.prompt import PromptArea
from tui.widgets.status import StatusLine

SIDEBAR_MIN_WIDTH = 110
MEMORY_MIN_WIDTH = 76


class ChatScreen(Screen[None]):
    """The main screen; the app owns the agent and calls ``apply`` with what it reports."""

    def __init__(self, status: render.StatusInfo) -> None:
        super().__init__(id="chat-screen")
        self._status = status
        self._answer: MessageView | None = None
        self._wide: tuple[bool, bool] | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield ConversationList(id="sidebar")
            with Vertical(id="center"):
                yield Label("", id="chat-title")
                yield ChatLog(id="chat")
                yield PromptArea(id="prompt")
            yield MemoryPanel(id="memory")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(StatusLine).info = self._status
        self.query_one(PromptArea).focus()

    # -- layout ------------------------------------------------------------------------------
    def on_resize(self, event: events.Resize) -> None:
        wide = (event.size.width >= SIDEBAR_MIN_WIDTH, event.size.width >= MEMORY_MIN_WIDTH)
        if wide != self._wide:
            # Only when crossing a threshold: a toggle the user made stays as it is otherwise.
            self._wide = wide
            self.query_one("#sidebar").display = wide[0]
            self.query_one("#memory").display = wide[1]

    def toggle(self, widget_id: str) -> bool:
        widget = self.query_one(f"#{widget_id}")
        widget.display = not widget.display
        return bool(widget.display)

    # -- accessors ---------------------------------------------------------------------------
    @property
    def chat(self) -> ChatLog:
        return self.query_one(ChatLog)

    @property
    def prompt(self) -> PromptArea:
        return self.query_one(PromptArea)

    @property
    def sidebar(self) -> ConversationList:
        return self.query_one(ConversationList)

    @property
    def memory(self) -> MemoryPanel:
        return self.query_one(MemoryPanel)

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    @property
    def answering(self) -> MessageView | None:
        return self._answer

    def set_title(self, title: str) -> None:
        self.query_one("#chat-title", Label).update(Content(title))

    # -- what the agent reports -------------------------------------------------------------
    async def apply(self, item: object) -> None:
        """Render one backend message or agent event."""
        if isinstance(item, ev.TextDelta):
            if self._answer is not None:
                await self._answer.append(item.text)
        elif isinstance(item, be.TurnBegins):
            if item.replay_step is not None:
                await self.chat.add_notice(f"replay {item.replay_step}/{item.replay_total}", kind="replay")
            self._answer = await self.chat.begin_turn(item.text)
            self.status.set(phase="reading your message…")
        elif isinstance(item, ev.Prefilled):
            self.status.set(phase=f"read {item.tokens} tokens in {item.ms:.0f} ms")
        elif isinstance(item, ev.Rereading):
            self.status.set(phase=f"re-reading the history: {item.done:,} of {item.total:,} tokens")
        elif isinstance(item, ev.Evicted):
            self.memory.note_eviction(item)
            self.status.set(phase=f"evicted to {item.cells_after} cells")
        elif isinstance(item, ev.CertificateRead):
            self.status.set(certificate=item.value)
        elif isinstance(item, ev.GateFired):
            await self.chat.add_notice(render.gate_note(item))
            self.memory.note_gate(item)
            # The notice belongs before the answer it caused: move the pending answer below it.
            if self._answer is not None:
                await self._move_answer_last()
        elif isinstance(item, ev.Restored):
            await self.chat.add_notice(render.restore_note(item), kind="restore")
            self.memory.note_restore(item)
            if self._answer is not None:
                await self._move_answer_last()
        elif isinstance(item, ev.GateDeferred):
            await self.chat.add_notice(render.deferred_note(item), kind="restore")
            if self._answer is not None:
                await self._move_answer_last()
        elif isinstance(item, ev.Regenerating):
            if self._answer is not None:
                await self._answer.restart()
        elif isinstance(item, ev.TurnFinished):
            await self._finish(item.result)
            self.memory.show(item.memory)
            self.status.set_memory(item.memory)
            self.status.set(certificate=item.result.certificate, phase=_finish_phase(item.result))
        elif isinstance(item, be.ConversationShown):
            self._answer = None
            await self.chat.show(item.messages, item.turns)
            self.memory.show(item.memory)
            self.status.set_memory(item.memory)
            last = item.memory.certificates[-1][1] if item.memory.certificates else None
            self.status.set(certificate=last, phase="ready")
        elif isinstance(item, be.MemoryChanged):
            self.memory.show(item.memory)
            self.status.set_memory(item.memory)

    async def _move_answer_last(self) -> None:
        answer = self._answer
        assert answer is not None
        chat = self.chat
        if chat.children and chat.children[-1] is not answer:
            chat.move_child(answer, after=chat.children[-1])

    async def _finish(self, result: ev.TurnResult) -> None:
        if self._answer is None:
            return
        status = "interrupted" if result.stop == "cancelled" else "complete"
        await self._answer.finish(status)
        self._answer = None

    async def fail_answer(self, note: str) -> None:
        """The turn ended in an error: the pending answer says so instead of spinning."""
        if self._answer is not None:
            await self._answer.finish("failed", note=note)
            self._answer = None


def _finish_phase(result: ev.TurnResult) -> str:
    stop = {"eog": "done", "max_tokens": "stopped at max_tokens", "cancelled": "cancelled",
            "hook": "stopped"}.get(result.stop, result.stop)
    return f"{stop}: {result.answer_tokens} tokens in {result.decode_ms / 1000:.1f} s"
