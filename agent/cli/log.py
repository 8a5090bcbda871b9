"""``certchat log …``: list, show, search, delete, export and import the conversation log.

Thin: parses arguments, calls ``memory_store``, prints. The database is
``agent.paths.db_path()`` (XDG data dir, or ``CERTCHAT_DB``) unless ``--db``
is given. Commands that only read never create a missing database.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from agent import paths
from agent.chat.saved_state import SavedStates, discard
from agent.cli import errors as cli_errors
from memory_store import Conversation, DatabaseMissingError, DiskFullError, Message, ReadOnlyError, Store, StoreError
from memory_store.export import export_jsonl, export_markdown, import_jsonl
from memory_store.records import NOT_REREAD

Handler = Callable[[argparse.Namespace], int]

# C0 controls other than tab and newline, DEL and C1: printed raw they would
# drive the terminal (an ANSI escape in a message must not recolour the screen).
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def _db(args: argparse.Namespace) -> Path:
    given = getattr(args, "db", None)
    return Path(given).expanduser() if given else paths.db_path()


def _open(args: argparse.Namespace, *, create: bool = False) -> Store | None:
    """The store, or None when the database does not exist yet (read-only commands). A log that cannot be
    written (read-only data dir, full disk) is opened read-only: reading it needs no write."""
    try:
        return Store(_db(args), create=create)
    except DatabaseMissingError:
        return None
    except (ReadOnlyError, DiskFullError):
        return Store(_db(args), create=False, read_only=True)


def _existing(args: argparse.Namespace) -> Store:
    """The store of a command about conversation ``args.id``, which needs the database to exist."""
    store = _open(args)
    if store is None:
        raise StoreError(f"{_db(args)}: no conversation {args.id} (the database does not exist)")
    return store


def _safe(text: str) -> str:
    return text.translate(_CONTROL)


def _conversation_json(conversation: Conversation) -> dict[str, Any]:
    return {
        "id": conversation.id,
        "title": conversation.title,
        "model": conversation.model,
        "created_at": conversation.created_at,
        "updated_at": conversation.updated_at,
        "message_count": conversation.message_count,
    }


def _message_json(message: Message) -> dict[str, Any]:
    return {
        "index": message.index,
        "role": message.role,
        "status": message.status,
        "content": message.content,
        "n_tokens": None if message.tokens is None else len(message.tokens),
        "first_pos": message.first_pos,
        "created_at": message.created_at,
        "reread": not any(message.meta.get(key) for key in NOT_REREAD),
    }


def _print_json(data: Any, out: IO[str]) -> None:
    out.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def _size_words(n: int | None) -> str:
    """A file size as people read it: 20.3M, 512K, – for none."""
    if n is None:
        return "–"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _list(args: argparse.Namespace) -> int:
    store = _open(args)
    conversations = [] if store is None else store.list_conversations(limit=args.limit)
    if store is not None:
        store.close()
    # what reopening each conversation resumes from instead of re-reading its log (certchat's saved states)
    states = SavedStates.beside(_db(args)).sizes()
    if args.json:
        _print_json([{**_conversation_json(c), "state_bytes": states.get(c.id)} for c in conversations], sys.stdout)
        return 0
    if not conversations:
        print("no conversations")
        return 0
    print(f"{'ID':>5}  {'MSGS':>5}  {'STATE':>6}  {'UPDATED':<19}  TITLE")
    for c in conversations:
        title = _safe(c.title) or "(untitled)"
        model = f"  [{_safe(c.model)}]" if c.model else ""
        print(f"{c.id:>5}  {c.message_count:>5}  {_size_words(states.get(c.id)):>6}  "
              f"{c.updated_at[:19].replace('T', ' '):<19}  {title}{model}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    store = _existing(args)
    with store:
        store.delete_conversation(args.id)
    discard(_db(args), args.id)
    print(f"deleted conversation {args.id}")
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _existing(args)
    with store:
        conversation = store.get_conversation(args.id)
        messages = store.messages(args.id)
        settings = conversation.settings
    if args.json:
        data = _conversation_json(conversation)
        data["settings"] = settings
        data["messages"] = [_message_json(m) for m in messages]
        _print_json(data, sys.stdout)
        return 0
    print(f"# {_safe(conversation.title) or '(untitled)'}  (conversation {conversation.id}, {len(messages)} messages)")
    if conversation.model:
        print(f"model: {_safe(conversation.model)}")
    for m in messages:
        marks = [m.status] if m.status != "complete" else []
        marks += [f"{key}: {m.meta[key]}" if isinstance(m.meta[key], str) else key
                  for key in ("refused", "unanswered") if m.meta.get(key)]
        status = f" ({', '.join(marks)})" if marks else ""
        print(f"\n[{m.index}] {m.role}{status}")
        print(_safe(m.content))
    return 0


def _search(args: argparse.Namespace) -> int:
    store = _open(args)
    hits = [] if store is None else store.search(args.text, limit=args.limit)
    if store is not None:
        store.close()
    if args.json:
        _print_json([dataclasses.asdict(hit) for hit in hits], sys.stdout)
        return 0
    if not hits:
        print("no matches")
        return 0
    for hit in hits:
        snippet = _safe(" ".join(hit.snippet.split()))
        print(f"{hit.conversation_id}:{hit.index}  {hit.role:<9}  {_safe(hit.title) or '(untitled)'}: {snippet}")
    return 0


def _export(args: argparse.Namespace) -> int:
    store = _existing(args)
    with store:
        store.get_conversation(args.id)  # fail before creating an output file

        def write(out: IO[str]) -> None:
            if args.format == "jsonl":
                export_jsonl(store, args.id, out, tokens=not args.no_tokens)
            else:
                export_markdown(store, args.id, out)

        if args.output and args.output != "-":
            _write_atomically(Path(args.output), write)
        else:
            write(sys.stdout)
    return 0


def _write_atomically(path: Path, write: Callable[[IO[str]], None]) -> None:
    """Write through a temporary file beside ``path``, renamed over it only once complete: a failed export
    leaves no half-written file (and an existing one untouched)."""
    path = path.expanduser()
    if path.is_dir():
        raise StoreError(f"cannot export to {path}: it is a directory; give a file name, e.g. {path / 'chat.jsonl'}")
    parent = path.parent
    if not parent.is_dir():
        raise StoreError(f"cannot export to {path}: the directory {parent} does not exist; create it first")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as error:
        raise StoreError(_export_failure(path, error)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as error:
        os.unlink(tmp)
        raise StoreError(_export_failure(path, error)) from None
    except BaseException:
        os.unlink(tmp)
        raise


def _export_failure(path: Path, error: OSError) -> str:
    why = {
        errno.ENOSPC: "the disk is full; free some space",
        errno.EDQUOT: "the disk quota is used up; free some space",
        errno.EFBIG: "the file would be too large for this file system or limit; write it elsewhere",
        errno.EROFS: "the file system is read-only; write it elsewhere",
        errno.EACCES: "permission denied; write it somewhere you may write",
        errno.EPERM: "permission denied; write it somewhere you may write",
    }.get(error.errno or 0, f"{error.strerror or error}; write it elsewhere")
    return f"cannot export to {path}: {why} — nothing was written"


def _import(args: argparse.Namespace) -> int:
    with Store(_db(args), create=True) as store:
        conversation = import_jsonl(store, args.file, title=args.title)
    print(f"imported conversation {conversation.id} ({conversation.message_count} messages)")
    return 0


def _path(args: argparse.Namespace) -> int:
    print(_db(args))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``log`` command and its sub-actions (each sets ``func``)."""
    # --db is accepted before or after the action: `log --db X list` and `log list --db X`.
    db_option = argparse.ArgumentParser(add_help=False)
    db_option.add_argument("--db", metavar="PATH", default=argparse.SUPPRESS, help="the log database file")

    log = subparsers.add_parser("log", help="browse and export the conversation log")
    # SUPPRESS: an unset --db here must not overwrite a global --db the main parser set.
    log.add_argument(
        "--db", metavar="PATH", default=argparse.SUPPRESS, help="the log database file (default: certchat log path)"
    )
    actions = log.add_subparsers(dest="log_action", metavar="ACTION", required=True)

    p = actions.add_parser("list", parents=[db_option], help="conversations, most recent first")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=None, help="show at most N conversations")
    p.set_defaults(func=cli_errors.guard(_list, prefix=""))

    p = actions.add_parser("show", parents=[db_option], help="one conversation's messages")
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cli_errors.guard(_show, prefix=""))

    p = actions.add_parser("delete", parents=[db_option], help="delete a conversation and its saved state")
    p.add_argument("id", type=int, metavar="ID")
    p.set_defaults(func=cli_errors.guard(_delete, prefix=""))

    p = actions.add_parser("search", parents=[db_option], help="full-text search over message content")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=cli_errors.guard(_search, prefix=""))

    p = actions.add_parser("export", parents=[db_option], help="write a conversation as replay JSONL or Markdown")
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--format", choices=["jsonl", "md"], default="jsonl")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write here instead of stdout")
    p.add_argument("--no-tokens", action="store_true", help="JSONL without token ids")
    p.set_defaults(func=cli_errors.guard(_export, prefix=""))

    p = actions.add_parser("import", parents=[db_option], help="add a conversation from a replay JSONL file")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cli_errors.guard(_import, prefix=""))

    p = actions.add_parser("path", parents=[db_option], help="print the database path")
    p.set_defaults(func=_path)
