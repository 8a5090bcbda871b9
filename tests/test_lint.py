"""The committed lint and type configuration (pyproject.toml) holds for the whole tree: ruff and mypy pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_passes() -> None:
    r = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_passes() -> None:
    r = _run("mypy", "--cache-dir", str(ROOT / ".mypy_cache"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
