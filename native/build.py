"""Build the patched llama.cpp and our design-core library, cached by content hash.

Pipeline (each step skipped when its output already exists):

1. fetch   the llama-cpp-python 0.3.36 sdist with pip (the only source of llama.cpp
           here), verified by sha256, kept under ``<cache>/sdist``;
2. extract the vendored llama.cpp tree from it, once per sdist;
3. patch   a copy of that tree with ``native/patches/*.patch`` in sorted order;
4. build   libllama + ggml (CMake/Ninja, shared libs, CPU or CUDA) into
           ``<cache>/builds/llama-<hash(sdist, patches, flags, compilers)>`` and
           ``native/src`` (libcertchat_core*.so) into ``<cache>/builds/core-<hash(sources, …)>``
           — two keys, so editing our C++ never rebuilds llama.cpp;
5. publish both into ``<cache>/lib/<llama key>-<core key>`` and point ``native/_built.json`` at it.

A second run with nothing changed only hashes inputs and rewrites the pointer. A failed
step raises :class:`BuildError` naming the step and its log file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

from native.runtime import POINTER_FILE

SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# Only what a `llama` library build reads; skipping models/, docs/, tools/… saves ~140 MB.
VENDOR_PARTS = ("CMakeLists.txt", "LICENSE", "cmake/", "ggml/", "src/", "include/", "common/", "vendor/", "licenses/")

NATIVE_DIR = Path(__file__).resolve().parent
PATCH_DIR = NATIVE_DIR / "patches"
CORE_SRC_DIR = NATIVE_DIR / "src"

LLAMA_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    # The libraries are copied next to each other, so they find each other via $ORIGIN.
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    "-DCMAKE_BUILD_RPATH=$ORIGIN",
)
CUDA_FLAGS = ("-DGGML_CUDA=ON", "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF")


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log."""


@dataclass
class BuildOptions:
    """What to build and where."""

    cache_dir: Path
    """Root for sdists, source trees and builds (``agent.paths.native_dir()``)."""
    cuda: bool = False
    """Build llama.cpp with the CUDA backend (hours on 2 cores; minutes on 16)."""
    cuda_arch: str | None = None
    """CMAKE_CUDA_ARCHITECTURES, e.g. ``90``; detected with nvidia-smi when absent."""
    jobs: int = field(default_factory=lambda: os.cpu_count() or 2)
    """Parallel compile jobs."""
    quiet: bool = False
    """No progress output (errors still raise)."""
    core_cuda: bool | None = None
    """Compile our .cu sources too; default: whenever nvcc exists (even with no GPU)."""
    cpu: str = field(default_factory=lambda: os.environ.get("CERTCHAT_CPU", "native"))
    """Which x86 instruction set ggml's CPU kernels target: ``native`` (the build machine's, ``GGML_NATIVE``) or
    ``avx2`` (AVX2/FMA/F16C/BMI2, no AVX-512: runs on any x86 CPU of the last decade, and computes as an AVX2-only
    machine does). ``CERTCHAT_CPU`` sets it."""


class Progress:
    """One status line: rewritten in place on a terminal, sparse lines otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0
        self._last_text = ""

    def step(self, text: str) -> None:
        if self.quiet:
            return
        self._finish_line()
        print(f"[certchat build] {text}", file=sys.stderr, flush=True)

    def update(self, text: str) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            print(f"\r  {text[:100]:<100}", end="", file=sys.stderr, flush=True)
            self._last_text = text
        elif now - self._last_line >= 15:
            print(f"  {text}", file=sys.stderr, flush=True)
            self._last_line = now

    def _finish_line(self) -> None:
        if self.tty and self._last_text:
            print(file=sys.stderr)
            self._last_text = ""


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks (sdists, models and results all use this one)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def nvcc_path() -> str | None:
    """The nvcc compiler, if the CUDA toolkit is installed."""
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def detect_cuda_arch() -> str | None:
    """Compute capability of the first visible GPU as CMake wants it (``90`` for 9.0)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run(
        [smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return first.replace(".", "") if re.fullmatch(r"\d+\.\d+", first) else None


def _run_logged(step: str, cmd: list[str], log: Path, progress: Progress, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> None:
    """Run a command, teeing its output to ``log``; ninja's [i/n] lines drive progress."""
    if shutil.which(cmd[0], path=(env or os.environ).get("PATH")) is None:
        raise BuildError(f"build step '{step}' failed: `{cmd[0]}` was not found; install it (README: Set up)")
    log.parent.mkdir(parents=True, exist_ok=True)
    ninja_re = re.compile(r"^\[(\d+)/(\d+)\]")
    with log.open("a") as sink:
        sink.write(f"\n$ {' '.join(cmd)}\n")
        sink.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            match = ninja_re.match(line)
            if match:
                done, total = int(match.group(1)), int(match.group(2))
                progress.update(f"{step}: {done}/{total} ({100 * done // max(total, 1)}%)")
        code = proc.wait()
    if code != 0:
        raise BuildError(f"build step '{step}' failed (exit {code}); see the log: {log}")


def fetch_sdist(cache_dir: Path, progress: Progress) -> Path:
    """The verified sdist, downloaded with pip once."""
    target = cache_dir / "sdist" / SDIST_NAME
    stamp = target.with_suffix(".verified")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == SDIST_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        progress.step(f"downloading the llama.cpp source ({SDIST_REQUIREMENT} sdist, 77 MB) with pip")
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                   "-d", tmp, SDIST_REQUIREMENT]
            try:
                import scikit_build_core  # noqa: F401,PLC0415 — only probing availability

                # pip prepares metadata for an sdist; reuse the venv's backend instead of a fresh build env.
                cmd.insert(4, "--no-build-isolation")
            except ImportError:
                pass
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            got = Path(tmp) / SDIST_NAME
            if out.returncode != 0 or not got.exists():
                tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
                raise BuildError(f"build step 'fetch sdist' failed: pip download {SDIST_REQUIREMENT}: {tail[0]}")
            got.replace(target)
    digest = sha256_file(target)
    if digest != SDIST_SHA256:
        target.unlink()
        raise BuildError(
            f"build step 'fetch sdist' failed: {SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}; "
            "the corrupt download was removed, run the build again"
        )
    stamp.write_text(SDIST_SHA256)
    return target


def extract_vendor(sdist: Path, cache_dir: Path, progress: Progress) -> Path:
    """The pristine vendored llama.cpp tree (only the parts a library build needs)."""
    dest = cache_dir / "src" / f"llama.cpp-{SDIST_SHA256[:16]}"
    if (dest / ".complete").exists():
        return dest
    progress.step("extracting llama.cpp from the sdist")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(VENDOR_PREFIX):
                continue
            rel = member.name[len(VENDOR_PREFIX):]
            if rel and any(rel == part or rel.startswith(part) for part in VENDOR_PARTS):
                member.name = rel
                members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    (dest / ".complete").write_text("ok")
    return dest


def patch_files() -> list[Path]:
    """Our patches, in the order they apply."""
    return sorted(PATCH_DIR.glob("*.patch"))


def _core_sources() -> list[Path]:
    if not CORE_SRC_DIR.exists():
        return []
    return sorted(p for p in CORE_SRC_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


# GGML_NATIVE compiles for the build machine; on a Xeon that reports AMX, ggml then takes its AMX kernels, which
# die with SIGILL in a VM that does not grant the tile state. AVX-512 and the rest stay native.
X86_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


CPU_TARGETS = ("native", "avx2")
# GGML_NATIVE off, ggml's x86 options name what its kernels use; AVX-512 stays off so that float results (and so
# greedy answers) are those of an AVX2-only CPU.
AVX2_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF")
# The compiler macros that say which instruction sets `-march=native` turns on: what a GGML_NATIVE build needs.
_ISA_MACRO = re.compile(r"^#define __(SSE\d?_?\d?|SSSE3|AVX\w*|FMA|F16C|BMI2?|AMX\w*)__ 1$")


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def check_cpu(cpu: str) -> None:
    if cpu not in CPU_TARGETS:
        raise BuildError(f"build step 'configure' failed: unknown CPU target {cpu!r} (CERTCHAT_CPU); "
                         f"use one of: {', '.join(CPU_TARGETS)}")


@cache
def native_isa() -> tuple[str, ...]:
    """The instruction sets ``-march=native`` enables on this machine (``AVX512F``, ``FMA``, …), from the C
    compiler's own macros: a GGML_NATIVE build of ggml runs only where all of them exist."""
    if not _is_x86():
        return (platform.machine(),)
    try:
        out = subprocess.run(["cc", "-march=native", *X86_NO_AMX.split(), "-dM", "-E", "-x", "c", "-"], input="",
                             capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ("unknown",)
    found = sorted({m.group(1) for line in out.stdout.splitlines() if (m := _ISA_MACRO.match(line.strip()))})
    return tuple(found) or ("unknown",)


def cpu_target(opts: BuildOptions) -> str:
    """What the CPU kernels are compiled for, in words: ``avx2``, or ``native:`` and the ISA list."""
    check_cpu(opts.cpu)
    if opts.cpu == "avx2" or not _is_x86():
        return opts.cpu
    return "native:" + ",".join(native_isa())


def llama_flags(opts: BuildOptions, cuda_arch: str | None) -> list[str]:
    check_cpu(opts.cpu)
    flags = list(LLAMA_FLAGS)
    if _is_x86():
        flags += [f"-DCMAKE_C_FLAGS={X86_NO_AMX}", f"-DCMAKE_CXX_FLAGS={X86_NO_AMX}"]
        if opts.cpu == "avx2":
            flags += list(AVX2_FLAGS)
    if opts.cuda:
        flags += list(CUDA_FLAGS) + [f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return flags


def _compilers(cuda: bool) -> bytes:
    out = _tool_version(["cc", "--version"]) + _tool_version(["c++", "--version"])
    if cuda:
        out += _tool_version([nvcc_path() or "nvcc", "--version"])
    return out.encode()


def llama_key(opts: BuildOptions, cuda_arch: str | None) -> str:
    """Hash of everything that changes libllama/libggml: sdist, patches, flags, compilers, and the instruction sets
    the CPU kernels target (a native build from an AVX-512 machine must not be reused on an AVX2 one)."""
    digest = hashlib.sha256()
    digest.update(SDIST_SHA256.encode())
    for path in patch_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(json.dumps(llama_flags(opts, cuda_arch)).encode())
    digest.update(cpu_target(opts).encode())
    digest.update(_compilers(opts.cuda))
    return digest.hexdigest()[:16]


def core_key(core_cuda: bool, cuda_arch: str | None) -> str:
    """Hash of everything that changes libcertchat_core*: our sources, flags, compilers."""
    digest = hashlib.sha256()
    for path in _core_sources():
        digest.update(str(path.relative_to(CORE_SRC_DIR)).encode() + b"\0" + path.read_bytes())
    digest.update(f"core_cuda={core_cuda};arch={cuda_arch if core_cuda else None}".encode())
    digest.update(_compilers(core_cuda))
    return digest.hexdigest()[:16]


def build_key(opts: BuildOptions, cuda_arch: str | None, core_cuda: bool) -> str:
    """Key of the published library set: the llama.cpp part and the design-core part."""
    return f"{llama_key(opts, cuda_arch)}-{core_key(core_cuda, cuda_arch)}"


def _apply_patches(tree: Path, log: Path, progress: Progress) -> None:
    # The sdist's vendored tree carries a submodule `.git` file pointing nowhere; git apply
    # would try to use it, so the patched copy must not have one.
    (tree / ".git").unlink(missing_ok=True)
    for patch in patch_files():
        progress.step(f"applying {patch.name}")
        _run_logged(f"apply {patch.name}", ["git", "apply", "--whitespace=nowarn", "-p1", str(patch)], log, progress,
                    cwd=tree)


def _publish(llama_build: Path, core_build: Path | None, lib_dir: Path) -> None:
    lib_dir.mkdir(parents=True, exist_ok=True)
    sources = list((llama_build / "bin").glob("lib*.so*"))
    if core_build is not None:
        sources += list(core_build.glob("libcertchat_core*.so"))
    for src in sources:
        dest = lib_dir / src.name
        dest.unlink(missing_ok=True)
        # Keep the soname symlinks as links: copying them would triple the size.
        shutil.copy2(src, dest, follow_symlinks=False)


def _write_pointer(lib_dir: Path, key: str, cuda: bool, core_cuda: bool, cpu: str) -> None:
    data = {"lib_dir": str(lib_dir), "key": key, "cuda": cuda, "core_cuda": core_cuda, "cpu": cpu}
    tmp = POINTER_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(POINTER_FILE)


def build(opts: BuildOptions, progress_factory: Callable[[bool], Progress] = Progress) -> Path:
    """Run the pipeline; returns the directory holding the built libraries."""
    progress = progress_factory(opts.quiet)
    cache = opts.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    nvcc = nvcc_path()
    core_cuda = bool(nvcc) if opts.core_cuda is None else opts.core_cuda
    if core_cuda and not nvcc:
        raise BuildError("build step 'configure' failed: CUDA sources requested but nvcc was not found")
    cuda_arch = opts.cuda_arch or os.environ.get("CERTCHAT_CUDA_ARCH")
    if opts.cuda or core_cuda:
        cuda_arch = cuda_arch or detect_cuda_arch() or ("90" if not opts.cuda else None)
    if opts.cuda and not cuda_arch:
        raise BuildError("build step 'configure' failed: no GPU detected to pick the CUDA architecture; "
                         "pass --cuda-arch (e.g. 90 for H100/H200, 86 for RTX 30xx, 89 for RTX 40xx)")
    if opts.cuda and not nvcc:
        raise BuildError("build step 'configure' failed: --cuda needs nvcc (the CUDA toolkit) on PATH")

    sdist = fetch_sdist(cache, progress)
    lkey = llama_key(opts, cuda_arch)
    ckey = core_key(core_cuda, cuda_arch)
    key = f"{lkey}-{ckey}"
    lib_dir = cache / "lib" / key
    if (lib_dir / "PUBLISHED").exists() and (lib_dir / "libllama.so").exists():
        _write_pointer(lib_dir, key, opts.cuda, core_cuda, cpu_target(opts))
        progress.step(f"up to date: {lib_dir}")
        return lib_dir

    env = dict(os.environ)
    # cmake and ninja come with certchat's own environment (pyproject), even when not activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if nvcc:
        env["CUDACXX"] = nvcc
    llama_build = _build_llama(opts, cuda_arch, sdist, cache / "builds" / f"llama-{lkey}", env, progress)
    core_build = _build_core(opts, core_cuda, cuda_arch, cache / "builds" / f"core-{ckey}", env, progress)

    _publish(llama_build, core_build, lib_dir)
    if not (lib_dir / "libllama.so").exists():
        raise BuildError(f"build step 'publish' failed: no libllama.so in {lib_dir}")
    (lib_dir / "PUBLISHED").write_text(json.dumps({"key": key, "cuda": opts.cuda, "core_cuda": core_cuda,
                                                   "cpu": cpu_target(opts),
                                                   "built": time.time()}))
    _write_pointer(lib_dir, key, opts.cuda, core_cuda, cpu_target(opts))
    progress.step(f"done: {lib_dir}")
    return lib_dir


def _build_llama(opts: BuildOptions, cuda_arch: str | None, sdist: Path, root: Path, env: dict[str, str],
                 progress: Progress) -> Path:
    """Patched libllama + ggml under ``root`` (skipped when already built)."""
    out = root / "build"
    if (root / "BUILD_OK").exists() and (out / "bin" / "libllama.so").exists():
        return out
    pristine = extract_vendor(sdist, opts.cache_dir, progress)
    log = root / "build.log"
    tree = root / "llama.cpp"
    if not (root / "PATCHED").exists():
        shutil.rmtree(tree, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        log.write_text(f"certchat llama.cpp build {root.name}\n")
        shutil.copytree(pristine, tree, symlinks=True)
        _apply_patches(tree, log, progress)
        (root / "PATCHED").write_text("ok")
    kind = f"CUDA sm_{cuda_arch}" if opts.cuda else f"CPU {cpu_target(opts)}"
    progress.step(f"configuring llama.cpp ({kind}); log: {log}")
    configure = ["cmake", "-S", str(tree), "-B", str(out), "-G", "Ninja", *llama_flags(opts, cuda_arch)]
    _run_logged("configure llama.cpp", configure, log, progress, env=env)
    progress.step(f"compiling llama.cpp ({kind}, {opts.jobs} jobs; several minutes)")
    _run_logged("compile llama.cpp", ["cmake", "--build", str(out), "--target", "llama", "-j", str(opts.jobs)],
                log, progress, env=env)
    (root / "BUILD_OK").write_text("ok")
    return out


def _build_core(opts: BuildOptions, core_cuda: bool, cuda_arch: str | None, root: Path, env: dict[str, str],
                progress: Progress) -> Path | None:
    """Our design-core libraries under ``root`` (skipped when already built)."""
    if not (CORE_SRC_DIR / "CMakeLists.txt").exists():
        return None
    out = root / "build"
    if (root / "BUILD_OK").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    log.write_text(f"certchat design core build {root.name}\n")
    core_kind = f"CPU + CUDA sm_{cuda_arch}" if core_cuda else "CPU"
    progress.step(f"compiling the certchat design core ({core_kind}); log: {log}")
    core_cfg = ["cmake", "-S", str(CORE_SRC_DIR), "-B", str(out), "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", f"-DCERTCHAT_CUDA={'ON' if core_cuda else 'OFF'}"]
    if core_cuda:
        core_cfg.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}")
    _run_logged("configure design core", core_cfg, log, progress, env=env)
    _run_logged("compile design core", ["cmake", "--build", str(out), "-j", str(opts.jobs)], log, progress, env=env)
    (root / "BUILD_OK").write_text("ok")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m native.build --cache-dir DIR`` (the agent's ``certchat build`` passes its cache dir)."""
    parser = argparse.ArgumentParser(prog="native.build", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--cuda", action="store_true", default=os.environ.get("CERTCHAT_CUDA") == "1")
    parser.add_argument("--cuda-arch", default=None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--cpu", choices=CPU_TARGETS, default=os.environ.get("CERTCHAT_CPU", "native"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        build(BuildOptions(cache_dir=args.cache_dir, cuda=args.cuda, cuda_arch=args.cuda_arch, jobs=args.jobs,
                           quiet=args.quiet, cpu=args.cpu))
    except BuildError as err:
        print(f"certchat build: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
