"""Driving the real ``certchat`` console script in child processes, as a user does.

Each child runs from this checkout (PYTHONPATH) with the test's isolated data and config
dirs (the conftest's environment is inherited), so what it writes is what the test reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from memory_store import Store

ROOT = Path(__file__).resolve().parents[1]
# The fast model and settings that make it evict and gate on every turn.
EVICTING = ["--model", "smollm2-135m", "--policy", "poisson", "--budget", "48", "--gate", "0",
            "--evict-from", "0", "--threads", "2"]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(ROOT) + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    out.update(extra)
    return out


def cli(*args: str, input: bytes | str | None = None, timeout: float = 300,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``certchat ARGS…`` to the end; stdout and stderr as text."""
    data = input.encode() if isinstance(input, str) else input
    proc = subprocess.run([sys.executable, "-m", "agent.cli", *args], input=data, capture_output=True,
                          timeout=timeout, env=env(**(extra_env or {})), cwd=ROOT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def spawn(*args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "agent.cli", *args], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env(), cwd=ROOT)


def one_line_error(stderr: str, *needles: str) -> str:
    """The single error line a failed command printed (no traceback), checked to contain ``needles``. A
    ``[warning]`` line about the settings the command ran with (an uncertified budget's notice) is not the error."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[warning] ")]
    assert len(lines) == 1, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float = 120) -> bool:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (polled); False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            hit = ready()
        except Exception:  # the database may not exist yet
            hit = False
        if hit:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    raise AssertionError("the moment to kill never came")


def roles(store: Store, conversation_id: int) -> list[str]:
    return [m.role for m in store.rereadable(conversation_id)]


def consistent(sequence: Sequence[str]) -> bool:
    """A history a chat template can render: an optional system message, then user/assistant turns."""
    rest = list(sequence[1:] if sequence and sequence[0] == "system" else sequence)
    return all(role == ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(rest))
