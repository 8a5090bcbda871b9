"""Small modal dialogs: a validated text input, a yes/no question, a pick-one list."""

from __future__ import annotations

from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

Validator = Callable[[str], str | None]
"""Returns a one-line problem with the value, or None when it is fine."""


class InputDialog(ModalScreen[str | None]):
    """Ask for one value; Enter accepts (if the validator agrees), Esc cancels."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel", show=False)]

    def __init__(self, title: str, value: str = "", *, hint: str = "", validate: Validator | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self._title = title
        self._value = value
        self._hint = hint
        self._validate = validate

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(Content(self._title), classes="dialog-title")
            if self._hint:
                yield Static(Content(self._hint), classes="muted")
            yield Input(self._value, id="value")
            yield Static(id="problem", classes="error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        problem = self._validate(event.value) if self._validate else None
        if problem:
            self.query_one("#problem", Static).update(Content(problem))
            return
        self.dismiss(event.value)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question; Esc means no."""

    BINDINGS = [Binding("escape", "answer(False)", "No", show=False),
                Binding("y", "answer(True)", "Yes", show=False)]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self._question = question
        self._yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(Content(self._question), classes="dialog-title")
            with Horizontal(classes="buttons"):
                yield Button(self._yes, id="yes", variant="error")
                yield Button("Cancel", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class ChoiceDialog(ModalScreen[str | None]):
    """Pick one of a few named options (Enter picks, Esc cancels)."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel", show=False)]

    def __init__(self, title: str, choices: list[tuple[str, str]], current: str | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self._title = title
        self._choices = choices
        self._current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self._title, classes="dialog-title")
            yield OptionList(*(Option(f"{name}  —  {about}", id=name) for name, about in self._choices), id="choices")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        names = [name for name, _ in self._choices]
        if self._current in names:
            options.highlighted = names.index(self._current)
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
