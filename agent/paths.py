"""Every filesystem location certchat uses, in one place.

XDG base directories by default; each can be overridden by an environment
variable so that tests and users can isolate a run:

- ``CERTCHAT_DATA_DIR``   database and logs      (default ``$XDG_DATA_HOME/certchat``)
- ``CERTCHAT_CACHE_DIR``  native builds, models  (default ``$XDG_CACHE_HOME/certchat``)
- ``CERTCHAT_CONFIG``     the config file        (default ``$XDG_CONFIG_HOME/certchat/config.toml``)
- ``CERTCHAT_DB``         the database file      (default ``<data dir>/certchat.db``)
"""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    # The XDG spec says relative values are invalid and must be ignored.
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / fallback


def data_dir() -> Path:
    """Directory for the conversation database and logs."""
    override = os.environ.get("CERTCHAT_DATA_DIR")
    return Path(override).expanduser() if override else _xdg("XDG_DATA_HOME", ".local/share") / "certchat"


def cache_dir() -> Path:
    """Directory for native builds, downloaded sources and models."""
    override = os.environ.get("CERTCHAT_CACHE_DIR")
    return Path(override).expanduser() if override else _xdg("XDG_CACHE_HOME", ".cache") / "certchat"


def config_path() -> Path:
    """The TOML config file (it need not exist)."""
    override = os.environ.get("CERTCHAT_CONFIG")
    if override:
        return Path(override).expanduser()
    return _xdg("XDG_CONFIG_HOME", ".config") / "certchat" / "config.toml"


def db_path() -> Path:
    """The SQLite conversation log."""
    override = os.environ.get("CERTCHAT_DB")
    return Path(override).expanduser() if override else data_dir() / "certchat.db"


def models_dir() -> Path:
    """Verified GGUF files, one per registry name."""
    return cache_dir() / "models"


def calibrations_dir() -> Path:
    """Model calibrations ``certchat calibrate`` wrote, one file per GGUF hash."""
    override = os.environ.get("CERTCHAT_CALIBRATION_DIR")
    return Path(override).expanduser() if override else cache_dir() / "calibrations"


def native_dir() -> Path:
    """Downloaded sdists, patched source trees and build outputs keyed by content hash."""
    return cache_dir() / "native"


def logs_dir() -> Path:
    """Build logs and application logs."""
    return data_dir() / "logs"
