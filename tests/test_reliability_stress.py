"""The acceptance runs: kill -9 at every moment of a turn, and several processes on one log at once.

Both drive scripts/ (which print their tallies): ``kill_loop.py`` (20 rounds there; 4 here, one per
moment, to keep the suite short) and ``concurrency_check.py`` (30 seconds, as the issue asks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability_support import ROOT, env


def _script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          env=env(), cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_kill_loop_leaves_a_consistent_log(small_model: Path, tmp_path: Path) -> None:
    r = _script("kill_loop.py", "--rounds", "4", "--dir", str(tmp_path), timeout=1200)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    tally = [line for line in r.stdout.splitlines() if line.startswith("kill -9 loop:")]
    assert tally and "4 rounds" in tally[0] and "consistency failures 0" in tally[0], r.stdout


@pytest.mark.slow
def test_concurrent_writers_and_a_reader(small_model: Path) -> None:
    r = _script("concurrency_check.py", "--seconds", "30", timeout=1200)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 reader errors, 0 'database is locked'" in r.stdout
    assert "second writer refused" in r.stdout
