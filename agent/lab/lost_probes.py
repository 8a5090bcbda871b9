"""The account of every lost probe: each probe the full cache answered and a gated run did not, and why.

Results folders of ``certchat demo long … --policy full,…,poisson+gate`` (any number of scripts; a script's full
run may come from another folder than its gated run, e.g. an earlier run) hold, per probe, the full cache's answer
and the gated run's: whether the gate fired, the statistic's reading against the bar that
turn, how the re-read ran and which logged messages it brought back. Each lost probe falls in one class:

- **never fired**: the reading stayed under the bar (under the floor τ, or under the adaptive bar above it);
- **fired on other messages**: a targeted re-read brought back messages, but not the fact's;
- **fact back, still wrong**: the fact's message was back (copied or re-read, or never evicted) and the answer
  was still wrong.

Which message held the fact comes from the step's ``fact_message`` (runs since it was recorded) or, for older
runs, from the folder's ``replay.db`` (the conversation's user messages in order); where neither exists, a
targeted firing's class is "fired, fact's message unknown". A copied or whole re-read brings every evicted message
back, so its class needs no lookup.

    python -m agent.lab.lost_probes DIR… [--gated poisson+gate] [--summary-only]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from agent.lab.gate_lab import finite
from agent.lab.replay import aggregate

NEVER = "never fired"
OTHER = "fired on other messages"
STILL_WRONG = "fact back, still wrong"
UNKNOWN = "fired, fact's message unknown"
CLASSES = (NEVER, OTHER, STILL_WRONG, UNKNOWN)


@dataclass(frozen=True)
class Lost:
    """One probe the full cache answered and the gated run did not."""

    script: str
    turn: int
    category: str
    distance: int | None
    cls: str
    reading: float | None
    bar: float | None
    path: str
    answer: str
    full_answer: str

    @property
    def under(self) -> str:
        """How far under its bar an unfired reading stayed ("" when it fired or has no reading)."""
        if self.cls != NEVER or self.reading is None or not self.bar:
            return ""
        return f"{self.reading:.1f} / {self.bar:.1f} ({self.reading / self.bar:.0%})"


def _user_ids(db: Path, conversation_id: Any) -> list[int]:
    """The conversation's user messages, oldest first (the script's turns in order: long-chat probes are not
    independent, so every step leaves its message)."""
    if conversation_id is None or not db.is_file():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT id FROM messages WHERE conversation_id = ? AND role = 'user' ORDER BY id",
                           (conversation_id,)).fetchall()
    return [int(r[0]) for r in rows]


def _fact_message(step: dict[str, Any], turn_ids: dict[int, int]) -> int | None:
    if isinstance(step.get("fact_message"), int):
        return int(step["fact_message"])
    fact = step.get("fact_turn")
    return turn_ids.get(fact) if isinstance(fact, int) else None


def classify(step: dict[str, Any], fact_message: int | None) -> str:
    """The class of one lost probe's gated step."""
    if not step.get("gate_fired"):
        return NEVER
    if step.get("reread_path") in ("copied", "full"):
        return STILL_WRONG
    if fact_message is None:
        return UNKNOWN
    return STILL_WRONG if fact_message in set(step.get("reread_messages") or []) else OTHER


def account(folders: Sequence[Path], gated: str = "poisson+gate") -> list[Lost]:
    """Every lost probe of the ``gated`` column against the full cache, script by script (seed 0)."""
    lost: list[Lost] = []
    # a script's full run and its gated run may sit in different folders (e.g. a later run of one budget)
    by: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {}
    for folder in folders:
        db = Path(folder) / "replay.db" if Path(folder).is_dir() else Path(folder).with_name("replay.db")
        for f in aggregate.result_files([folder]):
            for run in aggregate.read_results(f)["runs"]:
                if run.get("seed", 0) == 0:
                    by.setdefault(run["script"], {})[str(run["policy"])] = (run, db)
    for name, cols in by.items():
        if "full" not in cols or gated not in cols:
            continue
        full, (run, db) = cols["full"][0], cols[gated]
        ids = _user_ids(db, run.get("conversation_id"))
        turn_ids = {s["turn"]: i for s, i in zip(run["steps"], ids)} if len(ids) == len(run["steps"]) else {}
        for f, g in zip(full["steps"], run["steps"]):
            if g["kind"] != "probe" or not f.get("correct") or g.get("correct"):
                continue
            detail = g.get("certificate_detail") or {}
            lost.append(Lost(Path(name).stem, int(g["turn"]), str(g.get("category") or ""), g.get("distance"),
                             classify(g, _fact_message(g, turn_ids)), finite(detail.get("sketch.max")),
                             finite(g.get("gate_threshold")), str(g.get("reread_path") or ""),
                             str(g.get("answer") or ""), str(f.get("answer") or "")))
    return lost


def _short(text: str, width: int = 48) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= width else text[: width - 1] + "…"


def summary(lost: Sequence[Lost]) -> str:
    """Counts per class, split by the probe's category (verbatim or paraphrased)."""
    cats = sorted({x.category for x in lost})
    counts = Counter((x.cls, x.category) for x in lost)
    lines = ["| class | " + " | ".join(cats) + " | all |", "|---|" + "---|" * (len(cats) + 1)]
    for cls in CLASSES:
        row = [counts[(cls, c)] for c in cats]
        if sum(row):
            lines.append(f"| {cls} | " + " | ".join(str(n) for n in row) + f" | {sum(row)} |")
    lines.append("| all | " + " | ".join(str(sum(counts[(k, c)] for k in CLASSES)) for c in cats)
                 + f" | {len(lost)} |")
    return "\n".join(lines) + "\n"


def table(lost: Sequence[Lost]) -> str:
    """One row per lost probe."""
    lines = ["| script | turn | category | distance | class | reading / bar | path | answered | full cache |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in lost:
        lines.append(f"| {x.script} | {x.turn} | {x.category} | {x.distance if x.distance is not None else '—'} | "
                     f"{x.cls} | {x.under or '—'} | {x.path or '—'} | {_short(x.answer)} | "
                     f"{_short(x.full_answer)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.lab.lost_probes", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--gated", default="poisson+gate", help="the column to account for, e.g. "
                   "poisson+gate@copy_back=named")
    p.add_argument("--summary-only", action="store_true", help="print only the counts per class")
    args = p.parse_args(argv)
    try:
        lost = account(args.folders, args.gated)
    except aggregate.ResultsError as err:
        print(f"lost_probes: {err}", file=sys.stderr)
        return 1
    print(f"{len(lost)} probes the full cache answered and {args.gated} did not.\n")
    print(summary(lost))
    if not args.summary_only and lost:
        print(table(lost), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
