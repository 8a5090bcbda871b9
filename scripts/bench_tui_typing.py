"""How long keys typed while the model streams an answer take to show in the chat app's prompt.

The app decodes on a worker thread, so the UI keeps taking keys while an answer streams; this script runs the app
headless (Textual's pilot) on a small model, types a few keys as a terminal would once each answer has started to
stream, and prints how long they took to show in the prompt.

    python scripts/bench_tui_typing.py [--model smollm2-135m] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent import models
from agent.config import Config
from tui.app import CertchatApp
from tui.testing import store_reading, type_nowait, wait_for

KEYS = "next"


def _idle(app: CertchatApp) -> bool:
    return app.backend is not None and app.backend.ready and app.busy is None and not store_reading(app)


async def _measure(app: CertchatApp, pilot: Any, repeats: int) -> list[float]:
    delays: list[float] = []
    await wait_for(pilot, lambda: _idle(app), what="model loaded")
    for _ in range(repeats):
        prompt = app.chat_screen.prompt
        prompt.focus()
        prompt.text = ""
        await pilot.press(*"Write a poem about autumn leaves, with many verses.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat_screen.answering is not None and bool(app.chat_screen.answering.text),
                       what="streaming")
        prompt.text = ""
        started = time.perf_counter()
        type_nowait(app, KEYS)
        while prompt.text != KEYS and app.busy == "answering":
            await asyncio.sleep(0.005)
        if prompt.text == KEYS and app.busy == "answering":
            delays.append(time.perf_counter() - started)
        await wait_for(pilot, lambda: _idle(app), what="answer finished")
    return delays


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=320)
    args = p.parse_args()
    path = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        config = Config().replace(model=str(path), n_ctx=2048, n_batch=256, max_tokens=args.max_tokens,
                                  threads=args.threads, policy="full", gate="off", evict_from=0)
        app = CertchatApp(config, db_path=Path(tmp) / "chat.db", model_path=path,
                          config_path=Path(tmp) / "config.toml", save_settings=False)

        async def run() -> list[float]:
            async with app.run_test(size=(100, 30)) as pilot:
                return await _measure(app, pilot, args.repeats)

        delays = asyncio.run(run())
    if not delays:
        print("no answer was still streaming when the keys showed; raise --max-tokens")
        return 1
    d = np.asarray(delays)
    print(f"{len(KEYS)} keys typed while streaming ({args.model}, {args.threads} decode thread(s)), "
          f"{len(d)} of {args.repeats} answers: median {np.median(d):.3f} s, max {d.max():.3f} s to show")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
