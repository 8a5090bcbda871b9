"""The coverage study's product path on a real small model through the patched library.

A replay of the Poisson policy runs with the study's observers; at every question on an evicted cache the
cache is copied into a capture context and re-decoded. Asserted: the copy computes what the engine computed
(its attention output = numpy's p·V from the captured weights; no weight on a cell the mask hides; the
recorded rounds explain every cell's cumulative log π), and the numpy reference
(``native.poisson.page_variance`` with every cell its own unit and the cumulative π) equals the V̂ the product
computes in the graph and the gate shows — to the F16 V cache's precision, with the graph's F32
cancellation floor (V̂ is a difference of sums there) as the absolute bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from script_support import code_number_script

from agent.config import Config
from agent.lab.replay import batch, capture, script


def _script(tmp_path: Path) -> Path:
    return code_number_script(tmp_path / "cert.jsonl", 6, aside=", it matters a lot to me and my team")


@pytest.mark.slow
def test_numpy_reference_equals_the_graph_on_real_tensors(small_model: Path, tmp_path: Path) -> None:
    settings = batch.Settings(out=tmp_path / "out", policies=["poisson"], budgets=["25%"],
                              protocols=("multi-round", "one-shot"), model=str(small_model), threads=1,
                              max_tokens=4, progress=False)
    result = capture.run_coverage([script.load(_script(tmp_path))], settings, Config(model=str(small_model),
                                                                                      threads=1, evict_from=0))
    assert {r["protocol"] for r in result["rows"]} == {"multi-round", "one-shot"}
    assert result["n_cells"] > 0 and 0.0 <= result["coverage"] <= 1.0 and result["protocol"] in ("multi-round", "one-shot")
    turns = json.loads((tmp_path / "out" / "coverage-turns.json").read_text())
    assert turns and all(t["n_cells"] == 8 * 30 * 9 for t in turns)  # rows × layers × heads (SmolLM2-135M)
    for t in turns:
        assert t["out_rel"] < 2e-2  # the graph's output vs numpy's p·V (F16 V cache)
        assert t["full_out_rel"] < 2e-2  # the full reference's numpy attention = the full graph's output
        assert t["mask_mismatch"] == 0.0
        assert t["rounds_logpi_gap"] < 1e-9
        if t["label"].endswith("multi-round"):
            assert t["sketch_evicted_mass"] > 0  # the product's phase 1 read the question, as in a chat
    cells = np.load(tmp_path / "out" / "coverage-cells.npz")
    for row in result["rows"]:
        label = f"{row['design']} {row['protocol']}"
        graph, ref, o2 = (cells[f"{label}|{k}"] for k in ("v_hat", "v_hat_token_np", "o_norm2"))
        rel = np.abs(graph - ref) / (np.maximum(graph, ref) + 1e-6 * o2)
        assert np.median(rel) < 1e-3
        assert np.all(np.abs(graph - ref) <= 2e-3 * o2)
        # the page form is at least the token form's size here (pages of similar cells), never negative
        page = cells[f"{label}|v_hat_page_np"]
        assert np.all(page >= 0) and np.median(page / np.maximum(ref, 1e-30)) > 0.9
        # phase 1 measured exactly (the full history's softmax on the evicted positions), the sample's own
        # Horvitz-Thompson estimate of it, and the kept values' spread: shares and a spread, nothing else
        exact, ht, spread = (cells[f"{label}|{k}"] for k in ("evicted_mass", "ht_evicted_mass", "spread"))
        assert np.all((exact >= 0) & (exact <= 1 + 1e-9)) and exact.max() > 0
        assert np.all((ht >= 0) & (ht <= 1 + 1e-6)) and ht.max() > 0
        assert np.all(spread >= 0) and spread.max() > 0
