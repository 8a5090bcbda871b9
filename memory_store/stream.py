"""Streaming an assistant answer into the log while it is generated.

``append`` only touches memory, so the decode loop never waits on disk. A
background thread with its own connection commits the partial content and
tokens every ``commit_interval`` seconds (0.5 s by default, so never more than
~1 s of an answer is lost to a kill -9) and refreshes the writer's heartbeat
even when nothing new arrived (a long re-prefill mid-answer is not mistaken
for a dead process). ``finish`` marks the message complete; ``cancel``, an
exception or Ctrl-C inside the ``with`` block marks it interrupted — always
with everything appended so far committed.
"""

from __future__ import annotations

import atexit
import sqlite3
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol

import numpy as np

from memory_store import liveness
from memory_store.errors import StoreError, StreamLostError
from memory_store.records import Message
from memory_store.tokens import as_token_array


class StreamHost(Protocol):
    """What a stream needs of the store that opened it (``memory_store.store.Store``)."""

    key: str
    _streams: dict[int, AssistantStream]

    def _side_connection(self) -> sqlite3.Connection: ...

    def _close_side_connection(self, conn: sqlite3.Connection) -> None: ...

    def _stream_writer(self, conn: sqlite3.Connection | None) -> Callable[..., None]: ...

    def get_message(self, message_id: int) -> Message: ...

_INT32_MAX = 2**31 - 1

# Streams still open when the interpreter exits normally (an unhandled
# exception, sys.exit) are committed as interrupted right away; a process
# killed outright leaves them partial until the next open marks them.
_open_streams: weakref.WeakSet[AssistantStream] = weakref.WeakSet()


@atexit.register
def _interrupt_open_streams() -> None:
    for stream in list(_open_streams):
        try:
            stream.cancel()
        except Exception:
            pass  # the next open marks it interrupted instead


def check_text(text: str, what: str) -> None:
    """Reject text SQLite cannot store exactly (lone surrogates do not encode to UTF-8)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode (lone surrogate at offset {error.start}); "
            "decode model output with errors='replace'"
        ) from None


class AssistantStream:
    """A partial assistant message being written; use as a context manager."""

    def __init__(
        self,
        store: StreamHost,
        message: Message,
        *,
        commit_interval: float,
        writer: liveness.Writer,
    ) -> None:
        if not 0 < commit_interval <= 1.0:
            raise ValueError(
                "commit_interval must be in (0, 1] seconds: partial answers are committed at least every second"
            )
        self._store = store
        self._message = message
        self._interval = commit_interval
        self._writer = writer
        self._lock = threading.Lock()
        self._chunks: list[str] = []
        self._tokens = array("i")
        self._first_pos = message.first_pos
        self._version = 0
        self._lost: StreamLostError | None = None
        self.last_flush_error: BaseException | None = None
        self._result: Message | None = None
        self._stop = threading.Event()
        liveness.register_active((store.key, message.id))
        self._thread = threading.Thread(target=self._run, name=f"certchat-stream-{message.id}", daemon=True)
        self._thread.start()
        _open_streams.add(self)

    # -- what the decode loop calls -------------------------------------------------

    @property
    def message_id(self) -> int:
        return self._message.id

    @property
    def conversation_id(self) -> int:
        return self._message.conversation_id

    @property
    def index(self) -> int:
        return self._message.index

    @property
    def content(self) -> str:
        with self._lock:
            return "".join(self._chunks)

    @property
    def tokens(self) -> np.ndarray:
        with self._lock:
            return np.frombuffer(self._tokens.tobytes(), dtype=np.int32).copy()

    @property
    def closed(self) -> bool:
        """Finished, cancelled, or lost (its row was deleted)."""
        return self._result is not None or (self._lost is not None and not self._thread.is_alive())

    def append(self, delta: str = "", tokens: Sequence[int] | np.ndarray = ()) -> None:
        """Add generated text and/or the token ids fed to the model for it."""
        self._check_open()
        check_text(delta, "assistant delta")
        if isinstance(tokens, np.ndarray) or len(tokens) > 8:
            ids: Sequence[int] = as_token_array(tokens).tolist()
        else:
            ids = tokens
            for t in ids:
                if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t <= _INT32_MAX:
                    raise ValueError(f"token id {t!r} is not an integer in [0, 2^31)")
        with self._lock:
            if delta:
                self._chunks.append(delta)
            if len(ids):
                self._tokens.extend(int(t) for t in ids)
            self._version += 1

    def set_first_position(self, first_pos: int) -> None:
        """Position of this message's first token, when known only after the stream began."""
        self._check_open()
        if first_pos < 0:
            raise ValueError("first_pos must be >= 0")
        with self._lock:
            self._first_pos = int(first_pos)
            self._version += 1

    def finish(self) -> Message:
        """Commit everything and mark the answer complete."""
        return self._close("complete")

    def cancel(self) -> Message:
        """Commit everything appended so far and mark the answer interrupted."""
        return self._close("interrupted")

    def __enter__(self) -> AssistantStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.closed:
            return
        if exc is None:
            self.finish()
            return
        try:
            self.cancel()
        except Exception as error:  # the original exception matters more
            exc.add_note(f"certchat: could not mark the answer interrupted: {error}")

    # -- internals ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._result is not None:
            raise StoreError(f"assistant message {self._message.id} is already {self._result.status}")
        if self._lost is not None:
            raise self._lost

    def _snapshot(self) -> tuple[int, str, bytes, int | None]:
        with self._lock:
            content = "".join(self._chunks)
            # Keep one chunk, so the next join costs only the new deltas.
            self._chunks = [content] if content else []
            return self._version, content, self._tokens.tobytes(), self._first_pos

    def _flush(self, write: Callable[..., None], status: str) -> int:
        version, content, blob, first_pos = self._snapshot()
        # array('i') is native-endian int32; the log stores little-endian.
        if not np.little_endian:
            blob = np.frombuffer(blob, dtype=np.int32).astype("<i4").tobytes()
        write(self._message.id, content, blob, first_pos, status, self._writer, time.time())
        return version

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        flushed = 0
        last_write = time.monotonic()
        try:
            while not self._stop.wait(self._interval):
                now = time.monotonic()
                if self._version == flushed and now - last_write < liveness.HEARTBEAT_S:
                    continue
                try:
                    if conn is None:
                        conn = self._store._side_connection()
                    flushed = self._flush(self._store._stream_writer(conn), "partial")
                    last_write = now
                    self.last_flush_error = None
                except StreamLostError as error:
                    self._lost = error
                    return
                except StoreError as error:
                    # Transient (a peer held the lock past busy_timeout): retry next tick.
                    self.last_flush_error = error
        except BaseException as error:  # the thread must not die silently
            self.last_flush_error = error
        finally:
            if conn is not None:
                try:
                    self._store._close_side_connection(conn)
                except BaseException as error:
                    self.last_flush_error = error

    def _close(self, status: str) -> Message:
        if self._result is not None:
            return self._result
        if self._lost is not None and not self._thread.is_alive():
            raise self._lost
        self._stop.set()
        self._thread.join()
        try:
            if self._lost is not None:
                raise self._lost
            self._flush(self._store._stream_writer(None), status)
        except StreamLostError as error:
            # Nothing left to write to: the stream is over either way.
            self._lost = error
            self._store._streams.pop(self._message.id, None)
            liveness.unregister_active((self._store.key, self._message.id))
            _open_streams.discard(self)
            raise
        # Any other failure leaves the stream open, so finish()/cancel() can be retried.
        liveness.unregister_active((self._store.key, self._message.id))
        _open_streams.discard(self)
        self._result = self._store.get_message(self._message.id)
        return self._result
