"""The gate, start to finish: the turn's certificates, the decision to re-read, and what a re-read reads.

Each turn gets one :class:`TurnCertificates`: the question window's relative certificate
(read on the cache that will answer), one per answer step, the sample they rest on, and the
decision that fired, if any. A re-read of the history does not wipe it, so the turn reports
the value that fired the gate. :class:`Gate` compares the configured turn statistic with τ
(the calibrated default through ``agent.gate.calibration``, or the configured threshold) and fails
closed: a non-finite certificate, or history evicted with too few sampled pages to estimate
the error (*uncertified*), fires it.

The re-read planner says which logged messages a firing re-prefills (all of them, or the
system prompt and the newest that fit) and how many of them the host copy of the previous
re-read still holds token for token (config ``reread_copy``); the copy itself lives here too.
The session carries out the plan on the engine; the log stays the source of truth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from agent.config import Budget, Config, GateThreshold
from agent.events import Hook
from agent.eviction import policies
from agent.gate import calibration, certificate, repetition, signals
from agent.gate.bars import Bar
from agent.gate.baselines import RunningMedians
from agent.gate.certificate import CertificateForm
from agent.gate.signals import Signal
from agent.llm.engine import holds_logged_tokens
from native import patched, poisson

if TYPE_CHECKING:
    from agent.llm.engine import Engine, EngineSnapshot


@dataclass(frozen=True)
class GateDecision:
    value: float | None
    threshold: float | None
    fire: bool
    uncertified: bool = False
    """Fired because too little of the evicted history was sampled to estimate the error, whatever the value."""
    second: str = ""
    """The second signal's statistic when it fired the turn (``value`` and ``threshold`` are then its own); ""
    for the gate's statistic."""


@dataclass
class TurnCertificates:
    """What the gate measured during one turn (kept through a re-read of the history)."""

    question: np.ndarray | None = None
    """(rows, layers, heads) sqrt(V̂)/‖ô‖ over the question window, as the graph gave it."""
    answer: list[np.ndarray] = field(default_factory=list)
    """One (layers, heads) sqrt(V̂)/‖ô‖ per answer step."""
    form: CertificateForm = field(default_factory=CertificateForm)
    """How those become the certificate shown (calibrated per model, budget and rounds: agent.gate.certificate)."""
    rounds: int = 0
    """The engine's eviction rounds when the certificates were read."""
    sampled_cells: int | None = None
    """Cells with π < 1 when the question's certificate was read: 0 means the certificate is 0 because nothing
    was sampled (everything kept was protected), not because nothing was lost."""
    uncertified: bool = False
    """History was evicted but fewer than two units (pages) of it survive as samples, so there is no variance
    to estimate and the certificate cannot speak for what was dropped: the gate fires whatever the value."""
    evicted_share: dict[str, float] = field(default_factory=dict)
    """``question.evicted_share[_layer_max]``: see :func:`evicted_share`."""
    fired: GateDecision | None = None
    """The decision that re-read the history this turn (question or answer phase)."""
    sketch: dict[str, float] = field(default_factory=dict)
    """``sketch.max`` and ``sketch.evicted_mass``: see :meth:`Gate.read_sketch`."""
    implicated: list[tuple[int, float]] = field(default_factory=list)
    """(message index, anomaly) of the five mostly evicted messages the question points at most, most anomalous
    first."""
    anomalies: dict[int, float] = field(default_factory=dict)
    """Message index → anomaly, for every mostly evicted message with a baseline (what a targeted re-read picks
    from)."""
    excess: dict[int, float] = field(default_factory=dict)
    """Message index → the question's share on it above its baseline, in the layer of its anomaly: how much of
    the question's attention it draws beyond what earlier questions paid it (the implicated mass)."""
    shares: dict[int, np.ndarray] = field(default_factory=dict)
    """Per message index: its estimated share of the question's attention in each sketch layer."""
    sketch_layers: list[int] = field(default_factory=list)
    """The model layers the sketch scored (the order of every per-layer list in ``sketch_messages``)."""
    sketch_messages: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per message index with evicted cells: enough to recompute ``sketch.max`` offline for any subset of the
    layers (``agent/lab/fits/sketch_records.py`` reads it back): see :meth:`Gate.read_sketch`."""
    discarded: bool = False
    """The turn was rolled back (an independent probe)."""

    def statistics(self, form: CertificateForm | None = None) -> dict[str, float]:
        """Every statistic of the turn, the certificate ones in ``form`` (default: the certificate shown)."""
        form = form or self.form
        question = form.apply(self.question) if self.question is not None and self.question.size else None
        answer = form.apply(np.stack(self.answer)) if self.answer else None
        if question is None and answer is None:
            return dict(self.sketch)
        return {**poisson.turn_statistics(question=question, answer=answer), **self.evicted_share, **self.sketch}

    def detail(self) -> dict[str, Any]:
        detail: dict[str, Any] = dict(self.statistics())
        if self.question is not None and self.question.size:
            shown = self.form.apply(self.question)
            detail["per_layer"] = [float(x) for x in np.quantile(shown, 0.95, axis=(0, 2))]
        detail["answer_steps"] = len(self.answer)
        if self.sampled_cells is not None:
            detail["sampled_cells"] = self.sampled_cells
        if self.uncertified:
            detail["uncertified"] = 1
        if self.sketch:
            detail["sketch.top"] = [[m, round(a, 4)] for m, a in self.implicated]
            detail["sketch.layers"] = list(self.sketch_layers)
            detail["sketch.messages"] = self.sketch_messages
        return detail


def relative_certificate(cert: patched.Certificate) -> np.ndarray:
    """(rows, layers, heads) relative certificate of a ubatch. Layers without attention (all NaN: recurrent or
    shared-KV layers) are dropped; any other non-finite value is a breach and reads +inf, never 0."""
    rel = np.transpose(cert.relative(), (2, 0, 1)).astype(np.float64)
    rel = rel[:, ~np.isnan(rel).all(axis=(0, 2)), :]
    return np.nan_to_num(rel, nan=np.inf, posinf=np.inf)


def evicted_share(reading: patched.Importance, positions: np.ndarray, logpi: np.ndarray) -> dict[str, float]:
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


SHARE_FLOOR = 1e-4
"""The smallest baseline share an anomaly divides by, so a message earlier questions ignored does not read as
infinitely anomalous on noise."""

REPEATS_CHECKED = 24
"""The most anomalous messages checked for being a question the turn repeats (agent.gate.repetition): more than a
targeted re-read ever takes (``MAX_TARGETED``), read from the log in one query."""

MessageTexts = Callable[[Sequence[int]], dict[int, str]]
"""The log's text of the messages at some indices (the session reads them from the store)."""


def _sig(x: Any) -> Any:
    """Floats to 4 significant digits (a float or a list): the detail records per-message shares compactly."""
    if np.ndim(x):
        return [float(f"{v:.4g}") for v in np.asarray(x, dtype=np.float64)]
    return float(f"{float(x):.4g}")


@dataclass(frozen=True)
class ReadCopy:
    """The cache as a gate's re-read left it: the logged messages it holds (id, exact tokens) from position 0."""

    conversation_id: int
    messages: tuple[tuple[int, tuple[int, ...]], ...]
    snapshot: "EngineSnapshot"


@dataclass(frozen=True)
class ReadPlan:
    """What a re-read does: restore the copy's first ``restored`` messages, then prefill the rest."""

    messages: list[Any]
    """The logged messages the cache will hold, in order."""
    truncated: bool
    """The history did not fit: the system prompt and the newest messages that do."""
    restored: int = 0
    """How many of ``messages`` come from the host copy (0: none)."""
    snapshot: "EngineSnapshot | None" = None
    """The copy to restore, truncated to ``restored_tokens`` after restoring."""
    restored_tokens: int = 0

    @property
    def to_prefill(self) -> list[Any]:
        return self.messages[self.restored:]

    @property
    def prefill_tokens(self) -> int:
        return sum(len(m.tokens) for m in self.to_prefill)


MAX_TARGETED = 16
"""Most messages a targeted re-read brings back: when more stand out, the question's attention on evicted history
is spread, not pointed, and the whole history is re-read."""

COVER = 0.5
"""The share of the implicated mass (the question's attention above baseline on the messages past τ) that the
messages fitting ``reread_budget`` must hold for a targeted re-read; less, and the whole history is re-read."""

WHOLE_REREAD_FACTOR = 4
"""A history of more than this many times ``reread_budget`` tokens is not re-read whole when the question's
attention is spread or its messages overflow the budget: the most anomalous messages that fit are re-read instead.
On a CPU a re-read costs its tokens' prefill, tens of times a full-cache turn for a history of a few thousand tokens,
so past this size the whole re-read costs more than the full cache saved (docs/results/NOTES.md)."""


@dataclass(frozen=True)
class TargetedRead:
    """A targeted re-read: the evicted tokens of the messages the question points at, put back at the positions
    they were evicted from, from the log's exact token ids; then the question is prefilled again on top."""

    messages: list[tuple[Any, int, list[tuple[int, int]]]]
    """(logged message, its first position, its evicted [p0, p1) runs), most implicated first."""
    fresh: list[Any] = field(default_factory=list)
    """Logged messages a frame shift left without a place (``Engine.homeless``): fed whole at fresh positions,
    before the question."""

    @property
    def tokens(self) -> int:
        return sum(p1 - p0 for _, _, runs in self.messages for p0, p1 in runs) + sum(len(m.tokens) for m in self.fresh)

    @property
    def ids(self) -> list[int]:
        return [m.id for m, _, _ in self.messages] + [m.id for m in self.fresh]

    @property
    def indices(self) -> list[int]:
        return [m.index for m, _, _ in self.messages] + [m.index for m in self.fresh]

    def runs(self) -> list[tuple[list[int], int, int]]:
        """Each evicted run to put back: (the log's tokens of it, its first position, its message's index), what
        ``Engine.copy_back`` and ``Engine.reinsert`` take."""
        return [([int(t) for t in message.tokens[p0 - first:p1 - first]], p0, message.index)
                for message, first, runs in self.messages for p0, p1 in runs]


def copyable(engine: "Engine", index: int, message: Any, runs: list[tuple[int, int]]) -> int | None:
    """The first position of logged message ``index`` when the engine's evicted rows hold every one of its evicted
    ``runs`` for the log's tokens (a copy puts it back whole); None where the rows or the log disagree."""
    span = fed_span(engine, index, message)
    if engine.rows is None or span is None:
        return None
    toks = message.tokens
    if not all(engine.rows.covers(p0, toks[p0 - span[0]:p1 - span[0]]) for p0, p1 in runs):
        return None
    return span[0]


def fed_span(engine: "Engine", index: int, message: Any) -> tuple[int, int] | None:
    """Where the engine fed logged message ``index``, when the log's tokens for it fill exactly that span."""
    span = engine.cache.spans.get(index)
    if message is None or span is None or message.tokens is None or len(message.tokens) != span[1] - span[0]:
        return None
    return span


def choose_messages(messages: Sequence[Any], room: int) -> tuple[list[Any], bool]:
    """All of ``messages`` when their tokens fit in ``room`` cells; else the system prompt and the newest that
    do (True: truncated), starting at a user turn for the template to hold."""
    msgs = list(messages)
    if sum(len(m.tokens) for m in msgs) <= room:
        return msgs, False
    head = [m for m in msgs[:1] if m.role == "system"]
    budget = room - sum(len(m.tokens) for m in head)
    tail: list[Any] = []
    for m in reversed(msgs[len(head):]):
        if len(m.tokens) > budget:
            break
        tail.insert(0, m)
        budget -= len(m.tokens)
    while tail and tail[0].role == "assistant":
        tail.pop(0)
    return head + tail, True


@dataclass(frozen=True)
class GateState:
    """What a gate carries from one turn to the next (:meth:`Gate.state`)."""

    statistic: str
    recent: list[float]
    """The conversation's turn statistics, oldest first."""
    paid: dict[int, list[np.ndarray]]
    """Per message index: its share of each earlier question's attention, per sketch layer."""
    paid_layers: tuple[int, ...] | None


@dataclass(frozen=True)
class GateSettings:
    """What the gate reads of the configuration, parsed and resolved once (:meth:`from_config`)."""

    threshold: GateThreshold
    """"auto" (the calibrated τ, which follows the conversation), off, or a fixed τ."""
    calibrated: calibration.GateCalibration | None
    """The model's calibrated gate for ``evict_at`` (None: the model has none, and "auto" is off)."""
    certificate_records: tuple[certificate.Record, ...] | None
    """The model's own certificate calibration (None: the shipped one's rows for it, or the largest of them)."""
    bars: tuple[Bar, ...]
    """What the gate holds against a bar, its own first: the turn statistic compared with τ ("auto" resolved to
    the calibrated one for ``evict_at``), then the calibrated second signal, when config ``gate_second`` is "auto"
    and the τ is the calibrated one."""
    evict_at: str
    budget: Budget
    """The budget the cache manager runs (``auto`` resolved, ``CacheManager.budget``): the certificate's calibration
    is looked up by it."""
    model: str
    policy: str
    page_size: int
    answer_certificate: bool
    reread_budget: int
    reread_copy: bool
    sees_restore: bool = True
    """Config ``gate_sees_restore``: the sketch reads the cells put back this turn as still evicted."""
    trusts_restore: bool = False
    """Config ``gate_trusts_restore``: a firing that pulls mostly on restored messages re-reads nothing more."""

    @property
    def statistic(self) -> str:
        """The gate's own statistic (its first bar's)."""
        return self.bars[0].signal.name

    @classmethod
    def from_config(cls, config: Config, model: calibration.ModelCalibration | None,
                    budget: Budget | None = None) -> GateSettings:
        """``budget``: the budget in force (None: the configured one)."""
        stat = config.gate_stat
        cal = model.gate(config.evict_at) if model is not None else None
        auto = cal.statistic if cal is not None else calibration.fallback_statistic(config.evict_at)
        second = cal.second() if cal is not None and config.gate_second == "auto" and config.gate_threshold.auto \
            else None
        bars = (Bar.own(auto if stat == "auto" else stat), *([Bar.calibrated(second)] if second is not None else []))
        return cls(threshold=config.gate_threshold, calibrated=cal,
                   certificate_records=model.certificate if model is not None and model.certificate else None,
                   bars=bars, evict_at=config.evict_at, budget=budget or config.kv_budget, model=config.model,
                   policy=config.policy,
                   page_size=config.page_size, answer_certificate=config.answer_certificate,
                   reread_budget=config.reread_budget, reread_copy=config.reread_copy,
                   sees_restore=config.gate_sees_restore, trusts_restore=config.gate_trusts_restore)


class Gate:
    """The gate of one session: threshold, statistic, the turn's certificates, and the re-read planner."""

    def __init__(self, config: Config, model: calibration.ModelCalibration | None,
                 budget: Budget | None = None) -> None:
        """``model``: the model's calibration (:func:`calibration.for_model`; None: it has none); ``budget``: the
        budget the cache manager runs (``CacheManager.budget``; None: the configured one)."""
        self.model_calibration = model
        self.settings = GateSettings.from_config(config, model, budget)
        self.turn = TurnCertificates()
        self.copy: ReadCopy | None = None
        self._paid: dict[int, list[np.ndarray]] = {}
        """Per message index: its attention share in each sketch layer at every earlier turn (the baselines)."""
        self._medians = RunningMedians()
        """The baselines of ``_paid``, kept sorted as it grows; cleared wherever ``_paid`` is replaced."""
        self._paid_layers: tuple[int, ...] | None = None
        """The sketch layers the baselines in ``_paid`` were read in (None: none read yet)."""
        self._recent: list[float] = []
        """The conversation's earlier turn statistics, oldest first (what an adaptive τ follows)."""
        self._tau: tuple[float | None] | None = None
        """This turn's τ once worked out: it changes only with the settings and between turns."""
        self.sketch_read_ms = 0.0
        """Milliseconds spent reading the sketch for questions so far (scoring, shares, baselines)."""
        self.question_read: Hook[[Engine, int, bool]] = Hook()
        """Heard after every :meth:`read_question` that read one: (the engine, the question's rows, whether the
        design is sampled)."""

    def reconfigure(self, config: Config, budget: Budget | None = None) -> None:
        self.settings = GateSettings.from_config(config, self.model_calibration, budget)
        self._tau = None

    # -- threshold and statistic ------------------------------------------------------
    @property
    def statistic(self) -> str:
        """The configured turn statistic, "auto" resolved to the calibrated one."""
        return self.settings.statistic

    @property
    def signal(self) -> Signal:
        """The signal of the gate's own bar (:mod:`agent.gate.signals`)."""
        return self.settings.bars[0].signal

    def _read(self, turn: TurnCertificates | None = None) -> float | None:
        """The gate's own statistic of ``turn`` (default: this one), in the form compared with τ."""
        return self.signal.read(self.turn if turn is None else turn, self.decision_form())

    def threshold(self) -> float | None:
        """τ for this turn: the configured number, or the calibrated τ — raised, when its calibration is
        adaptive, to its factor × the median of this conversation's recent turn statistics."""
        if self._tau is None:
            self._tau = (self._work_out_threshold(),)
        return self._tau[0]

    def _work_out_threshold(self) -> float | None:
        gate, cal = self.settings.threshold, self.settings.calibrated
        if gate.auto:
            tau = cal.tau_for(self.statistic) if cal is not None else None
            if tau is None or cal is None:
                return None
            return calibration.adaptive_tau(tau, self._recent, cal.adaptive(self.statistic))
        return gate.tau

    def implicating_level(self, tau: float) -> float:
        """The anomaly at which a message counts as implicated when a turn fired at bar ``tau``: the bar itself for
        a fixed τ; for an adaptive one, the calibrated floor or the conversation's ordinary turn peak (the median
        the bar multiplies), whichever is higher — the bar decides whether the turn stands out, and every message
        above the ordinary peak is part of what it points at (the bar alone would bring back only the top one)."""
        cal = self.settings.calibrated
        if not self.settings.threshold.auto or cal is None:
            return tau
        floor = cal.tau_for(self.statistic)
        rule = cal.adaptive(self.statistic)
        if floor is None or rule is None or not self._recent:
            return tau
        return min(tau, max(floor, rule.ordinary(self._recent)))

    def certificate_form(self, rounds: int) -> CertificateForm:
        """The certificate shown for this policy, model and budget after ``rounds`` eviction rounds
        (agent.gate.certificate)."""
        return certificate.form_for(self.settings.budget, self.settings.model, rounds, policy=self.settings.policy,
                                    records=self.settings.certificate_records)

    def decision_form(self) -> CertificateForm:
        """The form the gate compares with τ: a calibrated τ's own (GateCalibration.tau_form), else the
        certificate shown (an explicit threshold is read on what the user sees)."""
        cal = self.settings.calibrated
        if self.settings.threshold.auto and cal is not None and self.signal.certificate:
            return cal.tau_form(self.settings.budget, self.settings.model, self.turn.rounds, self.settings.policy)
        return self.turn.form

    def wants_answer_certificates(self) -> bool:
        """Per-step certificates while answering: needed by an answer.* gate, or asked for (replays record
        every statistic); otherwise paused, since each costs a V-sized product per layer."""
        return self.settings.answer_certificate or signals.ANSWER_STEPS in self.signal.needs

    def _breach(self, value: float | None, tau: float | None) -> bool:
        return calibration.breach(value, tau)

    # -- the turn's certificates ---------------------------------------------------------
    def begin_turn(self) -> TurnCertificates:
        folded = self.state()
        self._paid, self._recent = folded.paid, folded.recent
        self._tau = None
        self.turn = TurnCertificates()
        return self.turn

    def state(self) -> "GateState":
        """What the next turn starts from: the baselines and recent statistics with this turn folded in, as
        :meth:`begin_turn` folds it (a saved chat state carries it, so a resumed chat gates as if never closed)."""
        paid = {message: list(shares) for message, shares in self._paid.items()}
        recent = list(self._recent)
        previous = self.turn
        for message, share in previous.shares.items():
            paid.setdefault(message, []).append(share)
        if not previous.discarded:
            value = self._read(previous)
            if value is not None and math.isfinite(value):
                recent.append(float(value))
        return GateState(self.statistic, recent, paid, self._paid_layers)

    def resume(self, state: "GateState") -> None:
        """Go on from a :meth:`state` of this conversation (``ValueError``, nothing changed, when it was read under
        another statistic than this gate's)."""
        if state.statistic != self.statistic:
            raise ValueError(f"its gate read {state.statistic}, this one reads {self.statistic}")
        self.new_conversation()
        self._recent = list(state.recent)
        self._tau = None
        self._paid = {message: list(shares) for message, shares in state.paid.items()}
        self._medians.clear()
        self._paid_layers = state.paid_layers

    def drop_copy(self) -> None:
        """Forget the host copy of the last re-read (the cache's positions moved since: it no longer fits)."""
        self.copy = None

    def new_conversation(self) -> None:
        """A new or reopened conversation: no copy, no baselines, no recent statistics."""
        self.copy = None
        self._paid = {}
        self._medians.clear()
        self._paid_layers = None
        self._recent = []
        self._tau = None
        self.turn = TurnCertificates()

    def history_record(self) -> dict[str, Any]:
        """What a reopened conversation needs of this turn to gate as it would have without closing
        (:meth:`restore`): the turn statistic an adaptive τ follows, and the share of the question's attention
        on each message in each sketch layer, from which the messages' baselines are medians."""
        turn = self.turn
        out: dict[str, Any] = {}
        value = self._read(turn)
        if value is not None and math.isfinite(value):
            out["statistic"], out["value"] = self.statistic, float(value)
        if turn.shares:
            out["layers"] = list(turn.sketch_layers)
            out["shares"] = {str(m): _sig(share) for m, share in turn.shares.items()}
        return out

    def restore(self, records: Sequence[dict[str, Any]]) -> None:
        """Continue a logged conversation: ``records`` are its kept turns' :meth:`history_record`, oldest first.
        A value recorded under another statistic is not one of this gate's recent ones, and shares read in other
        sketch layers than the latest turn's are no baseline for them."""
        self.new_conversation()
        for record in records:
            if record.get("statistic") == self.statistic and isinstance(record.get("value"), (int, float)):
                self._recent.append(float(record["value"]))
                self._tau = None
            shares = record.get("shares")
            if shares:
                self._keep_baselines(tuple(int(x) for x in record.get("layers", ())))
                for message, share in shares.items():
                    self._paid.setdefault(int(message), []).append(np.asarray(share, dtype=np.float64))

    def _keep_baselines(self, layers: tuple[int, ...]) -> None:
        """Baselines are per sketch layer: read in other layers, they are dropped."""
        if self._paid_layers is not None and layers != self._paid_layers:
            self._paid = {}
            self._medians.clear()
        self._paid_layers = layers

    def discard_turn(self) -> None:
        """The turn was rolled back (an independent probe): what it paid each message is no baseline, and its
        statistic no part of the conversation's recent ones."""
        self.turn.shares = {}
        self.turn.discarded = True

    def read_question(self, engine: "Engine", rows: int, sampled_design: bool,
                      reading: patched.Importance | None = None, texts: MessageTexts | None = None) -> None:
        """The last feed's last ``rows`` rows are the question: their certificate, with the sample it rests on;
        ``reading``: that feed's attention, when already read from the graph; ``texts``: the log's messages, to
        tell the sketch which old messages the question merely repeats."""
        if not engine.reading or rows <= 0:
            return
        cache = engine.cache
        logpi = np.asarray(cache.logpi, dtype=np.float64)
        positions = np.asarray(cache.positions, dtype=np.int64)
        sampled = logpi < 0
        # A variance estimate needs at least two sampled units (survey sampling's rule for a stratum): with
        # fewer, V̂ is 0 or one term whatever was lost — e.g. a 10% budget of a 400-token history, whose tail
        # expects less than one page. (Nothing evicted: nothing lost, and 0 is the right certificate.)
        segs = np.asarray(cache.segments, dtype=np.int64)[sampled]
        pages = positions[sampled] // self.settings.page_size
        units = np.unique(np.stack([segs, pages]), axis=1).shape[1] if len(pages) else 0
        evicted = len(cache) < engine.next_pos
        if reading is None:
            reading = engine.read_importance()
        share = evicted_share(reading, positions, engine.applied_logpi())
        turn = self.turn
        turn.rounds = engine.rounds
        turn.form = self.certificate_form(engine.rounds)
        turn.question = relative_certificate(engine.read_certificate())[-rows:]
        turn.sampled_cells = int(np.count_nonzero(sampled))
        turn.uncertified = sampled_design and evicted and units < 2
        turn.evicted_share = share
        if engine.sketch is not None and engine.sketch.n_tokens:
            started = time.perf_counter()
            try:
                self.read_sketch(engine, reading, texts)
            finally:
                self.sketch_read_ms += (time.perf_counter() - started) * 1000.0
        self.question_read(engine, rows, sampled_design)

    def read_sketch(self, engine: "Engine", reading: patched.Importance, texts: MessageTexts | None = None) -> None:
        """Phase 1 of the two-phase design: the question's attention on every earlier message, the evicted part
        estimated from the sketch, and how far it exceeds what earlier questions paid the message.

        In each sketch layer, a message's share is a census of the question's attention over every cell the
        history had, each counted once: the live cells' weights from the importance readout with their −log π
        biases taken back out (× π: the bias lets a sampled cell stand for 1/π cells, which the sketch already
        counts; as read, where a restore lifted the biases for the turn), plus the sketch's estimate for its
        evicted cells, on the same scale (the kept softmax), over the census of all messages. Read that way a
        message's share does not depend on how its cells are split between the sample and the sketch, so it keeps
        its scale when a re-read brings cells back and a later round samples them anew (with the biases left in,
        its few survivors weighed 1/π each and read as anomalous on turn after turn: docs/results/NOTES.md). A
        message's anomaly is the largest ratio, over the sketch layers, of this share to its median over the
        earlier turns (at least two; the median floored at ``SHARE_FLOOR``); ``sketch.max``
        is the largest anomaly over the messages more than half evicted — the ones the certificate of the kept
        sample cannot speak for. An earlier question this one repeats word for word (``agent.gate.repetition``, read
        from ``texts``) is left out: the pull on an earlier copy of its own words is no sign that the question
        needs what that copy says. The turn's detail records, per message with evicted cells, ``share`` and ``base``
        per layer, ``anomaly`` (None before two earlier turns), its ``evicted`` and ``live`` cells, and
        ``repeat`` where it was left out as a repeat."""
        sk = engine.sketch
        assert sk is not None
        score = sk.score(engine.read_queries())
        ids, mass = score.per_message()
        layers = score.layers
        segs = np.asarray(engine.cache.segments, dtype=np.int64)
        cache_pos = np.asarray(engine.cache.positions, dtype=np.int64)
        # the biases the readout was read under (none on a turn whose restore lifted them) are taken back out
        pi = np.exp(engine.applied_logpi())
        stored = score.messages
        self._keep_baselines(tuple(int(x) for x in layers))
        n_msg = int(max(segs.max(initial=0), stored.max(initial=0))) + 1
        kept = np.zeros((len(layers), n_msg))
        for li, layer in enumerate(layers):
            one = patched.Importance(reading.mass[layer:layer + 1], reading.cell_pos[layer:layer + 1])
            paid = one.per_position(cache_pos)
            if paid.sum() > 0:
                kept[li] = np.bincount(segs, weights=paid * pi, minlength=n_msg)[:n_msg] / paid.sum()
        gone = np.zeros((len(layers), n_msg))
        gone[:, ids] = mass / score.per_head.shape[1]  # the mean over heads, on the kept softmax's scale
        census = kept.sum(axis=1, keepdims=True) + gone.sum(axis=1, keepdims=True)
        share = (kept + gone) / np.where(census > 0, census, 1.0)
        n_gone = np.bincount(stored, minlength=n_msg)[:n_msg]
        n_live = np.bincount(segs, minlength=n_msg)[:n_msg]
        if self.settings.sees_restore and len(engine.reinserted):
            # cells put back before the question (a restore) are read as the eviction left them: brought back by
            # the wrong rank, they would otherwise take the question's attention off what is still evicted
            back = np.bincount(segs[np.isin(cache_pos, engine.reinserted)], minlength=n_msg)[:n_msg]
            n_gone, n_live = n_gone + back, n_live - back
        anomalies: dict[int, float] = {}
        excess: dict[int, float] = {}
        # every message with evicted cells is recorded (share, baseline, anomaly, cell counts), so a study can
        # recompute sketch.max for another layer subset or another "mostly evicted" rule from the detail alone
        record: dict[int, dict[str, Any]] = {}
        for m in np.flatnonzero(n_gone):
            earlier = self._paid.get(int(m), [])
            base = self._medians.median(int(m), earlier) if len(earlier) >= 2 else None
            anomaly = None
            if base is not None:
                ratio = share[:, m] / np.maximum(base, SHARE_FLOOR)
                top = int(np.argmax(ratio))
                anomaly = float(ratio[top])
                if n_gone[m] > n_live[m]:
                    anomalies[int(m)] = anomaly
                    excess[int(m)] = float(max(share[top, m] - base[top], 0.0))
            record[int(m)] = {"share": _sig(share[:, m]), "base": None if base is None else _sig(base),
                              "anomaly": None if anomaly is None else _sig(anomaly),
                              "evicted": int(n_gone[m]), "live": int(n_live[m])}
        if texts is not None and anomalies and len(segs):
            for repeated in self._repeats(texts, int(segs[-1]), anomalies):
                del anomalies[repeated]
                excess.pop(repeated, None)
                record[repeated]["repeat"] = True
        turn = self.turn
        turn.sketch_layers = [int(x) for x in layers]
        turn.sketch_messages = record
        turn.shares = {int(m): share[:, m].copy() for m in np.flatnonzero(n_gone + n_live)}
        turn.anomalies = anomalies
        turn.excess = excess
        turn.implicated = sorted(anomalies.items(), key=lambda kv: -kv[1])[:5]
        turn.sketch = {"sketch.max": max(anomalies.values(), default=0.0),
                       "sketch.evicted_mass": float(gone.sum(axis=1).mean())}

    @staticmethod
    def _repeats(texts: MessageTexts, question: int, anomalies: dict[int, float]) -> list[int]:
        """The most anomalous messages (``REPEATS_CHECKED`` of them) whose words the question repeats."""
        top = sorted(anomalies, key=lambda m: -anomalies[m])[:REPEATS_CHECKED]
        got = texts([question, *top])
        asked = got.get(question, "")
        return [m for m in top if asked and m in got and repetition.is_repeat(asked, got[m])]

    def question_decision(self) -> GateDecision:
        tau = self.threshold()
        signal = self.signal
        value = self._read()
        # Too few sampled pages leave the kept sample's certificate nothing to estimate from; a signal that reads
        # every evicted cell (the sketch) does not rest on the sample, so the rule stands only where none spoke.
        spoke = signal.reads_evicted and value is not None
        if self.turn.uncertified and tau is not None and not spoke:
            return GateDecision(value if value is not None else 0.0, tau, fire=True, uncertified=True)
        if signal.phase != signals.QUESTION:
            return GateDecision(None, tau, False)
        if self._breach(value, tau):
            return GateDecision(value, tau, fire=True)
        sampled = self.turn.sampled_cells or 0
        for bar in self.settings.bars[1:] if tau is not None else ():
            if bar.signal.phase != signals.QUESTION or not bar.applies(sampled):
                continue
            # read in the form shown: the one the calibration chats recorded it in
            other = bar.signal.read(self.turn, self.turn.form)
            if bar.fires(other, sampled):
                return GateDecision(other, bar.tau, fire=True, second=bar.signal.name)
        return GateDecision(value, tau, fire=False)

    def begin_answer(self) -> None:
        self.turn.answer = []

    def step_decision(self, engine: "Engine") -> GateDecision:
        """Read this decode step's certificate; fire when an answer statistic reaches τ."""
        tau = self.threshold()
        if not engine.reading:
            return GateDecision(None, tau, False)
        self.turn.rounds = engine.rounds
        self.turn.form = self.certificate_form(engine.rounds)
        self.turn.answer.append(relative_certificate(engine.read_certificate())[-1])
        if self.signal.phase != signals.ANSWER:
            return GateDecision(None, tau, False)
        value = self._read()
        return GateDecision(value, tau, fire=self._breach(value, tau))

    def record_firing(self, decision: GateDecision) -> None:
        """The session re-read the history on ``decision``: the turn reports the value that fired."""
        if self.turn.fired is None:
            self.turn.fired = decision

    def turn_certificate(self) -> float | None:
        """The turn's certificate: the value that fired the gate, else the configured statistic."""
        fired = self.turn.fired
        if fired is not None and fired.value is not None and not fired.second:
            return fired.value
        return self._read()

    # -- the re-read planner --------------------------------------------------------------
    def plan_targeted(self, decision: GateDecision, logged: dict[int, Any], engine: "Engine",
                      free_cells: int) -> tuple[TargetedRead | None, str]:
        """The messages a question-phase firing brings back, or (None, why the whole history is re-read instead).

        Only a signal that ranks the evicted messages (a sketch statistic) names them. The messages whose own anomaly
        reaches τ (an adaptive τ's :meth:`implicating_level`) are the implicated ones (at most :data:`MAX_TARGETED`,
        else the attention is spread); they come back whole (every evicted run), most anomalous first, as many as fit
        ``reread_budget`` — when those hold at least :data:`COVER` of the implicated mass. ``logged``: the log's
        re-readable messages by index (exact token ids), checked against the positions the engine fed them at and the
        tokens still live there — on any disagreement the log wins and the whole history is re-read. A message a
        restore put back whole before the question was read needs nothing more: where every message named is such,
        the plan is empty, and the question has already read what the firing would bring back."""
        tau = self._naming_bar(decision)
        if self.settings.reread_budget <= 0:
            return None, "targeted re-reads are off (reread_budget = 0)"
        if not self.signal.names_messages or decision.uncertified or tau is None:
            return None, "the uncertified sample names no message" if decision.uncertified else \
                f"the gate read {self.statistic}, which names no message"
        chosen = self._implicated(tau)
        if not chosen:
            return None, "no single evicted message stands out"
        # past this size the whole history costs more to re-read than the turns it would protect: read what fits
        best_effort = sum(len(m.tokens) for m in logged.values() if m.tokens is not None) > \
            WHOLE_REREAD_FACTOR * self.settings.reread_budget
        if len(chosen) > MAX_TARGETED and not best_effort:
            return None, f"the question's attention is spread over {len(chosen)} evicted messages"
        chosen = chosen[:MAX_TARGETED]
        plan: list[tuple[Any, int, list[tuple[int, int]]]] = []
        fresh: list[Any] = []
        room = min(self.settings.reread_budget, free_cells)
        implicated = sum(self.turn.excess.get(i, 0.0) for i in chosen)
        if self.settings.trusts_restore and implicated > 0:
            # what a restore put back whole is read as evicted (gate_sees_restore) yet has no evicted run left
            served = sum(self.turn.excess.get(i, 0.0) for i in chosen
                         if i not in engine.homeless and i in engine.cache.spans and not engine.evicted_runs(i))
            if served >= COVER * implicated:
                return TargetedRead([]), ""
        covered = 0.0
        whole = 0
        for index in chosen:
            message, span = logged.get(index), fed_span(engine, index, logged.get(index))
            if message is not None and message.tokens is not None and index in engine.homeless:
                # its positions were packed away by a frame shift: it comes back whole, at fresh positions
                if len(message.tokens) > room:
                    break
                room -= len(message.tokens)
                covered += self.turn.excess.get(index, 0.0)
                fresh.append(message)
                continue
            if message is None or span is None:
                return None, f"message {index} is not where the log puts it"
            cache = engine.cache
            if not holds_logged_tokens(cache.positions, cache.tokens, cache.segments, index, span[0], message.tokens):
                return None, f"the cache and the log disagree on message {index}"
            runs = engine.evicted_runs(index)
            need = sum(p1 - p0 for p0, p1 in runs)
            if need > room:
                break
            room -= need
            covered += self.turn.excess.get(index, 0.0)
            if runs:
                plan.append((message, span[0], runs))
            else:
                whole += 1  # a restore brought it back before the question was read (config gate_sees_restore)
        if not (plan or fresh or whole) or (implicated > 0 and covered < COVER * implicated and not best_effort):
            return None, "the messages the question points at hold more evicted tokens than the re-read budget"
        return TargetedRead(plan, fresh), ""

    def _naming_bar(self, decision: GateDecision) -> float | None:
        """The bar a firing names messages at: its own, or for a second-signal firing the gate statistic's, so that
        it names messages the way the gate's own statistic does."""
        return self.threshold() if decision.second else decision.threshold

    def _implicated(self, tau: float) -> list[int]:
        """The evicted messages a firing at bar ``tau`` points at: their anomaly at :meth:`implicating_level`, most
        anomalous first."""
        level = self.implicating_level(tau)
        ranked = sorted(self.signal.scores(self.turn).items(), key=lambda kv: -kv[1])
        return [index for index, anomaly in ranked if math.isfinite(anomaly) and anomaly >= level]

    def plan_copied(self, logged: dict[int, Any], engine: "Engine", free_cells: int,
                    most: int | None = None, decision: GateDecision | None = None) -> TargetedRead | None:
        """Every evicted token of the history back from the engine's evicted rows (a copy, no decode), when the
        rows hold all of them for the log's tokens and the cache has room: the question then reads the cache the
        full history made, whatever the gate read. None where any is missing (the row budget let it go, the chat
        was reopened since), the cache and the log disagree, or more than ``most`` tokens are evicted.

        After a frame shift the messages it packed away have no place to be copied to: the copy holds every other
        message, and those of them the firing ``decision`` names (as :meth:`plan_targeted` would) are fed whole at
        fresh positions, within ``reread_budget``."""
        if engine.rows is None:
            return None
        plan: list[tuple[Any, int, list[tuple[int, int]]]] = []
        need = 0
        gone = engine.evicted_by_message()
        for index, message in sorted(logged.items()):
            runs = gone.get(index)
            if not runs or index in engine.homeless:
                continue
            first = copyable(engine, index, message, runs)
            if first is None:
                return None
            need += sum(p1 - p0 for p0, p1 in runs)
            plan.append((message, first, runs))
        if not plan or need > free_cells or (most is not None and need > most):
            return None
        fresh = self._named_homeless(decision, logged, engine, free_cells - need) if engine.homeless else []
        return TargetedRead(plan, fresh)

    def _named_homeless(self, decision: GateDecision | None, logged: dict[int, Any], engine: "Engine",
                        room: int) -> list[Any]:
        """The messages a frame shift left without a place that the firing names (their anomaly at the implicating
        level, most anomalous first, at most :data:`MAX_TARGETED`), as many whole as fit ``reread_budget``."""
        if decision is None or decision.uncertified or not self.signal.names_messages:
            return []
        tau = self._naming_bar(decision)
        if tau is None:
            return []
        room = min(self.settings.reread_budget, room)
        named = []
        for index in self._implicated(tau)[:MAX_TARGETED]:
            message = logged.get(index)
            if index not in engine.homeless or message is None or message.tokens is None:
                continue
            if len(message.tokens) > room:
                break
            room -= len(message.tokens)
            named.append(message)
        return named

    def plan_reread(self, conversation_id: int, messages: Sequence[Any], room: int) -> ReadPlan:
        """Which of the logged ``messages`` (with their exact tokens) a re-read into ``room`` cells holds, and
        how many of the first the host copy serves."""
        chosen, truncated = choose_messages(messages, room)
        restored = self._copy_covers(conversation_id, chosen)
        if not restored:
            return ReadPlan(chosen, truncated)
        assert self.copy is not None
        tokens = sum(len(toks) for _, toks in self.copy.messages[:restored])
        return ReadPlan(chosen, truncated, restored, self.copy.snapshot, tokens)

    def _copy_covers(self, conversation_id: int, chosen: list[Any]) -> int:
        """How many of ``chosen``'s first messages the previous re-read's copy holds, token for token (0: none,
        the copy is off or of another conversation). A copy whose later messages the log no longer lists (an
        independent probe, a replaced answer) still serves the messages before them. Never all of ``chosen``:
        the last message is always fed, as the answer starts from its logits."""
        copy = self.copy
        if copy is None or not self.settings.reread_copy or copy.conversation_id != conversation_id:
            return 0
        n = 0
        for (mid, toks), m in zip(copy.messages[: len(chosen) - 1], chosen):
            if m.id != mid or len(m.tokens) != len(toks) or tuple(int(t) for t in m.tokens) != toks:
                break
            n += 1
        return n

    def keep_copy(self, conversation_id: int, chosen: list[Any], engine: "Engine") -> None:
        """Keep the cache a re-read just left as the next re-read's copy, when the config asks for one and a
        gate can fire at all."""
        if self.settings.reread_copy and policies.get(self.settings.policy).evicts and self.threshold() is not None:
            self.copy = ReadCopy(conversation_id, tuple((m.id, tuple(int(t) for t in m.tokens)) for m in chosen),
                                 engine.snapshot())

