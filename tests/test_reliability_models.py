"""Smaller gaps: a damaged cached model, serialised log writes (SQLite's WAL-reset bug), the WAL's size limit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agent import models, paths
from memory_store import Store
from memory_store.db import JOURNAL_SIZE_LIMIT
from tests.reliability_support import cli, one_line_error


@pytest.fixture
def cache(small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated cache dir holding a verified copy of smollm2-135m (children inherit the variable)."""
    monkeypatch.setenv("CERTCHAT_CACHE_DIR", str(tmp_path / "cache"))
    target = models.model_file("smollm2-135m")
    target.parent.mkdir(parents=True)
    shutil.copyfile(small_model, target)
    stamp = target.with_suffix(".verified")
    stamp.write_text(f"{models.REGISTRY['smollm2-135m'].sha256} {target.stat().st_size}\n")
    os.utime(target, ns=(1, 1))  # older than its stamp: the cheap size check applies
    return target


def _damage(target: Path) -> None:
    with target.open("r+b") as f:  # same size, different bytes, written after the stamp
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_same_size_damaged_model_is_found_and_refused(cache: Path) -> None:
    assert models.state("smollm2-135m") == "ok"
    _damage(cache)
    assert models.state("smollm2-135m") == "damaged"
    r = cli("ask", "--model", "smollm2-135m", "hello")
    assert r.returncode == 1
    one_line_error(r.stderr, "smollm2-135m", "is damaged", "certchat models pull smollm2-135m")
    with Store(paths.db_path()) as store:
        assert store.list_conversations() == []
    r = cli("models", "verify", "smollm2-135m")
    assert r.returncode == 1
    one_line_error(r.stderr, "is damaged")
    r = cli("doctor", "--json")
    data = json.loads(r.stdout)
    assert data["models"]["smollm2-135m"]["state"] == "damaged"
    assert any("smollm2-135m" in e and "damaged" in e for e in data["errors"])


def test_models_verify_rehashes_an_intact_file(cache: Path) -> None:
    r = cli("models", "verify", "smollm2-135m")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout and "sha256 verified" in r.stdout


def test_doctor_says_log_writes_are_serialised_and_warns_of_no_wal_reset_race() -> None:
    # Commits and checkpoints never overlap (memory_store.locking), so SQLite's WAL-reset bug cannot
    # bite whatever SQLite this Python has: nothing to warn about.
    r = cli("doctor")
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stdout.splitlines() if "WAL-reset" in line and line.startswith("warning:")]
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("log writes")]
    assert "serialised" in line and f"{paths.db_path().name}.lock" in line


def test_wal_size_is_bounded(tmp_path: Path) -> None:
    with Store(tmp_path / "log.db") as store:
        (limit,) = store._conn.execute("PRAGMA journal_size_limit").fetchone()
    assert limit == JOURNAL_SIZE_LIMIT > 0
