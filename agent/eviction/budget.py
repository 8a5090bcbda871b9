"""The cache manager: the budget, the protected set, and eviction rounds for one engine.

It turns the policy's scores into a keep set through the design core (``native.poisson``) and
hands it to :meth:`Engine.evict`, which alone changes the cache; it returns what it did as an
:class:`EvictionReport` for the session to log. It also decides when the graph's attention
readout runs (the policy's importance and the gate's certificates come from it) and keeps the
readings that score the next eviction.

With ``evict_at = "question"`` eviction is question-aware: the session prefills the user's
message except its last ``cert_window`` tokens (:meth:`split_question`), the attention of those
rows' last ``question_window`` decides what matters, the cache is evicted, and the held-back
tokens are prefilled on the evicted cache, so their certificate is the error of the cache that
will actually answer. With ``evict_at = "turn-end"`` the session evicts after the answer (scored
by the question's attention and the answer's closing tokens' attention, protecting only the
sinks and the recent window) and the next message's prefill runs on the evicted cache, so its
own window certifies it.

Below ``evict_from`` tokens of history the manager runs the full cache: no budget, no eviction, and the
readout off (so no importance, certificate or sketch query rows, and a gate has nothing to fire on). The
readout comes back a turn's worth of tokens before the threshold (:attr:`readout_lead`), so the round
that first evicts is scored by the attention of the question and answer that crossed it.

Under ``gate = "auto"`` on a model without a calibration (``calibration.for_model``), an evicting policy
does not apply at any length (:attr:`CacheManager.full_reason`): the calibrated floor sits where such a model's
turns never reach it, so the gate would never fire and eviction would forget silently. An explicit threshold or
``gate = "off"`` is the user's choice and evicts as configured.

The budget is resolved here too (:func:`resolve`, :attr:`CacheManager.in_force`): ``budget = "auto"`` runs the
cheapest budget the model's record certifies for config ``risk`` (agent/gate/certification.py), and where none is
certified, or the record has no certification, the full cache at any length, with the one line why as
:attr:`CacheManager.full_reason`. An explicit budget runs as given, with one notice line when the record does not
certify it at the risk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent import models
from agent.config import Budget, Config, GateThreshold
from agent.events import Hook
from agent.eviction import policies
from agent.gate import calibration, certification
from agent.llm.engine import Engine, FrameShift
from native import patched, poisson


@dataclass(frozen=True)
class EvictionReport:
    """One eviction round, as the session logs it."""

    round: int
    policy: str
    seed: int
    cells_before: int
    cells_after: int
    budget_cells: int
    sum_pi: float
    feasible: bool


@dataclass(frozen=True)
class ContextShift:
    """A full cache made room as llama.cpp's context shift does: the oldest history after the sinks dropped, the
    rest moved down to follow them (:meth:`CacheManager.shift_context`)."""

    dropped: int
    """Cells dropped."""
    kept: int
    """Positions kept at the front (the sinks, and the first message when it is short)."""


BUDGET_HOW = ("evict anyway with a budget of your own (--budget 25%), or allow more loss (--risk 20%, config "
              "risk)")
"""How to get eviction on a model whose record certifies no budget at the risk (or none at all)."""
HINTS = {calibration.UNCALIBRATED_HOW: "gate τ or off evicts", BUDGET_HOW: "--budget or a higher risk evicts"}
"""Each way out in a few words (the status line's)."""


@dataclass(frozen=True)
class BudgetInForce:
    """The budget a chat runs and how much it may forget, resolved once per configuration (:func:`resolve`)."""

    configured: Budget
    """The budget as configured: ``auto`` or an explicit one."""
    budget: Budget | None
    """The budget run (``auto`` resolved); None: the full cache at any length (``reason`` says why), or a policy that
    never evicts."""
    risk: float
    """The configured risk (config ``risk``)."""
    certified_risk: float | None = None
    """The loss ``budget`` is certified at on the model's long calibration chats (None: not certified)."""
    reason: str | None = None
    """Why ``budget = "auto"`` keeps the full cache (certification.NO_BUDGET or NOT_CERTIFIED); None otherwise."""
    notice: str | None = None
    """An explicit budget the model's record does not certify at the risk: the one line that says so."""

    @property
    def certified(self) -> bool:
        """The budget run is certified within the risk."""
        return self.certified_risk is not None and self.certified_risk <= self.risk

    def words(self) -> str:
        """How much the chat may forget, for the status line and the memory panel: "25% · certified ≤ 10% loss",
        "25% · not certified", or "full cache"."""
        if self.budget is None:
            return "full cache"
        if self.certified_risk is None:
            return f"{self.budget} · not certified"
        return f"{self.budget} · certified ≤ {certification.percent(self.certified_risk)} loss"


def resolve(budget: Budget, risk: float, evicts: bool, model: calibration.ModelCalibration | None,
            name: str) -> BudgetInForce:
    """The budget an evicting policy runs for ``budget`` at ``risk`` on the model of calibration ``model``, named
    ``name`` in the lines (:func:`model_name`). ``auto``: the cheapest budget the record's certification certifies at
    ``risk``, else the full cache with certification.NO_BUDGET (nothing certifies) or NOT_CERTIFIED (no
    certification). An explicit budget runs as given, with certification.UNCERTIFIED_BUDGET when not certified at
    ``risk``. A policy that never evicts runs no budget and needs no line."""
    if not evicts:
        return BudgetInForce(budget, None, risk)
    certified = model.certification if model is not None else None
    if budget.auto:
        if certified is None:
            return BudgetInForce(budget, None, risk, reason=certification.NOT_CERTIFIED.format(model=name))
        choice = certified.choose(risk, name)
        if choice.budget is None:
            return BudgetInForce(budget, None, risk, reason=choice.reason)
        return BudgetInForce(budget, Budget.parse(choice.budget), risk, choice.certified_risk)
    if certified is None:
        return BudgetInForce(budget, budget, risk, notice=certification.UNCERTIFIED_BUDGET.format(
            model=name, budget=budget, detail="the model's record has no certification"))
    return BudgetInForce(budget, budget, risk, certified.certified_risk(budget),
                         notice=certified.explain(budget, risk, name))


def model_name(model: calibration.ModelCalibration | None, path: Path) -> str:
    """How the budget's lines name a model: its registry name when the GGUF is a registry model (by its hash, or the
    registry's file), else the file's stem."""
    sha = model.model_sha256 if model is not None else None
    resolved = path.expanduser().resolve()
    for name, spec in models.REGISTRY.items():
        if spec.sha256 == sha or models.model_file(name).resolve() == resolved:
            return name
    return path.stem


@dataclass(frozen=True)
class EvictionSettings:
    """What the cache manager reads of the configuration, parsed once (:meth:`from_config`)."""

    budget: Budget
    """The budget as configured (``auto`` is resolved by the cache manager: :attr:`CacheManager.in_force`)."""
    risk: float
    gate: GateThreshold
    evict_from: int
    evict_at: str
    sinks: int
    recent: int
    page_size: int
    seed: int
    question_window: int
    cert_window: int
    sketch_layers: tuple[int, ...] | None
    """The configured sketch layers; None: the calibrated ones."""
    sketch_bits: int
    n_batch: int
    max_tokens: int
    evicted_rows_mb: int
    frame_shift: bool

    @classmethod
    def from_config(cls, config: Config) -> EvictionSettings:
        return cls(budget=config.kv_budget, risk=config.loss_risk, gate=config.gate_threshold,
                   evict_from=config.evict_from, evict_at=config.evict_at, sinks=config.sinks, recent=config.recent,
                   page_size=config.page_size,
                   seed=config.seed, question_window=config.question_window, cert_window=config.cert_window,
                   sketch_layers=config.sketch_layer_choice, sketch_bits=config.sketch_bits, n_batch=config.n_batch,
                   max_tokens=config.max_tokens, evicted_rows_mb=config.evicted_rows_mb, frame_shift=config.frame_shift)


class CacheManager:
    """Budget, protected set and eviction rounds for one engine's cache."""

    def __init__(self, engine: Engine, config: Config, model: calibration.ModelCalibration | None) -> None:
        """``model``: the engine's model's calibration (:func:`calibration.for_model`; None: it has none)."""
        self.engine = engine
        self.model_calibration = model
        self.settings = EvictionSettings.from_config(config)
        self.policy: policies.Policy = policies.from_config(config)
        self.round = 0
        self.planned: Hook[[int, np.ndarray, Any]] = Hook()
        """Heard after every eviction plan, before it is applied: (its round, the live positions it scored, the
        plan)."""
        self.rolled_back: Hook[[int, int]] = Hook()
        """Heard when :meth:`roll_back` undoes rounds [first, end): the cache is as it was before them."""
        self._longest = 0
        """The longest history this conversation's cache has held (a re-read starts the cache from position 0,
        but the history it reads is no shorter: eviction, once begun, goes on)."""
        self._importance: list[patched.Importance] = []
        """Attention readings since the last eviction (the question's window; at turn end also the closing's)."""
        self.full_reason: str | None = None
        """Why the evicting policy does not apply at any history length (None: it applies from ``evict_from``): the
        gate's calibration is missing (:meth:`_uncalibrated`), or ``budget = "auto"`` certifies no budget."""
        self.full_how: str | None = None
        """How to evict anyway where :attr:`full_reason` holds (None where it does not)."""
        self.name = model_name(model, engine.settings.model_path)
        """The model as the budget's lines name it."""
        self.in_force = BudgetInForce(Budget(auto=True), None, 0.0)
        """The budget run and how much it may forget (:func:`resolve`)."""
        self.reconfigure(config)

    # -- configuration ------------------------------------------------------------------
    def reconfigure(self, config: Config) -> None:
        self.settings = settings = EvictionSettings.from_config(config)
        self.policy = policies.from_config(config)
        self.in_force = resolve(settings.budget, settings.risk, self.policy.evicts, self.model_calibration, self.name)
        uncalibrated = self._uncalibrated()
        self.full_reason = uncalibrated or self.in_force.reason
        self.full_how = (calibration.UNCALIBRATED_HOW if uncalibrated is not None
                         else BUDGET_HOW if self.full_reason is not None else None)
        # The readout costs a little per step: on only for a policy that uses it, and with a window fixed for
        # the context, since every window change rebuilds the scheduler's graph reservation. A ubatch reports
        # its last min(rows, n_tokens) rows, so one setting serves the question window of a prefill, the
        # held-back question tokens and one-token decodes.
        # The sketch keeps what a sampled design evicts, for the gate: its query rows are the certificate window's.
        sketched = self.policy.sampled and self.policy.evicts and self.full_reason is None
        layers = settings.sketch_layers
        if layers is None:
            gate = self.model_calibration.gate(settings.evict_at) if self.model_calibration is not None else None
            windows = self.engine.info.layer_windows
            layers = (gate.sketch_layers(windows) if gate is not None
                      else calibration.fallback_sketch_layers(windows, settings.evict_at))
        self.engine.set_sketch(layers if sketched else (), settings.sketch_bits, settings.cert_window)
        # what a gate's re-read copies back; without a gate nothing is ever re-read
        self.engine.keep_rows(settings.evicted_rows_mb if self.policy.evicts and not settings.gate.off else 0)
        if self.policy.reads_attention:
            self.set_readout(True)
        elif self.engine.readout[1]:
            self.engine.set_readout(False, self.engine.readout[1])

    def _uncalibrated(self) -> str | None:
        """:data:`calibration.UNCALIBRATED` (or :data:`calibration.REJECTED`, with why) when the policy evicts under
        ``gate = "auto"`` on a model without an accepted gate calibration for ``evict_at``; None otherwise (a
        threshold or "off" was chosen, or nothing is evicted)."""
        if not self.policy.evicts or not self.settings.gate.auto:
            return None
        return calibration.full_cache_reason(self.model_calibration, self.settings.evict_at)

    @property
    def readout_rows(self) -> int:
        return max(1, self.settings.question_window, self.settings.cert_window)

    @property
    def reads_attention(self) -> bool:
        return self.policy.reads_attention

    def set_readout(self, on: bool) -> None:
        """Resume or pause the readout of a policy that uses it (a plain answer step needs none); below
        ``evict_from`` (less the lead) it stays off."""
        if self.reads_attention:
            self.engine.set_readout(on and self.readout_due(), self.readout_rows)

    # -- the full cache below evict_from ---------------------------------------------------------
    @property
    def evict_from(self) -> int:
        """``evict_from``, but no later than the length at which the full cache could no longer take a turn (the
        context less a question's batch and an answer): a context filled by the full cache would lose its oldest
        messages to a truncated re-read, evicted by no policy and certified by no gate."""
        return min(self.settings.evict_from, max(0, self.engine.n_ctx - self.readout_lead))

    @property
    def readout_lead(self) -> int:
        """Tokens before ``evict_from`` at which the readout comes on: a question's batch and an answer, so the
        turn that crosses the threshold is read while it is prefilled."""
        return self.settings.n_batch + self.settings.max_tokens + 16

    @property
    def history(self) -> int:
        """The conversation's history length in tokens, as the cache has seen it (its frame moved down or not)."""
        self._longest = max(self._longest, self.engine.log_position(self.engine.next_pos))
        return self._longest

    def evicting(self, history: int | None = None) -> bool:
        """Whether the policy applies at ``history`` tokens (default: now): it evicts and the history has
        reached ``evict_from``."""
        length = self.history if history is None else max(history, self.history)
        return self.policy.evicts and self.full_reason is None and length >= self.evict_from

    def readout_due(self) -> bool:
        """The readout serves eviction and the gate: on from a turn's worth of tokens before ``evict_from``."""
        return (self.policy.evicts and self.full_reason is None
                and self.history + self.readout_lead >= self.evict_from)

    @property
    def full_until(self) -> int | None:
        """``evict_from`` while an evicting policy still runs the full cache below it (for the status line);
        None once eviction applies, for a policy that never evicts, or while it does not apply at all
        (:attr:`full_reason`)."""
        return self.evict_from if self.policy.evicts and self.full_reason is None and not self.evicting() else None

    def reset(self, round: int = 0) -> None:
        """A new or reopened conversation; ``round``: the next eviction round the log expects."""
        self.round = round
        self._longest = 0
        self.reset_cache_state()

    def reset_cache_state(self) -> None:
        """The cache was cleared (re-prefill follows)."""
        self._importance = []
        self.set_readout(True)

    def snapshot(self) -> Any:
        return (self.round, list(self._importance), self.history)

    def restore(self, snap: Any) -> None:
        self.round, self._importance, self._longest = snap[0], list(snap[1]), snap[2]

    def roll_back(self, snap: Any) -> None:
        """Back to :meth:`snapshot`'s readings after a turn that is forgotten (an independent probe's, a cancelled
        re-read's). The rounds it evicted stay in the log, so the round counter goes on from them: the next
        eviction is logged under a new number, with new draws."""
        forgotten = (snap[0], self.round)
        self._importance, self._longest = list(snap[1]), snap[2]
        self.rolled_back(*forgotten)

    # -- budget ----------------------------------------------------------------------------
    @property
    def budget(self) -> Budget | None:
        """The budget in force (``auto`` resolved); None where the full cache runs at any length."""
        return self.in_force.budget if self.full_reason is None else None

    @property
    def full_hint(self) -> str | None:
        """:attr:`full_how` in a few words (the status line's)."""
        return HINTS.get(self.full_how) if self.full_how is not None else None

    @property
    def certified_risk(self) -> float | None:
        """The loss the budget in force is certified at on the model's long calibration chats (None: not
        certified, or none in force)."""
        return self.in_force.certified_risk if self.budget is not None else None

    @property
    def budget_words(self) -> str:
        """How much the chat may forget (:meth:`BudgetInForce.words`): "25% · certified ≤ 10% loss", "25% · not
        certified", or "full cache" where the full cache runs at any length."""
        if not self.policy.evicts or self.full_reason is not None:
            return "full cache"
        return self.in_force.words()

    @property
    def budget_notice(self) -> str | None:
        """The one line an explicit budget gets where the model's record does not certify it (None: certified, or
        the budget does not apply at all)."""
        return self.in_force.notice if self.full_reason is None else None

    def budget_cells(self, history: int | None = None) -> int | None:
        """Cells the budget allows for a history of ``history`` tokens (default: the current one); None for
        the full cache (a policy that never evicts, or a history below ``evict_from``)."""
        if not self.evicting(history):
            return None
        length = self.engine.log_position(self.engine.next_pos) if history is None else history
        assert self.in_force.budget is not None  # evicting: a budget was resolved
        cells = self.in_force.budget.cells(length)
        return max(cells, self.settings.sinks + self.settings.recent)

    def split_question(self, n_tokens: int) -> int:
        """How many of a question's ``n_tokens`` to hold back until after its eviction: the certificate
        window, when prefilling the rest will take the cache past its budget (else 0, one prefill). The
        rest's last rows score the eviction; the held-back rows, prefilled on the evicted cache, certify it."""
        hold = min(self.settings.cert_window, n_tokens - 1)
        if not self.reads_attention or not self.readout_due() or hold < 1:
            return 0
        head = n_tokens - hold
        budget = self.budget_cells(self.engine.log_position(self.engine.next_pos) + head)
        return hold if budget is not None and len(self.engine.cache) + head > budget else 0

    # -- attention readings ------------------------------------------------------------
    def after_prefill(self) -> patched.Importance | None:
        """The question's attention (importance) on the pre-eviction cache: kept to score the next eviction,
        and returned for the gate (None when the readout is off, or below ``evict_from``: the full cache has
        nothing to certify, so the gate has nothing to fire on)."""
        if not self.reads_attention:
            return None
        self._importance = []
        self.read_importance()
        return self._importance[-1] if self._importance and self.evicting() else None

    def read_importance(self, add: bool = False) -> None:
        """Keep the attention the last feed's window rows paid each cell (the next eviction's scores);
        ``add`` keeps the earlier readings too (a turn-end eviction scores with the question's and the
        closing's attention)."""
        if self.engine.reading:
            reading = self.engine.read_importance()
            self._importance = [*self._importance, reading] if add else [reading]

    def _scores(self, positions: np.ndarray) -> np.ndarray | None:
        """Importance per position: each reading as a share of its own mass, summed over the readings."""
        if not self._importance:
            return None
        total = np.zeros(len(positions), dtype=np.float64)
        for reading in self._importance:
            mass = reading.per_position(positions)
            total += mass / max(float(mass.sum()), 1e-30)
        return total

    # -- eviction ------------------------------------------------------------------------
    def evict(self, protect_from: int, budget: int | None = None) -> EvictionReport | None:
        """Bring the cache back to its budget; positions ≥ ``protect_from`` are never evicted."""
        pol = self.policy
        target = budget if budget is not None else self.budget_cells()
        cache = self.engine.cache
        n = len(cache)
        if not pol.evicts or target is None or n <= target:
            return None
        if pol.needs_importance and not self._importance:
            # Nothing read yet to score with (the readout was off below evict_from when this history arrived in
            # one batch, e.g. a reopened conversation): the next prefill reads it, and the round waits for it.
            return None
        positions = np.asarray(cache.positions, dtype=np.int64)
        segments = np.asarray(cache.segments, dtype=np.int64)
        protected = self._protected(positions, protect_from, target)
        scores = pol.score(policies.CacheView(positions, segments, self._scores(positions)))
        unprotected = scores[~protected]
        plan = poisson.plan_eviction(
            scores, protected, float(target), method=pol.design,  # type: ignore[arg-type]
            page_size=self.settings.page_size, message_ids=segments, top_share=pol.top_share,
            floor=pol.floor * float(unprotected.mean()) if unprotected.size else 0.0,
            seed=self.settings.seed, round=self.round, positions=positions,
            prev_cum_logpi=np.asarray(cache.logpi, dtype=np.float64), strict=False,
        )
        self.planned(self.round, positions, plan)
        self.engine.evict(np.asarray(plan.keep, dtype=bool), plan.cum_logpi if pol.sampled else None)
        report = EvictionReport(round=self.round, policy=pol.name, seed=self.settings.seed, cells_before=n,
                                cells_after=len(cache), budget_cells=int(target), sum_pi=float(plan.expected_kept),
                                feasible=plan.feasible)
        self.round += 1
        # The readings stay: they map cells to the positions they held, so after compaction they still score
        # the survivors (a make_room eviction before the next prefill has nothing newer); the next prefill
        # replaces them.
        return report

    def _protected(self, positions: np.ndarray, protect_from: int, target: float) -> np.ndarray:
        """Sinks, the recent window before the current message, the current message (if any), and the newest
        cell (the next batch continues from its position).

        The recent window gives way: it takes at most half of the budget beyond the sinks and the message,
        leaving the rest to the top slice and the sampled tail. Otherwise a short history's budget (10% of
        400 tokens: 40 cells) is all protected cells, nothing is sampled, and the certificate is 0 by
        construction."""
        protected = positions >= protect_from
        protected[: self.settings.sinks] = True
        before = np.flatnonzero(positions < protect_from)
        spare = int(target) - int(np.count_nonzero(protected))
        recent = min(self.settings.recent, max(0, spare // 2))
        if recent and len(before):
            protected[before[-recent:]] = True
        protected[-1:] = True
        return protected

    def make_room(self, needed: int) -> tuple[bool, EvictionReport | None]:
        """Free cells for the next prefill + answer: (freed enough, the round that did it); never for ``full``, nor
        while the policy does not apply (:attr:`full_reason`: the session keeps the newest history, as for ``full``)."""
        if not self.policy.evicts or self.full_reason is not None:
            return False, None
        target = max(self.settings.sinks + self.settings.recent, self.engine.n_ctx - needed)
        budget = min(self.budget_cells() or target, target)
        report = self.evict(protect_from=self.engine.next_pos, budget=budget)
        return self.engine.free_cells() >= needed, report

    def shift_context(self, needed: int) -> ContextShift | None:
        """Make room for ``needed`` cells in a cache that does not evict (``full``, or a policy that does not apply
        yet), as llama.cpp's context shift does, at message boundaries: the sinks and the first message (the
        system prompt, when it is short) stay, the oldest whole messages after them are dropped — about half the
        rest, at least what ``needed`` takes — and the newer ones move down behind them, keys re-rotated. Nothing is
        recomputed and positions stay under the context size. None where the cache cannot move positions, keeps
        evicted cells' keys, or cannot free enough that way (the session then re-reads the newest history)."""
        engine = self.engine
        short = needed - engine.free_cells()
        if short <= 0 or not engine.ctx.can_shift():
            return None
        if (engine.sketch is not None and engine.sketch.n_tokens) or (engine.rows is not None and len(engine.rows)):
            return None
        live = np.asarray(engine.cache.positions, dtype=np.int64)
        low = self._after_sinks(live)
        spans = sorted(engine.cache.spans.values())
        if spans and spans[0][0] == 0 and spans[0][1] <= engine.n_ctx // 4:
            low = max(low, spans[0][1])
        after = int(np.count_nonzero(live >= low))
        if after < short:
            return None
        want = max(short, after // 2)
        below = np.searchsorted(live, low)
        cut = next((a for a, _ in spans if a > low and np.searchsorted(live, a) - below >= want
                    and np.any(live >= a)), None)
        if cut is None:
            # every message after the kept ones goes
            dropped = after
            engine.cut_history(low)
        else:
            dropped = int(np.searchsorted(live, cut) - below)
            engine.evict((live < low) | (live >= cut), remember=False)
            engine.shift_down(cut, cut - low)
        # readings map cells to positions the shift changed; the next prefill reads new ones
        self._importance = []
        return ContextShift(dropped=dropped, kept=low)

    def keep_frame(self, needed: int) -> FrameShift | None:
        """When the next ``needed`` positions would run past the model's trained context, move the frame down
        (``Engine.shift_frame``) so that the next position lands near half of it: the sinks stay, the oldest kept
        cells are packed behind them, the rest keep their distances. Only for a cache that evicts (a full cache,
        a policy that does not apply at all among them, :attr:`full_reason`, shifts its context when its cells run
        out, :meth:`shift_context`); None when nothing is due, the config
        says ``frame_shift = false`` or the model's RoPE cannot be followed."""
        engine = self.engine
        limit = engine.info.n_ctx_train
        if (not self.settings.frame_shift or limit <= 0 or engine.next_pos + needed <= limit
                or not self.policy.evicts or self.full_reason is not None or engine.rope is None
                or not engine.ctx.can_shift()):
            return None
        live = np.asarray(engine.cache.positions, dtype=np.int64)
        low = self._after_sinks(live)
        want = engine.next_pos - limit // 2
        # how far the cells from each candidate cut would move: the gap behind the sinks less the cells packed there
        cuts = np.arange(low + 1, engine.next_pos, dtype=np.int64)
        moved = cuts - low - (np.searchsorted(live, cuts) - np.searchsorted(live, low))
        ok = np.flatnonzero(moved >= want)
        if not len(ok) or not np.any(live >= cuts[ok[0]]):
            return None
        shift = engine.shift_frame(low, int(cuts[ok[0]]))
        # readings map cells to positions the shift changed; the next prefill reads new ones
        self._importance = []
        return shift

    def _after_sinks(self, live: np.ndarray) -> int:
        """The first position after the sinks among the live positions ``live`` (sorted)."""
        sinks = min(self.settings.sinks, len(live))
        return int(live[sinks - 1]) + 1 if sinks else 0

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
