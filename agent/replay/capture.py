"""The coverage study: does the certificate cover the realized attention-output error, per (layer, head)?

Protocol (one-shot, single-layer teacher forcing; the approximation is stated in the results):

1. Replay the script under ``full``; the log then holds the exact token ids of the history
   every policy shares.
2. Feed that history, probe by probe, into a raw llama.cpp context with a ``cb_eval``
   capture: at each probe's last ``question_window`` tokens, read every layer's post-RoPE
   queries and the cache's K and V (the ``kq`` / ``kqv`` nodes' sources).
3. In numpy: the question window's attention mass (summed over heads and layers, pooled
   as the policy pools it) scores the cells; ``native.poisson.plan_eviction`` draws the
   agent's design (same protected set, budget, pages, top slice, floor) ``draws`` times;
   for the probe's last query row, per (layer, head), ``native.poisson.hajek_estimate``
   gives the Hájek estimate ô over the kept cells and its variance estimates, and the
   realized error is ‖ô − o‖ against the full-cache output o of the *same* query.

Each (probe, draw, layer, head) is one cell. Coverage is reported for the certificate
forms of ``native.poisson.certificate`` (z, χ², F) and for the token- and cluster-form
variance, so the sampling unit's effect is visible. What this does not include: the
query of an *evicted* run (earlier layers' errors propagating into later layers' queries)
and multi-round cumulative probabilities; both need reading the evicted run's graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from native.ggml_tensor import GGML_TYPE_F16, GgmlTensor, read


@dataclass
class LayerCapture:
    q: np.ndarray
    """[n_head, rows, head_dim] post-RoPE queries of the last ubatch."""
    k: np.ndarray
    """[n_head_kv, n_kv, head_dim]."""
    v: np.ndarray
    """[n_head_kv, n_kv, head_dim]."""
    out: np.ndarray | None = None
    """[n_head, rows, head_dim] the graph's own attention output (a check on the numpy path)."""


@dataclass
class _Recorder:
    n_layer: int
    armed: bool = False
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    pending: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from native import runtime  # noqa: PLC0415

        self.callback = runtime.llama_cpp().ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, tensor: int, ask: bool, _user: Any) -> bool:
        if not self.armed:
            return False
        name = GgmlTensor.from_address(tensor).name.decode()
        kind, _, layer = name.rpartition("-")
        if kind not in ("kq", "kqv") or not layer.isdigit():
            return False
        if ask:
            return True
        il = int(layer)
        t = GgmlTensor.from_address(tensor)
        got = self.pending.setdefault(il, {})
        if kind == "kq":
            k = read(t.src[0])[0]  # [n_head_kv, n_kv, head_dim]
            q = read(t.src[1])[0]  # [n_head, rows, head_dim]
            got["k"], got["q"] = k, q
        else:
            vt = read(t.src[0])[0]  # [n_head_kv, head_dim, n_kv] (V is stored transposed)
            got["v"] = np.ascontiguousarray(np.transpose(vt, (0, 2, 1)))
            got["out"] = read(tensor)[0]  # [n_head, rows, head_dim]
        if {"k", "q", "v"} <= got.keys():
            self.layers[il] = LayerCapture(got["q"], got["k"], got["v"], got.get("out"))
        return True


class FullCacheProbe:
    """A raw full-cache context over a model that captures Q, K, V at chosen ubatches."""

    def __init__(self, model_path: Path, n_ctx: int, threads: int = 1, window: int = 32) -> None:
        from native import runtime  # noqa: PLC0415

        self.lc = lc = runtime.llama_cpp()
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), params)
        if not self.model:
            raise RuntimeError(f"could not load {model_path}")
        self.n_layer = lc.llama_model_n_layer(self.model)
        self.rec = _Recorder(self.n_layer)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 0  # the kq / kqv nodes exist only without flash attention
        cp.type_k = cp.type_v = GGML_TYPE_F16
        cp.no_perf = True
        cp.cb_eval = self.rec.callback
        cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("could not create the capture context")
        self.window = window
        self.next_pos = 0
        self.head_dim = lc.llama_model_n_embd(self.model) // lc.llama_model_n_head(self.model)

    def _decode(self, tokens: list[int]) -> None:
        lc = self.lc
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = int(tok)
                batch.pos[i] = self.next_pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i == len(tokens) - 1 else 0
            batch.n_tokens = len(tokens)
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lc.llama_batch_free(batch)
        self.next_pos += len(tokens)

    def feed(self, tokens: list[int], capture: bool) -> dict[int, LayerCapture]:
        """Append ``tokens``; with ``capture`` the last ``window`` of them are one ubatch, captured."""
        tail = tokens[-self.window:] if capture else []
        head = tokens[: len(tokens) - len(tail)]
        for i in range(0, len(head), 512):
            self._decode(head[i:i + 512])
        if not tail:
            return {}
        self.rec.layers, self.rec.pending, self.rec.armed = {}, {}, True
        try:
            self._decode(tail)
        finally:
            self.rec.armed = False
        return dict(self.rec.layers)

    def rewind(self, pos: int) -> None:
        """Forget positions ≥ ``pos`` (an independent probe's question, before the next history)."""
        if pos < self.next_pos:
            if not self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), 0, pos, -1):
                raise RuntimeError(f"could not remove positions from {pos} on")
            self.next_pos = pos

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def coverage_cells(layers: dict[int, LayerCapture], n_live: int, protect_from: int, segments: np.ndarray,
                   budget_share: float, cfg: Any, draws: int, delta: float = 0.05,
                   seed0: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Cells of one probe: the design drawn ``draws`` times, every (layer, head) of the last query row."""
    from agent import policies  # noqa: PLC0415
    from native import poisson  # noqa: PLC0415

    n = n_live
    rows = next(iter(layers.values())).q.shape[1]
    row_pos = np.arange(n - rows, n)
    cell_pos = np.arange(n)
    causal = cell_pos[None, :] <= row_pos[:, None]  # [rows, n]
    importance = np.zeros(n)
    logits_last: dict[tuple[int, int], np.ndarray] = {}
    max_check = 0.0
    for il, cap in sorted(layers.items()):
        n_head, group = cap.q.shape[0], cap.q.shape[0] // cap.k.shape[0]
        scale = 1.0 / math.sqrt(cap.q.shape[2])
        for h in range(n_head):
            k = cap.k[h // group, :n].astype(np.float64)
            s = scale * cap.q[h].astype(np.float64) @ k.T  # [rows, n]
            s = np.where(causal, s, -np.inf)
            p = _softmax_rows(s)
            importance += p.sum(axis=0)
            logits_last[(il, h)] = s[-1]
            if cap.out is not None:
                o = p[-1] @ cap.v[h // group, :n].astype(np.float64)
                ref = cap.out[h, -1].astype(np.float64)
                max_check = max(max_check, float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-12)))
    positions = cell_pos.astype(np.int64)
    protected = positions >= protect_from
    protected[: cfg.sinks] = True
    before = np.flatnonzero(positions < protect_from)
    if cfg.recent and len(before):
        protected[before[-cfg.recent:]] = True
    scores = policies.PoissonImportance().score(policies.CacheView(positions, segments[:n], importance))
    unprotected = scores[~protected]
    floor = cfg.floor * float(unprotected.mean()) if unprotected.size else 0.0
    budget = max(int(round(budget_share * n)), cfg.sinks + cfg.recent)
    plans = [poisson.plan_eviction(scores, protected, float(budget), method="poisson", page_size=cfg.page_size,
                                   message_ids=segments[:n], top_share=cfg.top_share, floor=floor,
                                   seed=seed0 + d, round=0, positions=positions, strict=False)
             for d in range(draws)]
    pi = plans[0].pi
    keep = np.stack([p.keep for p in plans])
    units = plans[0].unit_ids
    cells: list[dict[str, Any]] = []
    for (il, h), s in logits_last.items():
        cap = layers[il]
        group = cap.q.shape[0] // cap.k.shape[0]
        v = cap.v[h // group, :n].astype(np.float64)
        o = _softmax_rows(s[None, :])[0] @ v
        est = poisson.hajek_estimate(s, v, pi, keep, units)
        err = np.linalg.norm(est.o_hat - o[None, :], axis=1)
        o2 = np.sum(est.o_hat ** 2, axis=1)
        forms = {
            "z_token": poisson.certificate(est.v_hat_token, o2, delta)[0],
            "z_cluster": poisson.certificate(est.v_hat_cluster, o2, delta)[0],
            "chi2_cluster": poisson.certificate(est.v_hat_cluster, o2, delta, dof=est.dof)[0],
            "f_cluster": poisson.certificate(est.v_hat_cluster, o2, delta, dof=est.dof, dof_var=est.dof_var)[0],
        }
        for d in range(draws):
            cells.append({"layer": il, "head": h, "draw": d, "error": float(err[d]),
                          "o_norm": float(np.linalg.norm(o)),
                          **{f: float(c[d]) for f, c in forms.items()}})
    info = {"n_cells_kv": n, "budget_cells": budget, "kept_mean": float(keep.sum(axis=1).mean()),
            "sum_pi": float(pi.sum()), "numpy_vs_graph_max_rel": max_check}
    return cells, info


def run_coverage(scripts: list[Any], settings: Any, base: Any, draws: int = 8) -> dict[str, Any]:
    """The coverage study over the scripts' probes (see the module docstring).

    One capture per probe serves every design asked for: each Poisson variant of
    ``settings.policies`` (e.g. ``poisson@page_size=1`` for token units) at each budget.
    """
    from agent.replay import batch, studies  # noqa: PLC0415
    from agent.replay.runner import base_policy, variant_overrides  # noqa: PLC0415
    from memory_store.store import Store  # noqa: PLC0415

    variants = [p for p in settings.policies if base_policy(p) in ("poisson", "poisson+gate")] or ["poisson"]
    designs = []
    for variant in dict.fromkeys(v.replace("poisson+gate", "poisson", 1) for v in variants):
        for budget_text in settings.budgets:
            if not budget_text.endswith("%"):
                raise ValueError("the coverage study takes share budgets such as 10%")
            designs.append((f"{variant} {budget_text}", base.replace(**variant_overrides(variant)),
                            float(budget_text[:-1]) / 100))
    settings.policies = ["full"]
    settings.protocols = ("multi-round",)
    settings.plots = False
    doc = batch.run(scripts, settings, base)
    store = Store(Path(settings.out) / "replay.db")
    model_path = batch._model_identity(settings.model or base.model)[0]
    cells_by: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in designs}
    probes_info: list[dict[str, Any]] = []
    try:
        for run in doc["runs"]:
            messages = [m for m in store.messages(run["conversation_id"]) if m.tokens is not None]
            kept = [m for m in messages if not m.meta.get("discarded")]
            n_ctx = ((sum(len(m.tokens) for m in messages) + 1024) // 256 + 1) * 256
            cap = FullCacheProbe(model_path, n_ctx, threads=settings.threads or 1, window=base.question_window)
            try:
                fed: list[int] = []
                users = [m for m in messages if m.role == "user"]
                for user_msg, step in zip(users, run["steps"]):
                    if step["kind"] != "probe":
                        continue
                    # the shared history before this probe, then the probe's own question
                    prefix = [m for m in kept if m.index < user_msg.index]
                    toks = [int(t) for m in prefix for t in m.tokens] + [int(t) for t in user_msg.tokens]
                    segs = [m.index for m in prefix for _ in m.tokens] + [user_msg.index] * len(user_msg.tokens)
                    common = 0
                    while common < min(len(fed), len(toks)) and fed[common] == toks[common]:
                        common += 1
                    cap.rewind(common)  # an independent probe's question is not part of later history
                    layers = cap.feed(toks[common:], capture=True)
                    fed = toks
                    protect_from = len(toks) - len(user_msg.tokens)
                    info: dict[str, Any] = {"script": run["script"], "turn": step["turn"], "designs": {}}
                    for label, cfg, share in designs:
                        cells, design_info = coverage_cells(layers, len(toks), protect_from, np.asarray(segs), share,
                                                            cfg, draws, seed0=1000 * len(probes_info))
                        for c in cells:
                            c["probe"] = len(probes_info)
                        cells_by[label] += cells
                        info["designs"][label] = design_info
                    probes_info.append(info)
            finally:
                cap.close()
    finally:
        store.close()
    forms = ("z_token", "z_cluster", "chi2_cluster", "f_cluster")
    by_design = {label: {f: studies.coverage([{"layer": c["layer"], "head": c["head"], "certificate": c[f],
                                               "error": c["error"]} for c in cells]) for f in forms}
                 for label, cells in cells_by.items() if cells}
    first = designs[0][0]
    return {"study": "coverage", "meta": doc["meta"], "nominal": 0.95, "draws": draws, "design": first,
            "coverage": by_design[first]["f_cluster"], "forms": by_design[first], "by_design": by_design,
            "probes": probes_info,
            "protocol": "one-shot, single-layer teacher forcing (full-run query, K, V; drawn design)"}
