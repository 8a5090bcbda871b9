"""Several certchat processes on one log at once: no "database is locked", every message accounted for.

For ``--seconds`` (30 by default): two writer processes, each running `certchat ask` turn after turn on
its own conversation, and a reader process opening the log and reading every conversation in a loop
(as `certchat log show` does, read-write open with recovery). Then two writers on the *same*
conversation: the second must be refused in one line naming the first, and write nothing.

    python scripts/concurrency_check.py --seconds 30     # prints the tally, exits 0 when every check held
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_store import Store  # noqa: E402

ARGS = ["--model", "smollm2-135m", "--policy", "poisson", "--budget", "48", "--gate", "0",
        "--evict-from", "0", "--max-tokens", "24",
        "--threads", "1"]

READER = r"""
import json, sys, time
from memory_store import Store, StoreError
db, until = sys.argv[1], float(sys.argv[2])
reads = errors = 0
last = []
while time.time() < until:
    try:
        with Store(db, check=False) as store:
            for c in store.list_conversations():
                store.messages(c.id)
                store.turns(c.id)
        reads += 1
    except StoreError as err:
        errors += 1
        last.append(str(err))
    time.sleep(0.02)
print(json.dumps({"reads": reads, "errors": errors, "last": last[-3:]}))
"""


def _env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CERTCHAT_DATA_DIR=str(work / "data"), CERTCHAT_CONFIG=str(work / "config.toml"),
               PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    env.pop("CERTCHAT_DB", None)
    return env


def _ask(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "ask", *ARGS, "--json", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=False)


def _writer(env: dict[str, str], cid: int, until: float, out: dict[str, object]) -> None:
    sent, failures = [], []
    n = 0
    while time.time() < until:
        text = f"conversation {cid}, turn {n}: name a colour."
        r = _ask(env, "--conversation", str(cid), text)
        sent.append(text)
        if r.returncode != 0 or "Traceback" in r.stderr:
            failures.append(r.stderr.strip())
        n += 1
    out.update(sent=sent, failures=failures)


def run(seconds: float, work: Path) -> int:
    env = _env(work)
    db = work / "data" / "certchat.db"
    cids = []
    for name in ("Ada", "Bo"):
        r = _ask(env, "--new", f"My name is {name}.")
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 2
        cids.append(json.loads(r.stdout.strip().splitlines()[-1])["conversation_id"])
    until = time.time() + seconds
    reader = subprocess.Popen([sys.executable, "-c", READER, str(db), str(until)], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT)
    results: list[dict[str, object]] = [{}, {}]
    threads = [threading.Thread(target=_writer, args=(env, cid, until, res)) for cid, res in zip(cids, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read = json.loads(reader.communicate()[0])
    problems = []
    locked = [f for res in results for f in res["failures"] if "locked" in str(f)]  # type: ignore[union-attr]
    problems += [f"writer failed: {f}" for res in results for f in res["failures"]]  # type: ignore[union-attr]
    problems += [f"reader: {e}" for e in read["last"]] if read["errors"] else []
    with Store(db) as store:
        for cid, res in zip(cids, results):
            messages = store.messages(cid)
            users = [m.content for m in messages if m.role == "user"]
            for text in res["sent"]:  # type: ignore[union-attr]
                if text not in users:
                    problems.append(f"conversation {cid}: lost {text!r}")
            roles = [m.role for m in messages]
            if roles != ["system"] + ["user", "assistant"] * (len(roles) // 2):
                problems.append(f"conversation {cid}: roles {roles}")
            if len(store.turns(cid)) != len(users):
                problems.append(f"conversation {cid}: {len(users)} user messages but {len(store.turns(cid))} turns")
    turns = sum(len(res["sent"]) for res in results)  # type: ignore[arg-type, misc]
    print(f"concurrent run: {seconds:.0f} s, 2 writers on different conversations, {turns} turns, "
          f"reader {read['reads']} full reads, {read['errors']} reader errors, {len(locked)} 'database is locked'")

    # Two writers on one conversation: a REPL holds it, an `ask` on it is refused.
    repl = subprocess.Popen([sys.executable, "-m", "agent.cli", "repl", *ARGS, "--conversation", str(cids[0])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    deadline = time.time() + 300
    while True:
        with Store(db, read_only=True, check=False) as store:
            if store.conversation_writer(cids[0]) is not None:
                break
        if repl.poll() is not None or time.time() > deadline:
            problems.append("the REPL never held its conversation")
            break
        time.sleep(0.05)
    with Store(db) as store:
        before = len(store.messages(cids[0]))
    second = _ask(env, "--conversation", str(cids[0]), "me too")
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    refused = (second.returncode == 1 and len(lines) == 1 and f"pid {repl.pid}" in lines[0]
               and "Traceback" not in second.stderr)
    repl.communicate(b"", timeout=120)
    with Store(db) as store:
        after = len(store.messages(cids[0]))
    if not refused:
        problems.append(f"the second writer was not refused cleanly: rc {second.returncode}, {second.stderr!r}")
    if after != before:
        problems.append(f"the refused writer changed the conversation ({before} → {after} messages)")
    print(f"same conversation: second writer {'refused: ' + lines[0] if refused else 'NOT refused'}")
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="certchat-concurrency-") as tmp:
        return run(args.seconds, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
