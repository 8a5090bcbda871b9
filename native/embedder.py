"""A chat model's own text embeddings: its last hidden states, mean-pooled over a text's tokens.

A second llama.cpp context on the model with embeddings on (``pooling_type = mean``), separate from the chat's
cache: it reads each text from an empty cache, so a message's vector does not depend on what came before it.
Several texts share one decode, each its own sequence in a unified cache, because a 2-core CPU computes forty
tokens barely faster than four hundred.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from native import llama

POOLING_MEAN = 1
"""llama.cpp's ``LLAMA_POOLING_TYPE_MEAN``."""


class Embedder:
    """Mean-pooled hidden states of a GGUF model for whole texts; each text cut to ``n_ctx`` tokens."""

    def __init__(self, model_path: str | Path, n_ctx: int = 1024, n_threads: int = 2, max_seqs: int = 16) -> None:
        self._lib = llama.lib()
        self.model = llama.Model(model_path)
        self.n_ctx = n_ctx
        self.max_seqs = max_seqs
        self.n_embd = self.model.info().n_embd
        cp = self._lib.llama_context_default_params()
        # llama.cpp pools each micro-batch on its own and keeps the last one's mean: a text must fit one micro-batch.
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = max_seqs
        cp.kv_unified = True  # the packed texts share the n_ctx cells instead of n_ctx / max_seqs each
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.embeddings = True
        cp.pooling_type = POOLING_MEAN
        cp.no_perf = True
        handle = self._lib.llama_init_from_model(self.model.handle, cp)
        if not handle:
            raise llama.ContextError(f"llama.cpp could not create an embeddings context with n_ctx={n_ctx}")
        self._handle: Any = handle
        self._memory = self._lib.llama_get_memory(handle)
        self._batch = llama.Batch(n_ctx)

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self._batch.close()
            self._lib.llama_free(self._handle)
            self._handle = None
            self.model.close()

    def __del__(self) -> None:
        self.close()

    def tokens(self, text: str) -> list[int]:
        """The ids a text is embedded from: special tokens as the model adds them, none parsed out of the text."""
        return self.model.tokenize(text, add_special=True, parse_special=False)[: self.n_ctx] or [self.model.eos()]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One row per text (float32, ``n_embd`` wide), in order."""
        out = np.zeros((len(texts), self.n_embd), dtype=np.float32)
        pending: list[tuple[int, list[int]]] = []
        used = 0
        for i, text in enumerate(texts):
            ids = self.tokens(text)
            if pending and (used + len(ids) > self.n_ctx or len(pending) == self.max_seqs):
                self._decode(pending, out)
                pending, used = [], 0
            pending.append((i, ids))
            used += len(ids)
        if pending:
            self._decode(pending, out)
        return out

    def _decode(self, pending: list[tuple[int, list[int]]], out: np.ndarray) -> None:
        b = self._batch.raw
        n = 0
        for seq, (_, ids) in enumerate(pending):
            for pos, token in enumerate(ids):
                b.token[n] = token
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = 1  # pooling needs every token's output
                n += 1
        b.n_tokens = n
        code = int(self._lib.llama_decode(self._handle, b))
        if code != 0:
            self._lib.llama_memory_clear(self._memory, True)
            raise llama.DecodeError(f"llama_decode failed with code {code} while embedding", code)
        for seq, (row, _) in enumerate(pending):
            ptr = self._lib.llama_get_embeddings_seq(self._handle, seq)
            if not ptr:
                raise llama.LlamaError(f"no pooled embedding for sequence {seq}")
            out[row] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,))
        self._lib.llama_memory_clear(self._memory, True)
