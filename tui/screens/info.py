"""Read-only screens: the log files (the tail of each) and the key/command help."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, Log, Markdown, Select

from agent import logs, paths
from tui import bindings

TAIL_LINES = 400


def log_files() -> list[Path]:
    """certchat's own log first, then any other log in the logs dir (builds, …), newest first."""
    folder = paths.logs_dir()
    if not folder.is_dir():
        return []
    files = sorted((p for p in folder.glob("*.log") if p.is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    files.sort(key=lambda p: p.name != logs.log_file().name)
    return files


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            return handle.read().splitlines()[-lines:]
    except OSError as err:
        return [f"cannot read {path}: {err.strerror}"]


class LogsScreen(ModalScreen[None]):
    """The last lines of a log file; a selector switches between files."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Close", show=True)]

    def compose(self) -> ComposeResult:
        files = log_files()
        with Vertical(classes="dialog wide"):
            yield Label(Content(f"Logs — {paths.logs_dir()}"), classes="dialog-title")
            if files:
                yield Select([(p.name, str(p)) for p in files], value=str(files[0]), allow_blank=False, id="file")
            yield Log(id="log-view", highlight=False)

    def on_mount(self) -> None:
        files = log_files()
        view = self.query_one(Log)
        if files:
            view.write_lines(tail(files[0]))
        else:
            view.write_line(f"no log files yet in {paths.logs_dir()}")

    def on_select_changed(self, event: Select.Changed) -> None:
        view = self.query_one(Log)
        view.clear()
        view.write_lines(tail(Path(str(event.value))))


def help_markdown(overrides: dict[str, str]) -> str:
    rows = "\n".join(f"| `{bindings.key_for(k.id, overrides)}` | {k.description} | `{k.id}` |"
                     for k in bindings.ALL_KEYS)
    return f"""# certchat chat

Type a message and press **Enter**; **Shift+Enter** or **Ctrl+J** starts a new line.
**Esc** stops a reply (the partial answer is kept, marked *interrupted*).
**Ctrl+P** opens the command palette: every command below, plus policies, themes and more.

| key | command | binding id |
|---|---|---|
{rows}

Remap a key in the config file (`certchat` reads `$CERTCHAT_CONFIG` or `~/.config/certchat/config.toml`):

    keys = {{ new_chat = "ctrl+o", toggle_memory = "f4" }}

While the prompt has focus it keeps its editing keys (ctrl+a/e/k/u/w/x/c/v/z/y, f6, f7):
a command remapped onto one of those only works when the prompt is not focused.

## The memory panel (Ctrl+T)

- **cells**: KV cells holding tokens now, of those allocated; the budget is marked `│`. Under it, how
  much the chat may forget: the budget in force and the loss it is certified at on the model's long
  chats ("25% · certified ≤ 10% loss"), "not certified" for a budget of your own the model's record does
  not certify, or "full cache" where budget "auto" certifies none at the risk (config `risk`).
- **certificate per turn**: the error certificate of each answered turn; the `─` row is the
  gate threshold τ. A turn whose certificate reached τ re-read the evicted history from the log
  (marked `↻`, and noted in the chat as "re-read N tokens of history").
- **still cached per turn**: for every earlier turn, the share of the question and of the answer
  whose tokens are still in the cache.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Close", show=True)]

    def __init__(self, overrides: dict[str, str]) -> None:
        super().__init__()
        self._overrides = overrides

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Markdown(help_markdown(self._overrides), id="help-text")
