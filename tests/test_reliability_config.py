"""Non-finite and out-of-range settings are refused before anything runs, naming the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent import paths
from agent.config import Config, ConfigError, GateThreshold, load
from tests.reliability_support import cli, one_line_error


@pytest.mark.parametrize(("flags", "key"), [
    (["--gate", "nan"], "gate"),
    (["--gate", "inf"], "gate"),
    (["--gate=-inf"], "gate"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--seed", "-1"], "seed"),
    (["--n-ctx", "300"], "n_ctx"),
    (["--n-ctx", "590", "--max-tokens", "520"], "n_ctx"),
    (["--risk", "0.05"], "risk"),
    (["--risk", "100%"], "risk"),
    (["--budget", "automatic"], "budget"),
])
def test_bad_flags_are_refused_before_the_model_loads(flags: list[str], key: str) -> None:
    r = cli("ask", "--model", "smollm2-135m", *flags, "hello")
    assert r.returncode == 1
    line = one_line_error(r.stderr, f"certchat ask: {key}:")
    assert r.stdout == ""
    assert not paths.db_path().exists(), line  # nothing was logged


@pytest.mark.parametrize(("toml", "key"), [
    ("floor = nan", "floor"),
    ("floor = inf", "floor"),
    ("top_share = nan", "top_share"),
    ("top_p = inf", "top_p"),
    ("min_p = -inf", "min_p"),
    ("repeat_penalty = nan", "repeat_penalty"),
    ("repeat_penalty = 0.0", "repeat_penalty"),
    ("temperature = inf", "temperature"),
    ('gate = "nan"', "gate"),
    ("gate = nan", "gate"),
    ("seed = -1", "seed"),
    ("seed = 4294967296", "seed"),
    ("top_k = -1", "top_k"),
    ("n_ctx = 512", "n_ctx"),  # with the default max_tokens 512 every message would be refused
])
def test_bad_config_file_values_are_refused_naming_the_key(toml: str, key: str) -> None:
    config = Path(os.environ["CERTCHAT_CONFIG"])
    config.write_text(toml + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load(config)
    r = cli("ask", "--model", "smollm2-135m", "hello")
    assert r.returncode == 1
    one_line_error(r.stderr, f"certchat ask: {key}:")
    assert not paths.db_path().exists()


def test_edges_that_stay_valid() -> None:
    Config().replace(seed=2**32 - 1, top_k=0, gate="0", n_ctx=512 + 16 + 64, max_tokens=512).validate()
    assert GateThreshold.parse("off").off and GateThreshold.parse("auto").auto and GateThreshold.parse("0.25").tau == 0.25
