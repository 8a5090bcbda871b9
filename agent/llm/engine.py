"""The inference engine: one model, one context, one sequence; prefill, sample, stream, evict.

Drives llama.cpp's low-level API through ``native.llama`` (the high-level ``Llama``
class assumes contiguous positions, which eviction breaks). The engine is the one owner of
the KV cache and of its mirror — each live position's token, the message it belongs to and
its cumulative log inclusion probability: only the engine adds, removes, biases and compacts
cells (:meth:`Engine.evict` applies a keep set in one call), so policies and the gate read the
mirror and never write it. It knows nothing of SQLite or the UI.
"""

from __future__ import annotations

import bisect
import codecs
import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from agent.events import Hook
from agent.llm.evicted_rows import EvictedRows
from native import llama, patched, rope
from native.sketch import EvictedKeySketch, SketchRows

if TYPE_CHECKING:
    from agent.config import Config


@dataclass(frozen=True)
class EngineSettings:
    """How to load the model and size the context."""

    model_path: Path
    n_ctx: int = 8192
    n_batch: int = 512
    threads: int = 2
    gpu_layers: int = 0

    @classmethod
    def from_config(cls, config: "Config", model_path: Path, n_ctx: int | None = None) -> "EngineSettings":
        """The settings a configuration asks for (``n_ctx`` overrides the configured context size)."""
        return cls(model_path=model_path, n_ctx=config.n_ctx if n_ctx is None else n_ctx, n_batch=config.n_batch,
                   threads=config.threads, gpu_layers=config.gpu_layers)


@dataclass
class CacheMirror:
    """What the KV cache holds, position by position (kept sorted by position)."""

    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    """Index of the message each position belongs to (for per-turn retention and spans)."""
    logpi: list[float] = field(default_factory=list)
    """Cumulative log inclusion probability of each live position (0 until sampled)."""
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per message: the positions [first, end) it was fed at, whether still live or evicted since (a targeted
    re-read puts a message's evicted tokens back at these positions)."""

    def append(self, tokens: list[int], start: int, segment: int) -> None:
        self.positions.extend(range(start, start + len(tokens)))
        self.tokens.extend(tokens)
        self.segments.extend([segment] * len(tokens))
        self.logpi.extend([0.0] * len(tokens))
        self._extend_span(segment, start, start + len(tokens))

    def insert(self, tokens: list[int], start: int, segment: int) -> None:
        """Put ``tokens`` back at positions [start, start + n), which no live cell holds, in position order."""
        at = bisect.bisect_left(self.positions, start)
        n = len(tokens)
        self.positions[at:at] = range(start, start + n)
        self.tokens[at:at] = tokens
        self.segments[at:at] = [segment] * n
        self.logpi[at:at] = [0.0] * n

    def _extend_span(self, segment: int, start: int, end: int) -> None:
        span = self.spans.get(segment)
        self.spans[segment] = (start, end) if span is None or span[1] != start else (span[0], end)

    def cut(self, pos: int) -> None:
        """Forget the spans of positions ≥ ``pos`` (the sequence was truncated there)."""
        for segment, (first, end) in list(self.spans.items()):
            if first >= pos:
                del self.spans[segment]
            elif end > pos:
                self.spans[segment] = (first, pos)

    def keep(self, mask: np.ndarray) -> None:
        """Drop the positions where ``mask`` is False."""
        idx = np.flatnonzero(mask)
        self.positions = [self.positions[i] for i in idx]
        self.tokens = [self.tokens[i] for i in idx]
        self.segments = [self.segments[i] for i in idx]
        self.logpi = [self.logpi[i] for i in idx]

    def clear(self) -> None:
        self.positions.clear()
        self.tokens.clear()
        self.segments.clear()
        self.logpi.clear()
        self.spans.clear()

    def __len__(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class EngineSnapshot:
    """A saved sequence state plus the mirror that describes it."""

    state: bytes
    positions: list[int]
    tokens: list[int]
    segments: list[int]
    logpi: list[float]
    next_pos: int
    sketch: EvictedKeySketch | None = None
    """The evicted cells' keys at that moment (a copy)."""
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    held: SketchRows | None = None
    """The sketch rows of re-inserted cells, kept for their next eviction (see ``Engine._held``)."""
    reinserted: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    """The live positions :meth:`Engine.reinsert` put back."""
    rounds: int = 0
    """Eviction rounds since the cache was last empty (``Engine.rounds``)."""
    frame_offset: int = 0
    """How far the frame had shifted (``Engine.frame_offset``)."""
    homeless: frozenset[int] = frozenset()
    """Messages a frame shift had taken the span of (``Engine.homeless``)."""
    transient: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    """Live positions of messages fed again at fresh positions for the turn (``Engine.feed_transient``)."""


@dataclass(frozen=True)
class FrameShift:
    """What :meth:`Engine.shift_frame` did."""

    low: int
    """Cells below it stayed (the sinks)."""
    cut: int
    """Live cells in [low, cut) were packed behind the sinks."""
    packed: int
    delta: int
    """How far every cell from ``cut`` on moved down."""
    homeless: tuple[int, ...]
    """Messages that lost their span (a re-read feeds them at fresh positions)."""


@dataclass
class Generation:
    """One generated answer."""

    tokens: list[int]
    text: str
    stop: str
    """"eog" (the model ended its turn), "max_tokens", "cancelled" or "hook" (a step hook asked to stop)."""
    decode_ms: float
    logprobs: list[float]
    """Log-probability of each chosen token under the model (output confidence)."""

    @property
    def tok_per_s(self) -> float:
        return 1000.0 * len(self.tokens) / self.decode_ms if self.decode_ms > 0 else 0.0


class Engine:
    """Prefill and decode for one conversation sequence."""

    SEQ = 0

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.model = llama.Model(settings.model_path, n_gpu_layers=settings.gpu_layers)
        self.info = self.model.info()
        unsupported = self.model.eviction_unsupported()
        if unsupported:
            self.model.close()
            raise llama.LlamaError(unsupported)
        self.ctx = llama.Context(
            self.model,
            llama.ContextParams(n_ctx=settings.n_ctx, n_batch=settings.n_batch, n_ubatch=settings.n_batch,
                                n_threads=settings.threads, flash_attn=False),
        )
        self.n_ctx = self.ctx.n_ctx()
        self.batch = llama.Batch(settings.n_batch)
        self.cache = CacheMirror()
        self.next_pos = 0
        self.fed: Hook[[int, list[int]]] = Hook()
        """Heard after every :meth:`feed`: (the position it started at, its tokens)."""
        self.readout: tuple[bool, int] = (False, 0)
        """(on, window) of the in-graph attention readout (certificate + importance) the context computes."""
        self.sketch: EvictedKeySketch | None = None
        """Phase 1 of the two-phase design: a quantised copy of every evicted cell's keys (``set_sketch``)."""
        self._sketch_spec: tuple[tuple[int, ...], int, int] = ((), 8, 0)
        """(layers, bits, query window) of the sketch; no layers: none."""
        self._held: SketchRows | None = None
        """The sketch rows of cells re-inserted at their old positions, as first evicted: when those cells are
        evicted again these rows go back to the sketch, not their keys as re-decoded. A re-inserted cell is decoded
        over the evicted cache, not over the context its message first had, and its keys can draw a later question's
        attention out of all proportion (docs/results/NOTES.md)."""
        self._reinserted = np.empty(0, np.int64)
        """The live positions :meth:`reinsert` put back (sorted), for :meth:`evict_reinserted`."""
        self.rounds = 0
        """Eviction rounds that removed cells since the cache was last empty. After one, every kept cell was
        decoded over the whole history; after two, some were decoded over an evicted one, and their K/V drift
        from the full cache's (the certificate is calibrated for each case: agent.gate.certificate)."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.biases_lifted = False
        """The cells' −log π biases are lifted for this turn (:meth:`lift_biases`)."""
        self.rows: EvictedRows | None = None
        """Every evicted cell's K/V rows, all layers, as first computed (:meth:`keep_rows`): :meth:`reinsert` puts a
        message back from them (a copy) rather than decoding it over the evicted cache. None: off, or a cache that
        cannot give them."""
        self.copied_tokens = 0
        """Tokens :meth:`reinsert` has put back from :attr:`rows` rather than decoded, since the engine started."""
        self.rope = self.model.rope()
        """How the model rotates its rows (None: certchat cannot rotate them; no frame shift with a sketch)."""
        self.homeless: set[int] = set()
        """Messages whose span a frame shift took (:meth:`shift_frame`): a re-read feeds them at fresh positions."""
        self._transient = np.empty(0, np.int64)
        """Live positions of messages fed again at fresh positions for one turn (:meth:`feed_transient`): evicted
        again, they leave nothing in the sketch or the rows, which keep the message as first evicted."""
        self.frame_offset = 0
        """How far :meth:`shift_frame` has moved the newest cells down since the cache was last empty: a position
        fed now is the conversation's position ``next_pos + frame_offset`` (what the log keeps)."""

    def keep_rows(self, budget_mb: int) -> None:
        """Keep the K/V rows of cells evicted from now on in up to ``budget_mb`` MiB of host memory (0: none, and
        forget those kept). Rows already kept stay, within the new budget."""
        if budget_mb <= 0:
            self.rows = None
        elif self.rows is not None:
            self.rows.resize(budget_mb << 20)
        else:
            try:
                row_bytes = self.ctx.kv_row_bytes(self.SEQ)
            except patched.PatchError:
                return  # iSWA or recurrent memory: re-reads decode, as without the rows
            self.rows = EvictedRows(row_bytes, budget_mb << 20)

    def _rotate_row_keys(self, rows: np.ndarray, offset: int) -> np.ndarray | None:
        """``rows`` (as :meth:`kv_rows` reads them) with every layer's key rotated by ``offset`` positions, as
        llama.cpp's K-shift rotates a live cell; None where the row is not F16 keys and values of one head size
        in every layer (a quantised or mixed cache: its rows are then let go at a shift)."""
        info, spec = self.info, self.rope
        head_dim = self.model.head_dims()
        if spec is None or head_dim is None or head_dim[0] != head_dim[1] or head_dim[0] < spec.n_rot \
                or rows.shape[1] != 4 * info.n_layer * info.n_head_kv * head_dim[0]:
            return None
        width = info.n_head_kv * head_dim[0]
        out = np.array(rows, dtype=np.uint8, copy=True)
        layers = out.reshape(len(out), info.n_layer, 2, width * 2)  # per layer: K row then V row, F16
        for first in range(0, len(out), 4096):  # bounded scratch: rope.rotate works in float64
            keys = layers[first:first + 4096, :, 0].view(np.float16)
            keys[...] = rope.rotate(keys.astype(np.float32), head_dim[0], spec, offset).astype(np.float16)
        return out

    def close(self) -> None:
        """Free in dependency order: batch, context, model."""
        self.batch.close()
        self.ctx.close()
        self.model.close()

    # -- cache bookkeeping ---------------------------------------------------------------
    @property
    def live_cells(self) -> int:
        return len(self.cache)

    def free_cells(self) -> int:
        return self.n_ctx - len(self.cache)

    def snapshot(self, share_sketch: bool = False) -> "EngineSnapshot":
        """Everything needed to come back to this exact cache (for independent probes). ``share_sketch``: the live
        sketch itself rather than a copy, for a caller that reads the snapshot before the cache changes again
        (saving a chat state copies the sketch's rows anyway)."""
        sketch = self.sketch if self.sketch is not None and self.sketch.n_tokens else None
        return EngineSnapshot(self.ctx.seq_state(self.SEQ), list(self.cache.positions), list(self.cache.tokens),
                              list(self.cache.segments), list(self.cache.logpi), self.next_pos,
                              sketch if share_sketch or sketch is None else copy.deepcopy(sketch),
                              dict(self.cache.spans), self._held, self._reinserted, self.rounds, self.frame_offset,
                              frozenset(self.homeless), self._transient)

    def restore(self, snap: "EngineSnapshot") -> None:
        """Put the cache back as it was, biases included (state files carry none)."""
        self.ctx.set_seq_state(snap.state, self.SEQ)
        self.cache = CacheMirror(list(snap.positions), list(snap.tokens), list(snap.segments), list(snap.logpi),
                                 dict(snap.spans))
        self.next_pos = snap.next_pos
        if self.rows is not None:
            self.rows.forget_from(snap.next_pos)
        self._write_biases()
        if snap.sketch is not None:
            self.sketch = copy.deepcopy(snap.sketch)
            self.sketch.rope = self.rope
        elif self.sketch is not None:
            self.sketch.clear()
        self._held = snap.held
        self._reinserted = snap.reinserted
        self.rounds = snap.rounds
        self.frame_offset = snap.frame_offset
        self.homeless = set(snap.homeless)
        self._transient = snap.transient

    def evict(self, keep: np.ndarray, cum_logpi: np.ndarray | None = None, remember: bool = True) -> None:
        """Keep only the live cells where ``keep`` is True (mirror order) and compact the rest away; with
        ``cum_logpi`` (one value per live cell), the survivors' cumulative log π, written as their −log π
        logit bias. Arguments are checked before anything changes, so the call does all of it or nothing.
        ``remember=False``: the cells are dropped, not evicted — neither the sketch nor the rows keep them, and
        no eviction round is counted (a full cache making room before :meth:`shift_down`)."""
        keep = np.asarray(keep, dtype=bool)
        n = len(self.cache)
        if keep.shape != (n,):
            raise ValueError(f"keep mask of shape {keep.shape} for {n} live cells")
        if cum_logpi is not None:
            cum_logpi = np.asarray(cum_logpi, dtype=np.float64)
            kept = cum_logpi[keep] if cum_logpi.shape == (n,) else cum_logpi
            if cum_logpi.shape != (n,) or not np.isfinite(kept).all() or (kept > 1e-9).any():
                raise ValueError(f"cum_logpi must hold {n} values, finite and ≤ 0 where kept")
        if n and not keep[-1]:
            raise ValueError("the newest cell cannot be evicted: the next batch continues from its position")
        positions = np.asarray(self.cache.positions, dtype=np.int64)
        gone = positions[~keep]
        gone_segments = np.asarray(self.cache.segments, dtype=np.int32)[~keep]
        layers, bits, _ = self._sketch_spec
        held = rest = None
        if self._held is not None and len(gone):
            held, rest = self._held.split(gone)
        fresh = ~np.isin(gone, held.positions) if held is not None else np.ones(len(gone), dtype=bool)
        transient = np.isin(gone, self._transient)
        fresh &= ~transient
        keys = self.ctx.keys(self.SEQ, layers, gone[fresh]) if remember and layers and fresh.any() else None
        if remember and self.rows is not None and len(gone):
            # a re-inserted cell's rows are already kept (put back from them) or were decoded over the evicted
            # cache (kept nowhere): only first evictions are stored, so the store holds rows as first computed
            first = ~np.isin(gone, self._reinserted) & ~transient
            if first.any():
                tokens = np.asarray(self.cache.tokens, dtype=np.int64)[~keep][first]
                self.rows.put(gone[first], tokens, self.ctx.kv_rows(self.SEQ, gone[first]))
        for p0, p1 in _runs(gone):
            if not self.ctx.seq_rm(self.SEQ, p0, p1):
                raise llama.LlamaError(f"could not evict positions [{p0}, {p1})")
        if rest is not None:
            self._held = rest
        self._reinserted = np.setdiff1d(self._reinserted, gone, assume_unique=True)
        self._transient = np.setdiff1d(self._transient, gone, assume_unique=True)
        if keys is not None:
            if self.sketch is None:
                self.sketch = EvictedKeySketch(layers, self.info.n_head_kv, keys.shape[2] // self.info.n_head_kv, bits,
                                               threads=self.settings.threads, rope=self.rope)
            self.sketch.append(gone[fresh], gone_segments[fresh], keys)
        if held is not None and self.sketch is not None:
            self.sketch.put(held)
        self.cache.keep(keep)
        if len(gone) and remember:
            self.rounds += 1
        if cum_logpi is not None:
            self.cache.logpi = [float(x) for x in cum_logpi[keep]]
        self._write_biases()
        self.ctx.compact(self.SEQ)

    def _write_biases(self) -> None:
        self.biases_lifted = False
        if len(self.cache):
            bias = (-np.asarray(self.cache.logpi, dtype=np.float64)).astype(np.float32)
            self.ctx.set_bias(self.SEQ, np.asarray(self.cache.positions, dtype=np.int32), bias)

    def lift_biases(self) -> None:
        """Let attention read every live cell as itself — bias 0 — until :meth:`restore_biases`, the next
        :meth:`evict` or :meth:`restore`; the mirror keeps each cell's cumulative log π for the next round."""
        if len(self.cache):
            self.ctx.set_bias(self.SEQ, np.asarray(self.cache.positions, dtype=np.int32),
                              np.zeros(len(self.cache), dtype=np.float32))
        self.biases_lifted = True

    def restore_biases(self) -> None:
        """Write the −log π biases back after :meth:`lift_biases` (nothing to do otherwise)."""
        if self.biases_lifted:
            self._write_biases()

    def applied_logpi(self) -> np.ndarray:
        """Each live cell's log π as attention reads it now, in cache order: the mirror's cumulative log π, or 0
        for every cell while the biases are lifted (what a readout of this moment's attention was weighted by)."""
        if self.biases_lifted:
            return np.zeros(len(self.cache), dtype=np.float64)
        return np.asarray(self.cache.logpi, dtype=np.float64)

    # -- the attention readout -------------------------------------------------------------
    def set_readout(self, on: bool, window: int) -> None:
        """Have the graph compute the certificate and the importance over each ubatch's last ``window`` rows
        (and the sketch's query rows), or stop; a no-op when nothing changes, since every change rebuilds the
        graph reservation."""
        if (on, window) != self.readout:
            self.ctx.set_attn_readout(on, window)
            layers, _, q_window = self._sketch_spec
            if layers:
                self.ctx.set_attn_queries(layers if on else None, q_window)
            self.readout = (on, window)

    def set_sketch(self, layers: tuple[int, ...], bits: int, window: int) -> None:
        """Keep the keys of evicted cells for ``layers`` (none: no sketch) and report the query rows of each
        ubatch's last ``window`` rows for them while the readout is on. A changed sketch starts empty: cells
        evicted before it are not in it."""
        if (layers, bits, window) == self._sketch_spec:
            return
        bad = [x for x in layers if x >= self.info.n_layer]
        if bad:
            raise ValueError(f"sketch_layers: the model has layers 0–{self.info.n_layer - 1}, not {bad}")
        windowed = [x for x in layers if self.info.layer_windows[x]]
        if windowed:
            full = ",".join(str(il) for il, w in enumerate(self.info.layer_windows) if w == 0) or "none"
            raise ValueError(f"sketch_layers: layers {','.join(map(str, windowed))} of this model attend through a "
                             f"{self.info.layer_windows[windowed[0]]}-token sliding window and never see an evicted "
                             f"message; choose among its full-attention layers ({full}) or use \"auto\"")
        self.sketch = None
        self._held = None
        self._sketch_spec = (tuple(layers), bits, window)
        self.ctx.set_attn_queries(layers if layers and self.readout[0] else None, max(1, window))

    @property
    def sketch_spec(self) -> tuple[tuple[int, ...], int, int]:
        """(layers, bits, query window) of the sketch (:meth:`set_sketch`); no layers: none."""
        return self._sketch_spec

    def read_queries(self) -> patched.Queries:
        return self.ctx.attn_queries()

    def _forget_in_sketch(self) -> None:
        """The sketch holds only cells that are gone: drop those back in the cache or past the sequence's end."""
        if self.sketch is None or not self.sketch.n_tokens:
            return
        stored = self.sketch.positions
        back = np.isin(stored, np.asarray(self.cache.positions, dtype=np.int32)) | (stored >= self.next_pos)
        if back.any():
            self.sketch.drop(stored[back])

    @property
    def reading(self) -> bool:
        """Whether the last ubatch computed the readout."""
        return self.readout[0]

    def read_certificate(self) -> patched.Certificate:
        return self.ctx.attn_certificate()

    def read_importance(self) -> patched.Importance:
        return self.ctx.attn_importance()

    def truncate(self, pos: int) -> None:
        """Forget every position ≥ ``pos`` (the newest tokens), so decoding resumes at ``pos``."""
        if not self.ctx.seq_rm(self.SEQ, pos, -1):
            raise llama.LlamaError(f"could not remove positions from {pos} on")
        keep = np.asarray(self.cache.positions, dtype=np.int64) < pos
        self.cache.keep(keep)
        self.cache.cut(pos)
        self.next_pos = pos
        if self.rows is not None:
            self.rows.forget_from(pos)
        self._forget_in_sketch()
        if self._held is not None:
            self._held = self._held.split(self._held.positions[self._held.positions >= pos])[1]
        self._reinserted = self._reinserted[self._reinserted < pos]
        self._transient = self._transient[self._transient < pos]

    def reset(self) -> None:
        """Empty the KV cache (a new conversation, or a full re-prefill)."""
        self.ctx.clear()
        self.cache.clear()
        self.next_pos = 0
        self.frame_offset = 0
        self.homeless = set()
        self._transient = np.empty(0, np.int64)
        self._held = None
        self._reinserted = np.empty(0, np.int64)
        self.rounds = 0
        if self.rows is not None:
            self.rows.clear()
        if self.sketch is not None:
            self.sketch.clear()

    # -- prefill ---------------------------------------------------------------------------
    def feed(self, tokens: list[int], segment: int, logits_last: bool = True,
             cancel: threading.Event | None = None, progress: Callable[[int], None] | None = None,
             scores: list[float] | None = None) -> float:
        """Decode ``tokens`` at the next positions (teacher-forced); returns milliseconds. ``cancel`` is
        checked before each batch (``InterruptedError``); ``progress(n)`` hears the tokens done after each.
        Given ``scores``, the log-probability of each token after the first, given everything before it, is
        appended to it (every row's logits are then computed: slower, for studies of the model's fit)."""
        origin = self.next_pos
        if not tokens:
            self.fed(origin, tokens)
            return 0.0
        if len(tokens) > self.free_cells():
            raise llama.KVCacheFull(
                f"{len(tokens)} tokens do not fit in the {self.free_cells()} free KV cells (n_ctx={self.n_ctx})", 1)
        start = time.perf_counter()
        n_batch = self.settings.n_batch
        # The remainder goes first so that the last ubatch is a full one: the in-graph
        # certificate and importance report the last rows of the last ubatch only.
        first = len(tokens) % n_batch or n_batch
        bounds = [0, *range(first, len(tokens), n_batch)]
        # After a truncation the newest live cell may sit below next_pos - 1 (its successors were evicted, e.g. a
        # question taken out for a targeted re-read): llama.cpp then needs leave to continue past the gap.
        gap = bool(self.cache.positions) and self.cache.positions[-1] != self.next_pos - 1
        if gap:
            self.ctx.set_reinsert(True)
        try:
            for offset, end in zip(bounds, [*bounds[1:], len(tokens)]):
                if cancel is not None and cancel.is_set():
                    raise InterruptedError("prefill cancelled")
                chunk = tokens[offset:end]
                last_chunk = end >= len(tokens)
                positions = list(range(self.next_pos, self.next_pos + len(chunk)))
                rows = "all" if scores is not None else "last" if (logits_last and last_chunk) else "none"
                self.batch.set(chunk, positions, self.SEQ, logits=rows)
                self.ctx.decode(self.batch)
                if scores is not None:
                    # row i predicts the token after it: the next chunk's first token for the chunk's last row
                    for i, token in enumerate(tokens[offset + 1:end + 1]):
                        scores.append(_log_softmax_at(self.ctx.logits(i, copy=False), int(token)))
                self.cache.append(chunk, self.next_pos, segment)
                self.next_pos += len(chunk)
                if progress is not None:
                    progress(end)
        finally:
            if gap:
                self.ctx.set_reinsert(False)
        ms = (time.perf_counter() - start) * 1000.0
        self.fed(origin, tokens)
        return ms

    def evicted_runs(self, segment: int) -> list[tuple[int, int]]:
        """The [p0, p1) runs of message ``segment``'s positions that are no longer in the cache."""
        span = self.cache.spans.get(segment)
        if span is None:
            return []
        live = np.asarray(self.cache.positions, dtype=np.int64)
        live = live[(live >= span[0]) & (live < span[1])]
        gone = np.setdiff1d(np.arange(span[0], span[1], dtype=np.int64), live, assume_unique=True)
        return _runs(gone)

    def evicted_by_message(self) -> dict[int, list[tuple[int, int]]]:
        """:meth:`evicted_runs` of every message that has any, in one pass over the cache (a ranking reads them all
        each turn)."""
        if not self.cache.spans:
            return {}
        positions = np.asarray(self.cache.positions, dtype=np.int64)
        low = min(p0 for p0, _ in self.cache.spans.values())
        high = max(p1 for _, p1 in self.cache.spans.values())
        live = np.zeros(high - low, dtype=bool)
        live[positions[(positions >= low) & (positions < high)] - low] = True
        out: dict[int, list[tuple[int, int]]] = {}
        for segment, (p0, p1) in self.cache.spans.items():
            gone = np.flatnonzero(~live[p0 - low:p1 - low])
            if len(gone):
                out[segment] = _runs(gone + p0)
        return out

    def reinsert(self, tokens: list[int], start: int, segment: int, cancel: threading.Event | None = None,
                 progress: Callable[[int], None] | None = None) -> float:
        """Put ``tokens`` back at their old positions [start, start + n), evicted positions below the sequence's
        end: copied from :attr:`rows` when it keeps every one of them for exactly these tokens (patch 0007: the
        K/V the cache first computed), else decoded (patch 0005: each sees the cells before it, biases included).
        Every later position sees them. They come back unbiased (π = 1) and leave the sketch, which keeps their
        rows for their next eviction (:attr:`_held`). Returns milliseconds; ``cancel`` and ``progress`` as for
        :meth:`feed`."""
        n = len(tokens)
        if n == 0:
            return 0.0
        live = np.asarray(self.cache.positions, dtype=np.int64)
        if start < 0 or start + n > self.next_pos:
            raise ValueError(f"positions [{start}, {start + n}) are not below the sequence's end {self.next_pos}")
        if np.any((live >= start) & (live < start + n)):
            raise ValueError(f"positions [{start}, {start + n}) are partly still in the cache")
        if n > self.free_cells():
            raise llama.KVCacheFull(f"{n} tokens do not fit in the {self.free_cells()} free KV cells", 1)
        begin = time.perf_counter()
        n_batch = self.settings.n_batch
        if self.copy_back([(tokens, start, segment)]):
            if progress is not None:
                progress(n)
            return (time.perf_counter() - begin) * 1000.0
        self.ctx.set_reinsert(True)
        try:
            for offset in range(0, n, n_batch):
                if cancel is not None and cancel.is_set():
                    raise InterruptedError("re-read cancelled")
                chunk = tokens[offset:offset + n_batch]
                pos0 = start + offset
                self.batch.set(chunk, list(range(pos0, pos0 + len(chunk))), self.SEQ, logits="none")
                self.ctx.decode(self.batch)
                self.cache.insert(chunk, pos0, segment)
                if progress is not None:
                    progress(offset + len(chunk))
        finally:
            self.ctx.set_reinsert(False)
            live = np.asarray(self.cache.positions, dtype=np.int64)
            self._took_back(live[(live >= start) & (live < start + n)])
        return (time.perf_counter() - begin) * 1000.0

    def _took_back(self, back: np.ndarray) -> None:
        """The sorted positions ``back`` are in the cache again, re-inserted; their sketch rows wait in
        :attr:`_held` for their next eviction."""
        self._reinserted = np.union1d(self._reinserted, back)
        if self.sketch is not None and self.sketch.n_tokens:
            self._held = SketchRows.join(self._held, self.sketch.take(back))

    def copy_back(self, runs: Sequence[tuple[Sequence[int], int, int]]) -> bool:
        """Put every (tokens, start, segment) run back at its old positions from :attr:`rows`, in one copy, when
        the rows hold all of them for exactly these tokens; else change nothing and return False. As
        :meth:`reinsert` does run by run, without a Python pass per run over the cache."""
        if self.rows is None or not runs:
            return False
        parts = []
        for tokens, start, _ in runs:
            rows = self.rows.take(start, tokens)
            if rows is None:
                return False
            parts.append(rows)
        positions = np.concatenate([np.arange(start, start + len(tokens), dtype=np.int64) for tokens, start, _ in runs])
        if len(np.unique(positions)) != len(positions) or positions.min() < 0 or positions.max() >= self.next_pos:
            raise ValueError("runs to copy back must be distinct positions below the sequence's end")
        if np.isin(positions, np.asarray(self.cache.positions, dtype=np.int64)).any():
            raise ValueError("runs to copy back are partly still in the cache")
        if len(positions) > self.free_cells():
            raise llama.KVCacheFull(f"{len(positions)} tokens do not fit in the {self.free_cells()} free KV cells", 1)
        self.ctx.put_kv_rows(self.SEQ, positions, np.concatenate(parts))
        for tokens, start, segment in sorted(runs, key=lambda r: r[1]):
            self.cache.insert([int(t) for t in tokens], start, segment)
        self.copied_tokens += len(positions)
        self._took_back(np.sort(positions))
        return True

    @property
    def reinserted(self) -> np.ndarray:
        """The live positions put back at their old places since their last eviction (sorted; read-only): a
        restore's or a re-read's, evicted again at the turn's end."""
        view = self._reinserted.view()
        view.flags.writeable = False
        return view

    def evict_reinserted(self) -> None:
        """Evict again every cell :meth:`reinsert` put back, their sketch rows returning as first evicted.

        Re-inserted cells are decoded over the evicted cache, not over the context their message first had; kept
        on, they drew later questions' attention out of all proportion (layer 11 of qwen paid a re-read message
        10–200× its baseline) and fired the gate on most later turns of a long chat (docs/results/NOTES.md)."""
        if not len(self._reinserted):
            return
        back = np.isin(np.asarray(self.cache.positions, dtype=np.int64), self._reinserted)
        if back.any():
            self.evict(~back)

    def shift_down(self, first: int, delta: int) -> "FrameShift":
        """Move every live cell at position ≥ ``first`` down by ``delta`` into the gap before it, which must hold
        no live cell (drop those first): :meth:`shift_frame` with nothing to pack. The cells below keep their
        positions (the sinks stay at the front) and the moved ones their distances to each other; a message whose
        span reaches into the gap loses its span (:attr:`homeless`)."""
        live = np.asarray(self.cache.positions, dtype=np.int64)
        if delta <= 0 or first < delta or first > self.next_pos:
            raise ValueError(f"cannot move positions from {first} down by {delta} (sequence end {self.next_pos})")
        if np.any((live >= first - delta) & (live < first)):
            raise ValueError(f"positions [{first - delta}, {first}) still hold live cells: drop them first")
        return self.shift_frame(first - delta, first)

    def shift_frame(self, low: int, cut: int) -> "FrameShift":
        """Move the frame down, keeping a long chat's positions inside what the model was trained on. The cells
        below ``low`` (the sinks) stay; the live cells in [low, cut) — old history the sample kept — are packed
        behind them, in order; every cell from ``cut`` on moves down by the same ``delta`` (what the packing
        leaves), so the recent history keeps its distances exactly. Messages with positions in [low, cut) lose
        their span (:attr:`homeless`: a re-read feeds them at fresh positions); the sketch's keys, rotated where
        they were evicted, are scored as lying ``delta`` further (``EvictedKeySketch.shift``), so a message's
        reading does not change; the evicted rows move with their positions, keys re-rotated
        (:meth:`_rotate_row_keys`), and those of the packed zone go (their messages are re-read fresh).
        The log keeps the conversation's positions (:attr:`frame_offset`). The shift is applied at once (the newest
        cell is decoded again), so every later read, snapshot or saved state sees rotated keys."""
        live = np.asarray(self.cache.positions, dtype=np.int64)
        zone = (live >= low) & (live < cut)
        k = int(zone.sum())
        delta = cut - low - k
        if low < 0 or cut > self.next_pos or delta <= 0 or not np.any(live >= cut):
            raise ValueError(f"no frame shift from [{low}, {cut}): it would move nothing down")
        sketched = self.sketch is not None and self.sketch.n_tokens
        if (sketched or self._held is not None) and self.rope is None:
            raise ValueError("this model's RoPE is not one certchat can rotate: the sketch cannot follow a shift")
        where = np.flatnonzero(zone)
        rank = 0
        for a, b in _runs(live[where]):
            self.ctx.seq_add(self.SEQ, a, b, low + rank - a)
            rank += b - a
        self.ctx.seq_add(self.SEQ, cut, -1, -delta)
        new_live = live.copy()
        new_live[where] = low + np.arange(k)
        new_live[live >= cut] -= delta

        def live_map(pos: np.ndarray) -> np.ndarray:
            return new_live[np.searchsorted(live, pos)]

        def gone_map(pos: np.ndarray) -> np.ndarray:
            # evicted positions in the packed zone have no place left: unique negative ids, kept in order
            pos = np.asarray(pos, dtype=np.int64)
            return np.where(pos >= cut, pos - delta, np.where(pos >= low, pos - cut, pos - (cut - low)))

        homeless = {seg for seg, (a, b) in self.cache.spans.items() if a < cut and b > low}
        for segment, (a, b) in list(self.cache.spans.items()):
            if segment in homeless:
                del self.cache.spans[segment]
            elif a >= cut:
                self.cache.spans[segment] = (a - delta, b - delta)
        self.homeless |= homeless
        self.cache.positions = [int(p) for p in new_live]
        if self.sketch is not None and self.sketch.n_tokens:
            self.sketch.shift(gone_map(self.sketch.positions), delta)
        if self._held is not None:
            self._held = self._held.shifted(live_map(self._held.positions.astype(np.int64)), delta)
        self._reinserted = live_map(self._reinserted) if len(self._reinserted) else self._reinserted
        self._transient = live_map(self._transient) if len(self._transient) else self._transient
        if self.rows is not None:
            self.rows.shift(low, cut, delta, self._rotate_row_keys)
        self.next_pos -= delta
        self.frame_offset += delta
        self._redecode_newest()
        return FrameShift(low=low, cut=cut, packed=k, delta=delta, homeless=tuple(sorted(homeless)))

    def feed_transient(self, tokens: list[int], segment: int, cancel: threading.Event | None = None,
                       progress: Callable[[int], None] | None = None) -> float:
        """Feed message ``segment`` again at the next positions for one turn (a re-read of a message a frame shift
        left without a place): evicted again by :meth:`evict_reinserted`, without a trace in the sketch or rows."""
        start = self.next_pos
        span = self.cache.spans.get(segment)
        ms = self.feed(tokens, segment, logits_last=False, cancel=cancel, progress=progress)
        if span is None:
            self.cache.spans.pop(segment, None)
        else:
            self.cache.spans[segment] = span
        back = np.arange(start, self.next_pos, dtype=np.int64)
        self._transient = np.union1d(self._transient, back)
        self._reinserted = np.union1d(self._reinserted, back)
        return ms

    def _redecode_newest(self) -> None:
        """Decode the newest cell again at its position: llama.cpp applies pending position shifts at a decode."""
        pos, token = self.cache.positions[-1], self.cache.tokens[-1]
        readout = self.readout
        self.set_readout(False, readout[1])
        try:
            if not self.ctx.seq_rm(self.SEQ, pos, -1):
                raise llama.LlamaError(f"could not take back position {pos}")
            self.ctx.set_reinsert(True)
            self.batch.set([token], [pos], self.SEQ, logits="last")
            self.ctx.decode(self.batch)
        finally:
            self.ctx.set_reinsert(False)
            self.set_readout(*readout)
        self.ctx.set_bias(self.SEQ, np.asarray([pos], dtype=np.int32),
                          np.asarray([0.0 if self.biases_lifted else -self.cache.logpi[-1]], dtype=np.float32))

    def continue_log(self, logged_end: int) -> None:
        """The cache was just filled from the log, whose history it holds ends at the conversation's position
        ``logged_end``: what is fed next continues the log's positions there, whatever the cache's frame."""
        self.frame_offset = max(0, logged_end - self.next_pos)

    def cut_history(self, pos: int) -> None:
        """Drop every cell from ``pos`` on (a full cache making room for a long message): the next cell goes at
        ``pos``, while the conversation's positions run on (:attr:`frame_offset`)."""
        end = self.next_pos
        self.truncate(pos)
        self.frame_offset += end - pos

    def log_position(self, pos: int) -> int:
        """The conversation's position (what the log keeps) of frame position ``pos`` fed since the last shift."""
        return pos + self.frame_offset

    def frame_position(self, logged: int) -> int:
        """The frame position of the conversation's position ``logged`` (a message fed since the last shift)."""
        return logged - self.frame_offset

    # -- decode ----------------------------------------------------------------------------
    def generate(
        self,
        sampler: llama.Sampler,
        max_tokens: int,
        segment: int,
        cancel: threading.Event | None = None,
        on_text: Callable[[str], None] | None = None,
        step_hook: Callable[[int], bool] | None = None,
    ) -> Generation:
        """Sample until end-of-generation, ``max_tokens``, cancel, or ``step_hook`` returning False.

        Every sampled token except the end-of-generation one is fed back, so the cache
        holds exactly the answer's tokens when this returns.
        """
        self._decoder.reset()
        tokens: list[int] = []
        logprobs: list[float] = []
        pieces: list[str] = []
        stop = "max_tokens"
        start = time.perf_counter()
        for step in range(max_tokens):
            if cancel is not None and cancel.is_set():
                stop = "cancelled"
                break
            logits = self.ctx.logits(-1, copy=False)  # read before the next decode overwrites it
            token = sampler.sample(self.ctx, -1, logits)
            logprobs.append(_log_softmax_at(logits, token))
            if self.model.is_eog(token):
                stop = "eog"
                break
            if self.free_cells() < 1:
                stop = "max_tokens"
                break
            tokens.append(token)
            piece = self._decoder.decode(self.model.token_to_piece(token))
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)
            self.batch.set([token], [self.next_pos], self.SEQ, logits="last")
            self.ctx.decode(self.batch)
            self.cache.append([token], self.next_pos, segment)
            self.next_pos += 1
            if step_hook is not None and not step_hook(step):
                stop = "hook"
                break
        tail = self._decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        return Generation(tokens=tokens, text="".join(pieces), stop=stop,
                          decode_ms=(time.perf_counter() - start) * 1000.0, logprobs=logprobs)


def holds_logged_tokens(positions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                        segments: Sequence[int] | np.ndarray, index: int, first: int, logged: Sequence[int]) -> bool:
    """Whether the live cells of message ``index`` (a mirror's positions, tokens and segments: the engine's, or a
    snapshot's) hold the log's tokens ``logged`` at their offsets from ``first``, where the message was fed."""
    segs = np.asarray(segments, dtype=np.int64)
    where = np.flatnonzero(segs == index)
    if not len(where):
        return True
    pos = np.asarray(positions, dtype=np.int64)[where] - first
    live = np.asarray(tokens, dtype=np.int64)[where]
    expected = np.asarray([int(t) for t in logged], dtype=np.int64)
    return bool(pos.min() >= 0 and pos.max() < len(expected) and np.array_equal(expected[pos], live))


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions → [p0, p1) runs, so eviction costs one seq_rm per run."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate(([positions[0]], positions[breaks + 1]))
    ends = np.concatenate((positions[breaks], [positions[-1]])) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def _log_softmax_at(logits: np.ndarray, index: int) -> float:
    top = float(np.max(logits))
    return float(logits[index] - top - np.log(np.sum(np.exp(logits - top))))
