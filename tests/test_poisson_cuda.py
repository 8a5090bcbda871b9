"""The CUDA design core against the C++ one: identical uniforms, keep sets and kinds, the same
probabilities to rounding, the same errors; without a device it must refuse cleanly; and its
sources must compile wherever nvcc exists. GPU tests are skipped, not faked, without a device."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from native import poisson as P
from native import runtime

HAS_DEVICE = P.cuda_available()
gpu = pytest.mark.skipif(not HAS_DEVICE, reason="no CUDA device (or the CUDA design core is not built)")


def _cuda_lib_built() -> bool:
    try:
        return runtime.core_library_path(cuda=True).exists()
    except runtime.NativeNotBuilt:
        return False


@pytest.mark.gpu
def test_a_required_gpu_is_seen_by_the_cuda_core() -> None:
    """scripts/gpu_check.sh sets CERTCHAT_REQUIRE_GPU: there a skipped GPU test would hide a broken setup."""
    import os

    if not os.environ.get("CERTCHAT_REQUIRE_GPU"):
        pytest.skip("no GPU required here")
    assert HAS_DEVICE, "CERTCHAT_REQUIRE_GPU is set but the CUDA design core is not built or sees no device"


@pytest.mark.skipif(HAS_DEVICE, reason="a device is present: the no-device contract cannot be exercised")
def test_cuda_library_without_a_device_refuses_cleanly():
    if not _cuda_lib_built():
        pytest.skip("libcertchat_core_cuda.so is not built (CERTCHAT_CUDA off or no nvcc)")
    assert P.core_version("cuda").endswith("-cuda")
    lib = ctypes.CDLL(str(runtime.core_library_path(cuda=True)))
    assert lib.certchat_cuda_device_count() == 0
    r = np.ones(64)
    calls = [
        lambda: P.inclusion_probabilities(r, None, 10.0, 0.0, device="cuda"),
        lambda: P.plan_eviction(r, None, 10.0, device="cuda"),
        lambda: P.draw(np.full(64, 0.5), 1, 2, np.arange(64), device="cuda"),
        lambda: P.uniforms(1, 2, np.arange(64), device="cuda"),
        lambda: P.update_log_pi(np.full(64, 0.5), np.ones(64, bool), device="cuda"),
    ]
    for call in calls:
        with pytest.raises(P.DeviceUnavailable, match="no usable CUDA device"):
            call()


@pytest.mark.slow
def test_cuda_sources_compile(tmp_path: Path):
    nvcc, cmake, ninja = shutil.which("nvcc"), shutil.which("cmake"), shutil.which("ninja")
    if not (nvcc and cmake and ninja):
        pytest.skip("nvcc, cmake or ninja missing")
    src = Path(__file__).resolve().parents[1] / "native" / "src"
    build = tmp_path / "build"
    subprocess.run(
        [cmake, "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DCERTCHAT_CUDA=ON",
         "-DCMAKE_CUDA_ARCHITECTURES=90"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    out = subprocess.run([ninja, "-C", str(build), "-j2"], check=True, capture_output=True, text=True)
    assert "warning" not in out.stdout.lower(), out.stdout
    lib = ctypes.CDLL(str(build / "libcertchat_core_cuda.so"))
    lib.certchat_core_version.restype = ctypes.c_char_p
    assert lib.certchat_core_version().decode().endswith("-cuda")
    assert lib.certchat_cuda_device_count() >= 0


# ---------------------------------------------------------------- on a device


def _case(n: int, seed: int, dist: str):
    rng = np.random.default_rng(seed)
    if dist == "heavy":
        r = rng.pareto(1.2, n)
    elif dist == "ties":
        r = rng.integers(0, 4, n).astype(np.float64)  # many equal scores: the top slice's tie rule
    else:
        r = np.exp(rng.normal(0, 3, n))
    prot = np.zeros(n, dtype=bool)
    prot[:4] = True
    prot[-32:] = True
    return r, prot


SETTINGS = [
    dict(method="poisson"),
    dict(method="poisson", top_share=0.5),
    dict(method="poisson", page_size=16),
    dict(method="poisson", page_size=8, top_share=0.3),
    dict(method="topk"),
    dict(method="topk", page_size=16),
    dict(method="window"),
    dict(method="uniform"),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["lognormal", "heavy", "ties"])
@pytest.mark.parametrize("n", [100, 4096, 131072])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_cuda_plans_match_cpu(dist, n, settings):
    r, prot = _case(n, n, dist)
    kw = dict(settings)
    page = kw.pop("page_size", 1)
    msg = np.repeat(np.arange(n // 50 + 1), 50)[:n]
    units = P.make_units(n, page, msg, prot) if page > 1 else None
    pos = np.arange(n) * 2 + 7
    prev = -np.random.default_rng(1).exponential(0.3, n)
    for budget in (0.05 * n + 36, 0.3 * n, 20.0):
        common = dict(unit_ids=units, floor=1e-6, seed=99, round=4, positions=pos, prev_cum_logpi=prev, **kw)
        cpu = P.plan_eviction(r, prot, budget, device="cpu", **common)
        dev = P.plan_eviction(r, prot, budget, device="cuda", **common)
        np.testing.assert_array_equal(dev.keep, cpu.keep)
        np.testing.assert_array_equal(dev.kind, cpu.kind)
        np.testing.assert_allclose(dev.pi, cpu.pi, rtol=1e-12, atol=0)
        np.testing.assert_allclose(dev.cum_logpi[cpu.keep], cpu.cum_logpi[cpu.keep], rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(dev.bias, cpu.bias, rtol=2e-7, atol=0)
        assert dev.feasible == cpu.feasible
        pi_dev = P.inclusion_probabilities(r, prot, budget, 1e-6, unit_ids=units, strict=False, device="cuda", **kw)
        np.testing.assert_allclose(pi_dev, cpu.pi, rtol=1e-12, atol=0)


@gpu
@pytest.mark.gpu
def test_cuda_draws_and_bookkeeping_match_cpu():
    rng = np.random.default_rng(3)
    n = 200_003
    pos = rng.permutation(n).astype(np.int64) * 3
    for seed, rnd in [(0, 0), (2**63 + 11, 2**33 + 5)]:
        np.testing.assert_array_equal(P.uniforms(seed, rnd, pos, device="cuda"), P.uniforms(seed, rnd, pos))
    pi = rng.random(n)
    pi[:1000] = 0.0
    pi[1000:2000] = 1.0
    np.testing.assert_array_equal(P.draw(pi, 5, 6, pos, device="cuda"), P.draw(pi, 5, 6, pos))
    keep = rng.random(n) < 0.5
    prev = -rng.exponential(1.0, n)
    c_dev, b_dev = P.update_log_pi(np.maximum(pi, 1e-3), keep, prev, device="cuda")
    c_cpu, b_cpu = P.update_log_pi(np.maximum(pi, 1e-3), keep, prev)
    np.testing.assert_allclose(c_dev[keep], c_cpu[keep], rtol=1e-14)
    np.testing.assert_allclose(b_dev, b_cpu, rtol=2e-7)
    timing = P.last_cuda_timing()
    assert set(timing) == {"h2d_ms", "kernel_ms", "d2h_ms"} and all(v >= 0 for v in timing.values())


@gpu
@pytest.mark.gpu
def test_cuda_rejects_what_the_cpu_rejects():
    r = np.ones(1000)
    r[321] = np.nan
    for device in ("cpu", "cuda"):
        with pytest.raises(P.DesignError, match=r"scores\[321\]"):
            P.plan_eviction(r, None, 10.0, device=device)
    with pytest.raises(P.DesignError, match="unit_ids"):
        P.plan_eviction(np.ones(10), None, 5.0, unit_ids=np.array([0] * 9 + [-1]), device="cuda")
    with pytest.raises(P.DesignError, match=r"pi\[2\]"):
        P.draw(np.array([0.1, 0.2, 1.5]), 0, 0, np.arange(3), device="cuda")
    with pytest.raises(P.BudgetInfeasible):
        P.inclusion_probabilities(np.ones(100), np.arange(100) < 50, 10.0, 0.0, device="cuda")
    assert P.plan_eviction(np.zeros(0), None, 1.0, device="cuda").keep.shape == (0,)
