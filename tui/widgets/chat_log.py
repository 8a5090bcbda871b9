"""The conversation pane: one widget per message, answers streamed into Markdown.

Answers grow by appending deltas through ``Markdown.get_stream`` (the stream batches
fragments when they come faster than the screen redraws), never by re-rendering the
whole message. Long conversations mount only their last page of messages; a button at
the top brings earlier pages in, so a 500-turn log opens as fast as a short one.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Button, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from memory_store.records import Message, Turn
from tui import bindings, render

PAGE = 40
ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}


class MessageView(Vertical, can_focus=True):
    """One message: a header line (role, status) and its text; focus it and press c to copy."""

    BINDINGS = bindings.bindings(bindings.MESSAGE_KEYS)

    def __init__(self, role: str, content: str = "", status: str = "complete", *, pending: bool = False) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self._text = content
        self.status = status
        self._pending = pending
        self._stream: MarkdownStream | None = None

    @property
    def text(self) -> str:
        return self._text

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-header")
        if self.role == "assistant":
            yield Markdown(self._text, classes="message-body")
        else:
            # The user's text is shown verbatim: what they typed is what the model read.
            yield Static(Content(self._text), classes="message-body")

    def _header(self) -> Content:
        parts: list[tuple[str, str] | str] = [(ROLE_LABELS.get(self.role, self.role), "bold")]
        if self._pending:
            parts.append(("  writing…", "italic $text-muted"))
        elif self.status == "interrupted":
            parts.append(("  ✂ interrupted", "bold $warning"))
        elif self.status == "failed":
            parts.append(("  ✗ no answer", "bold $error"))
        return Content.assemble(*parts)

    def _refresh_header(self) -> None:
        self.query_one(".message-header", Label).update(self._header())

    async def append(self, delta: str) -> None:
        """Add streamed text (only the new fragment goes to the Markdown widget)."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self._text += delta
        await self._stream.write(delta)

    async def restart(self) -> None:
        """A mid-answer gate breach: what was streamed is discarded, the answer starts again."""
        await self._stop_stream()
        self._text = ""
        await self.query_one(Markdown).update("")

    async def finish(self, status: str, note: str | None = None) -> None:
        await self._stop_stream()
        self._pending = False
        self.status = status
        if note and not self._text:
            await self.query_one(Markdown).update(f"*{note}*")
        self._refresh_header()

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self._text)
        self.app.notify(f"copied {len(self._text)} characters", timeout=2)


class Notice(Static):
    """A line in the conversation that is not a message (gate events, replay progress)."""

    def __init__(self, text: str, kind: str = "gate") -> None:
        super().__init__(Content(text), classes=f"notice {kind}")


class ChatLog(VerticalScroll):
    """The messages of the open conversation, newest at the bottom."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._hidden: list[Message] = []
        self._gates: dict[int, Turn] = {}

    # -- whole conversations ----------------------------------------------------------------
    async def show(self, messages: list[Message], turns: list[Turn]) -> None:
        """Replace the pane's content with a conversation (its last page mounted)."""
        await self.remove_children()
        self._gates = {t.message_id: t for t in turns if t.gate_fired and t.message_id is not None}
        self._hidden = messages[:-PAGE] if len(messages) > PAGE else []
        widgets: list[Widget] = [*self._views(messages[len(self._hidden):])]
        if self._hidden:
            widgets.insert(0, self._more_button())
        await self.mount_all(widgets)
        self.anchor()

    def _more_button(self) -> Button:
        return Button(f"↑ {len(self._hidden)} earlier messages", id="more", variant="default", compact=True)

    def _views(self, messages: list[Message]) -> list[Notice | MessageView]:
        out: list[Notice | MessageView] = []
        for m in messages:
            turn = self._gates.get(m.id)
            if turn is not None:
                out.append(Notice(render.logged_gate_note(turn.reprefill_tokens)))
            out.append(MessageView(m.role, m.content, m.status))
        return out

    async def show_earlier(self) -> None:
        if not self._hidden:
            return
        page, self._hidden = self._hidden[-PAGE:], self._hidden[:-PAGE]
        button = self.query_one("#more", Button)
        views = self._views(page)
        await self.mount_all(views, after=button)
        if self._hidden:
            button.label = f"↑ {len(self._hidden)} earlier messages"
        else:
            await button.remove()

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "more":
            event.stop()
            await self.show_earlier()

    # -- the turn being answered ---------------------------------------------------------
    async def begin_turn(self, text: str) -> MessageView:
        answer = MessageView("assistant", pending=True)
        await self.mount_all([MessageView("user", text), answer])
        # Anchored: the pane follows the stream until the user scrolls up to read.
        self.anchor()
        return answer

    async def add_notice(self, text: str, kind: str = "gate") -> None:
        await self.mount(Notice(text, kind))

    def last_answer(self) -> MessageView | None:
        answers = [v for v in self.query(MessageView) if v.role == "assistant"]
        return answers[-1] if answers else None

    @property
    def hidden_count(self) -> int:
        return len(self._hidden)
