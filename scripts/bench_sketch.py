"""The evicted-key sketch's own cost, without a model: one eviction round's quantisation and one question's scoring.

Synthetic keys and queries in Qwen2.5-Coder-0.5B's shapes (2 KV heads × 64, 14 query heads; the cost does not
depend on the values): ``--evicted`` tokens (3,686 = 90% of a 4k history), ``--rows`` question rows (config
``cert_window``, 8), per layer and for a layer set, at 1 thread and at ``--threads``, with the numpy reference's
time for the same scoring as the baseline. Wall-clock (or ``--timer cpu``) medians; the machine's load moves them,
so the report names the timer, the thread counts and the repeats.

    python scripts/bench_sketch.py --threads 2 --layers 11,13,14,15,16,20,21,22,23 --bits 8
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from native import sketch  # noqa: E402

N_KV, HEAD_DIM, N_HEAD, KQ_SCALE = 2, 64, 14, 0.125


TIMER: Callable[[], float] = time.perf_counter


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = TIMER()
        fn()
        times.append((TIMER() - t) * 1000.0)
    return statistics.median(times)


def _store(layers: tuple[int, ...], bits: int, threads: int) -> sketch.EvictedKeySketch:
    kwargs = {"threads": threads} if "threads" in inspect.signature(sketch.EvictedKeySketch).parameters else {}
    return sketch.EvictedKeySketch(layers=layers, n_kv_head=N_KV, head_dim=HEAD_DIM, bits=bits, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evicted", type=int, default=3686, help="evicted tokens in the sketch")
    ap.add_argument("--rows", type=int, default=8, help="question rows scored (config cert_window)")
    ap.add_argument("--layers", default="11,13,14,15,16,20,21,22,23", help="the layer set of the per-turn figure")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--round", type=int, default=100, help="tokens of a steady eviction round")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (all its threads), steadier on a loaded machine")
    args = ap.parse_args()
    global TIMER
    TIMER = time.process_time if args.timer == "cpu" else time.perf_counter

    rng = np.random.default_rng(0)
    layers = tuple(int(x) for x in args.layers.split(","))
    n_layers = len(layers)
    keys = rng.standard_normal((n_layers, args.evicted, N_KV * HEAD_DIM)).astype(np.float32)
    keys[:, :, ::7] *= 6.0
    positions = np.arange(args.evicted, dtype=np.int32)
    messages = positions // 40
    q = rng.standard_normal((n_layers, args.rows, N_HEAD, HEAD_DIM)).astype(np.float32)
    lse = rng.uniform(3.0, 9.0, size=(n_layers, args.rows, N_HEAD)).astype(np.float32)
    queries = SimpleNamespace(layers=np.asarray(layers), q=q, lse=lse,
                              kq_scale=np.full(n_layers, KQ_SCALE, np.float32))
    step = keys[:, :args.round]
    print(f"sketch cost — synthetic Qwen2.5-0.5B shapes ({N_KV} KV × {HEAD_DIM}, {N_HEAD} query heads), "
          f"{args.evicted} evicted tokens, {args.rows} rows, int{args.bits}, {os.cpu_count()} CPUs visible, "
          f"median of {args.repeats}, {args.timer} time")
    print(f"  bytes per evicted token, {n_layers} layers: "
          f"{sketch.bytes_per_token(n_layers, N_KV, HEAD_DIM, args.bits)}")

    one = _store(layers[:1], args.bits, 1)
    one.append(positions, messages, keys[:1])
    q1 = SimpleNamespace(layers=queries.layers[:1], q=q[:1], lse=lse[:1], kq_scale=queries.kq_scale[:1])
    t_ref = _median_ms(lambda: sketch.reference_score(one.keys()[0], q[0], lse[0], KQ_SCALE), max(3, args.repeats // 5))
    print(f"  numpy reference, one layer score: {t_ref:8.2f} ms")
    for threads in sorted({1, args.threads}):
        sk1 = _store(layers[:1], args.bits, threads)
        sk1.append(positions, messages, keys[:1])
        t1 = _median_ms(lambda: sk1.score(q1), args.repeats)
        a1 = _median_ms(lambda: (sk1.clear(), sk1.append(positions, messages, keys[:1])), args.repeats)
        sk = _store(layers, args.bits, threads)
        t_add = _median_ms(lambda: (sk.clear(), sk.append(positions, messages, keys)), args.repeats)
        t_score = _median_ms(lambda: sk.score(queries).per_message(), args.repeats)

        nxt = [args.evicted]

        def steady() -> None:
            # a steady round: a turn's worth of tokens onto the 4k history's sketch
            sk.append(nxt[0] + positions[:args.round], messages[:args.round], step)
            nxt[0] += args.round
        t_round = _median_ms(steady, args.repeats)
        print(f"  {threads} thread(s): one layer: score {t1:7.2f} ms, quantise {args.evicted} tokens {a1:7.2f} ms | "
              f"{n_layers} layers: score + per-message {t_score:7.2f} ms, first round ({args.evicted} tokens) "
              f"{t_add:7.2f} ms, steady round ({args.round} tokens) {t_round:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
