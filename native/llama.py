"""Owning wrappers over llama.cpp's low-level C API: Model, Context, Batch, Sampler.

Layered like llama-cpp-python's ``_internals.py``: the ctypes declarations come from
``llama_cpp`` (bound to our patched library by ``native.runtime``); each wrapper owns one
C object, frees it exactly once, keeps whatever it depends on alive (a Context holds its
Model, so the model is freed last), and turns failure codes into Python exceptions with
messages that say what went wrong and what to do. The functions of certchat's patch
(``native.patched``: per-cell bias, compaction, the attention readout) are methods of the
Context whose cache and graph they act on.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from native import patched, rope, runtime

log = logging.getLogger("certchat.llama")

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: Any = None  # the CFUNCTYPE object must outlive every llama.cpp call


class LlamaError(RuntimeError):
    """Base class for errors raised by the llama.cpp wrappers."""


class ModelLoadError(LlamaError):
    """llama.cpp could not load a model file."""


class ContextError(LlamaError):
    """llama.cpp could not create a context (usually: not enough memory for n_ctx)."""


class DecodeError(LlamaError):
    """llama_decode failed; ``code`` is its return value."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class KVCacheFull(DecodeError):
    """No free KV cells for the batch (llama_decode returned 1)."""


def lib() -> Any:
    """The ``llama_cpp`` module bound to the patched library, with the backend initialised."""
    global _backend_ready, _log_callback
    llama_cpp = runtime.llama_cpp()
    with _backend_lock:
        if not _backend_ready:
            _log_callback = llama_cpp.llama_log_callback(_route_log)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True
    return llama_cpp


def supports_gpu_offload() -> bool:
    """Whether the loaded library can offload layers to a GPU (a CUDA build)."""
    return bool(lib().llama_supports_gpu_offload())


# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line.
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}


def _route_log(level: int, text: bytes, _user: Any) -> None:
    # llama.cpp writes model-loading chatter to stderr by default; inside a TUI that would
    # corrupt the screen, so everything goes through Python logging instead.
    try:
        message = text.decode("utf-8", errors="replace").rstrip()
    except Exception:  # never raise through a C callback
        return
    if message:
        log.log(_LEVELS.get(level, logging.DEBUG), message)


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts the engine and the patch need."""

    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    n_swa: int
    layer_windows: tuple[int, ...]
    """Per layer, its attention window in tokens; 0 for a layer that sees every earlier position."""
    n_ctx_train: int
    n_vocab: int
    is_recurrent: bool
    is_hybrid: bool
    description: str


# Architectures llama.cpp runs with ALiBi even when the GGUF carries no max_alibi_bias key.
_ALIBI_ARCHS = frozenset({"bloom", "mpt", "refact", "jina-bert-v2"})


class Model:
    """A loaded GGUF model (weights + vocabulary)."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, vocab_only: bool = False) -> None:
        self._lib = lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        handle = self._lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not handle:
            raise ModelLoadError(f"llama.cpp could not load {self.path} (unsupported architecture or damaged file)")
        self._handle: Any = handle
        self._vocab = self._lib.llama_model_get_vocab(handle)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise LlamaError("the model was closed")
        return self._handle

    @property
    def vocab(self) -> Any:
        return self._vocab

    def close(self) -> None:
        """Free the model; safe to call twice."""
        if getattr(self, "_handle", None) is not None:
            self._lib.llama_model_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

    def info(self) -> ModelInfo:
        lc, h = self._lib, self.handle
        desc = ctypes.create_string_buffer(256)
        lc.llama_model_desc(h, desc, 256)
        n_layer = lc.llama_model_n_layer(h)
        return ModelInfo(
            n_layer=n_layer,
            n_head=lc.llama_model_n_head(h),
            n_head_kv=lc.llama_model_n_head_kv(h),
            n_embd=lc.llama_model_n_embd(h),
            n_swa=lc.llama_model_n_swa(h),
            layer_windows=patched.layer_windows(h, n_layer),
            n_ctx_train=lc.llama_model_n_ctx_train(h),
            n_vocab=lc.llama_vocab_n_tokens(self._vocab),
            is_recurrent=bool(lc.llama_model_is_recurrent(h)),
            is_hybrid=bool(lc.llama_model_is_hybrid(h)),
            description=desc.value.decode("utf-8", errors="replace"),
        )

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        buf = ctypes.create_string_buffer(4096)
        n = self._lib.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self._lib.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def head_dims(self) -> tuple[int, int] | None:
        """The size of one key head and one value head (GGUF ``attention.key_length`` / ``value_length``, else
        n_embd / n_head); None for a model without attention heads."""
        info = self.info()
        if info.n_head <= 0:
            return None
        arch = self.meta("general.architecture") or ""
        plain = info.n_embd // info.n_head
        key, value = self.meta(f"{arch}.attention.key_length"), self.meta(f"{arch}.attention.value_length")
        return (int(key) if key and key.isdigit() else plain, int(value) if value and value.isdigit() else plain)

    def rope(self) -> "rope.RopeSpec | None":
        """How the model rotates its full-attention layers' query and key rows; None where certchat cannot rotate
        them itself (no RoPE, M-RoPE, or a scaling such as YaRN that changes each dimension differently)."""
        kind = int(self._lib.llama_model_rope_type(self.handle))
        if kind not in (rope.NORM, rope.NEOX):
            return None
        arch = self.meta("general.architecture") or ""
        scaling = (self.meta(f"{arch}.rope.scaling.type") or "none").lower()
        if scaling not in ("none", "linear"):
            return None
        dims = self.head_dims()
        head_dim = dims[0] if dims else 0
        n_rot = self.meta(f"{arch}.rope.dimension_count")
        base = self.meta(f"{arch}.rope.freq_base")
        try:
            return rope.RopeSpec(kind, int(n_rot) if n_rot else head_dim, float(base) if base else 10000.0,
                                 float(self._lib.llama_model_rope_freq_scale_train(self.handle)) or 1.0)
        except ValueError:
            return None

    def eviction_unsupported(self) -> str | None:
        """Why certchat's patched cache cannot serve this model (one line naming it and what to use instead),
        or None. Recurrent and hybrid models keep state outside the KV cache, which eviction cannot thin;
        ALiBi models bias attention by distance, which the patch's per-cell bias and certificate refuse
        (a ``PatchError`` at the first eviction if not caught here)."""
        info = self.info()
        name = self.path.name
        if info.is_recurrent:
            return f"{name} is a recurrent model: it has no KV cache to evict; use a transformer model"
        if info.is_hybrid:
            return (f"{name} is a hybrid (attention + recurrent) model: its recurrent state cannot be evicted or "
                    "re-read; use a transformer model")
        arch = self.meta("general.architecture") or ""
        alibi = self.meta(f"{arch}.attention.max_alibi_bias")
        try:
            alibi_bias = float(alibi) if alibi is not None else 0.0
        except ValueError:
            alibi_bias = 0.0
        if arch in _ALIBI_ARCHS or alibi_bias > 0:
            return (f"{name} uses ALiBi positions ({arch}): certchat's eviction bias and certificate need "
                    "rotary or learned positions; use another model (`certchat models list`)")
        return None

    def chat_template(self) -> str | None:
        """The GGUF's default Jinja chat template, if it has one."""
        raw = self._lib.llama_model_chat_template(self.handle, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    # -- vocabulary -----------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ctypes.c_int32 * cap)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaError(f"tokenization failed for a text of {len(data)} bytes")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 sequence)."""
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.token_to_piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def bos(self) -> int:
        return int(self._lib.llama_vocab_bos(self._vocab))

    def eos(self) -> int:
        return int(self._lib.llama_vocab_eos(self._vocab))

    def adds_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))


class Batch:
    """A reusable llama_batch of token ids for one sequence."""

    def __init__(self, capacity: int) -> None:
        self._lib = lib()
        if capacity <= 0:
            raise ValueError("batch capacity must be positive")
        self.capacity = capacity
        self._batch: Any = self._lib.llama_batch_init(capacity, 0, 1)
        self._live = True

    @property
    def raw(self) -> Any:
        return self._batch

    @property
    def n_tokens(self) -> int:
        return int(self._batch.n_tokens)

    def set(self, tokens: Sequence[int], positions: Sequence[int], seq_id: int = 0,
            logits: str | Sequence[bool] = "last") -> None:
        """Fill the batch. ``logits``: "last", "all", "none" or one flag per token."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the batch capacity {self.capacity}")
        if len(positions) != n:
            raise ValueError("tokens and positions differ in length")
        b = self._batch
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = int(positions[i])
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            if logits == "last":
                b.logits[i] = 1 if i == n - 1 else 0
            elif logits == "all":
                b.logits[i] = 1
            elif logits == "none":
                b.logits[i] = 0
            else:
                b.logits[i] = 1 if logits[i] else 0  # type: ignore[index]
        b.n_tokens = n

    def close(self) -> None:
        if getattr(self, "_live", False):
            self._lib.llama_batch_free(self._batch)
            self._live = False

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class ContextParams:
    """The knobs certchat sets on a llama.cpp context."""

    n_ctx: int = 4096
    """Allocated KV cells."""
    n_batch: int = 512
    """Largest batch one llama_decode call takes."""
    n_ubatch: int = 512
    """Physical micro-batch."""
    n_threads: int = 2
    """CPU threads for decode and prefill."""
    flash_attn: bool = False
    """Flash attention; must stay off while certificates are computed."""
    swa_full: bool = True
    """Full-size sliding-window cache (llama.cpp's default)."""
    eval_callback: Callable[[int, bool], bool] | None = None
    """llama.cpp's graph callback (``cb_eval``), for a study that reads the graph's tensors: called with a node's
    address and ``ask`` True to ask whether to observe it, then, for the nodes it wanted, with ``ask`` False once the
    node is computed (read it with ``native.ggml_tensor``)."""


class Context:
    """An inference context (KV cache + compute graph) on a Model."""

    def __init__(self, model: Model, params: ContextParams) -> None:
        self._lib = lib()
        self.model = model  # keeps the model alive for as long as the context
        self.params = params
        cp = self._lib.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_ubatch, params.n_batch)
        cp.n_seq_max = 1
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads
        # The C default is AUTO (-1); certificates need it explicitly off.
        cp.flash_attn_type = 1 if params.flash_attn else 0
        cp.swa_full = params.swa_full
        cp.no_perf = True
        self._eval_callback: Any = None
        if params.eval_callback is not None:
            observe = params.eval_callback
            # kept on the context: llama.cpp holds only the C pointer
            self._eval_callback = self._lib.ggml_backend_sched_eval_callback(
                lambda tensor, ask, _user: bool(observe(int(tensor), bool(ask))))
            cp.cb_eval = self._eval_callback
            cp.cb_eval_user_data = None
        handle = self._lib.llama_init_from_model(model.handle, cp)
        if not handle:
            raise ContextError(
                f"llama.cpp could not create a context with n_ctx={params.n_ctx} (out of memory? try a smaller --n-ctx)"
            )
        self._handle: Any = handle
        self._memory = self._lib.llama_get_memory(handle)
        self.n_vocab = model.info().n_vocab

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise LlamaError("the context was closed")
        return self._handle

    @property
    def memory(self) -> Any:
        return self._memory

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self._lib.llama_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

    def n_ctx(self) -> int:
        return int(self._lib.llama_n_ctx(self.handle))

    def decode(self, batch: Batch) -> None:
        code = int(self._lib.llama_decode(self.handle, batch.raw))
        if code == 0:
            return
        if code == 1:
            raise KVCacheFull("no free KV cells for this batch: evict, or raise --n-ctx", code)
        if code == 2:
            raise DecodeError("decoding was aborted", code)
        if code == -1:
            raise DecodeError("invalid batch (positions must continue the sequence; tokens must be in the vocabulary)",
                              code)
        raise DecodeError(f"llama_decode failed with code {code}", code)

    def logits(self, index: int = -1, copy: bool = True) -> np.ndarray:
        """The logits of output row ``index`` (-1: the last one); with ``copy=False`` a read-only view of
        llama.cpp's buffer, valid only until the next decode (the per-token loop reads it once, in place)."""
        ptr = self._lib.llama_get_logits_ith(self.handle, index)
        if not ptr:
            raise LlamaError(f"no logits for output row {index} (was logits requested for that token?)")
        view = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        if copy:
            return view.copy()
        view.flags.writeable = False
        return view

    # -- KV memory --------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions [p0, p1) of a sequence (-1 = open end)."""
        return bool(self._lib.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move positions [p0, p1) of a sequence by ``delta`` (-1 = open end); llama.cpp re-rotates their keys
        (RoPE) at the next decode, and drops cells moved below position 0."""
        self._lib.llama_memory_seq_add(self._memory, seq_id, p0, p1, delta)

    def can_shift(self) -> bool:
        """Whether the cache can move positions (RoPE models; not M-RoPE or recurrent memory)."""
        return bool(self._lib.llama_memory_can_shift(self._memory))

    def seq_pos_min(self, seq_id: int = 0) -> int:
        return int(self._lib.llama_memory_seq_pos_min(self._memory, seq_id))

    def seq_pos_max(self, seq_id: int = 0) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._memory, seq_id))

    def clear(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)

    def seq_state(self, seq_id: int = 0) -> bytes:
        """The sequence's KV state (cells, positions, K/V) as bytes."""
        size = int(self._lib.llama_state_seq_get_size(self.handle, seq_id))
        buf = (ctypes.c_uint8 * size)()
        written = int(self._lib.llama_state_seq_get_data(self.handle, buf, size, seq_id))
        if written != size:
            raise LlamaError(f"saving the sequence state wrote {written} of {size} bytes")
        return bytes(buf)

    def set_seq_state(self, data: bytes, seq_id: int = 0) -> None:
        """Replace the sequence with a state from :meth:`seq_state` (the sequence is cleared first)."""
        self.seq_rm(seq_id, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(self._lib.llama_state_seq_set_data(self.handle, buf, len(data), seq_id)) == 0:
            raise LlamaError("restoring the sequence state failed (no room in the KV cache?)")

    # -- certchat's patch -------------------------------------------------------------
    def set_bias(self, seq_id: int, positions: Sequence[int] | np.ndarray, biases: Sequence[float] | np.ndarray) -> int:
        """Give the cells at ``positions`` these logit biases (−log π of a sampled survivor)."""
        return patched.set_bias_pos(self._memory, seq_id, positions, biases)

    def compact(self, seq_id: int = 0) -> int:
        """Move the sequence's live cells to the lowest indices, so attention spans only them."""
        return patched.compact(self.handle, seq_id)

    def set_reinsert(self, on: bool) -> None:
        """Accept batches below the sequence's largest position, at positions it does not hold (patch 0005)."""
        patched.set_reinsert(self.handle, on)

    def set_attn_readout(self, on: bool, n_window: int) -> None:
        """Compute the certificate and the per-cell importance over the last ``n_window`` rows of each
        ubatch, or stop (the graph drops them; the window is kept so resuming rebuilds nothing)."""
        patched.set_attn_certificate(self.handle, on, n_window)

    def attn_certificate(self) -> patched.Certificate:
        """The last ubatch's certificate terms."""
        return patched.get_certificate(self.handle)

    def attn_importance(self) -> patched.Importance:
        """The last ubatch's attention mass per cell."""
        return patched.get_importance(self.handle)

    def keys(self, seq_id: int, layers: Sequence[int], positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """K rows (after RoPE, F32) of the sequence's cells at ``positions`` for ``layers``: [layers, pos, width]."""
        return patched.get_keys(self.handle, layers, positions, seq_id)

    def kv_row_bytes(self, seq_id: int = 0) -> int:
        """The bytes of one cell's K/V row over all layers, as :meth:`kv_rows` reads it (patch 0007); raises
        :class:`native.patched.PatchError` where the cache cannot give one (iSWA, recurrent or hybrid memory)."""
        return patched.rows_size(self.handle, seq_id)

    def kv_rows(self, seq_id: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Every layer's K/V bytes of the sequence's cells at ``positions``: [pos, row bytes] (patch 0007)."""
        return patched.get_rows(self.handle, positions, seq_id)

    def put_kv_rows(self, seq_id: int, positions: Sequence[int] | np.ndarray, rows: np.ndarray) -> None:
        """Put rows read by :meth:`kv_rows` back at ``positions``, which the sequence must not hold."""
        patched.put_rows(self.handle, positions, rows, seq_id)

    def set_attn_queries(self, layers: Sequence[int] | None, n_window: int) -> None:
        """Report the query rows of ``layers`` over each ubatch's last ``n_window`` rows (None: off)."""
        patched.set_attn_queries(self.handle, layers, n_window)

    def attn_queries(self) -> patched.Queries:
        """The last ubatch's query rows with the log-sum-exp of their softmax."""
        return patched.get_attn_queries(self.handle)


@dataclass(frozen=True)
class SamplerParams:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    """1.0 disables the repetition penalty."""
    repeat_last_n: int = 64
    seed: int = 0


class Sampler:
    """A llama.cpp sampler chain built from SamplerParams."""

    def __init__(self, params: SamplerParams, n_vocab: int) -> None:
        self._lib = lc = lib()
        self.params = params
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if params.repeat_penalty != 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(
                n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0))
        if params.temperature <= 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(params.top_k))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self._chain: Any = chain

    @property
    def plain_greedy(self) -> bool:
        """The chain is greedy alone (no penalties): the choice is the first largest logit."""
        return self.params.temperature <= 0.0 and self.params.repeat_penalty == 1.0

    def sample(self, ctx: Context, index: int = -1, logits: np.ndarray | None = None) -> int:
        """Choose (and accept) the next token from output row ``index``. Given that row's ``logits``, a plain
        greedy chain is answered by argmax over them: llama.cpp's greedy sampler keeps the first largest
        logit too, but first copies the whole vocabulary into candidate records (0.4 ms a token at 152k)."""
        if logits is not None and self.plain_greedy:
            token = int(np.argmax(logits))
            self._lib.llama_sampler_accept(self._chain, token)
            return token
        return int(self._lib.llama_sampler_sample(self._chain, ctx.handle, index))

    def accept(self, token: int) -> None:
        """Feed a token the sampler did not choose (history for the repetition penalty)."""
        self._lib.llama_sampler_accept(self._chain, token)

    def reset(self) -> None:
        self._lib.llama_sampler_reset(self._chain)

    def close(self) -> None:
        if getattr(self, "_chain", None) is not None:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:
        self.close()
