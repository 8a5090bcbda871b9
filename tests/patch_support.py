"""Test helpers for the llama.cpp patch: a raw context driver and a cb_eval tensor capture.

The patch tests need knobs the production wrappers do not expose (F32 KV cache for exact
comparisons, several sequences for seq_cp, flash attention on for the F16 mask, cb_eval),
so they drive llama_cpp's low-level API directly through this module.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from native import patched, runtime
from native.ggml_tensor import GGML_TYPE_F16, GGML_TYPE_F32, GgmlTensor, src  # noqa: F401 (re-exported)
from native.ggml_tensor import read as read_tensor

_silenced: Any = None


def llama() -> Any:
    """The llama_cpp module bound to the patched library, backend initialised, logging silenced."""
    global _silenced
    lc = runtime.llama_cpp()
    if _silenced is None:
        _silenced = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(_silenced, ctypes.c_void_p(0))
        lc.llama_backend_init()
    patched.lib()
    return lc


@dataclass
class Capture:
    """Records named graph tensors through cb_eval: ``reads[name]`` runs on the tensor pointer.

    Every captured tensor splits the graph, so a capture only listens while ``armed`` (set it for the
    decode step of interest, not for the prefill).
    """

    reads: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    armed: bool = False

    def __post_init__(self) -> None:
        lc = runtime.llama_cpp()
        self.callback = lc.ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, tensor: int, ask: bool, _user: Any) -> bool:
        if not self.armed:
            return False
        name = GgmlTensor.from_address(tensor).name.decode()
        if name not in self.reads:
            return False
        if not ask:
            self.values[name] = self.reads[name](tensor)
        return True


@dataclass
class Driver:
    """One llama.cpp context over a model, driven token by token."""

    model: Any
    ctx: Any
    mem: Any
    n_vocab: int

    def decode(self, tokens: Sequence[int], p0: int, seq_ids: Iterable[int] = (0,), logits: str = "last") -> None:
        lc = llama()
        seqs = list(seq_ids)
        n = len(tokens)
        batch = lc.llama_batch_init(n, 0, len(seqs))
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = int(tok)
                batch.pos[i] = p0 + i
                batch.n_seq_id[i] = len(seqs)
                for j, s in enumerate(seqs):
                    batch.seq_id[i][j] = s
                batch.logits[i] = 1 if (logits == "all" or i == n - 1) else 0
            batch.n_tokens = n
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lc.llama_batch_free(batch)

    def logits(self, index: int = -1) -> np.ndarray:
        lc = llama()
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)).copy()

    def step(self, token: int, pos: int, seq_id: int = 0) -> np.ndarray:
        self.decode([token], pos, (seq_id,))
        return self.logits()

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(llama().llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def evict(self, positions: Iterable[int], seq_id: int = 0) -> None:
        for p in positions:
            self.seq_rm(seq_id, int(p), int(p) + 1)

    def close(self) -> None:
        if self.ctx is not None:
            llama().llama_free(self.ctx)
            self.ctx = None


_models: dict[tuple[str, int], Any] = {}


def load_model(path: Path, n_gpu_layers: int = 0) -> Any:
    """Load a GGUF once per test session (CPU unless ``n_gpu_layers``: then the KV cache lives there too)."""
    key = (str(path), n_gpu_layers)
    if key not in _models:
        lc = llama()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        handle = lc.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise RuntimeError(f"could not load {path}")
        _models[key] = handle
    return _models[key]


def make_driver(
    model: Any,
    n_ctx: int = 1024,
    n_batch: int = 512,
    flash_attn: bool = False,
    kv_type: int = GGML_TYPE_F16,
    v_type: int | None = None,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    swa_full: bool = True,
    n_threads: int = 2,
    capture: Capture | None = None,
) -> Driver:
    lc = llama()
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_batch
    cp.n_seq_max = n_seq_max
    cp.kv_unified = kv_unified
    cp.swa_full = swa_full
    cp.n_threads = n_threads
    cp.n_threads_batch = n_threads
    cp.flash_attn_type = 1 if flash_attn else 0
    cp.type_k = kv_type
    cp.type_v = kv_type if v_type is None else v_type
    cp.no_perf = True
    if capture is not None:
        cp.cb_eval = capture.callback
        cp.cb_eval_user_data = None
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("could not create a context")
    vocab = lc.llama_model_get_vocab(model)
    return Driver(model=model, ctx=ctx, mem=lc.llama_get_memory(ctx), n_vocab=lc.llama_vocab_n_tokens(vocab))


def tokens(n: int, seed: int = 0, low: int = 200, high: int = 8000) -> list[int]:
    """Deterministic pseudo-text: random ordinary token ids."""
    return [int(t) for t in np.random.default_rng(seed).integers(low, high, size=n)]


def tiny_model(arch: str, directory: Path, dtype: str = "f16") -> Path:
    """Write (once) the tiny random-weights ``arch`` GGUF of agent/lab/tiny_gguf.py into ``directory``."""
    prepared = os.environ.get("CERTCHAT_TINY_GGUF_DIR")  # set by scripts/gpu_check.sh, which carries them
    if prepared and (Path(prepared) / f"tiny-{arch}-{dtype}.gguf").exists():
        return Path(prepared) / f"tiny-{arch}-{dtype}.gguf"
    path = Path(directory) / f"tiny-{arch}-{dtype}.gguf"
    if not path.exists():
        from agent.lab import tiny_gguf  # needs gguf, which the GPU check machine does not carry

        tiny_gguf.write_tiny_gguf(arch, path, dtype=dtype)
    return path


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two logit vectors."""
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def kv_capture(layers: Sequence[int]) -> Capture:
    """Capture the K and V cache views (all n_kv cells) the attention of ``layers`` reads."""

    def kq(t: int) -> np.ndarray:
        return read_tensor(src(t, 0))  # K view [1, n_head_kv, n_kv, d]

    def kqv(t: int) -> np.ndarray:
        product = GgmlTensor.from_address(t).view_src or t
        return read_tensor(src(product, 0))  # V view [1, n_head_kv, d, n_kv]

    reads: dict[str, Any] = {}
    for il in layers:
        reads[f"kq-{il}"] = kq
        reads[f"kqv-{il}"] = kqv
    return Capture(reads=reads)


def kv_by_position(cap: Capture, il: int, cell_pos: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{position: (K row, V column)} of layer ``il`` from a kv_capture and the layer's cell -> position map."""
    k = cap.values[f"kq-{il}"][0]  # [n_head_kv, n_kv, d]
    v = cap.values[f"kqv-{il}"][0]  # [n_head_kv, d, n_kv]
    out = {}
    for cell, pos in enumerate(cell_pos[: k.shape[1]]):
        if pos >= 0:
            out[int(pos)] = (k[:, cell, :].copy(), v[:, :, cell].copy())
    return out
