"""Where diagnostics go: llama.cpp's own log lines land in a file, never on the terminal.

A TUI cannot have a C library writing to its screen, and a pipe user wants only the
answer on stdout; ``certchat doctor`` and the README point to the file.
"""

from __future__ import annotations

import logging
import os
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

from agent import paths

_configured = False


class _QuietFileHandler(RotatingFileHandler):
    """The log file, failing quietly: a full disk or a read-only data dir says so once on stderr and
    then drops records, instead of printing a ``--- Logging error ---`` traceback for every one."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 — logging's API
        if self.failed:
            return
        self.failed = True
        err = sys.exc_info()[1]
        detail = getattr(err, "strerror", None) or err
        print(f"certchat: cannot write the diagnostics log {self.baseFilename} ({detail}); diagnostics are off "
              "for this run — the conversation log is not affected", file=sys.stderr)
        try:
            if self.stream is not None:
                self.stream.close()
        except OSError:
            pass
        self.stream = None  # type: ignore[assignment]


def log_file() -> Path:
    return paths.logs_dir() / "certchat.log"


def configure() -> None:
    """Send certchat's and llama.cpp's log records to the log file (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("certchat")
    root.setLevel(logging.DEBUG if os.environ.get("CERTCHAT_DEBUG") else logging.INFO)
    root.propagate = False
    try:
        log_file().parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = _QuietFileHandler(log_file(), maxBytes=2_000_000, backupCount=2,
                                                     encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    except OSError:
        handler = logging.NullHandler()
    root.addHandler(handler)
