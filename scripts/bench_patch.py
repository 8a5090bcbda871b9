"""Benchmark of the llama.cpp patch: certificate overhead, decode speed after compaction, compaction time.

Prints both sides of every ratio (the issue's performance section):

1. certificate + importance on vs off, decode at ``--cells`` live cells (default 4096);
2. decode speed of a ``--big``-token cache (default 16384) evicted to ``--live`` cells (default 1638)
   and compacted, against the same full cache;
3. the time of that compaction;
4. the evicted-key sketch (``--only sketch``): a question prefill of ``--question`` tokens with the query
   rows on vs off, the K read of one eviction round, and scoring against the sketch, at ``--cells``
   history with 90% of it evicted, for a few storage settings, with their bytes per evicted token.

Timing on a shared machine is noisy, so the two sides of each comparison are measured as
interleaved pairs of single decode steps (same moment, same contention) and the script
reports the medians of both sides, their ratio and the median of the per-pair ratios.
Every decode step is rolled back with ``seq_rm`` so the cache size stays fixed.
``--timer cpu`` measures process CPU time instead of wall time: with ``--threads 1`` it is the
least contention-sensitive view of the work each side does (with more threads, ggml's
spinning barriers count as CPU time too).

    CERTCHAT_NATIVE_LIB_DIR=... python scripts/bench_patch.py --model qwen2.5-coder-0.5b.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from native import llama, patched, sketch  # noqa: E402


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 8000, size=n)]


def _prefill(ctx: llama.Context, toks: list[int], n_batch: int, cache: Path | None = None) -> float:
    """Prefill ``toks``; with ``cache``, reuse the sequence state a previous run saved there."""
    if cache is not None and cache.exists():
        t0 = time.perf_counter()
        ctx.set_seq_state(cache.read_bytes(), 0)
        print(f"  (state of {len(toks)} tokens loaded from {cache})")
        return time.perf_counter() - t0
    batch = llama.Batch(n_batch)
    t0 = time.perf_counter()
    for s in range(0, len(toks), n_batch):
        chunk = toks[s : s + n_batch]
        batch.set(chunk, list(range(s, s + len(chunk))), logits="last")
        ctx.decode(batch)
    batch.close()
    dt = time.perf_counter() - t0
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(ctx.seq_state(0))
    return dt


def _state_cache(args: argparse.Namespace, n: int, seed: int) -> Path | None:
    if args.state_cache is None:
        return None
    return args.state_cache / f"{args.model.stem}-{n}-seed{seed}.state"


TIMER = time.perf_counter

# each context has its own CPU thread pool, whose workers spin a little after a graph before they sleep;
# a pause between the two sides keeps one side's spinning threads from stealing the other's cores
SETTLE_S = 0.02


class _Stepper:
    """Decode one token at a fixed position and roll it back, timing the decode."""

    def __init__(self, ctx: llama.Context, pos: int) -> None:
        self.ctx = ctx
        self.pos = pos
        self.batch = llama.Batch(1)

    def step(self, token: int) -> float:
        self.batch.set([token], [self.pos], logits="last")
        t0 = TIMER()
        self.ctx.decode(self.batch)
        self.ctx.logits()  # waits for the result like a sampler would
        dt = TIMER() - t0
        self.ctx.seq_rm(0, self.pos, -1)
        return dt


def _pairs(a: _Stepper, b: _Stepper, n: int, seed: int) -> tuple[list[float], list[float]]:
    toks = _tokens(n + 1, seed)
    a.step(toks[-1])  # graph builds and warm caches are not part of the measurement
    b.step(toks[-1])
    ta: list[float] = []
    tb: list[float] = []
    for i in range(n):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t1 = first.step(toks[i])
        time.sleep(SETTLE_S)
        t2 = second.step(toks[i])
        time.sleep(SETTLE_S)
        ta.append(t1 if first is a else t2)
        tb.append(t2 if first is a else t1)
    return ta, tb


def _report(label_a: str, ta: list[float], label_b: str, tb: list[float]) -> None:
    ma, mb = statistics.median(ta), statistics.median(tb)
    paired = statistics.median(y / x for x, y in zip(ta, tb))
    print(f"  {label_a:<34} {ma * 1e3:8.2f} ms/token  ({1 / ma:6.1f} tok/s)  min {min(ta) * 1e3:8.2f} ms")
    print(f"  {label_b:<34} {mb * 1e3:8.2f} ms/token  ({1 / mb:6.1f} tok/s)  min {min(tb) * 1e3:8.2f} ms")
    print(f"  ratio of medians {mb / ma:.3f}   median of paired ratios {paired:.3f}   pairs {len(ta)}")


def _random_biases(ctx: llama.Context, n: int, seed: int) -> None:
    # half the cells get a Hajek bias, as after an eviction round
    rng = np.random.default_rng(seed)
    pos = np.flatnonzero(rng.random(n) < 0.5).astype(np.int32)
    patched.set_bias_pos(ctx.memory, 0, pos, rng.uniform(0.05, 3.0, size=len(pos)))


def bench_certificate(model: llama.Model, args: argparse.Namespace) -> None:
    n = args.cells
    params = llama.ContextParams(n_ctx=n + 256, n_batch=args.batch, n_ubatch=args.batch, n_threads=args.threads)
    off = llama.Context(model, params)
    on = llama.Context(model, params)
    dt = _prefill(off, _tokens(n, 1), args.batch, _state_cache(args, n, 1))
    print(f"[certificate] prefilled {n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s)")
    on.set_seq_state(off.seq_state(0), 0)
    for ctx in (off, on):
        _random_biases(ctx, n, 2)
    patched.set_attn_certificate(on.handle, True, args.window)
    ta, tb = _pairs(_Stepper(off, n), _Stepper(on, n), args.pairs, 3)
    d = patched.certificate_dims(on.handle)
    print(f"  (certificate of the last step: {d.n_layer} layers x {d.n_head} heads x {d.n_rows} rows, "
          f"n_kv {d.n_cells})")
    _report("certificate + importance off", ta, "certificate + importance on", tb)
    off.close()
    on.close()


def bench_compaction(model: llama.Model, args: argparse.Namespace) -> None:
    n, live = args.big, args.live
    params = llama.ContextParams(n_ctx=n + 256, n_batch=args.batch, n_ubatch=args.batch, n_threads=args.threads)
    full = llama.Context(model, params)
    dt = _prefill(full, _tokens(n, 4), args.batch, _state_cache(args, n, 4))
    print(f"[compaction] prefilled {n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s)")
    small = llama.Context(model, params)
    small.set_seq_state(full.seq_state(0), 0)

    # keep 4 sinks, the last 256 tokens and a random sample of the rest; evict by runs of seq_rm
    rng = np.random.default_rng(5)
    middle = np.arange(4, n - 256)
    kept = np.sort(rng.choice(middle, size=live - 4 - 256, replace=False))
    keep = np.zeros(n, dtype=bool)
    keep[:4] = True
    keep[n - 256 :] = True
    keep[kept] = True
    t0 = time.perf_counter()
    drop = np.flatnonzero(~keep)
    starts = drop[np.r_[True, np.diff(drop) > 1]]
    ends = drop[np.r_[np.diff(drop) > 1, True]] + 1
    for s, e in zip(starts, ends):
        small.seq_rm(0, int(s), int(e))
    t_evict = time.perf_counter() - t0
    extent_before = patched.extent(small.memory, 0)
    t0 = time.perf_counter()
    extent_after = patched.compact(small.handle, 0)
    t_compact = time.perf_counter() - t0
    print(f"  evicted {n - int(keep.sum())} of {n} cells in {len(starts)} seq_rm runs: {t_evict * 1e3:.1f} ms")
    print(f"  compaction {n} -> {extent_after} cells (extent before {extent_before}): {t_compact * 1e3:.1f} ms"
          f" [{'GPU' if args.gpu_layers else 'CPU'} KV buffers]")
    ta, tb = _pairs(_Stepper(full, n), _Stepper(small, n), args.pairs, 6)
    _report(f"full cache ({n} cells)", ta, f"evicted + compacted ({extent_after} cells)", tb)
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(f"  speed-up {ma / mb:.2f}x ({1 / mb:.1f} vs {1 / ma:.1f} tok/s)")
    full.close()
    small.close()


class _Prefiller(_Stepper):
    """Decode a question of several tokens at a fixed position and roll it back."""

    def __init__(self, ctx: llama.Context, pos: int, n: int) -> None:
        super().__init__(ctx, pos)
        self.n = n
        self.batch = llama.Batch(n)

    def step(self, token: int) -> float:
        toks = [(token + 7 * i) % 7000 + 200 for i in range(self.n)]
        self.batch.set(toks, list(range(self.pos, self.pos + self.n)), logits="last")
        t0 = TIMER()
        self.ctx.decode(self.batch)
        self.ctx.logits()
        dt = TIMER() - t0
        self.ctx.seq_rm(0, self.pos, -1)
        return dt


def _median_time(fn: object, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


SKETCH_SETTINGS = [(list(range(11, 24)), 8), (list(range(11, 24)), 4), ([11, 13, 15, 20, 22], 8),
                   ([11, 13, 14, 15, 16, 20, 21, 22, 23, 12, 17], 4)]


def bench_sketch(model: llama.Model, args: argparse.Namespace) -> None:
    n, nq = args.cells, args.question
    layers = list(range(11, 24))
    params = llama.ContextParams(n_ctx=n + 256, n_batch=args.batch, n_ubatch=args.batch, n_threads=args.threads)
    off = llama.Context(model, params)
    on = llama.Context(model, params)
    dt = _prefill(off, _tokens(n, 1), args.batch, _state_cache(args, n, 1))
    print(f"[sketch] prefilled {n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s)")
    on.set_seq_state(off.seq_state(0), 0)
    patched.set_attn_queries(on.handle, layers, nq)
    print(f"  question prefill of {nq} tokens at {n} cells, query rows of layers 11-23 off vs on:")
    ta, tb = _pairs(_Prefiller(off, n, nq), _Prefiller(on, n, nq), max(args.pairs // 4, 5), 4)
    _report("queries off", ta, "queries on", tb)
    batch = llama.Batch(nq)
    batch.set(_tokens(nq, 5), list(range(n, n + nq)), logits="last")
    on.decode(batch)
    batch.close()
    queries = patched.get_attn_queries(on.handle)
    rng = np.random.default_rng(6)
    evicted = np.sort(rng.choice(n, size=int(0.9 * n), replace=False)).astype(np.int32)
    t_keys = _median_time(lambda: patched.get_keys(on.handle, layers, evicted), 5)
    print(f"  get_keys: {len(evicted)} positions x {len(layers)} layers (one eviction round): {t_keys * 1e3:.2f} ms")
    keys = patched.get_keys(on.handle, layers, evicted)
    msgs = evicted // 40
    width = keys.shape[2]
    for lay, bits in SKETCH_SETTINGS:
        sel = [layers.index(x) for x in lay]
        sk = sketch.EvictedKeySketch(layers=tuple(lay), n_kv_head=2, head_dim=width // 2, bits=bits)
        t_add = _median_time(lambda: (sk.clear(), sk.append(evicted, msgs, keys[sel])), 3)
        for rows in (nq, 8):
            q = patched.Queries(layers=queries.layers, kq_scale=queries.kq_scale, q=queries.q[:, -rows:],
                                lse=queries.lse[:, -rows:])
            t_score = _median_time(lambda: sk.score(q).per_message(), 5)
            print(f"  sketch {len(lay):2d} layers int{bits}: {sk.bytes_per_token:5d} B/evicted token "
                  f"(+{sk.overhead_bytes} B per store), append {t_add * 1e3:7.2f} ms, "
                  f"score {len(evicted)} tokens x {rows:2d} rows {t_score * 1e3:7.2f} ms")
    for lay_n, bits in ((24, 32), (24, 8), (13, 8), (13, 4), (11, 4), (5, 8)):
        per_token = sketch.bytes_per_token(lay_n, 2, width // 2, bits)
        print(f"  bytes per evicted token, {lay_n:2d} layers, {bits:2d} bits: {per_token}")
    off.close()
    on.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="GGUF file (the issue: qwen2.5-coder-0.5b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--cells", type=int, default=4096, help="live cells for the certificate overhead")
    ap.add_argument("--window", type=int, default=8, help="certificate rows (decode reports 1)")
    ap.add_argument("--big", type=int, default=16384, help="full cache size for the compaction benchmark")
    ap.add_argument("--live", type=int, default=1638, help="cells kept after eviction")
    ap.add_argument("--pairs", type=int, default=40, help="interleaved decode pairs per comparison")
    ap.add_argument("--gpu-layers", type=int, default=0, help="offload layers (and the KV cache) to the GPU")
    ap.add_argument("--only", choices=["certificate", "compaction", "sketch"], help="run one part")
    ap.add_argument("--question", type=int, default=32, help="question tokens (sketch: query rows reported)")
    ap.add_argument("--timer", choices=["wall", "cpu"], default="wall", help="wall clock or process CPU time")
    ap.add_argument("--state-cache", type=Path,
                    help="keep prefilled states here and reuse them (a 16k state is ~200 MB)")
    args = ap.parse_args()

    global TIMER
    TIMER = time.process_time if args.timer == "cpu" else time.perf_counter

    print(f"patch level {patched.patch_version()}, model {args.model.name}, {args.threads} threads, {args.timer} time")
    model = llama.Model(args.model, n_gpu_layers=args.gpu_layers)
    if args.only in (None, "certificate"):
        bench_certificate(model, args)
    if args.only in (None, "compaction"):
        bench_compaction(model, args)
    if args.only in (None, "sketch"):
        bench_sketch(model, args)
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
