"""The cache manager: budget, eviction rounds, certificates and the gate for one engine.

It turns a policy's scores into a keep set (through the design core in ``native.poisson``),
applies it to the KV cache (remove, bias, compact through ``native.patched``), and reduces
the in-graph certificate terms to the gate statistic. The session asks it three things:
evict now?, does the question breach the gate?, does this answer step breach it?

With ``evict_at = "question"`` eviction is question-aware: the session prefills the user's
message except its last ``cert_window`` tokens, the attention of those rows' last
``question_window`` decides what matters, the cache is evicted, and the last ``cert_window``
tokens are then prefilled on the evicted cache, so their certificate is the error of the cache
that will actually answer — each token is read once (``split_question``). With ``evict_at = "turn-end"`` the session
evicts after the answer (scored by the question's attention and the answer's closing tokens'
attention, protecting only the sinks and the recent window) and the next message's prefill runs
on the evicted cache, so its own window certifies it without a re-read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent import calibration, policies
from agent.config import Config, parse_budget, parse_gate
from agent.engine import Engine
from native import patched, poisson

@dataclass(frozen=True)
class GateDecision:
    value: float | None
    threshold: float | None
    fire: bool
    uncertified: bool = False
    """Fired because too little of the evicted history was sampled to estimate the error, whatever the value."""


@dataclass(frozen=True)
class EvictionReport:
    round: int
    cells_before: int
    cells_after: int
    budget_cells: int
    sum_pi: float
    feasible: bool


@dataclass
class _TurnCerts:
    question: np.ndarray | None = None
    """(rows, layers, heads) relative certificate over the question window."""
    answer: list[np.ndarray] = field(default_factory=list)
    """One (layers, heads) relative certificate per answer step."""
    answer_running_q: float | None = None
    sampled_cells: int | None = None
    """Cells with π < 1 when the question's certificate was read: 0 means the certificate is 0 because nothing
    was sampled (everything kept was protected), not because nothing was lost."""
    uncertified: bool = False
    """History was evicted but fewer than two units (pages) of it survive as samples, so there is no variance
    to estimate and the certificate cannot speak for what was dropped: the gate fires whatever the value."""
    evicted_share: dict[str, float] = field(default_factory=dict)
    """``question.evicted_share[_layer_max]``: see :func:`_evicted_share`."""


def _evicted_share(reading: patched.Importance, positions: np.ndarray, logpi: np.ndarray) -> dict[str, float]:
    """The share of the question's attention that stands in for evicted cells, per layer (mean and max).

    Under the −log π bias a sampled cell of inclusion probability π carries the attention of 1/π cells of
    its stratum, of which only one is in the cache: a share 1 − π of its weight is the Horvitz–Thompson
    estimate of attention paid to cells that are gone. Summed over the cells (protected ones have π = 1),
    that is how much of the question's reading rests on imputed history — what the variance of the kept
    cells cannot show when the question looks for something the sample missed."""
    gone = 1.0 - np.exp(np.minimum(logpi, 0.0))
    shares = []
    for layer in range(reading.mass.shape[0]):
        total = float(reading.mass[layer][reading.cell_pos[layer] >= 0].sum())
        if total <= 0.0:
            continue  # a layer without attention (e.g. recurrent or shared-KV layers)
        one = patched.Importance(reading.mass[layer:layer + 1], reading.cell_pos[layer:layer + 1])
        shares.append(float((one.per_position(positions) * gone).sum()) / total)
    if not shares:
        return {}
    return {"question.evicted_share": float(np.mean(shares)),
            "question.evicted_share_layer_max": float(np.max(shares))}


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions → [p0, p1) runs, so eviction costs one seq_rm per run."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate(([positions[0]], positions[breaks + 1]))
    ends = np.concatenate((positions[breaks], [positions[-1]])) + 1
    return list(zip(starts.tolist(), ends.tolist()))


class CacheManager:
    """Budget, eviction, certificates and gate for one engine's cache."""

    def __init__(self, engine: Engine, config: Config) -> None:
        self.engine = engine
        self.config = config
        self.round = 0
        self._turn = _TurnCerts()
        self._importance: list[patched.Importance] = []
        """Attention readings since the last eviction (the question's window; at turn end also the closing's)."""
        self._cert_on = False
        self._window = 0
        self.reconfigure(config)

    # -- configuration ------------------------------------------------------------------
    @property
    def policy(self) -> policies.Policy:
        return policies.get(self.config.policy)

    @property
    def gate_stat(self) -> str:
        """The configured turn statistic, "auto" resolved to the calibrated one."""
        stat = self.config.gate_stat
        return calibration.default_statistic(self.config.evict_at) if stat == "auto" else stat

    def reconfigure(self, config: Config) -> None:
        self.config = config
        # Certificates/importance cost a little per step: on only when a policy uses them.
        want = self.policy.evicts and self.policy.name != "window"
        if want != self._cert_on or (want and self._window not in (0, self._rows())):
            patched.set_attn_certificate(self.engine.ctx.handle, want, self._rows())
            self._cert_on = want
            self._window = self._rows() if want else 0

    def _rows(self) -> int:
        """The graph's certificate window, fixed for the context: every n_window change rebuilds the
        scheduler's graph reservation. A ubatch reports its last min(rows, n_tokens) rows, so the same
        setting serves the question window of a prefill, the held-back question tokens and one-token decodes."""
        return max(1, self.config.question_window, self.config.cert_window)

    def _set_certificate(self, on: bool) -> None:
        """Resume (with the fixed window) or pause (the graph drops it) the certificate of an evicting policy."""
        if self._cert_on and on != (self._window > 0):
            patched.set_attn_certificate(self.engine.ctx.handle, on, self._rows())
            self._window = self._rows() if on else 0

    def _answer_certificates(self) -> bool:
        """Per-step certificates while answering: needed by an answer.* gate, or asked for (replays
        record every statistic); otherwise paused, since each costs a V-sized product per layer."""
        return self.config.answer_certificate or self.gate_stat.startswith("answer.")

    def reset(self) -> None:
        """A new or reopened conversation."""
        self.round = 0
        self.reset_cache_state()

    def reset_cache_state(self) -> None:
        """The cache was cleared (re-prefill follows)."""
        self._turn = _TurnCerts()
        self._importance = []
        self._set_certificate(True)

    def snapshot(self) -> Any:
        return (self.round, list(self._importance))

    def restore(self, snap: Any) -> None:
        """After an engine restore: state files carry no biases, so write them again."""
        self.round, self._importance = snap[0], list(snap[1])
        self._write_biases(np.ones(len(self.engine.cache), dtype=bool))

    # -- budget ----------------------------------------------------------------------------
    def budget_cells(self, history: int | None = None) -> int | None:
        """Cells the budget allows for a history of ``history`` positions (default: the current one)."""
        if not self.policy.evicts:
            return None
        kind, value = parse_budget(self.config.budget)
        length = self.engine.next_pos if history is None else history
        cells = int(value) if kind == "tokens" else int(round(value * max(length, 1)))
        return max(cells, self.config.sinks + self.config.recent)

    def split_question(self, n_tokens: int) -> int:
        """How many of a question's ``n_tokens`` to hold back until after its eviction: the certificate
        window, when prefilling the rest will take the cache past its budget (else 0, one prefill). The
        rest's last rows score the eviction; the held-back rows, prefilled on the evicted cache, certify it."""
        hold = min(self.config.cert_window, n_tokens - 1)
        if not self._cert_on or hold < 1:
            return 0
        head = n_tokens - hold
        budget = self.budget_cells(self.engine.next_pos + head)
        return hold if budget is not None and len(self.engine.cache) + head > budget else 0

    def threshold(self) -> float | None:
        gate = parse_gate(self.config.gate)
        if gate == "auto":
            return calibration.default_tau(self.gate_stat, self.config.evict_at)
        return gate if isinstance(gate, float) else None

    # -- prefill hooks -----------------------------------------------------------------
    def before_prefill(self) -> None:
        """The next feed's last rows are the question: score the cache with them."""
        self._set_certificate(True)

    def after_prefill(self) -> None:
        """Keep the question's attention (importance) and certificate of the pre-eviction cache."""
        if not self._cert_on:
            return
        self._importance = []
        self.read_importance()
        self._turn = self._question_certs(self.config.cert_window, self._importance[-1] if self._importance else None)

    def read_importance(self, add: bool = False) -> None:
        """Keep the attention the last feed's window rows paid each cell (the next eviction's scores);
        ``add`` keeps the earlier readings too (a turn-end eviction scores with the question's and the
        closing's attention)."""
        if self._cert_on and self._window:
            reading = patched.get_importance(self.engine.ctx.handle)
            self._importance = [*self._importance, reading] if add else [reading]

    def before_closing(self) -> None:
        """A turn-end eviction follows: the answer's closing tokens score the answer, which no question saw."""
        self._set_certificate(True)

    def _scores(self, positions: np.ndarray) -> np.ndarray | None:
        """Importance per position: each reading as a share of its own mass, summed over the readings."""
        if not self._importance:
            return None
        total = np.zeros(len(positions), dtype=np.float64)
        for reading in self._importance:
            mass = reading.per_position(positions)
            total += mass / max(float(mass.sum()), 1e-30)
        return total

    def _read_relative(self) -> np.ndarray:
        """(rows, layers, heads) relative certificate of the last ubatch; layers without attention dropped."""
        cert = patched.get_certificate(self.engine.ctx.handle)
        rel = np.transpose(cert.relative(), (2, 0, 1)).astype(np.float64)
        valid = ~np.isnan(rel).any(axis=(0, 2))
        rel = rel[:, valid, :]
        return np.nan_to_num(rel, nan=0.0, posinf=0.0)

    # -- eviction ------------------------------------------------------------------------
    def evict(self, protect_from: int, round_hint: int | None = None, conversation_id: int | None = None,
              store: Any = None, message_id: int | None = None, budget: int | None = None) -> EvictionReport | None:
        """Bring the cache back to its budget; positions ≥ ``protect_from`` are never evicted."""
        pol = self.policy
        target = budget if budget is not None else self.budget_cells()
        cache = self.engine.cache
        n = len(cache)
        if not pol.evicts or target is None or n <= target:
            return None
        positions = np.asarray(cache.positions, dtype=np.int64)
        segments = np.asarray(cache.segments, dtype=np.int64)
        protected = self._protected(positions, protect_from, target)
        importance = self._scores(positions)
        scores = pol.score(policies.CacheView(positions, segments, importance))
        unprotected = scores[~protected]
        floor = self.config.floor * float(unprotected.mean()) if unprotected.size and pol.method == "poisson" else 0.0
        plan = poisson.plan_eviction(
            scores, protected, float(target), method=pol.method,  # type: ignore[arg-type]
            page_size=self.config.page_size, message_ids=segments,
            top_share=self.config.top_share if pol.method == "poisson" else 0.0,
            floor=floor, seed=self.config.seed, round=self.round, positions=positions,
            prev_cum_logpi=np.asarray(cache.logpi, dtype=np.float64), strict=False,
        )
        keep = np.asarray(plan.keep, dtype=bool)
        ctx = self.engine.ctx
        for p0, p1 in _runs(positions[~keep]):
            if not ctx.seq_rm(self.engine.SEQ, p0, p1):
                raise RuntimeError(f"could not evict positions [{p0}, {p1})")
        cache.keep(keep)
        if pol.sampled:
            cache.logpi = [float(x) for x in plan.cum_logpi[keep]]
        self._write_biases(np.ones(len(cache), dtype=bool))
        patched.compact(ctx.handle, self.engine.SEQ)
        report = EvictionReport(round=self.round, cells_before=n, cells_after=len(cache), budget_cells=int(target),
                                sum_pi=float(plan.expected_kept), feasible=plan.feasible)
        if store is not None and conversation_id is not None:
            from memory_store.records import EvictionRound  # noqa: PLC0415

            store.record_eviction_round(EvictionRound(
                conversation_id=conversation_id, round=self.round, message_id=message_id, policy=pol.name,
                cells_before=n, cells_after=len(cache), expected_budget=float(target), seed=self.config.seed,
                sum_pi=float(plan.expected_kept)))
        self.round += 1
        # The readings stay: they map cells to the positions they held, so after compaction they still score
        # the survivors (a make_room eviction before the next prefill has nothing newer); the next prefill
        # replaces them.
        return report

    def _protected(self, positions: np.ndarray, protect_from: int, target: float) -> np.ndarray:
        """Sinks, the recent window before the current message, and the current message (if any).

        The recent window gives way: it takes at most half of the budget beyond the sinks and the message,
        leaving the rest to the top slice and the sampled tail. Otherwise a short history's budget (10% of
        400 tokens: 40 cells) is all protected cells, nothing is sampled, and the certificate is 0 by
        construction — as it was on turns 6–13 of every recall30 script before the fourth session, under
        both eviction timings."""
        protected = positions >= protect_from
        protected[: self.config.sinks] = True
        before = np.flatnonzero(positions < protect_from)
        spare = int(target) - int(np.count_nonzero(protected))
        recent = min(self.config.recent, max(0, spare // 2))
        if recent and len(before):
            protected[before[-recent:]] = True
        return protected

    def _write_biases(self, mask: np.ndarray) -> None:
        cache = self.engine.cache
        if not len(cache):
            return
        pos = np.asarray(cache.positions, dtype=np.int32)[mask]
        bias = (-np.asarray(cache.logpi, dtype=np.float64)[mask]).astype(np.float32)
        patched.set_bias_pos(self.engine.ctx.memory, self.engine.SEQ, pos, bias)

    def read_question_certificate(self, rows: int) -> None:
        """The certificate of the last feed's last ``rows`` rows (the held-back question tokens, prefilled on
        the evicted cache) is the question's."""
        if self._cert_on and self._window and rows > 0:
            self._turn = self._question_certs(rows)

    def requestion(self, tokens: list[int], segment: int) -> None:
        """Re-decode the question's last tokens on the evicted cache to certify that cache (only when the
        eviction was not foreseen, so nothing was held back: a one-token message)."""
        w = min(self.config.cert_window, len(tokens))
        if not self._cert_on or w == 0:
            return
        self._set_certificate(True)
        self.engine.truncate(self.engine.next_pos - w)
        self.engine.feed(tokens[-w:], segment=segment)
        self.read_question_certificate(w)

    def _question_certs(self, rows: int, reading: patched.Importance | None = None) -> _TurnCerts:
        """The last feed's last ``rows`` rows as the question's certificate, with the sample it rests on;
        ``reading``: that feed's attention, when already read from the graph."""
        cache = self.engine.cache
        sampled = np.asarray(cache.logpi, dtype=np.float64) < 0
        # A variance estimate needs at least two sampled units (survey sampling's rule for a stratum): with
        # fewer, V̂ is 0 or one term whatever was lost — e.g. a 10% budget of a 400-token history, whose tail
        # expects less than one page. (Nothing evicted: nothing lost, and 0 is the right certificate.)
        segs = np.asarray(cache.segments, dtype=np.int64)[sampled]
        pages = np.asarray(cache.positions, dtype=np.int64)[sampled] // self.config.page_size
        units = np.unique(np.stack([segs, pages]), axis=1).shape[1] if len(pages) else 0
        evicted = len(cache) < self.engine.next_pos
        share = _evicted_share(reading if reading is not None else patched.get_importance(self.engine.ctx.handle),
                               np.asarray(cache.positions, dtype=np.int64), np.asarray(cache.logpi, dtype=np.float64))
        return _TurnCerts(question=self._read_relative()[-rows:], sampled_cells=int(np.count_nonzero(sampled)),
                          uncertified=self.policy.sampled and evicted and units < 2, evicted_share=share)

    def make_room(self, needed: int) -> bool:
        """Free cells for the next prefill + answer; False when the policy cannot (``full``)."""
        if not self.policy.evicts:
            return False
        target = max(self.config.sinks + self.config.recent, self.engine.n_ctx - needed)
        budget = min(self.budget_cells() or target, target)
        self.evict(protect_from=self.engine.next_pos, budget=budget)
        return self.engine.free_cells() >= needed

    # -- certificates and the gate ----------------------------------------------------
    def _statistics(self) -> dict[str, float]:
        question = self._turn.question if self._turn.question is not None and self._turn.question.size else None
        answer = np.stack(self._turn.answer) if self._turn.answer else None
        if question is None and answer is None:
            return {}
        return {**poisson.turn_statistics(question=question, answer=answer), **self._turn.evicted_share}

    def question_gate(self) -> GateDecision:
        tau = self.threshold()
        value = self._statistics().get(self.gate_stat)
        if self._turn.uncertified and tau is not None:
            return GateDecision(value if value is not None else 0.0, tau, fire=True, uncertified=True)
        if not self.gate_stat.startswith("question."):
            return GateDecision(None, tau, False)
        return GateDecision(value, tau, fire=value is not None and tau is not None and value >= tau)

    def begin_answer(self) -> None:
        self._turn.answer = []
        self._turn.answer_running_q = None
        self._set_certificate(self._answer_certificates())

    def step_gate(self) -> GateDecision:
        """Read this decode step's certificate; fire when an answer statistic reaches τ."""
        tau = self.threshold()
        if not self._cert_on or self._window == 0:
            return GateDecision(None, tau, False)
        rel = self._read_relative()
        self._turn.answer.append(rel[-1])
        if not self.gate_stat.startswith("answer."):
            return GateDecision(None, tau, False)
        value = self._statistics().get(self.gate_stat)
        return GateDecision(value, tau, fire=value is not None and tau is not None and value >= tau)

    def turn_statistic(self) -> float | None:
        return self._statistics().get(self.gate_stat)

    def turn_detail(self) -> dict[str, Any]:
        detail: dict[str, Any] = dict(self._statistics())
        if self._turn.question is not None and self._turn.question.size:
            detail["per_layer"] = [float(x) for x in np.quantile(self._turn.question, 0.95, axis=(0, 2))]
        detail["answer_steps"] = len(self._turn.answer)
        if self._turn.sampled_cells is not None:
            detail["sampled_cells"] = self._turn.sampled_cells
        if self._turn.uncertified:
            detail["uncertified"] = 1
        return detail

    def retained_by_message(self, roles: dict[int, str], lengths: dict[int, int]) -> list[tuple[int, str, float]]:
        """(message index, role, share of its tokens still cached) for each message."""
        segs = np.asarray(self.engine.cache.segments, dtype=np.int64)
        counts = np.bincount(segs, minlength=max(lengths, default=0) + 1) if len(segs) else np.zeros(1)
        out = []
        for index, role in sorted(roles.items()):
            total = lengths.get(index, 0)
            kept = int(counts[index]) if index < len(counts) else 0
            out.append((index, role, min(1.0, kept / total) if total else 1.0))
        return out
