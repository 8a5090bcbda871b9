"""Run `certchat replay …` / `certchat demo …` without the console script (same arguments).

Useful before `agent.lab.cli_replay` is registered in `agent/cli/main.py`, and for running a shard
on another machine from a checkout: `python scripts/run_replay.py replay SCRIPT… --shard 2/4`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent import logs  # noqa: E402
from agent.lab import cli_replay  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    logs.configure()
    parser = argparse.ArgumentParser(prog="certchat")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_replay.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
