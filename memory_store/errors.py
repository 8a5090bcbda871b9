"""The exceptions the conversation log raises.

Every error a user can see is one line and names the database file, so the CLI
and the TUI can print ``str(error)`` as it is.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class: anything wrong with the conversation log."""


class DatabaseMissingError(StoreError):
    """The database file does not exist and the caller asked not to create it."""


class CorruptDatabaseError(StoreError):
    """The file at the path is not a SQLite database, or a damaged one; it is left as it is."""


class ForeignDatabaseError(StoreError):
    """The file is a SQLite database that some other program wrote."""


class SchemaTooNewError(StoreError):
    """The database was migrated by a newer certchat; this version must not write to it."""


class NotFoundError(StoreError, LookupError):
    """A conversation or message id that the database does not hold."""


class StreamLostError(StoreError):
    """The row an assistant stream writes to disappeared (its conversation was deleted)."""


class ImportFormatError(StoreError, ValueError):
    """A malformed line in a replay JSONL file (the message names file and line)."""


class ConversationBusyError(StoreError):
    """Another live process is writing this conversation (the message names it)."""


class DiskFullError(StoreError):
    """A write failed for lack of space (or a failing disk); what was committed before it is kept."""


class ReadOnlyError(StoreError):
    """The log cannot be written (read-only file, directory or mount); reading still works."""
