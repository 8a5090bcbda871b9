"""Offline model registry and GGUF validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent import models, paths


def test_registry_has_the_three_models() -> None:
    assert {"qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"} <= set(models.REGISTRY)
    assert models.DEFAULT_MODEL == "qwen2.5-coder-0.5b"


def test_pulled_model_is_verified_and_not_refetched(small_model: Path) -> None:
    assert models.is_pulled("smollm2-135m")
    before = small_model.stat().st_mtime_ns
    assert models.pull("smollm2-135m", quiet=True) == small_model
    assert small_model.stat().st_mtime_ns == before


def test_unknown_name_is_one_line_error() -> None:
    with pytest.raises(models.ModelError) as err:
        models.resolve("no-such-model")
    assert "\n" not in str(err.value) and "no-such-model" in str(err.value)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match="not found"):
        models.resolve(str(tmp_path / "missing.gguf"))


def test_non_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("hello, I am not a model\n")
    with pytest.raises(models.ModelError, match="not a GGUF file"):
        models.resolve(str(bogus))


def test_truncated_gguf(tmp_path: Path, small_model: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with small_model.open("rb") as src:
        cut.write_bytes(src.read(small_model.stat().st_size // 2))
    with pytest.raises(models.ModelError, match="truncated|damaged"):
        models.resolve(str(cut))
    assert "\n" not in str(pytest.raises(models.ModelError, models.resolve, str(cut)).value)


def test_models_list_json() -> None:
    out = subprocess.run([sys.executable, "-m", "agent.cli", "models", "list", "--json"], capture_output=True,
                         text=True, check=True)
    data = json.loads(out.stdout)
    names = {m["name"]: m for m in data["models"]}
    assert names["smollm2-135m"]["present"] is True
    assert names["qwen2.5-coder-0.5b"]["default"] is True


def test_paths_honour_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CERTCHAT_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("CERTCHAT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("CERTCHAT_CONFIG", str(tmp_path / "cfg.toml"))
    assert paths.data_dir() == tmp_path / "d"
    assert paths.db_path() == tmp_path / "d" / "certchat.db"
    assert paths.models_dir() == tmp_path / "c" / "models"
    assert paths.config_path() == tmp_path / "cfg.toml"
    monkeypatch.delenv("CERTCHAT_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert paths.data_dir() == tmp_path / "xdg" / "certchat"
