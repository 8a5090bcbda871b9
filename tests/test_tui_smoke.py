"""Smoke test: `certchat chat` in a real terminal (tmux), a typed message, the reply read off the screen.

The console script runs as a user would start it, in a private tmux server with its
own data and config dirs; the test types through ``tmux send-keys`` and reads the
screen with ``tmux capture-pane``. The reply on screen is checked against the log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from memory_store.store import Store

TMUX = shutil.which("tmux")
CERTCHAT = Path(sys.executable).with_name("certchat")

pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed")


class Terminal:
    """One tmux session on a private server socket."""

    def __init__(self, socket: str, name: str) -> None:
        self.socket = socket
        self.name = name

    def tmux(self, *args: str) -> str:
        assert TMUX is not None
        out = subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=30)
        return out.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def wait(self, condition: Callable[[str], bool], what: str, timeout: float = 180.0) -> str:
        start = time.monotonic()
        while True:
            text = self.screen()
            if condition(text):
                return text
            if time.monotonic() - start > timeout:
                size = self.tmux("display", "-p", "-t", self.name, "#{window_width}x#{window_height}").strip()
                raise AssertionError(f"{what} not on screen within {timeout:.0f} s ({size}); screen:\n{text}")
            time.sleep(0.25)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    term = Terminal(socket=f"certchat-smoke-{os.getpid()}", name="chat")
    yield term
    term.tmux("kill-server")
    # tmux leaves the socket file behind once its last session has ended by itself.
    socket_dir = Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}"
    (socket_dir / term.socket).unlink(missing_ok=True)


def test_certchat_chat_in_tmux(terminal: Terminal, tmp_path: Path, small_model: Path) -> None:
    if not CERTCHAT.exists():
        pytest.fail(f"{CERTCHAT} is missing: install the project into the venv (pip install -e .)")
    db = tmp_path / "chat.db"
    status = tmp_path / "exit-status"
    env = {"CERTCHAT_DATA_DIR": str(tmp_path / "data"), "CERTCHAT_CONFIG": str(tmp_path / "config.toml"),
           "TERM": "xterm-256color"}
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    # COLUMNS/LINES leak in from the test process (set to 80×24 there) and would override the pane size.
    command = (f"env -u COLUMNS -u LINES {exports} {CERTCHAT} chat --model {small_model} --n-ctx 1024 "
               f"--max-tokens 24 --threads 1 --policy full --gate off --db {db}; echo $? > {status}")
    terminal.tmux("new-session", "-d", "-s", terminal.name, "-x", "110", "-y", "32", command)

    terminal.wait(lambda s: "/1024 cells" in s and "policy full" in s, "the loaded model")
    terminal.keys("Hello! Who are you?")
    terminal.keys("Enter")
    screen = terminal.wait(lambda s: "done:" in s or "stopped at max_tokens" in s, "the finished reply")

    with Store(db) as store:
        conversation = store.list_conversations()[0]
        answer = store.messages(conversation.id)[-1]
    assert answer.role == "assistant" and answer.status == "complete" and answer.content.strip()
    assert "Hello! Who are you?" in screen
    # The reply is on screen: its first words, as the Markdown renders them (wrapped lines joined).
    flat = " ".join(screen.split())
    first_words = " ".join(answer.content.split()[:3]).replace("*", "").replace("`", "")
    assert first_words in flat, f"{first_words!r} not on screen:\n{screen}"
    assert "Traceback" not in screen

    terminal.keys("C-q")
    deadline = time.monotonic() + 60
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert status.exists(), "certchat chat did not exit on Ctrl+Q"
    assert status.read_text().strip() == "0"
