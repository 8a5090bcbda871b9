"""Is the process that was streaming a partial message still alive?

A partial assistant message records who writes it: pid, host name and, on
Linux, a token made of the boot id and the process start time (so a recycled
pid or a reboot is not mistaken for the writer). Its writer also refreshes a
heartbeat at least every few seconds while the stream is open. Another process
opening the log marks a partial message interrupted only when its writer is
provably gone:

- same host, Linux: the pid does not exist, is a zombie, or started at another
  time (or the machine rebooted since);
- same host, no /proc (macOS): the pid does not exist, or the heartbeat is
  older than ``STALE_AFTER_S`` (pid reuse cannot be ruled out otherwise);
- another host sharing the file: only the heartbeat can tell.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# A writer beats every HEARTBEAT_S; this much silence means it is gone even
# when its pid cannot be checked. Generous: a laptop that slept is not dead.
HEARTBEAT_S = 5.0
STALE_AFTER_S = 120.0

# Streams open in this process, keyed by (database file, message id): a
# partial message written by our own pid but absent here was abandoned (its
# stream object was dropped without finish).
StreamKey = tuple[str, int]
_active_lock = threading.Lock()
_active_streams: set[StreamKey] = set()


def register_active(key: StreamKey) -> None:
    with _active_lock:
        _active_streams.add(key)


def unregister_active(key: StreamKey) -> None:
    with _active_lock:
        _active_streams.discard(key)


def is_active_here(key: StreamKey) -> bool:
    with _active_lock:
        return key in _active_streams


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    # fields[0] is field 3 (state); start time is field 22.
    return fields[0], fields[19]


def process_token(pid: int) -> str | None:
    """Identity of a live process beyond its pid (Linux only)."""
    boot = _boot_id()
    stat = _proc_stat(pid)
    if boot is None or stat is None:
        return None
    return f"{boot}:{stat[1]}"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


@dataclass(frozen=True)
class Writer:
    """Who is streaming a partial message."""

    pid: int
    host: str
    token: str | None

    @classmethod
    def current(cls) -> Writer:
        pid = os.getpid()
        return cls(pid=pid, host=socket.gethostname(), token=process_token(pid))


def writer_alive(
    pid: int | None,
    host: str | None,
    token: str | None,
    heartbeat_at: float | None,
    *,
    active_here: bool,
    now: float | None = None,
) -> bool:
    """Whether the recorded writer of a partial message may still be writing it.

    ``active_here``: this process has the message's stream open (consulted
    when the writer's pid is our own).
    """
    now = time.time() if now is None else now
    if pid is None:
        return False  # written before leases existed, or by a broken writer
    fresh = heartbeat_at is not None and now - heartbeat_at < STALE_AFTER_S
    if host != socket.gethostname():
        return fresh
    if pid == os.getpid():
        return active_here
    if Path("/proc").is_dir() and _boot_id() is not None:
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        if token is not None:
            return process_token(pid) == token
        return fresh
    return _pid_exists(pid) and fresh
