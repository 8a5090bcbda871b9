"""The coverage study: does the certificate cover the realized attention-output error, per (layer, head)?

Two ways, both here:

- **The product path** (:func:`run_coverage`, what ``certchat replay --study coverage`` runs): the Poisson
  policy is replayed in this process, in the multi-round and/or one-shot protocol, with observers on the
  engine, the design core and the gate (:class:`ProductCoverage`). At each probe's question on an evicted
  cache, the cache is copied into a capture context and the question's last rows re-decoded (the chat's own
  weights, values and outputs), a full-history context gives the full cache's output for the same query rows,
  and every (row, layer, head) becomes a cell with the product's certificate terms beside the realized errors
  (:data:`CELL_FIELDS`). docs/POISSON.md, "The certificate the gate shows", has the definitions.
- **Numpy-drawn designs** (:func:`run_coverage_draws`, one-shot, single-layer teacher forcing): the full run's
  Q, K, V at each probe, the agent's design drawn ``draws`` times in numpy, certificates of every form from
  ``native.poisson.hajek_estimate`` — for design experiments (units, top slice) without a replay per design.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.gate.certificate import CertificateForm
from native.ggml_tensor import GgmlTensor, read

if TYPE_CHECKING:
    from memory_store.records import Message


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
    p: np.ndarray | None = None
    """[n_head, rows, n_kv] the graph's attention weights (after the mask and the cell biases)."""
    mask: np.ndarray | None = None
    """[rows (padded), n_kv] the KQ mask the softmax added (0 / −inf / a cell's bias; a SWA layer's own)."""
    scale: float | None = None
    """The softmax's kq_scale (Qwen2.5 1/√d; Gemma 3 scales Q instead and uses 1)."""


@dataclass
class _Recorder:
    n_layer: int
    armed: bool = False
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)

    def on_tensor(self, tensor: int, ask: bool) -> bool:
        """The context's graph callback (``ContextParams.eval_callback``): capture the attention's nodes."""
        if not self.armed:
            return False
        name = GgmlTensor.from_address(tensor).name.decode()
        kind, _, layer = name.rpartition("-")
        if kind not in ("kq", "kqv", "kq_soft_max") or not layer.isdigit():
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
        elif kind == "kq_soft_max":
            got["p"] = read(tensor)[0]  # [n_head, rows, n_kv]: the weights the graph used (bias, mask included)
            got["mask"] = read(t.src[1])[0, 0] if t.src[1] else None  # [rows (padded), n_kv]
            got["scale"] = float(np.frombuffer(bytes(t.op_params)[:4], dtype=np.float32)[0])
        else:
            vt = read(t.src[0])[0]  # [n_head_kv, head_dim, n_kv] (V is stored transposed)
            got["v"] = np.ascontiguousarray(np.transpose(vt, (0, 2, 1)))
            got["out"] = read(tensor)[0]  # [n_head, rows, head_dim]
        if {"k", "q", "v"} <= got.keys():
            self.layers[il] = LayerCapture(got["q"], got["k"], got["v"], got.get("out"), got.get("p"),
                                           got.get("mask"), got.get("scale"))
        return True


def _capture_context(model: Any, n_ctx: int, threads: int, rec: "_Recorder") -> Any:
    """A context on ``model`` whose every graph node passes ``rec``'s callback: F16 cache, 512-token batches, no
    flash attention (the kq / kqv nodes exist only without it)."""
    from native import llama  # noqa: PLC0415

    return llama.Context(model, llama.ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                                    flash_attn=False, eval_callback=rec.on_tensor))


class FullCacheProbe:
    """A raw full-cache context over a model that captures Q, K, V at chosen ubatches."""

    def __init__(self, model_path: Path, n_ctx: int, threads: int = 1, window: int = 32,
                 model: Any = None) -> None:
        from native import llama  # noqa: PLC0415

        self.owns_model = model is None
        self.model = llama.Model(model_path, n_gpu_layers=0) if model is None else model
        info = self.model.info()
        self.n_layer = info.n_layer
        self.rec = _Recorder(self.n_layer)
        self.ctx = _capture_context(self.model, n_ctx, threads, self.rec)
        self.batch = llama.Batch(512)
        self.window = window
        self.next_pos = 0
        self.head_dim = info.n_embd // info.n_head

    def _decode(self, tokens: list[int]) -> None:
        self.batch.set(tokens, range(self.next_pos, self.next_pos + len(tokens)), 0, logits="last")
        self.ctx.decode(self.batch)
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
            if not self.ctx.seq_rm(0, pos, -1):
                raise RuntimeError(f"could not remove positions from {pos} on")
            self.next_pos = pos

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        if self.model is not None and self.owns_model:
            self.model.close()
        self.model = None


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def coverage_cells(layers: dict[int, LayerCapture], n_live: int, protect_from: int, segments: np.ndarray,
                   budget_share: float, cfg: Any, draws: int, delta: float = 0.05,
                   seed0: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Cells of one probe: the design drawn ``draws`` times, every (layer, head) of the last query row."""
    from agent.eviction import policies  # noqa: PLC0415
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
                max_check = max(max_check, float(np.linalg.norm(o - ref) / max(float(np.linalg.norm(ref)), 1e-12)))
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


def _tokens(message: Message) -> np.ndarray:
    """A stored message's tokens, for the messages the study kept because they have them."""
    assert message.tokens is not None
    return message.tokens


def run_coverage_draws(scripts: list[Any], settings: Any, base: Any, draws: int = 8) -> dict[str, Any]:
    """The coverage study over the scripts' probes (see the module docstring).

    One capture per probe serves every design asked for: each Poisson variant of
    ``settings.policies`` (e.g. ``poisson@page_size=1`` for token units) at each budget.
    """
    from agent.lab.replay import batch  # noqa: PLC0415
    from agent.lab.replay.rank_stats import coverage  # noqa: PLC0415
    from agent.lab.replay.runner import base_policy, variant_overrides  # noqa: PLC0415
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
            n_ctx = ((sum(len(_tokens(m)) for m in messages) + 1024) // 256 + 1) * 256
            cap = FullCacheProbe(model_path, n_ctx, threads=settings.threads or 1, window=base.question_window)
            try:
                fed: list[int] = []
                users = [m for m in messages if m.role == "user"]
                for user_msg, step in zip(users, run["steps"]):
                    if step["kind"] != "probe":
                        continue
                    # the shared history before this probe, then the probe's own question
                    prefix = [m for m in kept if m.index < user_msg.index]
                    toks = [int(t) for m in prefix for t in _tokens(m)] + [int(t) for t in _tokens(user_msg)]
                    segs = [m.index for m in prefix for _ in _tokens(m)] + [user_msg.index] * len(_tokens(user_msg))
                    common = 0
                    while common < min(len(fed), len(toks)) and fed[common] == toks[common]:
                        common += 1
                    cap.rewind(common)  # an independent probe's question is not part of later history
                    layers = cap.feed(toks[common:], capture=True)
                    fed = toks
                    protect_from = len(toks) - len(_tokens(user_msg))
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
    by_design = {label: {f: coverage([{"layer": c["layer"], "head": c["head"], "certificate": c[f],
                                               "error": c["error"]} for c in cells]) for f in forms}
                 for label, cells in cells_by.items() if cells}
    first = designs[0][0]
    return {"study": "coverage", "meta": doc["meta"], "nominal": 0.95, "draws": draws, "design": first,
            "coverage": by_design[first]["f_cluster"], "forms": by_design[first], "by_design": by_design,
            "probes": probes_info,
            "protocol": "one-shot, single-layer teacher forcing (full-run query, K, V; drawn design)"}


# -- the product path: the cache a chat answers from, in both protocols -----------------------------
#
# A replay of the evicting policy runs in this process with three observers attached (no product code
# changes): every token the engine feeds (so the full history is known at each turn, evicted tokens
# included), every eviction round's units and π (the design actually drawn), and every question the gate
# reads on an evicted cache. At such a question the cache is copied (the sequence's state plus the cell
# biases) into a second context that re-decodes the question's last rows with a tensor capture — the same
# graph on the same cells, so its weights, values and outputs are the ones the chat computed — and a
# third context holds the full history, so the full cache's output for those rows is known too.

CELL_FIELDS = ("layer", "head", "row", "err", "err_e2e", "err_design", "v_hat", "o_norm2", "v_hat_token_np",
               "v_hat_page_np", "evicted_mass", "ht_evicted_mass", "spread")
"""Per cell (question row × layer × head): ``err`` ‖ô − o‖ with o the full cache's output for the *same* query vector
(the evicted run's), ``err_e2e`` against the full run's own output at that layer (earlier layers' and earlier rounds'
drift included), ``err_design`` against the same query over this run's own K/V for the kept cells and the full run's for
the evicted ones (the sample's error alone), ``v_hat``/``o_norm2`` the product's in-graph terms (what the gate turns
into the certificate), ``v_hat_token_np`` the same token form recomputed in numpy from the captured tensors (a check),
``v_hat_page_np`` the page form (:func:`native.poisson.page_variance`) for the design drawn; ``evicted_mass`` the share
of the full-history softmax (the same query, the full run's keys) on the evicted positions — what an exact sketch of
that layer estimates, phase 1 of the two-phase design —, ``ht_evicted_mass`` the sample's own estimate of it,
Σ_S (1 − π_i) p_i (what the −log π biases impute), and ``spread`` the kept values' attention-weighted spread
Σ_S p_i‖v_i − ô‖² around the output (the graph's weights, with biases)."""


class EvictedReplica:
    """A second context on the engine's model that reproduces an evicted cache and captures a re-decode."""

    def __init__(self, model: Any, n_ctx: int, threads: int) -> None:
        self.rec = _Recorder(0)
        self.ctx = _capture_context(model, n_ctx, threads, self.rec)

    def capture(self, state: bytes, positions: np.ndarray, bias: np.ndarray, tokens: list[int],
                rows: int) -> dict[int, LayerCapture]:
        """Load ``state`` (the engine's sequence), write the biases, re-decode the last ``rows`` cells capturing
        every layer (the certificate stays off here: the stock graph, whose nodes the capture reads; an earlier
        cell re-decoded would change, as the engine computed it on the cache before an eviction)."""
        from native import llama  # noqa: PLC0415

        self.ctx.clear()
        self.ctx.set_seq_state(state)
        self.ctx.set_bias(0, positions.astype(np.int32), bias.astype(np.float32))
        k = rows
        tail_pos = positions[-k:]
        if not np.array_equal(tail_pos, np.arange(tail_pos[0], tail_pos[0] + k)):
            raise RuntimeError("the question's last cells are not contiguous")
        if not self.ctx.seq_rm(0, int(tail_pos[0]), -1):
            raise RuntimeError("the replica could not drop the question's rows")
        batch = llama.Batch(k)
        try:
            batch.set(tokens[-k:], [int(p) for p in tail_pos], 0, logits="last")
            self.rec.layers, self.rec.pending, self.rec.armed = {}, {}, True
            try:
                self.ctx.decode(batch)
            finally:
                self.rec.armed = False
        finally:
            batch.close()
        return dict(self.rec.layers)

    def close(self) -> None:
        self.ctx.close()


def _stages_for(rounds: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], positions: np.ndarray,
                logpi: np.ndarray) -> tuple[Any, float]:
    """The design the kept cells went through, from the recorded rounds; and the largest gap between the
    rounds' Σ log π and the cache's cumulative log π (0 when the record explains every bias)."""
    from native import poisson  # noqa: PLC0415

    per_round = []
    total = np.zeros(len(positions))
    for r in sorted(rounds):
        pos_r, units_r, pi_r = rounds[r]
        idx = np.clip(np.searchsorted(pos_r, positions), 0, max(len(pos_r) - 1, 0))
        hit = (pos_r[idx] == positions) if len(pos_r) else np.zeros(len(positions), dtype=bool)
        units = np.where(hit, units_r[idx], -1)
        pi = np.where(hit, pi_r[idx], 1.0)
        total += np.log(pi)
        per_round.append((units, pi))
    gap = float(np.max(np.abs(total - logpi))) if len(positions) else 0.0
    return poisson.Stages.from_rounds(per_round), gap


def turn_cells(ev: dict[int, LayerCapture], full: dict[int, LayerCapture], rows: int, positions: np.ndarray,
               logpi: np.ndarray, v_hat: np.ndarray, o_norm2: np.ndarray, stages: Any
               ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The cells of one question: ``ev`` the evicted cache's re-decode (rows + 1 rows), ``full`` the full
    cache's last ``rows`` rows; ``v_hat``/``o_norm2`` [n_layer, n_head, rows] the product's terms."""
    from native import poisson  # noqa: PLC0415

    n = len(positions)
    n_full = int(positions[-1]) + 1
    gone = np.ones(n_full, dtype=bool)
    gone[positions] = False
    pi = np.exp(np.minimum(logpi, 0.0))
    cells_only = poisson.Stages.single(np.arange(n), pi)  # every cell its own unit, cumulative π: the graph's form
    cols: dict[str, list[np.ndarray]] = {f: [] for f in CELL_FIELDS}
    checks = {"out_rel": 0.0, "full_out_rel": 0.0, "token_np_vs_graph_rel": 0.0, "mask_mismatch": 0.0}
    rels: list[np.ndarray] = []
    # a sliding-window layer (Gemma 3) reads its own, smaller cache, whose cells are not the live positions in
    # order: only the layers of the full-width cache are measured
    width = max((c.p.shape[-1] for c in ev.values() if c.p is not None), default=0)
    checks["layers_skipped"] = 0.0
    for il in sorted(ev):
        e, f = ev[il], full.get(il)
        if f is None or e.p is None or f.mask is None or e.out is None or f.out is None:
            continue
        if e.p.shape[-1] != width or e.v.shape[1] < n:
            checks["layers_skipped"] += 1
            continue
        n_head, n_kv_head = e.q.shape[0], e.k.shape[0]
        group = n_head // n_kv_head
        p = e.p[:, -rows:, :n].astype(np.float64)  # [H, rows, n] (cells beyond n are empty: weight 0)
        checks["mask_mismatch"] = max(checks["mask_mismatch"], float(e.p[:, -rows:, n:].sum()))
        # row r of the question sees the cells at positions ≤ its own: a check that cell j holds positions[j]
        row_pos = positions[-rows:]
        future = positions[None, :] > row_pos[:, None]
        checks["mask_mismatch"] = max(checks["mask_mismatch"], float(p[:, future].sum()) if future.any() else 0.0)
        o_hat = e.out[:, -rows:, :].astype(np.float64)  # [H, rows, d]
        q = e.q[:, -rows:, :].astype(np.float64)
        mask_full = f.mask[:rows, :n_full].astype(np.float64)
        scale = float(f.scale if f.scale is not None else 1.0 / math.sqrt(q.shape[2]))
        per_kv = []
        for hk in range(n_kv_head):
            v_ev = e.v[hk, :n].astype(np.float64)
            k_full = f.k[hk, :n_full].astype(np.float64)
            v_full = f.v[hk, :n_full].astype(np.float64)
            # the reference with this run's own K/V for the kept cells and the full run's for the evicted ones:
            # the error of the sample alone, without the drift of what the kept cells hold
            k_mix, v_mix = k_full.copy(), v_full.copy()
            k_mix[positions] = e.k[hk, :n].astype(np.float64)
            v_mix[positions] = v_ev
            per_kv.append((v_ev, k_full, v_full, k_mix, v_mix))
        mask_g = np.tile(mask_full, (group, 1))  # the query heads of one KV head, stacked row-wise
        for hk in range(n_kv_head):
            # the query heads of this KV head as one (group · rows)-row problem: one call per KV head
            heads = np.arange(hk * group, (hk + 1) * group)
            v_ev, k_full, v_full, k_mix, v_mix = per_kv[hk]
            qg = q[heads].reshape(-1, q.shape[2])
            og = o_hat[heads].reshape(-1, o_hat.shape[2])
            pg = p[heads].reshape(-1, n)
            logits = scale * qg @ k_full.T + mask_g
            a_full = _softmax_rows(logits)
            o_same = a_full @ v_full
            evicted_mass = a_full[:, gone].sum(axis=1)
            ht_evicted_mass = pg @ (1.0 - pi)
            o2_np = np.einsum("rd,rd->r", og, og)
            spread = np.maximum(pg @ np.einsum("nd,nd->n", v_ev, v_ev)
                                - 2.0 * np.einsum("rd,rd->r", og, pg @ v_ev) + o2_np * pg.sum(axis=1), 0.0)
            o_design = _softmax_rows(scale * qg @ k_mix.T + mask_g) @ v_mix
            err = np.linalg.norm(og - o_same, axis=1)
            err_e2e = np.linalg.norm(og - f.out[heads][:, -rows:, :].reshape(-1, og.shape[1]).astype(np.float64),
                                     axis=1)
            err_design = np.linalg.norm(og - o_design, axis=1)
            o_np = pg @ v_ev
            # the full reference recomputed for the full run's own query rows = its graph's output (catches a
            # logit transform the numpy path would miss: soft-capping, a bias on the logits)
            full_q = f.q[heads][:, -rows:, :].reshape(-1, og.shape[1]).astype(np.float64)
            full_out = f.out[heads][:, -rows:, :].reshape(-1, og.shape[1]).astype(np.float64)
            full_np = _softmax_rows(scale * full_q @ k_full.T + mask_g) @ v_full
            checks["full_out_rel"] = max(checks["full_out_rel"], float(np.max(
                np.linalg.norm(full_np - full_out, axis=1) / np.maximum(np.linalg.norm(full_out, axis=1), 1e-12))))
            checks["out_rel"] = max(checks["out_rel"], float(np.max(np.linalg.norm(o_np - og, axis=1)
                                                                     / np.maximum(np.linalg.norm(og, axis=1), 1e-12))))
            vt = poisson.page_variance(pg, v_ev, og, cells_only)  # the token form, in the reference
            vp = poisson.page_variance(pg, v_ev, og, stages)
            vg = v_hat[il, heads].reshape(-1).astype(np.float64)
            o2 = o_norm2[il, heads].reshape(-1).astype(np.float64)
            # relative, with a floor of 1e-6‖ô‖² (the graph's V̂ is a difference of F32 sums, clamped at 0)
            rel = np.abs(vt - vg) / (np.maximum(np.abs(vg), vt) + 1e-6 * o2)
            checks["token_np_vs_graph_rel"] = max(checks["token_np_vs_graph_rel"], float(np.max(rel)))
            rels.append(rel)
            m = len(heads) * rows
            for name, val in (("layer", np.full(m, il)), ("head", np.repeat(heads, rows)),
                              ("row", np.tile(np.arange(rows), len(heads))), ("err", err), ("err_e2e", err_e2e),
                              ("err_design", err_design), ("v_hat", vg), ("o_norm2", o2), ("v_hat_token_np", vt),
                              ("v_hat_page_np", vp), ("evicted_mass", evicted_mass),
                              ("ht_evicted_mass", ht_evicted_mass), ("spread", spread)):
                cols[name].append(np.asarray(val, dtype=np.float64))
    out = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    checks["token_np_vs_graph_rel_median"] = float(np.median(np.concatenate(rels))) if rels else 0.0
    return out, checks


@dataclass
class _Observed:
    """What the observers of one in-process replay saw."""

    job: Any = None
    step: Any = None
    shadow: list[int] = field(default_factory=list)
    rounds: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)
    cells: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)


BASE_MODEL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma's turn markup, for a base model without a chat template (the study only; the agent refuses such a model)."""


class ProductCoverage:
    """Observers for an in-process replay (a context manager): at every question the gate reads on an evicted
    cache, the cells of :func:`turn_cells`, grouped by ``"<policy> <budget> <protocol>"``."""

    def __init__(self, model_path: Path, threads: int, every_turn: bool = False) -> None:
        self.model_path = model_path
        self.threads = threads
        self.every_turn = every_turn
        """Every question on an evicted cache (fillers too), not only the probes' (a live chat answers both;
        the numpy side costs seconds per question on two shared cores)."""
        self.fallback_template = False
        """The GGUF had no chat template and the study gave it Gemma's turn markup."""
        self.seen = _Observed()
        self._model: Any = None
        self._replica: EvictedReplica | None = None
        self._full: FullCacheProbe | None = None
        self._full_fed: list[int] = []
        self._n_ctx = 0

    # -- observers -----------------------------------------------------------------------
    def __enter__(self) -> "ProductCoverage":
        return self

    def attach(self, runner: Any) -> None:
        """Watch ``runner``'s replay (``batch.run``'s ``observe``): which job and step it is on, every token its
        engine feeds, every eviction plan and every question the gate reads, through their hooks."""
        from agent.llm import template as template_mod  # noqa: PLC0415

        seen = self.seen
        model = runner.engine.model
        if not model.chat_template():
            # a base model (gemma3-270m) has no chat template and the agent refuses it; the study gives it
            # Gemma's turn markup, so its attention can be measured on the same scripts (results say so)
            self.fallback_template = True
            bos = model.token_to_piece(model.bos(), special=True).decode("utf-8", errors="replace")
            eos = model.token_to_piece(model.eos(), special=True).decode("utf-8", errors="replace")
            runner.template = template_mod.ChatTemplate(source=BASE_MODEL_TEMPLATE, bos_token=bos, eos_token=eos)

        def job_started(job: Any, script: Any) -> None:
            seen.job, seen.shadow, seen.rounds = (job, script), [], {}

        def sending(step: Any) -> None:
            seen.step = step

        def fed(start: int, tokens: list[int]) -> None:
            del seen.shadow[start:]
            if len(seen.shadow) < start:
                seen.shadow += [-1] * (start - len(seen.shadow))  # never fed here: a hole (checked later)
            seen.shadow += [int(t) for t in tokens]

        def planned(round_: int, positions: np.ndarray, plan: Any) -> None:
            seen.rounds[int(round_)] = (np.asarray(positions, dtype=np.int64).copy(),
                                        np.asarray(plan.unit_ids, dtype=np.int64).copy(),
                                        np.asarray(plan.pi, dtype=np.float64).copy())

        def session_opened(session: Any) -> None:
            gate = session.gate

            def question_read(engine: Any, rows: int, sampled_design: bool) -> None:
                step = seen.step
                wanted = self.every_turn or (step is not None and getattr(step, "probe", None) is not None)
                if (seen.job is not None and wanted and sampled_design and engine.reading and rows > 0
                        and len(engine.cache) < engine.next_pos):
                    self._capture(gate, engine, rows)

            def rolled_back(first: int, end: int) -> None:
                for undone in range(first, end):
                    seen.rounds.pop(undone, None)

            session.memory.planned.subscribe(planned)
            session.memory.rolled_back.subscribe(rolled_back)
            gate.question_read.subscribe(question_read)

        runner.job_started.subscribe(job_started)
        runner.sending.subscribe(sending)
        runner.session_opened.subscribe(session_opened)
        runner.engine.fed.subscribe(fed)

    def __exit__(self, *exc: object) -> None:
        for probe in (self._replica, self._full):
            if probe is not None:
                probe.close()
        if self._model is not None:
            self._model.close()
            self._model = None

    # -- one question --------------------------------------------------------------------
    def _contexts(self, n_ctx: int) -> tuple[EvictedReplica, FullCacheProbe]:
        if self._replica is None or self._full is None or n_ctx > self._n_ctx:
            from native import llama  # noqa: PLC0415

            for probe in (self._replica, self._full):
                if probe is not None:
                    probe.close()
            if self._model is None:
                self._model = llama.Model(self.model_path, n_gpu_layers=0)
            self._replica = EvictedReplica(self._model, n_ctx, self.threads)
            self._full = FullCacheProbe(self.model_path, n_ctx, self.threads, window=8, model=self._model)
            self._full_fed, self._n_ctx = [], n_ctx
        return self._replica, self._full

    def _capture(self, gate: Any, engine: Any, rows: int) -> None:
        seen = self.seen
        job, script = seen.job
        n_total = engine.next_pos
        history = seen.shadow[:n_total]
        if len(history) < n_total or -1 in history:
            raise RuntimeError("the observers missed part of the history")
        cache = engine.cache
        positions = np.asarray(cache.positions, dtype=np.int64)
        logpi = np.asarray(cache.logpi, dtype=np.float64)
        rows = min(rows, len(positions) - 1)
        replica, full = self._contexts(engine.n_ctx)
        cert = engine.read_certificate()
        v_hat, o_norm2 = cert.v_hat[:, :, -rows:], cert.o_norm2[:, :, -rows:]
        ev = replica.capture(engine.ctx.seq_state(0), positions, -logpi, list(cache.tokens), rows)
        # the full cache: the history fed so far shares a prefix with this one (an independent probe's
        # question is rewound), so only the rest is fed, its last rows captured
        common = 0
        while common < min(len(self._full_fed), len(history)) and self._full_fed[common] == history[common]:
            common += 1
        common = min(common, len(history) - rows)
        full.window = rows
        full.rewind(common)
        full_layers = full.feed(history[common:], capture=True)
        self._full_fed = list(history)
        stages, gap = _stages_for(seen.rounds, positions, logpi)
        cells, checks = turn_cells(ev, full_layers, rows, positions, logpi, v_hat, o_norm2, stages)
        checks["rounds_logpi_gap"] = gap
        step = seen.step
        label = f"{job.policy} {job.budget} {job.protocol}"
        turn = {"label": label, "script": script.name, "lineno": getattr(step, "lineno", None),
                "kind": "probe" if getattr(step, "probe", None) is not None else "filler",
                "uncertified": bool(gate.turn.uncertified), "cells_kv": int(len(positions)),
                "history": int(n_total), "rounds": len(seen.rounds), "n_cells": int(len(cells["err"])),
                # phase 1 as the product read it (the sketch's layers, int8): the per-question scale a two-phase
                # certificate could use where the cell's own layer has no sketch
                "sketch_evicted_mass": (gate.turn.sketch or {}).get("sketch.evicted_mass"), **checks}
        seen.turns.append(turn)
        cells["turn"] = np.full(len(cells["err"]), len(seen.turns) - 1, dtype=np.float64)
        seen.cells.setdefault(label, []).append(cells)

    def arrays(self, label: str) -> dict[str, np.ndarray]:
        parts = self.seen.cells.get(label, [])
        return {k: np.concatenate([p[k] for p in parts]) for k in (*CELL_FIELDS, "turn")} if parts else {}


Z95 = 1.6448536269514722
"""z_{0.95}: DESIGN.md's certificate z·sqrt(V̂) at nominal 95%."""


def coverage_forms(cells: dict[str, np.ndarray], form: CertificateForm, n_layer: int) -> dict[str, dict[str, Any]]:
    """Coverage and Spearman of each certificate form over ``cells`` (arrays of :data:`CELL_FIELDS`).

    ``shipped`` is the certificate the gate and the TUI show (``form``, agent.gate.certificate, for a model of
    ``n_layer`` layers; compared in absolute terms, ‖ô‖ times the relative value); the others are for
    diagnosis: ``k_only`` the same multiplier without the drift term, the z forms uncalibrated."""
    from agent.lab.replay.rank_stats import spearman  # noqa: PLC0415

    if not len(cells.get("err", [])):
        return {}
    o_norm = np.sqrt(np.maximum(cells["o_norm2"], 0.0))
    sd_graph = np.sqrt(np.maximum(cells["v_hat"], 0.0))
    sd_page = np.sqrt(np.maximum(cells["v_hat_page_np"], 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(o_norm > 0, sd_graph / o_norm, 0.0)
    shipped = o_norm * form.apply_cells(rel, cells["layer"], n_layer)
    forms = {"shipped": (shipped, cells["err"]), "k_only": (form.multiplier * sd_graph, cells["err"]),
             "raw_token": (sd_graph, cells["err"]),
             "z_token": (Z95 * sd_graph, cells["err"]), "z_page": (Z95 * sd_page, cells["err"]),
             "shipped_vs_full_run": (shipped, cells["err_e2e"]),
             "shipped_vs_sample_error": (shipped, cells["err_design"]),
             "z_page_vs_sample_error": (Z95 * sd_page, cells["err_design"])}
    out: dict[str, dict[str, Any]] = {}
    for name, (cert, err) in forms.items():
        out[name] = {"n_cells": int(len(err)), "coverage": float(np.mean(err <= cert)),
                     "spearman": spearman(cert, err),
                     "median_ratio_error_to_certificate": float(np.median(err / np.maximum(cert, 1e-30)))}
    out["shipped"]["multiplier"] = form.multiplier
    out["shipped"]["form"] = form.record()
    out["z_page"]["page_over_token_variance_median"] = float(np.median(
        cells["v_hat_page_np"] / np.maximum(cells["v_hat"], 1e-30)))
    return out


def run_coverage(scripts: list[Any], settings: Any, base: Any) -> dict[str, Any]:
    """The coverage study of the certificate the chat shows, in the protocols of ``settings.protocols``.

    Replays each Poisson variant of ``settings.policies`` (ungated) at each budget under
    :class:`ProductCoverage`; writes every cell to ``coverage-cells.npz`` (per design, for the calibration)
    and returns per design and protocol the coverage of each certificate form. The headline (``coverage``,
    ``n_cells``, ``spearman``, ``protocol``) is the first design's first protocol, ``shipped`` form, over
    the certified turns (an uncertified turn fires the gate whatever it reads)."""
    from agent.gate import calibration, certificate  # noqa: PLC0415
    from agent.lab.replay import batch  # noqa: PLC0415
    from agent.lab.replay.runner import base_policy  # noqa: PLC0415

    variants = [p for p in settings.policies if base_policy(p) in ("poisson", "poisson+gate")] or ["poisson"]
    settings.policies = list(dict.fromkeys(v.replace("poisson+gate", "poisson", 1) for v in variants))
    settings.plots = False
    model_path = batch._model_identity(settings.model or base.model)[0]
    found = calibration.of_file(model_path)
    own = found.certificate if found is not None else ()
    out_dir = Path(settings.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with ProductCoverage(model_path, settings.threads or 1) as obs:
        doc = batch.run(scripts, settings, base, observe=obs.attach)
        labels = list(obs.seen.cells)
        arrays = {label: obs.arrays(label) for label in labels}
        turns = list(obs.seen.turns)
        fallback = obs.fallback_template
    flat = {f"{label}|{k}": v for label, a in arrays.items() for k, v in a.items()}
    # numpy's stub reads **kwds as if they could fill allow_pickle: bool; these keys are "label|field" names
    np.savez_compressed(out_dir / "coverage-cells.npz", **flat)  # type: ignore[arg-type]
    (out_dir / "coverage-turns.json").write_text(json.dumps(turns, indent=0) + "\n", encoding="utf-8")
    rows = []
    model_name = settings.model or base.model
    # every layer of the models studied has attention, so the deepest layer seen gives the depth
    n_layer = 1 + max((int(a["layer"].max()) for a in arrays.values() if len(a.get("layer", []))), default=0)
    for label in labels:
        policy, budget, protocol = label.rsplit(" ", 2)
        a = arrays[label]
        mine = [t for t in turns if t["label"] == label]
        certified = np.array([not mine_t["uncertified"] for mine_t in turns], dtype=bool)[a["turn"].astype(int)]
        sub = {k: v[certified] for k, v in a.items()}
        # what the product shows for this policy (a variant of it runs under the same name and calibration): the
        # model's own certificate where its calibration fitted one (Gate.certificate_form)
        form = certificate.form_for(budget, model_name, certificate.PROTOCOL_ROUNDS.get(protocol, 2),
                                    policy=base_policy(policy), records=own or None)
        by_script: dict[str, Any] = {}
        script_of = np.array([t["script"] for t in turns])[sub["turn"].astype(int)] if len(sub["turn"]) else []
        for name in sorted(set(script_of)):
            sel = script_of == name
            by_script[name] = coverage_forms({f: v[sel] for f, v in sub.items()}, form, n_layer)["shipped"]
        rows.append({"design": f"{policy} {budget}", "policy": policy, "budget": budget, "protocol": protocol,
                     "turns": len(mine), "uncertified_turns": sum(t["uncertified"] for t in mine),
                     "forms": coverage_forms(sub, form, n_layer), "by_script": by_script,
                     "checks": {c: max((t[c] for t in mine), default=None)
                                for c in ("out_rel", "full_out_rel", "token_np_vs_graph_rel",
                                          "token_np_vs_graph_rel_median", "mask_mismatch", "rounds_logpi_gap",
                                          "layers_skipped")}})
    head = next((r for r in rows if r["forms"]), None)
    shipped = head["forms"]["shipped"] if head else {}
    return {"study": "coverage", "meta": doc["meta"], "nominal": certificate.NOMINAL,
            "design": head["design"] if head else None, "protocol": head["protocol"] if head else None,
            "coverage": shipped.get("coverage"), "n_cells": shipped.get("n_cells"),
            "spearman": shipped.get("spearman"), "multiplier": shipped.get("multiplier"),
            "certificate": "k·sqrt(V̂ + λ_l‖ô‖²)/‖ô‖ (token-form V̂ in the graph; k and the drift λ per layer "
                           "calibrated per model and budget, agent/gate/certificate_calibration.json)",
            "rows": rows, "cells_file": str(out_dir / "coverage-cells.npz"),
            "template": "study fallback (Gemma turn markup: the GGUF has none)" if fallback else "the GGUF's"}
