"""Helpers for driving the app in tests: the screen as plain text, waiting on the model."""

from __future__ import annotations

import io
import time
from typing import Callable

from rich.console import Console
from textual import events
from textual.app import App
from textual.pilot import Pilot


def screen_text(app: App[object]) -> str:
    """What the terminal shows now, as plain text (one line per row)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def wait_for(pilot: Pilot[object], condition: Callable[[], bool], timeout: float = 180.0,
                   what: str = "condition") -> float:
    """Pause the pilot until ``condition()`` holds; returns the seconds it took."""
    start = time.perf_counter()
    while not condition():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        await pilot.pause(0.05)
    return time.perf_counter() - start


def store_reading(app: App[object]) -> bool:
    """Whether a store worker (the sidebar's reads, a rename) is still running."""
    return any(w.group == "store" and not w.is_finished for w in app.workers)


def type_nowait(app: App[object], text: str) -> None:
    """Queue key presses for ``text`` as a terminal would, without waiting for the app to idle.

    ``Pilot.press`` waits for the whole process to go idle after every key, which never
    happens while a worker thread decodes; this is how to type *during* model work.
    """
    driver = app._driver
    assert driver is not None
    for char in text:
        event = events.Key(char if char.isalnum() else "space" if char == " " else char, char)
        event.set_sender(app)
        driver.send_message(event)
