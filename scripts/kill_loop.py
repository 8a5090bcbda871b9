"""kill -9 `certchat ask` at varying moments of a turn, over and over, and check the log after each.

One process at a time, on one conversation, with a policy that evicts and a gate that fires on every
turn (so each turn has a prefill, a re-read, a streamed answer and a turn-end eviction). The moments,
in turn, each recognised in the log by a reader polling it:

* ``prefill``  — the user message is committed, its tokens are not yet (the model is reading it);
* ``reread``   — its tokens are committed but no answer has started (certificate, gate, re-read);
* ``streaming``— the answer row exists and has text;
* ``turn-end`` — the answer is complete but its turn is not recorded yet (turn-end eviction).

A moment the process passed before the reader saw it is counted as missed, and the process is killed
at the next one it is seen in. After every kill the next open must leave: every user message sent in
the log, no answer still ``partial``, no unanswered message re-read, a re-readable history that
alternates user/assistant — and the next turn must succeed.

    python scripts/kill_loop.py --rounds 20          # prints the tally and exits 0 when every check held
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_store import Store  # noqa: E402

MOMENTS = ("prefill", "reread", "streaming", "turn-end")
ARGS = ["--model", "smollm2-135m", "--policy", "poisson", "--budget", "48", "--gate", "0",
        "--evict-from", "0", "--max-tokens", "48",
        "--threads", "2"]


def _env(data: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CERTCHAT_DATA_DIR=str(data / "data"), CERTCHAT_CONFIG=str(data / "config.toml"),
               PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    env.pop("CERTCHAT_DB", None)
    return env


def _ask(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "agent.cli", "ask", *ARGS, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT)


def _moment(db: Path, cid: int, text: str, turns_before: int) -> str | None:
    """Which moment the turn answering ``text`` is in, as the log shows it."""
    with Store(db, read_only=True, check=False) as store:
        messages = store.messages(cid)
        users = [m for m in messages if m.role == "user" and m.content == text]
        if not users:
            return None
        after = [m for m in messages if m.index > users[-1].index]
        if not after:
            return "prefill" if users[-1].tokens is None else "reread"
        answer = after[-1]
        if answer.status == "partial":
            return "streaming" if answer.content else None
        if answer.status == "complete" and len(store.turns(cid)) == turns_before:
            return "turn-end"
    return None


def check(db: Path, cid: int, sent: list[str]) -> list[str]:
    """What is wrong with the log after a kill (empty: consistent). Opening it runs the recovery."""
    problems = []
    with Store(db) as store:
        messages = store.messages(cid)
        reread = store.rereadable(cid)
    logged = [m.content for m in messages if m.role == "user"]
    problems += [f"user message lost: {t[:40]!r}" for t in sent if t not in logged]
    problems += [f"message {m.index} still partial" for m in messages if m.status == "partial"]
    roles = [m.role for m in reread]
    body = roles[1:] if roles[:1] == ["system"] else roles
    if any(role != ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(body)):
        problems.append(f"re-read history does not alternate: {roles}")
    reread_ids = {m.id for m in reread}
    for m in messages:
        if m.role == "user" and not any(x.index == m.index + 1 and x.role == "assistant" for x in messages) \
                and m.id in reread_ids:
            problems.append(f"unanswered message {m.index} would be re-read")
    return problems


def run(rounds: int, work: Path) -> int:
    env = _env(work)
    db = work / "data" / "certchat.db"
    first = subprocess.run([sys.executable, "-m", "agent.cli", "ask", *ARGS, "--new", "--json",
                            "Remember: my bicycle is orange and my dog is called Pip."],
                           capture_output=True, env=env, cwd=ROOT, check=False)
    if first.returncode != 0:
        print(first.stderr.decode(), file=sys.stderr)
        return 2
    cid = json.loads(first.stdout.decode().strip().splitlines()[-1])["conversation_id"]
    sent = ["Remember: my bicycle is orange and my dog is called Pip."]
    hit: Counter[str] = Counter()
    missed: Counter[str] = Counter()
    failures = 0
    for n in range(rounds):
        want = MOMENTS[n % len(MOMENTS)]
        text = f"Round {n}: tell me a short story about Pip and the orange bicycle. " * (1 + 8 * (want == "prefill"))
        with Store(db) as store:
            turns_before = len(store.turns(cid))
        proc = _ask(env, "--conversation", str(cid), text)
        sent.append(text)
        seen: str | None = None
        while proc.poll() is None:
            try:
                now = _moment(db, cid, text, turns_before)
            except Exception:  # noqa: BLE001 — a reader racing the writer's first commit
                now = None
            if now is not None and (MOMENTS.index(now) >= MOMENTS.index(want)):
                seen = now
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait()
        _, err = proc.communicate()
        if seen is None:
            missed[want] += 1
            if proc.returncode != 0:
                failures += 1
                print(f"round {n}: ask failed without a kill: {err.decode().strip()}")
        else:
            hit[seen] += 1
            if seen != want:
                missed[want] += 1
        problems = check(db, cid, sent)
        print(f"round {n}: wanted {want}, killed at {seen or 'none (the turn finished)'}, "
              f"{len(problems)} problems", flush=True)
        for p in problems:
            print(f"round {n} (killed at {seen or 'none'}): {p}")
        failures += bool(problems)
    final = subprocess.run([sys.executable, "-m", "agent.cli", "ask", *ARGS, "--conversation", str(cid), "--json",
                            "What colour is my bicycle?"], capture_output=True, env=env, cwd=ROOT, check=False)
    if final.returncode != 0 or "Traceback" in final.stderr.decode():
        failures += 1
        print(f"the turn after the loop failed: {final.stderr.decode().strip()}")
    failures += bool(check(db, cid, sent + ["What colour is my bicycle?"]))
    kills = sum(hit.values())
    print(f"kill -9 loop: {rounds} rounds, {kills} kills "
          + ", ".join(f"{m} {hit[m]}" for m in MOMENTS)
          + (f"; moments passed before the reader saw them: {dict(missed)}" if missed else "")
          + f"; consistency failures {failures}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return run(args.rounds, args.dir)
    with tempfile.TemporaryDirectory(prefix="certchat-kill-loop-") as tmp:
        return run(args.rounds, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
