"""How a command fails: one line on stderr that names the problem and the fix, never a traceback.

``report`` renders any exception that reaches the console script (the known kinds with their own
message; anything else as an internal error whose traceback goes to the log file), and the input
helpers decode what a user types or pipes in even when it is not UTF-8.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable

from agent.errors import ExplainedError

_log = logging.getLogger("certchat.cli")

# Replacement for bytes that are not UTF-8 (what errors="replace" puts in their place).
_REPLACEMENT = "\ufffd"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class UsageError(ValueError):
    """A command given wrongly (the message says how to call it)."""


def _known() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what went wrong and what to do (imported lazily: keeps --help fast)."""
    from agent import config, models  # noqa: PLC0415
    from agent.chat.session import InputError  # noqa: PLC0415
    from agent.llm.template import TemplateError  # noqa: PLC0415
    from memory_store.errors import StoreError  # noqa: PLC0415
    from native.llama import LlamaError  # noqa: PLC0415
    from native.patched import NotPatched  # noqa: PLC0415
    from native.runtime import NativeNotBuilt  # noqa: PLC0415

    return (config.ConfigError, models.ModelError, StoreError, LlamaError, NativeNotBuilt, NotPatched, TemplateError,
            InputError, UsageError, ExplainedError, FileNotFoundError)


def describe(err: BaseException) -> str:
    """The one-line message for ``err``."""
    from native.patched import PatchError  # noqa: PLC0415
    from native.poisson import DesignError  # noqa: PLC0415

    if isinstance(err, _known()):
        return _one_line(str(err))
    if isinstance(err, DesignError):
        return _one_line(
            f"the eviction core refused this turn ({err}); everything said so far is in the log — retry with "
            "another --budget or --policy full, and report it with `certchat doctor --json` if it persists")
    if isinstance(err, PatchError):
        return _one_line(
            f"the patched attention cannot serve this model ({err}); use a transformer model without ALiBi or a "
            "recurrent/hybrid memory (`certchat models list`)")
    if isinstance(err, MemoryError):
        return "out of memory: lower --n-ctx or use a smaller model"
    if isinstance(err, OSError) and err.strerror:
        where = f" ({err.filename})" if err.filename else ""
        return _one_line(f"{err.strerror}{where}; nothing after the last saved message was lost — fix that and retry")
    from agent import logs  # noqa: PLC0415

    return _one_line(
        f"internal error ({type(err).__name__}: {err}); the log is consistent, the details are in "
        f"{logs.log_file()} — please report it")


def report(command: str | None, err: BaseException) -> int:
    """Print ``err`` as one line (``certchat COMMAND: …``), keep its traceback in the log file; exit status 1."""
    _log.error("certchat %s failed", command or "", exc_info=(type(err), err, err.__traceback__))
    prefix = f"certchat {command}" if command else "certchat"
    print(f"{prefix}: {describe(err)}", file=sys.stderr)
    return 1


def guard(func: Callable[[argparse.Namespace], int | None],
          prefix: str | None = None) -> Callable[[argparse.Namespace], int]:
    """The one CLI error guard: any failure of ``func`` becomes one line on stderr and exit status 1
    (``certchat COMMAND: …``; ``prefix`` replaces COMMAND, "" for a bare ``certchat: …``)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except Exception as err:
            return report(getattr(args, "command", None) if prefix is None else prefix, err)

    return run


def read_stdin(command: str) -> str:
    """All of stdin as text; bytes that are not UTF-8 become U+FFFD, and the user is told once."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        _warn_replaced(command, err.start)
        return data.decode("utf-8", errors="replace")


def tolerant_stdin() -> None:
    """Let line input carry undecodable bytes through (as surrogates) instead of raising mid-read."""
    reconfigure: Any = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def clean_line(line: str, command: str) -> str:
    """A line read after ``tolerant_stdin``: undecodable bytes become U+FFFD (the user is told)."""
    if not any("\udc80" <= ch <= "\udcff" for ch in line):
        return line
    raw = line.encode("utf-8", errors="surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        _warn_replaced(command, err.start)
        return raw.decode("utf-8", errors="replace")


def _warn_replaced(command: str, offset: int) -> None:
    print(f"certchat {command}: the input is not valid UTF-8 (first bad byte at offset {offset}); "
          f"undecodable bytes were replaced with {_REPLACEMENT} — re-encode it as UTF-8 to keep them",
          file=sys.stderr)
