"""`certchat chat`: the Textual app, its start-up, and the commands it runs.

Start-up: open the log, show the chat screen at once, then load the model in a thread
worker (or, with no model installed, show the set-up screen that offers to pull one).
Every piece of model work (a turn, a reopen, a policy switch, a replay) runs in one
thread worker at a time through ``tui.backend``; what it reports comes back as
``AgentMessage``s and the chat screen renders them. Errors become notifications and
go to the log file (``agent.logs``, with llama.cpp's own lines) with their traceback; the screen never shows one.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from textual import on
from textual.app import App
from textual.message import Message

from agent import config as cfg
from agent import events as ev
from agent import logs, models, paths
from agent.config import Config
from memory_store.errors import StoreError
from memory_store.store import Store
from tui import backend as be
from tui import bindings, render, settings
from tui.commands import CertchatCommands, Command
from tui.screens.chat import ChatScreen
from tui.screens.dialogs import ChoiceDialog, ConfirmDialog, InputDialog
from tui.screens.info import HelpScreen, LogsScreen
from tui.screens.setup import SetupScreen
from tui.widgets.conversations import ConversationList, entries
from tui.widgets.prompt import PromptArea

log = logging.getLogger("certchat.tui")


# Actions that need the chat screen in front (not the set-up screen, not a dialog).
CHAT_ACTIONS = frozenset({
    "new_chat", "cancel_reply", "regenerate", "copy_last", "rename_chat", "delete_chat", "search_chats",
    "toggle_sidebar", "toggle_memory", "pick_policy", "set_budget", "set_gate", "export", "replay",
})


TURN_WORK = frozenset({"answering", "regenerating", "replaying"})


class AgentMessage(Message):
    """Something a worker reported (an agent event or a backend message)."""

    def __init__(self, payload: object) -> None:
        super().__init__()
        self.payload = payload


@dataclass(frozen=True)
class SettingsApplied:
    """The session took new settings; the app records and saves them."""

    config: Config
    changes: dict[str, Any]


@dataclass
class WorkDone(Message):
    what: str
    result: object


@dataclass
class ConversationsRead(Message):
    """The sidebar's rows, read from the log by a store worker (never on the UI thread)."""

    query: str
    sidebar: be.Sidebar


@dataclass
class WorkFailed(Message):
    what: str
    text: str
    severity: str


def describe(err: BaseException) -> tuple[str, str]:
    """(one-line message, severity) for an error that ended some work."""
    if isinstance(err, InterruptedError):
        return "cancelled before the answer started", "information"
    known = (ValueError, LookupError, StoreError, models.ModelError, OSError, RuntimeError)
    if isinstance(err, known) and str(err):
        return str(err).splitlines()[0], "error"
    return f"{type(err).__name__}: {err} (details: Ctrl+L shows the log)", "error"


class CertchatApp(App[int]):
    """The chat app; construct with a config (and in tests a temp DB and a model path)."""

    CSS_PATH = "tui.tcss"
    TITLE = "certchat"
    BINDINGS = bindings.bindings(bindings.APP_KEYS)
    COMMANDS = App.COMMANDS | {CertchatCommands}

    def __init__(self, config: Config, *, conversation_id: int | None = None, db_path: Path | None = None,
                 model_path: Path | None = None, config_path: Path | None = None,
                 save_settings: bool = True) -> None:
        super().__init__()
        self.config = config
        self.conversation_id = conversation_id
        self.db_path = db_path or paths.db_path()
        self.model_path = model_path
        self.config_path = config_path
        self.save_settings = save_settings
        self.backend: be.Backend | None = None
        self.store: Store | None = None
        self.busy: str | None = None
        self.cancel_event: threading.Event | None = None
        self.keymap_overrides: dict[str, str] = {}
        self.titles: dict[int, str] = {}
        """Conversation titles as the sidebar last read them."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Chat commands act (and show in the footer) only while the chat screen is on top."""
        if action in CHAT_ACTIONS:
            return isinstance(self.screen, ChatScreen)
        return True

    def notify(self, message: str, *, title: str = "", severity: Any = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Notifications show text literally: error messages and titles may contain [brackets]."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    # -- start-up --------------------------------------------------------------------------
    async def on_mount(self) -> None:
        logs.configure()
        if self.config.theme in self.available_themes:
            self.theme = self.config.theme
        else:
            self.notify(f"theme: unknown theme {self.config.theme!r}; using {self.theme}", severity="warning")
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.keymap_overrides, problems = bindings.keymap(self.config.keys)
        self.set_keymap(self.keymap_overrides)
        for warning in problems:
            self.notify(warning, severity="warning", timeout=30)
        try:
            self.store = Store(self.db_path)
        except (StoreError, OSError) as err:
            log.error("cannot open the log %s: %s", self.db_path, err)
            await self.push_screen(SetupScreen(str(err), title="certchat cannot open its conversation log"),
                                   callback=lambda _: self.exit(1))
            return
        await self.push_screen(ChatScreen(self._status_info("loading model…")))
        self.refresh_conversations()
        self.chat_screen.chat.loading = True
        path, problem, offer = self._locate_model()
        if problem is not None:
            await self.push_screen(SetupScreen(problem, offer=offer), callback=self._setup_done)
            return
        assert path is not None
        self._load(path)

    def _locate_model(self) -> tuple[Path | None, str | None, str | None]:
        """(path, problem, registry name to offer) for the configured model."""
        if self.model_path is not None:
            return self.model_path, None, None
        name = self.config.model
        if name in models.REGISTRY:
            if models.is_pulled(name):
                return models.model_file(name), None, None
            return None, f"The model **{name}** is not installed yet.", name
        path = Path(name).expanduser()
        if not path.exists():
            return None, f"The model file `{path}` does not exist.", models.DEFAULT_MODEL
        return path, None, None

    def _setup_done(self, path: Path | None) -> None:
        if path is None:
            self.exit(0)
            return
        self.model_path = path
        self._load(path)

    def _model_name(self, path: Path) -> str:
        return models.display_name(self.config.model, path)

    def _load(self, path: Path) -> None:
        assert self.store is not None
        self.backend = be.Backend(self.config, self.store, path, self._model_name(path))
        self.chat_screen.status.set(model=self.backend.model_name)
        self.busy = "loading the model"
        self.run_worker(self._load_in_thread, thread=True, group="model", exit_on_error=False)

    def _load_in_thread(self) -> None:
        assert self.backend is not None
        try:
            self.backend.load(self.conversation_id, self._emit)
        except Exception as err:  # any load failure ends up on the set-up screen, not as a traceback
            log.exception("loading %s failed", self.backend.model_path)
            self.call_from_thread(self._load_failed, err)
            return
        self.post_message(WorkDone("load", None))

    def _load_failed(self, err: BaseException) -> None:
        self.busy = None
        self.backend = None
        text, _ = describe(err)
        offer = models.DEFAULT_MODEL if isinstance(err, models.ModelError) else None
        self.push_screen(SetupScreen(f"Loading the model failed: {text}", offer=offer,
                                     title="certchat could not start the model"), callback=self._setup_done)

    # -- running model work ----------------------------------------------------------------
    def _emit(self, payload: object) -> None:
        """Called from worker threads: hand the payload to the UI's message queue."""
        self.post_message(AgentMessage(payload))

    def _start(self, what: str, job: Callable[[threading.Event], object]) -> bool:
        """Run ``job(cancel)`` in the model worker unless the model is busy or not loaded."""
        if self.backend is None or not self.backend.ready:
            self.notify("the model is still loading — a moment", severity="warning")
            return False
        if self.busy is not None:
            self.notify(f"busy {self.busy} — wait, or press Esc to stop it", severity="warning")
            return False
        self.busy = what
        cancel = threading.Event()
        self.cancel_event = cancel

        def body() -> None:
            try:
                result = job(cancel)
            except Exception as err:  # reported as a notification; the traceback goes to the log
                text, severity = describe(err)
                if severity == "error":
                    log.exception("%s failed", what)
                self.post_message(WorkFailed(what, text, severity))
                return
            self.post_message(WorkDone(what, result))

        self.chat_screen.status.set(phase=f"{what}…")
        self.run_worker(body, thread=True, group="model", exit_on_error=False)
        return True

    async def on_agent_message(self, message: AgentMessage) -> None:
        payload = message.payload
        screen = self.chat_screen
        if isinstance(payload, be.ConversationShown):
            self.conversation_id = payload.conversation_id
            self.refresh_conversations()
            screen.chat.loading = False
        elif isinstance(payload, be.TurnBegins):
            self.refresh_conversations()
        if isinstance(payload, ev.Notice):
            severity = {"warning": "warning", "error": "error"}.get(payload.level, "information")
            self.notify(payload.text, severity=severity)  # type: ignore[arg-type]
        elif isinstance(payload, ev.TurnFinished):
            self.refresh_conversations()
        try:
            await screen.apply(payload)
        except Exception as err:  # a rendering bug must not take the conversation down with it
            log.exception("showing %s failed", type(payload).__name__)
            self.notify(describe(err)[0], severity="error")

    def on_work_done(self, message: WorkDone) -> None:
        self.busy = None
        self.cancel_event = None
        screen = self.chat_screen
        screen.chat.loading = False
        if isinstance(message.result, SettingsApplied):
            self._settings_applied(message.result)
        if isinstance(message.result, be.ReplayFinished):
            r = message.result
            self.notify(f"replay {'stopped' if r.cancelled else 'finished'} after {r.turns} turns")
        if message.what not in TURN_WORK:
            screen.status.set(phase="ready")  # a turn leaves its own summary there instead

    async def on_work_failed(self, message: WorkFailed) -> None:
        self.busy = None
        self.cancel_event = None
        screen = self.chat_screen
        screen.chat.loading = False
        await screen.fail_answer(message.text)
        screen.status.set(phase=f"{message.what}: failed")
        self.notify(message.text, severity=message.severity, timeout=8)  # type: ignore[arg-type]
        self.refresh_conversations()

    # -- screens and widgets ---------------------------------------------------------------
    @property
    def chat_screen(self) -> ChatScreen:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                return screen
        raise LookupError("the chat screen is not open")

    def _status_info(self, phase: str) -> render.StatusInfo:
        c = self.config
        return render.StatusInfo(model=Path(c.model).stem if c.model not in models.REGISTRY else c.model,
                                 policy=c.policy, budget=c.budget, gate=c.gate, phase=phase)

    def refresh_conversations(self) -> None:
        if self.store is None:
            return
        try:
            screen = self.chat_screen
        except LookupError:
            return
        query = screen.sidebar.query_text.strip()
        store = self.store

        def read() -> None:
            try:
                self.post_message(ConversationsRead(query, be.read_sidebar(store, query)))
            except (StoreError, ValueError) as err:
                self.call_from_thread(self.notify, f"search: {err}", severity="warning")

        self.run_worker(read, thread=True, group="store", exit_on_error=False)

    @on(ConversationsRead)
    def _conversations_read(self, message: ConversationsRead) -> None:
        try:
            screen = self.chat_screen
        except LookupError:
            return
        if message.query != screen.sidebar.query_text.strip():
            return  # a newer search is on its way
        side = message.sidebar
        self.titles = {c.id: c.title for c in side.conversations}
        screen.sidebar.show(entries(side.conversations, side.hits, message.query), self.conversation_id)
        screen.set_title(self.titles.get(self.conversation_id, "") if self.conversation_id is not None else "")

    @on(ConversationList.SearchChanged)
    def _search_changed(self, _: ConversationList.SearchChanged) -> None:
        self.refresh_conversations()

    @on(ConversationList.Chosen)
    def _chosen(self, message: ConversationList.Chosen) -> None:
        if message.conversation_id == self.conversation_id:
            self.chat_screen.prompt.focus()
            return
        backend = self.backend
        if backend is None:
            return
        cid = message.conversation_id
        if self._start("re-reading the conversation", lambda _c: backend.open(cid, self._emit)):
            self.chat_screen.chat.loading = True
            self.chat_screen.prompt.focus()

    # -- sending ---------------------------------------------------------------------------
    @on(PromptArea.Submitted)
    def _submitted(self, message: PromptArea.Submitted) -> None:
        backend = self.backend
        if backend is None:
            self.notify("the model is still loading — a moment", severity="warning")
            return
        text = message.text
        if self._start("answering", lambda cancel: backend.send(text, self._emit, cancel)):
            message.prompt.clear()

    def action_cancel_reply(self) -> None:
        if self.cancel_event is not None and self.busy is not None:
            self.cancel_event.set()
            self.chat_screen.status.set(phase="stopping…")

    def action_regenerate(self) -> None:
        backend = self.backend
        if backend is None:
            return
        self._start("regenerating", lambda cancel: backend.regenerate(self._emit, cancel))

    def action_copy_last(self) -> None:
        answer = self.chat_screen.chat.last_answer()
        if answer is None or not answer.text:
            self.notify("no answer to copy yet", severity="warning")
            return
        answer.action_copy()

    # -- conversations -----------------------------------------------------------------------
    def action_new_chat(self) -> None:
        backend = self.backend
        if backend is None:
            return
        if self._start("starting a new chat", lambda _c: backend.new_conversation(self._emit)):
            self.chat_screen.prompt.focus()

    def action_rename_chat(self) -> None:
        if self.store is None or self.conversation_id is None:
            return
        cid = self.conversation_id
        current = self.titles.get(cid, "")
        store = self.store

        def rename(title: str) -> None:
            try:
                store.rename_conversation(cid, title)
            except (StoreError, ValueError) as err:
                self.call_from_thread(self.notify, f"rename: {err}", severity="warning")
            self.call_from_thread(self.refresh_conversations)

        def done(title: str | None) -> None:
            if title is not None:
                self.run_worker(lambda: rename(title.strip() or current), thread=True, group="store",
                                exit_on_error=False)

        self.push_screen(InputDialog("Rename chat", current,
                                     validate=lambda t: None if t.strip() else "a title cannot be empty"), done)

    def action_delete_chat(self) -> None:
        backend = self.backend
        if self.store is None or backend is None:
            return
        target = self.chat_screen.sidebar.highlighted_id() if self.focused_in_sidebar() else self.conversation_id
        if target is None:
            return
        title = self.titles.get(target, f"chat {target}")

        def done(yes: bool | None) -> None:
            if yes:
                self._start("deleting", lambda _c: backend.delete(target, self._emit))

        self.push_screen(ConfirmDialog(f"Delete “{title}” and its log?", yes="Delete"), done)

    def focused_in_sidebar(self) -> bool:
        focused = self.focused
        sidebar = self.chat_screen.sidebar
        return focused is not None and (focused is sidebar or sidebar in focused.ancestors)

    def action_search_chats(self) -> None:
        screen = self.chat_screen
        screen.query_one("#sidebar").display = True
        screen.sidebar.focus_search()

    def action_toggle_sidebar(self) -> None:
        self.chat_screen.toggle("sidebar")

    def action_toggle_memory(self) -> None:
        self.chat_screen.toggle("memory")

    # -- settings ----------------------------------------------------------------------------
    def reconfigure(self, **changes: Any) -> None:
        backend = self.backend
        if backend is None:
            return

        def job(_: threading.Event) -> object:
            return SettingsApplied(backend.reconfigure(self._emit, **changes), changes)

        self._start("switching settings", job)

    def _settings_applied(self, applied: SettingsApplied) -> None:
        self.config = applied.config
        changes = applied.changes
        self.chat_screen.status.set(**{k: v for k, v in changes.items() if k in ("policy", "budget", "gate")})
        if self.save_settings:
            problem = settings.persist(self.config_path, **changes)
            if problem:
                self.notify(problem, severity="warning")
        shown = ", ".join(f"{k} {v}" for k, v in changes.items())
        self.notify(f"{shown} from the next message on", timeout=3)

    def set_policy(self, policy: str) -> None:
        self.reconfigure(policy=policy)

    def action_pick_policy(self) -> None:
        choices = [(p, settings.POLICY_HELP.get(p, "")) for p in cfg.POLICIES]
        self.push_screen(ChoiceDialog("Eviction policy", choices, current=self.config.policy),
                         lambda p: self.set_policy(p) if p else None)

    def action_set_budget(self) -> None:
        self.push_screen(InputDialog("KV budget", self.config.budget,
                                     hint="'auto' (the budget certified for the risk), a token count (1024) or a "
                                          "share (10%)",
                                     validate=settings.budget_problem),
                         lambda v: self.reconfigure(budget=v.strip()) if v else None)

    def action_set_gate(self) -> None:
        self.push_screen(InputDialog("Gate threshold τ", self.config.gate,
                                     hint="a threshold (0.3), 'auto' for the calibrated default, or 'off'",
                                     validate=settings.gate_problem),
                         lambda v: self.reconfigure(gate=v.strip()) if v else None)

    def _theme_changed(self, theme: Any) -> None:
        name = getattr(theme, "name", str(theme))
        if name == self.config.theme:
            return
        self.config = self.config.replace(theme=name)
        if self.save_settings:
            problem = settings.persist(self.config_path, theme=name)
            if problem:
                self.notify(problem, severity="warning")

    # -- export, replay, logs, help -----------------------------------------------------------
    def action_export(self, fmt: str) -> None:
        if self.backend is None or self.store is None or self.conversation_id is None:
            return
        cid = self.conversation_id
        suffix = "md" if fmt == "markdown" else "jsonl"
        default = paths.data_dir() / "exports" / f"conversation-{cid}.{suffix}"
        backend = self.backend

        def done(value: str | None) -> None:
            if not value:
                return
            target = Path(value).expanduser()
            try:
                written = backend.export(cid, target, fmt)
            except (OSError, StoreError, ValueError) as err:
                self.notify(f"export failed: {err}", severity="error")
                return
            self.notify(f"exported to {written}")

        self.push_screen(InputDialog(f"Export as {fmt}", str(default), hint="file to write"), done)

    def action_replay(self) -> None:
        backend = self.backend
        if backend is None:
            return

        def check(value: str) -> str | None:
            path = Path(value).expanduser()
            return None if path.is_file() else f"no such file: {path}"

        def done(value: str | None) -> None:
            if value:
                path = Path(value).expanduser()
                self._start("replaying", lambda cancel: backend.replay(path, self._emit, cancel))

        self.push_screen(InputDialog("Replay a script (JSONL) into a new chat", "",
                                     hint="turn by turn: its replies as written, the model answers probes and "
                                          "unanswered lines; Esc stops", validate=check), done)

    def action_show_logs(self) -> None:
        self.push_screen(LogsScreen())

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap_overrides))

    # -- the palette ------------------------------------------------------------------------
    def palette_commands(self) -> list[Command]:
        """The palette's entries, in the order they are listed before anything is typed."""
        c = self.config

        def key(binding_id: str) -> str:
            return f" ({bindings.key_for(binding_id, self.keymap_overrides)})"

        cmds = [
            Command("New chat", "start a new conversation" + key("new_chat"), self.action_new_chat),
            Command("Rename chat", "rename the open conversation" + key("rename_chat"), self.action_rename_chat),
            Command("Delete chat", "delete the open conversation" + key("delete_chat"), self.action_delete_chat),
            Command("Search chats", "full-text search over every conversation" + key("search_chats"),
                    self.action_search_chats),
            Command("Regenerate last answer", "answer the last question again, in a branch" + key("regenerate"),
                    self.action_regenerate),
            Command("Copy last answer", "to the clipboard" + key("copy_last"), self.action_copy_last),
            Command("Cancel reply", "stop the answer being written" + key("cancel"), self.action_cancel_reply),
            Command("Toggle memory panel", "what the model still remembers" + key("toggle_memory"),
                    self.action_toggle_memory),
            Command("Toggle chat list", "the conversations sidebar" + key("toggle_sidebar"),
                    self.action_toggle_sidebar),
        ]
        for policy in cfg.POLICIES:
            mark = " — current" if policy == c.policy else ""
            cmds.append(Command(f"Policy: {policy}", settings.POLICY_HELP.get(policy, "") + mark,
                                functools.partial(self.reconfigure, policy=policy)))
        cmds.append(Command("Budget…", f"KV budget, now {c.budget}" + key("set_budget"), self.action_set_budget))
        cmds.append(Command("Budget: auto", f"the budget the model's record certifies for the risk ({c.risk})",
                            functools.partial(self.reconfigure, budget="auto")))
        for budget in ("10%", "25%", "50%"):
            cmds.append(Command(f"Budget: {budget}", "keep this share of the history",
                                functools.partial(self.reconfigure, budget=budget)))
        for risk in ("10%", "20%"):
            mark = " — current" if risk == c.risk else ""
            cmds.append(Command(f"Risk: {risk}", "the share of the full cache's right answers budget auto may lose"
                                + mark, functools.partial(self.reconfigure, risk=risk)))
        cmds.append(Command("Gate…", f"gate threshold τ, now {c.gate}" + key("set_gate"), self.action_set_gate))
        for gate, about in (("auto", "the calibrated default τ"), ("off", "never re-read the history")):
            cmds.append(Command(f"Gate: {gate}", about, functools.partial(self.reconfigure, gate=gate)))
        cmds += [
            Command("Export Markdown", "write the conversation as Markdown" + key("export_markdown"),
                    lambda: self.action_export("markdown")),
            Command("Export JSONL", "write the conversation as replay JSONL" + key("export_jsonl"),
                    lambda: self.action_export("jsonl")),
            Command("Replay a script", "a JSONL script into a new chat, turn by turn" + key("replay"),
                    self.action_replay),
            Command("Show logs", "certchat's log and the build logs" + key("show_logs"), self.action_show_logs),
            Command("Help", "keys, binding ids and the memory panel" + key("help"), self.action_help),
        ]
        return cmds

    # -- shutdown ------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()
        self.exit(0)

    def on_unmount(self) -> None:
        self._close_backend()

    def _close_backend(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()
        backend, self.backend = self.backend, None
        if backend is not None:
            # Waits (under the backend's lock) for a running turn to see the cancel and stop.
            backend.close()
        elif self.store is not None:
            self.store.close()
        self.store = None


def run(config: Config, conversation_id: int | None = None, db: Path | None = None) -> int:
    """Run the chat UI until the user quits; returns the exit status."""
    app = CertchatApp(config, conversation_id=conversation_id, db_path=db)
    result = app.run()
    return int(result) if result is not None else int(app.return_code or 0)
