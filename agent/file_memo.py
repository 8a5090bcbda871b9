"""Facts about a file worth computing once per version of it (a model's SHA-256; that it parses as GGUF),
remembered under the cache dir and keyed by the file's resolved path, size and modification time, so a changed or
replaced file is looked at again."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from agent import paths

log = logging.getLogger(__name__)


def _memo_file(kind: str) -> Path:
    return paths.cache_dir() / f"{kind}.json"


def _stamp(path: Path) -> tuple[str, str]:
    resolved = path.resolve()
    st = resolved.stat()
    return str(resolved), f"{st.st_size}:{st.st_mtime_ns}"


def _load(kind: str) -> dict[str, Any]:
    try:
        known = json.loads(_memo_file(kind).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def recall(kind: str, path: Path) -> Any:
    """What :func:`remember` kept for this version of ``path`` (None: nothing, or the file changed since)."""
    where, stamp = _stamp(path)
    entry = _load(kind).get(where)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry.get("value")
    return None


def remember(kind: str, path: Path, value: Any) -> None:
    """Keep ``value`` for this version of ``path``; a cache dir that cannot be written only costs the next look."""
    where, stamp = _stamp(path)
    known = _load(kind)
    known[where] = {"stamp": stamp, "value": value}
    target = _memo_file(kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, target)
    except OSError as err:
        log.warning("cannot remember %s of %s in %s (%s)", kind, path, target, err)
