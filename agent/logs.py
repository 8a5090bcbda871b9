"""Where diagnostics go: llama.cpp's own log lines land in a file, never on the terminal.

A TUI cannot have a C library writing to its screen, and a pipe user wants only the
answer on stdout; ``certchat doctor`` and the README point to the file.
"""

from __future__ import annotations

import logging
import os
from logging.handlers import RotatingFileHandler
from pathlib import Path

from agent import paths

_configured = False


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
        handler: logging.Handler = RotatingFileHandler(log_file(), maxBytes=2_000_000, backupCount=2,
                                                       encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    except OSError:
        handler = logging.NullHandler()
    root.addHandler(handler)
