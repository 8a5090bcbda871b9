"""Small replay scripts the tests build on the fly."""

from __future__ import annotations

import json
from pathlib import Path


def code_number_script(path: Path, notes: int, aside: str = "") -> Path:
    """Write ``notes`` facts ("my code number i is …", each acknowledged), then an independent probe of code 1 and
    a probe of code 2 answered in the script; ``aside`` lengthens every fact (more history to evict)."""
    lines: list[dict[str, object]] = [{"role": "system", "content": "Be brief."}]
    for i in range(notes):
        lines += [{"role": "user", "content": f"Note {i}: my code number {i} is {4100 + 37 * i}, remember it "
                                              f"please{aside}."},
                  {"role": "assistant", "content": f"Noted: code {i} is {4100 + 37 * i}."}]
    lines += [{"role": "user", "content": "What is code number 1?", "probe": {"expect": ["4137"], "fact_turn": 2},
               "independent": True},
              {"role": "user", "content": "And code number 2?", "probe": {"expect": ["4174"], "fact_turn": 3}},
              {"role": "assistant", "content": "4174."}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path
