"""Locate the native libraries the last successful build produced, and load them.

``native.build`` writes ``native/_built.json`` (git-ignored) after every successful
build; this module reads it. ``CERTCHAT_NATIVE_LIB_DIR`` overrides it with one directory
that holds ``libllama.so`` (and the ggml libraries) plus ``libcertchat_core.so`` —
useful while developing a patch by hand.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

POINTER_FILE = Path(__file__).with_name("_built.json")


class NativeNotBuilt(RuntimeError):
    """The patched libraries are missing: run the set-up (``certchat build``)."""


@dataclass(frozen=True)
class BuiltLibs:
    """Where the last build put its outputs."""

    lib_dir: Path
    """Directory holding libllama.so, the ggml libraries and libcertchat_core*.so."""
    cuda: bool
    """True when the llama.cpp build includes the CUDA backend."""
    key: str
    """Content hash the build was keyed by (sdist, patches, flags, compiler)."""


def built_libs() -> BuiltLibs:
    """The libraries to load, or a clear error saying how to build them."""
    override = os.environ.get("CERTCHAT_NATIVE_LIB_DIR")
    if override:
        lib_dir = Path(override).expanduser()
        if not (lib_dir / "libllama.so").is_file():
            raise NativeNotBuilt(
                f"CERTCHAT_NATIVE_LIB_DIR={override}: no libllama.so there; point it at a folder holding the "
                "patched libllama.so and libcertchat_core.so, or unset it to use `certchat build`'s libraries"
            )
        return BuiltLibs(lib_dir=lib_dir, cuda=False, key="override")
    if not POINTER_FILE.exists():
        raise NativeNotBuilt(
            "the patched llama.cpp is not built yet: run `certchat build` (or the README's set-up command)"
        )
    try:
        data = json.loads(POINTER_FILE.read_text())
        lib_dir = Path(data["lib_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        raise NativeNotBuilt(f"{POINTER_FILE} is damaged: run `certchat build` to write it again") from None
    if not (lib_dir / "libllama.so").exists():
        raise NativeNotBuilt(f"{lib_dir}/libllama.so is missing: run `certchat build` to rebuild it")
    lacking = missing_isa(str(data.get("cpu", "")))
    if lacking:
        raise NativeNotBuilt(
            f"the patched llama.cpp was built for a CPU with {', '.join(lacking)}, which this one lacks: run "
            "`certchat build` here (or `CERTCHAT_CPU=avx2 certchat build` for a build any AVX2 CPU runs)"
        )
    return BuiltLibs(lib_dir=lib_dir, cuda=bool(data.get("cuda")), key=str(data.get("key", "")))


# ggml's x86 kernels by the compiler macro a native build records (native.build.native_isa) and the flag
# /proc/cpuinfo shows for it; only these decide whether ggml's code runs here.
_ISA_FLAGS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX512F": "avx512f",
              "AVX512BW": "avx512bw", "AVX512VL": "avx512vl", "AVX512DQ": "avx512dq", "AVX512VNNI": "avx512_vnni",
              "AVX512BF16": "avx512_bf16", "AVX512VBMI": "avx512vbmi", "AVXVNNI": "avx_vnni"}


def missing_isa(cpu: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The instruction sets a ``native:…`` build (the pointer's ``cpu``) uses that this CPU does not report;
    empty for a portable build, or where /proc/cpuinfo cannot be read."""
    if not cpu.startswith("native:"):
        return []
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    have = set(flags_line.partition(":")[2].split())
    if not have:
        return []
    return [isa for isa in cpu.removeprefix("native:").split(",") if isa in _ISA_FLAGS and _ISA_FLAGS[isa] not in have]


def core_library_path(cuda: bool = False) -> Path:
    """Path of our own design-core library (the CUDA variant when ``cuda``)."""
    name = "libcertchat_core_cuda.so" if cuda else "libcertchat_core.so"
    path = built_libs().lib_dir / name
    if not path.exists():
        hint = " (CUDA variant: build with CERTCHAT_CUDA=1 and nvcc present)" if cuda else ""
        raise NativeNotBuilt(f"{path} is missing{hint}: run `certchat build`")
    return path


@cache
def load_core(cuda: bool = False) -> ctypes.CDLL:
    """Load the design-core library once per process."""
    return ctypes.CDLL(str(core_library_path(cuda)))


def llama_cpp() -> ModuleType:
    """Import ``llama_cpp`` bound to the patched library.

    ``LLAMA_CPP_LIB_PATH`` is read by llama_cpp at import time, so it must be set before
    the first import anywhere in the process.
    """
    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"]
    libs = built_libs()
    os.environ["LLAMA_CPP_LIB_PATH"] = str(libs.lib_dir)
    try:
        import llama_cpp  # noqa: PLC0415 — must follow the env assignment above
    except (OSError, AttributeError, RuntimeError) as err:
        # Not a loadable libllama, or one missing functions llama-cpp-python binds (another version).
        for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
            del sys.modules[name]
        detail = " ".join(str(err).split())
        raise NativeNotBuilt(
            f"{libs.lib_dir}/libllama.so cannot be used ({detail}); run `certchat build`"
            + (" or unset CERTCHAT_NATIVE_LIB_DIR" if libs.key == "override" else "")
        ) from None
    return llama_cpp


def llama_cdll() -> ctypes.CDLL:
    """The CDLL that llama_cpp actually opened (to check its path and our extra symbols)."""
    llama_cpp()
    return sys.modules["llama_cpp.llama_cpp"]._lib
