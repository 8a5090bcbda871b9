"""How soon a streamed answer's appended text reaches the log, as an independent reader sees it.

``Store.stream_assistant`` commits the partial answer from a background thread every ``commit_interval`` seconds
(so a kill loses at most about a second of it); this script appends text, polls the database through a second
connection until the text is there, and prints the delays it measured.

    python scripts/bench_stream_commit.py [--repeats 20] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np

from memory_store import Store


def _visible(path: Path, message_id: int, text: str) -> bool:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT content FROM messages WHERE id = ?", (message_id,)).fetchone()
    finally:
        conn.close()
    return row is not None and row[0] == text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.5, help="the stream's commit_interval (s)")
    args = p.parse_args()
    delays: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "log.db") as store:
        conversation = store.create_conversation()
        for i in range(args.repeats):
            with store.stream_assistant(conversation.id, commit_interval=args.interval) as stream:
                text = f"answer {i}"
                stream.append(text, [i + 1])
                appended = time.perf_counter()
                while not _visible(store.path, stream.message_id, text):
                    time.sleep(0.005)
                delays.append(time.perf_counter() - appended)
    d = np.asarray(delays)
    print(f"partial answer visible to another connection after append, commit_interval {args.interval} s, "
          f"{len(d)} streams: median {np.median(d):.3f} s, max {d.max():.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
