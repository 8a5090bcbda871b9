"""Set-up: the patched library is the one loaded, and it really decodes with a real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from native import build, llama, patched, runtime


def test_pointer_names_a_built_library() -> None:
    libs = runtime.built_libs()
    assert (libs.lib_dir / "libllama.so").exists()
    assert (libs.lib_dir / "libggml.so").exists()


def test_loaded_library_is_ours_and_patched() -> None:
    llama.lib()  # loads it
    assert Path(runtime.llama_cdll()._name).resolve() == (runtime.built_libs().lib_dir / "libllama.so").resolve()
    # Fails on a stock llama.cpp: the marker symbol exists only in our patched build.
    assert patched.patch_version() is not None, "the loaded libllama.so does not carry certchat's patch"


def test_decode_a_few_tokens_greedy(small_model: Path) -> None:
    model = llama.Model(small_model)
    info = model.info()
    assert info.n_layer > 0 and info.n_vocab > 1000
    ctx = llama.Context(model, llama.ContextParams(n_ctx=512, n_batch=128, n_threads=2))
    prompt = model.tokenize("The capital of France is", add_special=True)
    batch = llama.Batch(128)
    batch.set(prompt, list(range(len(prompt))))
    ctx.decode(batch)
    sampler = llama.Sampler(llama.SamplerParams(temperature=0.0), info.n_vocab)
    produced: list[int] = []
    pos = len(prompt)
    for _ in range(6):
        logits = ctx.logits(-1)
        token = sampler.sample(ctx, -1)
        assert token == int(np.argmax(logits)), "greedy sampling must pick the arg-max logit"
        view = ctx.logits(-1, copy=False)
        assert not view.flags.writeable and np.array_equal(view, logits)
        # The decode loop's path (argmax over the view) chooses what llama.cpp's greedy sampler chose.
        assert sampler.sample(ctx, -1, view) == token
        produced.append(token)
        batch.set([token], [pos])
        ctx.decode(batch)
        pos += 1
    assert ctx.seq_pos_max(0) == pos - 1
    text = model.detokenize(produced)
    assert text.strip(), "the model produced no text"
    # Free order: sampler, batch, context, then model (the context holds the model).
    sampler.close()
    batch.close()
    ctx.close()
    model.close()


def test_tokenize_round_trip(small_model: Path) -> None:
    model = llama.Model(small_model, vocab_only=True)
    text = "Grüße aus Tromsø: locker 4172 — ok?"
    assert model.detokenize(model.tokenize(text)) == text


def test_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(llama.ModelLoadError, match="not found"):
        llama.Model(tmp_path / "nope.gguf")


def test_context_with_absurd_size_raises() -> None:
    with pytest.raises(ValueError):
        llama.Batch(0)


def test_build_key_tracks_inputs(tmp_path: Path) -> None:
    opts = build.BuildOptions(cache_dir=tmp_path)
    key = build.build_key(opts, None, False)
    assert key == build.build_key(opts, None, False)
    assert key != build.build_key(build.BuildOptions(cache_dir=tmp_path, cuda=True), "90", False)
    assert key != build.build_key(opts, None, True)


def test_build_key_follows_the_cpu_the_kernels_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A native build is keyed on the instruction sets -march=native turned on, so a cache built on an AVX-512
    machine is not reused on an AVX2 one; the portable build is one key wherever it is built."""
    if not build._is_x86():
        pytest.skip("x86 only")
    native = build.BuildOptions(cache_dir=tmp_path, cpu="native")
    portable = build.BuildOptions(cache_dir=tmp_path, cpu="avx2")
    assert "-DGGML_NATIVE=OFF" in build.llama_flags(portable, None)
    assert "-DGGML_NATIVE=OFF" not in build.llama_flags(native, None)
    monkeypatch.setattr(build, "native_isa", lambda: ("AVX", "AVX2", "F16C", "FMA"))
    avx2_machine = build.llama_key(native, None)
    monkeypatch.setattr(build, "native_isa", lambda: ("AVX", "AVX2", "AVX512F", "F16C", "FMA"))
    avx512_machine = build.llama_key(native, None)
    assert avx2_machine != avx512_machine
    assert build.llama_key(portable, None) not in (avx2_machine, avx512_machine)
    assert build.cpu_target(portable) == "avx2"
    with pytest.raises(build.BuildError, match="unknown CPU target 'sse9'"):
        build.llama_key(build.BuildOptions(cache_dir=tmp_path, cpu="sse9"), None)


def test_a_native_build_for_another_cpu_is_refused_in_one_line(tmp_path: Path) -> None:
    """The pointer names what a native build needs; a CPU without it gets a clear error, not SIGILL."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n")
    assert runtime.missing_isa("native:AVX,AVX2,AVX512F,AVX512BW,FMA,SSE4_1", cpuinfo) == ["AVX512F", "AVX512BW"]
    assert runtime.missing_isa("native:AVX,AVX2,FMA,F16C", cpuinfo) == []
    assert runtime.missing_isa("avx2", cpuinfo) == []


def test_second_build_does_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from agent import paths

    libs = runtime.built_libs()
    lib_dir = build.build(build.BuildOptions(cache_dir=paths.native_dir(), cuda=libs.cuda,
                                             core_cuda=None))
    err = capsys.readouterr().err
    assert "up to date" in err and "compiling" not in err
    assert lib_dir == libs.lib_dir


def test_doctor_json_reports_patched_library() -> None:
    out = subprocess.run([sys.executable, "-m", "agent.cli", "doctor", "--json"], capture_output=True, text=True,
                         check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("patched", "cuda", "library_path", "models", "data_dir", "cache_dir", "config_path"):
        assert key in data
    assert data["patched"] is True
    assert data["library_path"].endswith("libllama.so")
