"""Shared fixtures: an isolated data/config dir per test run, the real models, and engines of the fast one.

The native build and the models live in the user's cache dir (set up by ./setup.sh
test); everything a test writes (database, config) goes to a temporary directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

from agent import models
from agent.gate import calibration

if TYPE_CHECKING:
    from agent.llm.engine import Engine


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    base = tmp_path_factory.mktemp("certchat-home")
    monkeypatch.setenv("CERTCHAT_DATA_DIR", str(base / "data"))
    monkeypatch.setenv("CERTCHAT_CONFIG", str(base / "config.toml"))
    monkeypatch.delenv("CERTCHAT_DB", raising=False)
    # a calibration made on this machine (`certchat calibrate`) must not change what a test sees
    monkeypatch.setenv("CERTCHAT_CALIBRATION_DIR", str(base / "calibrations"))
    calibration.forget()
    yield
    calibration.forget()


def _model(name: str) -> Path:
    override = os.environ.get("CERTCHAT_TEST_MODEL") if name == "smollm2-135m" else None
    if override:
        return Path(override)
    # ./setup.sh test pulls these; pulling here keeps a bare `pytest` honest rather than skipped.
    return models.model_file(name) if models.is_pulled(name) else models.pull(name)


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    """``model_path("smollm2-135m")`` → path of a verified registry model."""
    return _model


@pytest.fixture(scope="session")
def small_model() -> Path:
    """The fast test model (SmolLM2-135M-Instruct Q4_1)."""
    return _model("smollm2-135m")


SMALL_ENGINE: dict[str, Any] = {"n_ctx": 2048, "n_batch": 256, "threads": 2}
"""The fast model's engine settings unless a test module changes them."""


@pytest.fixture(scope="module")
def engine_factory(small_model: Path) -> Iterator[Callable[..., "Engine"]]:
    """``engine_factory(n_ctx=1024)``: a new engine of the fast model, :data:`SMALL_ENGINE` with those changes;
    every one is closed when the module's tests are done."""
    from agent.llm.engine import Engine, EngineSettings  # the engine loads llama.cpp: only where a test asks

    opened: list[Engine] = []

    def make(**changes: Any) -> Engine:
        opened.append(Engine(EngineSettings(model_path=small_model, **{**SMALL_ENGINE, **changes})))
        return opened[-1]

    yield make
    for engine in opened:
        engine.close()


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, engine_factory: Callable[..., "Engine"]) -> "Engine":
    """One engine of the fast model per test module: :data:`SMALL_ENGINE`, with the changes in the module's
    ``ENGINE`` dict where it has one."""
    return engine_factory(**getattr(request.module, "ENGINE", {}))


@pytest.fixture
def calibrated_for() -> Iterator[Callable[..., None]]:
    """``calibrated_for("smollm2-135m")``: for this test, that registry model has a calibration of its own in the user's
    calibration dir (a temporary one): the shipped default model's gate records, naming this model's hash. Under gate
    "auto" a model without a calibration keeps the full cache (agent.eviction.budget); tests of eviction under the
    calibrated gate on the fast models mark them this way, before their session starts. ``certification=``: the
    record's ``certification`` too (``Certification.to_json()``), which ``budget = "auto"`` resolves through."""
    def mark(name: str, certification: dict[str, Any] | None = None) -> None:
        shipped = json.loads(calibration.PATH.read_text(encoding="utf-8"))["calibrations"]
        sha = models.REGISTRY[name].sha256
        document: dict[str, Any] = {"model": name, "model_sha256": sha,
                                    "calibrations": [{**r, "model": name, "model_sha256": sha} for r in shipped]}
        if certification is not None:
            document["certification"] = certification
        calibration.write_model(document, calibration.record_path(sha))

    yield mark
    calibration.forget()


@pytest.fixture(scope="session")
def has_gpu() -> bool:
    """True when a CUDA device is usable by the built library."""
    from native import llama

    try:
        return bool(llama.lib().llama_supports_gpu_offload()) and _cuda_device_count() > 0
    except Exception:
        return False


def _cuda_device_count() -> int:
    import ctypes

    try:
        cudart = ctypes.CDLL("libcudart.so")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    return count.value if cudart.cudaGetDeviceCount(ctypes.byref(count)) == 0 else 0
