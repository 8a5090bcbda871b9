"""The coverage study's capture on the real small model: numpy attention matches the graph's, cells add up."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_support import code_number_script

from agent.config import Config
from agent.lab.replay import batch, capture, script, studies


@pytest.mark.slow
def test_coverage_cells_from_a_real_full_cache_run(small_model: Path, tmp_path: Path) -> None:
    path = code_number_script(tmp_path / "cov.jsonl", 3)
    settings = batch.Settings(out=tmp_path / "out", policies=["poisson", "poisson@page_size=1"], budgets=["25%"],
                              model=str(small_model), threads=1, max_tokens=4, progress=False)
    cfg = Config(model=str(small_model), threads=1, evict_from=0)
    result = capture.run_coverage_draws([script.load(path)], settings, cfg, draws=2)
    # 30 layers × 9 heads × 2 draws for each of the two probes (the first one independent: rewound after)
    assert result["forms"]["f_cluster"]["n_cells"] == 2 * 30 * 9 * 2
    assert set(result["by_design"]) == {"poisson 25%", "poisson@page_size=1 25%"}
    for probe in result["probes"]:
        for info in probe["designs"].values():
            assert info["numpy_vs_graph_max_rel"] < 2e-2  # f16 cache vs float64 numpy
            # Σπ meets the budget, or exceeds it when the protected cells alone do (a tiny history)
            assert info["sum_pi"] >= info["budget_cells"] * (1 - 1e-6)
    # the independent probe's question was rewound: the next probe sees the same history plus its own
    kv = [p["designs"]["poisson 25%"]["n_cells_kv"] for p in result["probes"]]
    assert abs(kv[1] - kv[0]) <= 3
    for forms in result["by_design"].values():
        for form in forms.values():
            assert 0.0 <= form["coverage"] <= 1.0 and len(form["per_layer"]) == 30
    assert "| poisson@page_size=1 25% | f_cluster |" in studies.render(result)
