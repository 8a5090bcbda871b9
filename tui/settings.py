"""Settings the UI changes (policy, budget, gate, theme) written back to the typed config.

Only the changed keys go into the file: the file is re-read, the change applied and
saved, so flags given on the command line for this run (a model path, n_ctx…) never
leak into the user's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent import config as cfg
from agent.eviction import policies

POLICY_HELP = {name: policy.help for name, policy in policies.POLICIES.items()}


def persist(path: Path | None, **changes: Any) -> str | None:
    """Save ``changes`` into the config file; returns a one-line problem, or None."""
    try:
        current = cfg.load(path)
        cfg.save(current.replace(**changes), path)
    except (cfg.ConfigError, OSError) as err:
        return f"settings not saved: {err}"
    return None


def budget_problem(text: str) -> str | None:
    try:
        cfg.Budget.parse(text)
    except cfg.ConfigError as err:
        return str(err)
    return None


def gate_problem(text: str) -> str | None:
    try:
        cfg.GateThreshold.parse(text)
    except cfg.ConfigError as err:
        return str(err)
    return None
