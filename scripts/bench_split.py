"""What holding the question's last tokens back costs: one prefill batch against two.

With ``evict_at = "question"`` the session prefills a message in two batches when it evicts (all but the last
``cert_window`` tokens, then those on the evicted cache), so the certificate describes the cache that answers.
``certchat bench --only turn`` times that inside "prefill"; this script measures the difference the split makes
for a short chat message on a cache of about the steady turn's size, alternating the two ways, and prints both.

    python scripts/bench_split.py [--model qwen2.5-coder-0.5b] [--threads 2] [--cells 440] [--repeats 12]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from agent import models
from agent.config import Config
from agent.lab import bench
from agent.llm.engine import Engine, EngineSettings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cells", type=int, default=440, help="cache size before the message (the steady turn's)")
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args()
    eng = Engine(EngineSettings(model_path=models.resolve(args.model), n_ctx=args.cells + 512, n_batch=512,
                                threads=args.threads))
    eng.feed(bench._history_tokens(eng.model, args.cells), segment=0)
    msg = eng.model.tokenize("<|im_start|>user\nWas anything said about travel?<|im_end|>\n<|im_start|>assistant\n",
                             add_special=False, parse_special=True)
    held = Config().cert_window
    base = eng.next_pos
    times: dict[str, list[float]] = {"one": [], "two": []}
    for _ in range(args.repeats):
        for mode in ("one", "two"):
            start = time.perf_counter()
            if mode == "one":
                eng.feed(msg, segment=1)
            else:
                eng.feed(msg[:-held], segment=1)
                eng.feed(msg[-held:], segment=1)
            times[mode].append((time.perf_counter() - start) * 1000.0)
            eng.truncate(base)
    eng.close()
    one, two = float(np.median(times["one"])), float(np.median(times["two"]))
    print(f"{args.model}, {args.threads} threads, {args.cells} cells, a {len(msg)}-token message "
          f"(medians of {args.repeats}): one batch {one:.1f} ms, held back ({len(msg) - held} + {held}) {two:.1f} ms, "
          f"split costs {two - one:+.1f} ms per turn")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
