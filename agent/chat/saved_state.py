"""Saved chat states on disk: what a conversation's next turn needs, so that reopening it resumes.

A state is one file per conversation in a folder beside the log (``<db stem>-states/``). It holds the
sequence's KV cells as llama.cpp serialises them, and what describes them: the engine's mirror (positions,
tokens, messages, cumulative log π, message spans), the evicted-key sketch, the cache manager's round,
history length and attention readings, and the gate's baselines and recent statistics. Only what the
budget keeps is saved, so a state is the budget's share of a full cache plus the sketch.

The file is written atomically (a temporary file, fsync, rename, fsync of the folder), so a process killed
while writing leaves the previous state or none. It starts with a JSON header (the key, the metadata, each
array's place) and the SHA-256 of the body, so a truncated or damaged file is refused, never loaded. Its
key is everything that shapes the cache: the GGUF's hash, the patch level, the cache's settings. A state is
never the source of truth: the session checks it against the log before using it, and deleting every
state loses nothing but time. States are pruned least-recently-used under a disk budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

MAGIC = b"certchat-state\x00\x00"
VERSION = 1
SUFFIX = ".state"
_LEN = struct.Struct("<Q")


class StateError(ValueError):
    """A saved state that cannot be used; the message says why in a few words (shown to the user)."""


@dataclass(frozen=True)
class SavedState:
    """One conversation's saved state: its key, its metadata (JSON-able) and its arrays."""

    key: dict[str, Any]
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def state_dir(db_path: Path) -> Path:
    """The folder of a log's saved states: beside the database file, named after it."""
    db_path = Path(db_path)
    return db_path.with_name(f"{db_path.stem}-states")


def key_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The key fields whose values differ, in words ("budget 10% → 25%")."""
    out = []
    for name in sorted(set(saved) | set(wanted)):
        a, b = saved.get(name), wanted.get(name)
        if a != b:
            width = 12 if name in ("model", "patch") else None  # hashes: their first digits tell them apart
            out.append(f"{name} {str(a)[:width]} → {str(b)[:width]}")
    return out


def _encode(state: SavedState) -> tuple[bytes, list[memoryview]]:
    """The header and the body's parts (the arrays' bytes, in order)."""
    specs, parts, offset = [], [], 0
    digest = hashlib.sha256()
    for name, array in state.arrays.items():
        a = np.ascontiguousarray(array)
        if a.dtype.hasobject:
            raise TypeError(f"saved state array {name!r} holds Python objects")
        view = memoryview(a.data).cast("B") if a.size else memoryview(b"")
        specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                      "nbytes": a.nbytes})
        digest.update(view)
        parts.append(view)
        offset += a.nbytes
    header = {"version": VERSION, "key": state.key, "meta": state.meta, "arrays": specs,
              "body_bytes": offset, "body_sha256": digest.hexdigest()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return MAGIC + _LEN.pack(len(raw)) + raw, parts


def write(path: Path, state: SavedState) -> int:
    """Write ``state`` to ``path`` atomically; returns the file's size in bytes."""
    head, parts = _encode(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head)
            for part in parts:
                out.write(part)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path.stat().st_size


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: Path) -> dict[str, Any]:
    """The header of the state at ``path`` (``StateError`` if it is not a readable state)."""
    with path.open("rb") as handle:
        return _header(handle.read(len(MAGIC) + _LEN.size), handle)


def _header(start: bytes, handle: Any) -> dict[str, Any]:
    if len(start) < len(MAGIC) + _LEN.size or not start.startswith(MAGIC):
        raise StateError("not a certchat state file")
    (n,) = _LEN.unpack(start[len(MAGIC):])
    raw = handle.read(n)
    if len(raw) != n:
        raise StateError("the file is truncated")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise StateError("its header is damaged") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise StateError(f"it was written by another version of certchat (format {header.get('version')!r})"
                         if isinstance(header, dict) else "its header is damaged")
    return header


def read(path: Path) -> SavedState:
    """The state at ``path``, its body checked against the header's SHA-256 (``StateError`` says why not)."""
    with path.open("rb") as handle:
        header = _header(handle.read(len(MAGIC) + _LEN.size), handle)
        body = handle.read()
    try:
        size, want = int(header["body_bytes"]), str(header["body_sha256"])
        specs = list(header["arrays"])
    except (KeyError, TypeError, ValueError):
        raise StateError("its header is damaged") from None
    if len(body) < size:
        raise StateError("the file is truncated")
    if len(body) > size or hashlib.sha256(body).hexdigest() != want:
        raise StateError("the file is damaged (its checksum does not match)")
    arrays: dict[str, np.ndarray] = {}
    try:
        for spec in specs:
            dtype = np.dtype(spec["dtype"])
            start, nbytes = int(spec["offset"]), int(spec["nbytes"])
            arrays[str(spec["name"])] = np.frombuffer(body, dtype=dtype, count=nbytes // dtype.itemsize,
                                                      offset=start).reshape(spec["shape"]).copy()
    except (KeyError, TypeError, ValueError):
        raise StateError("its header is damaged") from None
    return SavedState(dict(header.get("key", {})), dict(header.get("meta", {})), arrays)


@dataclass(frozen=True)
class StateInfo:
    conversation_id: int
    path: Path
    size: int
    used: float
    """When it was last written or resumed from (its mtime)."""


class SavedStates:
    """The saved states of one log: one file per conversation, pruned least-recently-used under ``budget``
    bytes (0: nothing is saved)."""

    def __init__(self, folder: Path, budget: int = 0) -> None:
        self.folder = Path(folder)
        self.budget = int(budget)

    @classmethod
    def beside(cls, db_path: Path, budget_mb: int = 0) -> "SavedStates":
        """The states of the log at ``db_path``; without a budget, only to list, load and delete them (a save would
        prune them all)."""
        return cls(state_dir(db_path), budget_mb * 1024 * 1024)

    def path(self, conversation_id: int) -> Path:
        return self.folder / f"conversation-{int(conversation_id)}{SUFFIX}"

    def save(self, conversation_id: int, state: SavedState) -> int:
        """Write the conversation's state (replacing the previous one), then prune; returns its size."""
        size = write(self.path(conversation_id), state)
        self.prune(keep=conversation_id)
        return size

    def load(self, conversation_id: int) -> SavedState:
        """The conversation's state, marked as just used (``StateError`` with the reason when there is none or it
        cannot be read)."""
        path = self.path(conversation_id)
        if not path.exists():
            raise StateError("no saved state")
        try:
            state = read(path)
        except OSError as err:
            raise StateError(f"the saved state cannot be read ({err.strerror or err})") from None
        try:
            os.utime(path)
        except OSError:
            pass
        return state

    def delete(self, conversation_id: int) -> None:
        try:
            self.path(conversation_id).unlink()
        except FileNotFoundError:
            pass

    def states(self) -> list[StateInfo]:
        """Every saved state, least recently used first."""
        out: list[StateInfo] = []
        if not self.folder.is_dir():
            return out
        for path in self.folder.glob(f"conversation-*{SUFFIX}"):
            try:
                cid = int(path.name[len("conversation-"):-len(SUFFIX)])
                st = path.stat()
            except (ValueError, OSError):
                continue
            out.append(StateInfo(cid, path, st.st_size, st.st_mtime))
        return sorted(out, key=lambda s: (s.used, s.conversation_id))

    def sizes(self) -> dict[int, int]:
        return {s.conversation_id: s.size for s in self.states()}

    def prune(self, keep: int | None = None, existing: Iterable[int] | None = None) -> list[int]:
        """Delete states least-recently-used first until they fit the budget (``keep``'s last, and only if it alone
        is over), the states of conversations not in ``existing`` (when given), and temporary files left by a
        killed writer; returns the conversations whose state went."""
        gone: list[int] = []
        if not self.folder.is_dir():
            return gone
        now = time.time()
        for tmp in self.folder.glob(f".conversation-*{SUFFIX}.*.tmp"):
            try:
                if now - tmp.stat().st_mtime > 3600:
                    tmp.unlink()
            except OSError:
                pass
        states = self.states()
        if existing is not None:
            alive = set(existing)
            for s in [s for s in states if s.conversation_id not in alive]:
                self._drop(s, gone)
            states = [s for s in states if s.conversation_id in alive]
        total = sum(s.size for s in states)
        order = [s for s in states if s.conversation_id != keep] + [s for s in states if s.conversation_id == keep]
        for s in order:
            if total <= self.budget:
                break
            self._drop(s, gone)
            total -= s.size
        return gone

    @staticmethod
    def _drop(s: StateInfo, gone: list[int]) -> None:
        try:
            s.path.unlink()
            gone.append(s.conversation_id)
        except FileNotFoundError:
            pass


def discard(db_path: Path, conversation_id: int) -> None:
    """Delete a conversation's saved state (the conversation was deleted from the log)."""
    SavedStates.beside(db_path).delete(conversation_id)
