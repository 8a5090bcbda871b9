"""Benchmark of one eviction round of the design core: inclusion probabilities + draws +
cumulative log pi + bias vector (``native.poisson.plan_eviction``), for n = 4k, 32k, 128k.

Prints the C++ timings through the Python API, the numpy reference (tests/poisson_reference.py)
beside them, and, when a CUDA device is usable, the device path with its transfer costs.
``design_ms(n)`` / ``design_ms_32k()`` are what ``certchat bench`` reports.

    python scripts/bench_design.py [--repeats 50] [--sizes 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from native import poisson as P  # noqa: E402

BUDGET_SHARE = 0.10
FLOOR = 1e-6


def workload(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention-like importance (log-normal mass, sd 2 in logit space), 4 sinks and 32 recent
    tokens protected, positions 0..n-1."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, n)
    scores = np.exp(logits - logits.max())
    scores /= scores.sum()
    protected = np.zeros(n, dtype=bool)
    protected[:4] = True
    protected[-32:] = True
    return scores, protected, np.arange(n, dtype=np.int64)


def _times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(min, median) milliseconds over ``repeats`` calls after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(np.min(samples)), float(np.median(samples))


def design_ms(n: int = 32768, device: P.Device = "cpu", repeats: int = 30, **design: Any) -> float:
    """Median milliseconds of one round (probabilities + draws + bias) through the Python API."""
    scores, protected, positions = workload(n)
    budget = BUDGET_SHARE * n

    def once() -> object:
        return P.plan_eviction(scores, protected, budget, floor=FLOOR, positions=positions, device=device, **design)

    return _times(once, repeats)[1]


def design_ms_32k() -> float:
    """The figure ``certchat bench`` reports: median CPU ms of one round at n = 32768."""
    return design_ms(32768, "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sizes", default="4096,32768,131072")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    sys.path.insert(0, str(ROOT / "tests"))
    import poisson_reference as ref  # noqa: PLC0415 — a test helper, only for the comparison column

    print(f"design core {P.core_version()}; one round = pi + draws + cum log pi + bias; budget {BUDGET_SHARE:.0%}")
    variants: list[tuple[str, dict[str, Any]]] = [
        ("poisson", {}),
        ("poisson top_share=0.5", {"top_share": 0.5}),
        ("poisson pages of 16", {"page_size": 16}),
        ("pages of 8 + top 0.5", {"page_size": 8, "top_share": 0.5}),
        ("topk", {"method": "topk"}),
    ]
    print(f"{'n':>7}  {'design':22}  {'C++ min/median ms':>18}  {'numpy ref ms':>12}")
    for n in sizes:
        scores, protected, positions = workload(n)
        budget = BUDGET_SHARE * n
        for label, kw in variants:
            def cpp_round() -> object:
                return P.plan_eviction(scores, protected, budget, floor=FLOOR, positions=positions, **kw)

            cpp = _times(cpp_round, args.repeats)
            ref_kw = dict(kw)
            page = int(ref_kw.pop("page_size", 1))
            units = P.make_units(n, page, None, protected) if page > 1 else None
            def ref_round() -> object:
                return ref.plan_eviction(
                    scores, protected, budget, floor=FLOOR, positions=positions, unit_ids=units, **ref_kw
                )

            numpy_ms = _times(ref_round, max(3, args.repeats // 10))[1]
            print(f"{n:7d}  {label:22}  {cpp[0]:8.3f} / {cpp[1]:7.3f}  {numpy_ms:12.2f}")
    if P.cuda_available():
        print("\nCUDA (same round on the device; wall = Python call, transfers included)")
        print(f"{'n':>7}  {'design':22}  {'wall ms':>8}  {'h2d ms':>7}  {'kernels ms':>10}  {'d2h ms':>7}")
        for n in sizes:
            scores, protected, positions = workload(n)
            for label, kw in variants:
                def cuda_round() -> object:
                    return P.plan_eviction(
                        scores, protected, BUDGET_SHARE * n, floor=FLOOR, positions=positions, device="cuda", **kw
                    )

                wall = _times(cuda_round, args.repeats)[1]
                t = P.last_cuda_timing()
                legs = f"{t['h2d_ms']:7.3f}  {t['kernel_ms']:10.3f}  {t['d2h_ms']:7.3f}"
                print(f"{n:7d}  {label:22}  {wall:8.3f}  {legs}")
    else:
        print("\nCUDA: no usable device here (the device rows print where one is present)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
