"""Snapshot tests (pytest-textual-snapshot) of the main screens at two terminal sizes.

The chat screen opens a logged conversation whose turns carry certificates and gate
events, so the memory panel's chart, gate line, ↻ marks and retention bars are all on
screen; the model (SmolLM2-135M) really loads and re-reads the logged token ids.
Update after an intended change with ``pytest tests/test_tui_snapshots.py --snapshot-update``
and look at the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.config import Config
from memory_store.records import Turn
from memory_store.store import Store
from tui.app import CertchatApp
from tui.screens.setup import SetupScreen
from tui.testing import store_reading, wait_for

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((140, 40), id="140x40")]

QUESTIONS = ["My cat is called Purrnickel.", "I live in Tromsø, up north.", "What is the capital of Peru?",
             "Tell me a fact about owls.", "What is my cat called?"]
ANSWERS = ["Noted: your cat is **Purrnickel**.", "Tromsø — lovely northern lights.", "Lima.",
           "Owls can rotate their heads about 270°.", "Your cat is called *Purrnickel*."]
CERTS = [0.08, 0.12, 0.21, 0.27, 0.44]


def _logged_conversation(db: Path) -> int:
    """A five-turn conversation with exact token ids, certificates and one gate event."""
    store = Store(db)
    items: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant.",
                                    "tokens": list(range(200, 212)), "first_pos": 0}]
    pos = 12
    for n, (q, a) in enumerate(zip(QUESTIONS, ANSWERS)):
        for role, text in (("user", q), ("assistant", a)):
            tokens = [300 + (7 * n + k) % 500 for k in range(10 + 3 * n)]
            items.append({"role": role, "content": text, "tokens": tokens, "first_pos": pos})
            pos += len(tokens)
    conv = store.import_messages("Cats and places", items, model="smollm2-135m")
    answers = [m for m in store.messages(conv.id) if m.role == "assistant"]
    for cert, message in zip(CERTS, answers):
        fired = cert >= 0.3
        store.record_turn(Turn(conversation_id=conv.id, message_id=message.id, policy="poisson", gate_stat=cert,
                               gate_threshold=0.3, gate_fired=fired, reprefill_tokens=164 if fired else 0))
    store.import_messages("Another chat", [{"role": "user", "content": "hello"}])
    store.close()
    return conv.id


def _app(tmp_path: Path, small_model: Path, conversation_id: int | None) -> CertchatApp:
    config = Config().replace(model="smollm2-135m", n_ctx=1024, n_batch=256, max_tokens=16, threads=1,
                              policy="full", gate="0.3", theme="textual-dark")
    return CertchatApp(config, conversation_id=conversation_id, db_path=tmp_path / "chat.db",
                       model_path=small_model, config_path=tmp_path / "config.toml", save_settings=False)


async def _ready(pilot: Any) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.backend is not None and app.backend.ready and app.busy is None
                   and not store_reading(app), what="model loaded")
    _still_cursors(app)
    await pilot.pause(0.5)


def _still_cursors(app: Any) -> None:
    """Blinking cursors would make the picture depend on the moment it is taken."""
    from textual.widgets import Input, TextArea  # noqa: PLC0415

    for widget in app.screen.query("Input, TextArea"):
        if isinstance(widget, (Input, TextArea)):
            widget.cursor_blink = False


@pytest.mark.parametrize("size", SIZES)
def test_chat_screen_with_memory_panel(snap_compare: Any, tmp_path: Path, small_model: Path,
                                       size: tuple[int, int]) -> None:
    app = _app(tmp_path, small_model, _logged_conversation(tmp_path / "chat.db"))
    assert snap_compare(app, terminal_size=size, run_before=_ready)


@pytest.mark.parametrize("size", SIZES)
def test_command_palette(snap_compare: Any, tmp_path: Path, small_model: Path, size: tuple[int, int]) -> None:
    app = _app(tmp_path, small_model, _logged_conversation(tmp_path / "chat.db"))

    async def open_palette(pilot: Any) -> None:
        await _ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.press(*"policy")
        await pilot.pause(0.5)
        _still_cursors(pilot.app)
        await pilot.pause(1.0)

    assert snap_compare(app, terminal_size=size, run_before=open_palette)


@pytest.mark.parametrize("size", SIZES)
def test_first_run_screen(snap_compare: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          size: tuple[int, int]) -> None:
    monkeypatch.setenv("CERTCHAT_CACHE_DIR", str(tmp_path / "empty-cache"))
    app = CertchatApp(Config().replace(model="smollm2-135m"), db_path=tmp_path / "chat.db", save_settings=False)

    async def setup_shown(pilot: Any) -> None:
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SetupScreen), what="set-up screen")
        await pilot.pause(0.5)

    assert snap_compare(app, terminal_size=size, run_before=setup_shown)
