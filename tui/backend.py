"""The agent side of the chat UI: one ChatSession driven from worker threads.

Everything here blocks — loading the model, prefilling, decoding, re-reading a reopened
conversation — so the app calls it from Textual thread workers. Results and progress go
back through ``emit``, a thread-safe callable (the app's ``post_message``); nothing here
imports Textual. One lock serialises all model work because a ChatSession is not
thread-safe; the app also refuses to start model work while some is running.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent import events as ev
from agent.chat import saved_state
from agent.chat.session import ChatSession
from agent.config import Config
from memory_store import export
from memory_store.records import Message, Turn
from memory_store.store import Store

Emit = Callable[[object], None]

NEW_TITLE = "New chat"
TITLE_CHARS = 48


@dataclass(frozen=True)
class TurnBegins:
    """A user message is about to be answered (the UI mounts it and an empty answer)."""

    text: str
    replay_step: int | None = None
    replay_total: int | None = None


@dataclass(frozen=True)
class ConversationShown:
    """The session now holds this conversation; the UI shows its log and memory."""

    conversation_id: int
    messages: list[Message]
    turns: list[Turn]
    memory: ev.MemoryView


@dataclass(frozen=True)
class MemoryChanged:
    """The memory view after a change outside a turn (policy switch, reopen)."""

    memory: ev.MemoryView


@dataclass(frozen=True)
class Sidebar:
    """The conversations the sidebar lists, and the search hits for its query (None: no query)."""

    conversations: list[Any]
    hits: list[Any] | None


def read_sidebar(store: Store, query: str) -> Sidebar:
    """Read the sidebar's rows from the log (blocks: call it from a worker thread)."""
    return Sidebar(store.list_conversations(), store.search(query) if query else None)


@dataclass(frozen=True)
class ReplayFinished:
    conversation_id: int
    turns: int
    cancelled: bool


@dataclass
class Backend:
    """The store and the session (which owns the model) of one running app."""

    config: Config
    store: Store
    model_path: Path
    model_name: str
    session: ChatSession | None = None
    created: set[int] = field(default_factory=set)
    """Conversations this app created: dropped again if left without a user message."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    # -- start and stop -------------------------------------------------------------------
    def load(self, conversation_id: int | None, emit: Emit) -> None:
        """Load the model (seconds) and open or start a conversation."""
        with self.lock:
            self.session = ChatSession.start(self.config, self.store, self.model_path, self.model_name,
                                             conversation_id=conversation_id)
            if conversation_id is None:
                self.created.add(self.session.conversation_id)
            emit(self._shown())

    def close(self) -> None:
        """Free the model and close the log (an unanswered new chat is dropped)."""
        with self.lock:
            if self.session is not None:
                self._drop_if_empty(self.session.conversation_id)
                self.session.close()
                self.session = None
            self.store.close()

    @property
    def ready(self) -> bool:
        return self.session is not None

    def _session(self) -> ChatSession:
        if self.session is None:
            raise RuntimeError("the model is still loading")
        return self.session

    # -- conversations --------------------------------------------------------------------
    def _shown(self) -> ConversationShown:
        s = self._session()
        cid = s.conversation_id
        return ConversationShown(cid, self.store.messages(cid), self.store.turns(cid), s.memory_view())

    def _drop_if_empty(self, conversation_id: int) -> None:
        if conversation_id not in self.created:
            return
        self.created.discard(conversation_id)
        try:
            if not any(m.role == "user" for m in self.store.messages(conversation_id)):
                self.store.delete_conversation(conversation_id)
        except LookupError:
            pass  # already deleted from the list

    def new_conversation(self, emit: Emit) -> int:
        with self.lock:
            s = self._session()
            self._drop_if_empty(s.conversation_id)
            cid = s.new_conversation(title=NEW_TITLE)
            self.created.add(cid)
            emit(self._shown())
            return cid

    def open(self, conversation_id: int, emit: Emit) -> None:
        """Switch to a logged conversation: its exact tokens are re-read into the cache."""
        with self.lock:
            s = self._session()
            if conversation_id != s.conversation_id:
                self._drop_if_empty(s.conversation_id)
            s.open(conversation_id, on_event=emit)
            emit(self._shown())

    def delete(self, conversation_id: int, emit: Emit) -> None:
        """Delete a conversation; if it is the open one, a new chat takes its place."""
        with self.lock:
            s = self._session()
            self.created.discard(conversation_id)
            self.store.delete_conversation(conversation_id)
            saved_state.discard(self.store.path, conversation_id)
            if s.conversation_id == conversation_id:
                cid = s.new_conversation(title=NEW_TITLE)
                self.created.add(cid)
                emit(self._shown())

    # -- settings -------------------------------------------------------------------------
    def reconfigure(self, emit: Emit, **changes: Any) -> Config:
        with self.lock:
            s = self._session()
            s.reconfigure(**changes)
            self.config = s.config
            emit(MemoryChanged(s.memory_view()))
            return self.config

    # -- turns ----------------------------------------------------------------------------
    def send(self, text: str, emit: Emit, cancel: threading.Event,
             replay: tuple[int, int] | None = None) -> ev.TurnResult:
        with self.lock:
            return self._send(text, emit, cancel, replay)

    def _send(self, text: str, emit: Emit, cancel: threading.Event,
              replay: tuple[int, int] | None) -> ev.TurnResult:
        s = self._session()
        emit(TurnBegins(text, *(replay or (None, None))))
        self._title_from(text)
        try:
            return s.send(text, on_event=emit, cancel=cancel)
        except InterruptedError:
            # Cancelled during the prefill: the session took the message's tokens back out of
            # the cache and marked it unanswered in the log; show the log as it now stands.
            emit(self._shown())
            raise

    def _title_from(self, text: str) -> None:
        cid = self._session().conversation_id
        if self.store.get_conversation(cid).title != NEW_TITLE:
            return
        first = " ".join(text.strip().split())
        title = first if len(first) <= TITLE_CHARS else first[: TITLE_CHARS - 1].rstrip() + "…"
        if title:
            self.store.rename_conversation(cid, title)

    def regenerate(self, emit: Emit, cancel: threading.Event) -> ev.TurnResult:
        """Answer the last user message again, as a branch without the old answer.

        The log has no way to withdraw a message, so the branch is a new conversation that
        holds the history up to the last user message (with its exact token ids); the
        original is kept unchanged.
        """
        with self.lock:
            s = self._session()
            source = s.conversation_id
            messages = self.store.messages(source)
            users = [i for i, m in enumerate(messages) if m.role == "user"]
            if not users:
                raise LookupError("nothing to regenerate: this conversation has no question yet")
            last = users[-1]
            title = self.store.get_conversation(source).title
            branch = self.store.import_messages(
                f"{title} (regenerated)", [_message_item(m) for m in messages[:last]],
                model=self.model_name, settings={"policy": self.config.policy, "budget": self.config.budget,
                                                 "branched_from": source})
            s.open(branch.id)
            emit(self._shown())
            return self._send(messages[last].content, emit, cancel, None)

    def replay(self, path: Path, emit: Emit, cancel: threading.Event) -> ReplayFinished:
        """Replay a script into a new conversation, one turn per user line: a reply the script gives enters as
        written (teacher-forced, as ``certchat replay`` does, so a long script goes in at the cost of reading it);
        the model answers a probe, and a user line the script leaves unanswered."""
        header, items = export.read_jsonl(path)
        turns = replay_turns(items)
        if not turns:
            raise ValueError(f"{path}: the script has no user lines to replay")
        system = next((item["content"] for item in items if item["role"] == "system"), None)
        title = header.get("title") if isinstance(header.get("title"), str) else path.stem
        with self.lock:
            s = self._session()
            self._drop_if_empty(s.conversation_id)
            if system is not None and system != s.config.system_prompt:
                previous = s.config.system_prompt
                s.reconfigure(system_prompt=system)
                try:
                    cid = s.new_conversation(title=f"replay: {title}")
                finally:
                    s.reconfigure(system_prompt=previous)
            else:
                cid = s.new_conversation(title=f"replay: {title}")
            emit(self._shown())
            done = 0
            for n, (text, reply) in enumerate(turns, start=1):
                if cancel.is_set():
                    break
                if reply is None:
                    self._send(text, emit, cancel, (n, len(turns)))
                else:
                    self._as_written(text, reply, emit, cancel, (n, len(turns)))
                done = n
            return ReplayFinished(cid, done, cancelled=done < len(turns))

    def _as_written(self, text: str, reply: str, emit: Emit, cancel: threading.Event,
                    replay: tuple[int, int]) -> ev.TurnResult:
        """One scripted turn: ``text`` read (evicting and gating as a live turn does), ``reply`` its answer."""
        s = self._session()
        emit(TurnBegins(text, *replay))
        self._title_from(text)
        try:
            turn = s.begin_turn(text, on_event=emit, cancel=cancel)
        except InterruptedError:
            emit(self._shown())  # as a cancelled send: the message is logged unanswered
            raise
        s.force_answer(turn, reply)
        emit(ev.TextDelta(reply))
        return s.finish_turn(turn, on_event=emit)

    # -- reading ----------------------------------------------------------------------------
    def export(self, conversation_id: int, path: Path, fmt: str) -> Path:
        """Write a conversation as Markdown or replay JSONL (the log is read, not the model)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            if fmt == "markdown":
                export.export_markdown(self.store, conversation_id, out)
            elif fmt == "jsonl":
                export.export_jsonl(self.store, conversation_id, out)
            else:
                raise ValueError(f"unknown export format {fmt!r} (markdown or jsonl)")
        return path


def replay_turns(items: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """A script's turns: each user line with the reply that follows it, or None where the model is to answer (a
    probe or an independent line, whose scripted answer is set aside, or a line with no reply)."""
    turns: list[tuple[str, str | None]] = []
    for i, item in enumerate(items):
        if item["role"] != "user":
            continue
        after = items[i + 1] if i + 1 < len(items) else None
        meta = item.get("meta") or {}
        asked = "probe" in meta or bool(meta.get("independent"))
        reply = after["content"] if after is not None and after["role"] == "assistant" and not asked else None
        turns.append((item["content"], reply))
    return turns


def _message_item(m: Message) -> dict[str, Any]:
    """A logged message as ``Store.import_messages`` takes it back (exact tokens kept)."""
    item: dict[str, Any] = {"role": m.role, "content": m.content, "status": m.status, "meta": dict(m.meta)}
    if m.tokens is not None:
        item["tokens"] = [int(t) for t in m.tokens]
        item["first_pos"] = m.first_pos
    return item
