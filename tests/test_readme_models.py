"""The README's model table says what each model's record says: what ``budget = "auto"`` runs at the default risk."""

from __future__ import annotations

from pathlib import Path

from agent import models
from agent.config import Config
from agent.gate import calibration

README = Path(__file__).resolve().parents[1] / "README.md"


def _model_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    in_models = False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            in_models = line.strip() == "## Models"
        if in_models and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_registry_model_has_a_row() -> None:
    assert set(_model_rows()) == set(models.REGISTRY)


def test_each_rows_setting_is_its_records_line_at_the_default_risk() -> None:
    risk = Config().loss_risk
    for name, cells in _model_rows().items():
        expected = calibration.setting_line(calibration.for_model(models.REGISTRY[name].sha256), risk, name)
        assert cells[-1] == expected, f"README's row for {name}: regenerate it from `certchat models list`"
