"""The turn protocol: log → prefill → evict → certificate → gate → answer → log.

One ``ChatSession`` drives one conversation at a time on one engine. A turn is five named steps
(:meth:`ChatSession.send`):

1. **log** — the user's message is committed to the SQLite log before the model sees it, and its
   template suffix is tokenized (a message that cannot fit is refused, kept in the log);
2. **prefill** — the suffix goes into the cache (its exact token ids and first position go to the
   log); with ``evict_at = "question"`` the cache manager evicts after all but the question's last
   ``cert_window`` tokens, which are then prefilled on the evicted cache; the gate reads the
   question window's certificate on the cache that will answer;
3. **gate** — if the turn's statistic reaches τ (or the turn is uncertified), the history is re-read
   from the log's exact token ids and the answer comes from the full context;
4. **answer** — the answer streams into the log (partial → complete / interrupted); per-step
   certificates feed an answer-phase gate;
5. **close** — with ``evict_at = "turn-end"`` the cache is evicted back to its budget; every eviction
   round and the turn's measurements are logged.

The session is the only writer of the store during a turn. Replays compose the same public steps
(``begin_turn``, ``answer``/``force_answer``, ``finish_turn``, ``checkpoint``/``rollback``,
``replace_answer``) in ``agent.lab.replay.drive``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from agent import events as ev
from agent import models
from agent.chat import resume
from agent.chat.saved_state import SavedStates, StateError
from agent.config import Config
from agent.eviction.budget import CacheManager, EvictionReport
from agent.gate import calibration, restore
from agent.gate.decision import WHOLE_REREAD_FACTOR, Gate, GateDecision, ReadPlan, TargetedRead
from agent.llm.engine import Engine, EngineSettings, Generation
from agent.llm.template import ChatTemplate, strip_bos
from agent.llm.template import Message as TemplateMessage
from memory_store.records import EvictionRound, Message
from memory_store.records import Turn as TurnRecord
from memory_store.store import Store
from memory_store.stream import AssistantStream
from native import llama, poisson, runtime

EventSink = Callable[[ev.Event], None]
log = logging.getLogger(__name__)


class InputError(ValueError):
    """The user's input cannot be answered as it is (the message says why and what to do)."""


def _ignore(_: ev.Event) -> None:
    return None


class _Clock:
    """Milliseconds spent per phase of a turn (``with clock("evict"): …``)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - start) * 1000.0


@dataclass
class _Segment:
    """One message as the model saw it (the template renders these)."""

    index: int
    role: str
    content: str


@dataclass
class Turn:
    """One turn in progress, from :meth:`ChatSession.begin_turn` to :meth:`ChatSession.finish_turn`."""

    user: Message
    segment: _Segment
    tokens: list[int]
    first_pos: int
    meta: dict | None
    clock: _Clock = field(default_factory=_Clock)
    prefill_ms: float = 0.0
    reprefill_tokens: int = 0
    restored_tokens: int = 0
    gate_fired: bool = False
    gate_deferred: bool = False
    """The gate reached its bar on a turn whose restore had brought messages back and, where it would have named
    messages to re-read, left the answer to the restored ones (config ``gate_defers_to_restore``)."""
    reread_path: str = ""
    """How the gate's re-read ran: "copied" (every evicted token back from the engine's evicted rows), "targeted"
    (the implicated messages), "full" (the whole history re-prefilled) or ""."""
    reread_messages: list[int] = field(default_factory=list)
    """Ids of the logged messages the re-read brought back (restored from a copy or prefilled)."""
    reread_indices: tuple[int, ...] = ()
    """A targeted re-read: the indices of the messages it brought back (the memory panel marks their turns)."""
    restore_indices: tuple[int, ...] = ()
    """The evicted messages brought back before the question, nearest it (config ``restore``)."""
    restore_best: float | None = None
    """The restore's best reading this turn, over its floor or not (``restore.Ranker.best``)."""
    generation: Generation | None = None
    answer_id: int | None = None


@dataclass(frozen=True)
class Checkpoint:
    """The cache and what describes it, as :meth:`ChatSession.checkpoint` found them."""

    engine: Any
    memory: Any
    segments: list[_Segment]
    certificates: list[tuple[int, float | None, bool]]


def _certificates(logged: Sequence[TurnRecord]) -> list[tuple[int, float | None, bool]]:
    """(turn number, certificate, gate fired) of each logged turn: the memory panel's chart of a reopened chat."""
    return [(i + 1, t.gate_stat, t.gate_fired) for i, t in enumerate(logged)]


class ChatSession:
    """A conversation bound to an engine, a store, a cache manager and a gate."""

    def __init__(self, config: Config, store: Store, engine: Engine, model_name: str,
                 conversation_id: int | None = None, saver: resume.Saver | None = None,
                 template: ChatTemplate | None = None) -> None:
        """``template``: the chat markup, when not the model's own (a study gives a base model one)."""
        self.config = config
        self.saver = saver
        """Where the state goes after every turn and comes from when a conversation is reopened (None: nowhere;
        reopening re-reads the log)."""
        self.opened: ev.Opened | None = None
        """How the open conversation was last reopened: resumed from its saved state, or re-read (and why)."""
        self.store = store
        self.engine = engine
        self.model_name = model_name
        self.template = template or ChatTemplate.for_model(engine.model)
        # resolved once per session: every component reads this model's own calibration (none: uncalibrated)
        self.model_calibration = calibration.of_file(engine.settings.model_path)
        self.memory = CacheManager(engine, config, self.model_calibration)
        self.gate = Gate(config, self.model_calibration, self.memory.budget)
        self.sampler = llama.Sampler(self._sampler_params(), engine.info.n_vocab)
        self._segments: list[_Segment] = []
        self._turn_certs: list[tuple[int, float | None, bool]] = []
        self._last_tok_s: float | None = None
        self._told_reason: str | None = None
        """The full-cache notice (:attr:`full_cache_notice`) the chat last gave, so it is said once, not every turn."""
        self._told_budget: str | None = None
        """The budget's notice (:attr:`budget_notice`) the chat last gave, said once as the full-cache one is."""
        self._ranker: restore.Ranker | None = None
        """What ``restore`` ranks evicted messages with, and the sentence vectors it has read (made on first use)."""
        self._owns_engine = False
        self.conversation_id = -1
        if conversation_id is None:
            self.new_conversation()
        else:
            self.open(conversation_id)

    @classmethod
    def start(cls, config: Config, store: Store, model_path: Path, model_name: str,
              conversation_id: int | None = None) -> "ChatSession":
        """Load the model into an engine sized by ``config`` and bind a session to it; :meth:`close` frees the
        engine too."""
        engine = Engine(EngineSettings.from_config(config, model_path))
        try:
            saver = None
            if config.saved_states_mb > 0:
                saver = resume.Saver(SavedStates.beside(store.path, config.saved_states_mb),
                                     models.gguf_sha256(model_path), runtime.built_libs().key)
            session = cls(config, store, engine, model_name, conversation_id=conversation_id, saver=saver)
        except BaseException:
            engine.close()
            raise
        session._owns_engine = True
        return session

    # -- settings ----------------------------------------------------------------------------
    def _sampler_params(self) -> llama.SamplerParams:
        c = self.config
        return llama.SamplerParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, min_p=c.min_p,
                                   repeat_penalty=c.repeat_penalty, seed=c.seed)

    def reconfigure(self, **changes: object) -> None:
        """Change policy, budget, gate or sampling for the next turns (validated)."""
        self.config = self.config.replace(**changes)
        self.memory.reconfigure(self.config)
        self.gate.reconfigure(self.config, self.memory.budget)
        self.sampler.close()
        self.sampler = llama.Sampler(self._sampler_params(), self.engine.info.n_vocab)

    # -- conversations -------------------------------------------------------------------------
    def new_conversation(self, title: str = "New chat") -> int:
        conv = self.store.create_conversation(title=title, model=self.model_name,
                                              settings={"policy": self.config.policy, "budget": self.config.budget})
        self.conversation_id = conv.id
        self.opened = None
        self.gate.new_conversation()
        self.engine.reset()
        self.memory.reset()
        self._segments = []
        self._turn_certs = []
        self._told_reason = self._told_budget = None
        if self.config.system_prompt:
            msg = self.store.append_message(conv.id, "system", self.config.system_prompt)
            text = self.template.render([{"role": "system", "content": self.config.system_prompt}],
                                        add_generation_prompt=False)
            tokens = self._tokenize(text, first=True)
            first = self.engine.next_pos
            self.engine.feed(tokens, segment=msg.index, logits_last=False)
            self.store.set_message_tokens(msg.id, tokens, first)
            self._segments.append(_Segment(msg.index, "system", self.config.system_prompt))
        return conv.id

    def open(self, conversation_id: int, on_event: EventSink = _ignore) -> None:
        """Continue a logged conversation. Its saved state, when it matches the model, the settings and the log,
        is the cache as the conversation left it (:meth:`_resume`); otherwise its exact tokens are re-prefilled
        (``Rereading`` events report the progress), then evicted to budget; eviction rounds continue the log's
        numbering, and the gate resumes from the turn records (its baselines and recent statistics:
        :meth:`Gate.restore`). Either way ``opened`` and a ``Notice`` say which ran, and why. The conversation is
        claimed for this process first, so a second writer is refused before the re-read."""
        self.store.claim_conversation(conversation_id)
        self.conversation_id = conversation_id
        self._told_reason = self._told_budget = None
        started = time.perf_counter()
        reason = self._resume(conversation_id)
        if reason is None:
            self.opened = ev.Opened(True, "", 0, (time.perf_counter() - started) * 1000.0)
            on_event(ev.Notice(self.opened.words(), "info"))
            return
        tokens = self._reread_log(conversation_id, on_event)
        self.opened = ev.Opened(False, reason, tokens, (time.perf_counter() - started) * 1000.0)
        on_event(ev.Notice(self.opened.words(), "info"))
        self._save_state()

    def _reread_log(self, conversation_id: int, on_event: EventSink) -> int:
        """Re-prefill the log's exact tokens into an empty cache and evict to budget; returns the tokens fed."""
        logged = self.store.turns(conversation_id)
        # the gate goes on from the log: its recent statistics and the messages' baselines, as if never closed
        self.gate.restore([t.extra.get("gate", {}) for t in self._kept_turns(conversation_id, logged)])
        self.engine.reset()
        self.memory.reset(round=self.store.next_eviction_round(conversation_id))
        self._segments = []
        self._turn_certs = _certificates(logged)
        self.memory.set_readout(True)
        fed = self._read_history(self._plan_reread(), on_event=on_event, keep_copy=True)
        self.memory.after_prefill()
        report = self.memory.evict(protect_from=self.engine.next_pos)
        if report is not None:
            self._log_round(report, None)
        return fed

    # -- saved states ------------------------------------------------------------------------------
    def _state_key(self) -> dict[str, Any]:
        assert self.saver is not None
        in_force = self.memory.in_force.budget
        return self.saver.key(self.config, self.engine, self.gate.statistic,
                              str(in_force) if in_force is not None else None)

    def _resume(self, conversation_id: int) -> str | None:
        """Go on from the conversation's saved state; the reason it cannot be used (nothing changed then)."""
        if self.saver is None:
            return "saved states are off"
        try:
            state = self.saver.load(conversation_id, self._state_key(), self.engine.settings.threads)
        except StateError as err:
            return str(err) if str(err) == "no saved state" else f"the saved state was not used: {err}"
        rereadable = self.store.rereadable(conversation_id)
        why = resume.check_against_log(state, rereadable)
        if why is not None:
            return f"the saved state was not used: {why}"
        try:
            self.gate.resume(state.gate)
        except ValueError as err:
            return f"the saved state was not used: {err}"
        try:
            self.engine.reset()
            self.engine.restore(state.engine)
        except (llama.LlamaError, ValueError) as err:
            self.engine.reset()
            return f"the saved state was not used: llama.cpp refused it ({err})"
        self.memory.reset(round=state.memory[0])
        self.memory.restore(state.memory)
        by_index = {m.index: m for m in rereadable}
        self._segments = [_Segment(i, by_index[i].role, by_index[i].content) for i in state.segments]
        self._turn_certs = _certificates(self.store.turns(conversation_id))
        return None

    def _kept_turns(self, conversation_id: int, logged: list[TurnRecord]) -> list[TurnRecord]:
        """The conversation's ``logged`` turns but those whose answer was rolled back (an independent probe's); a
        replaced answer (teacher forcing) was answered and kept."""
        rolled_back = {m.id for m in self.store.messages(conversation_id)
                       if m.meta.get("discarded") and not m.meta.get("replaced")}
        return [t for t in logged if t.message_id not in rolled_back]

    def _save_state(self, last_message_id: int | None = None) -> None:
        """Save what the next turn needs (after a turn, or a re-read on opening). A failure costs only the next
        reopening's time: it is logged, never raised."""
        if self.saver is None:
            return
        try:
            if last_message_id is None:
                rereadable = self.store.rereadable(self.conversation_id)
                if not rereadable:
                    return
                last_message_id = rereadable[-1].id
            state = resume.SessionState(self.conversation_id, last_message_id, [s.index for s in self._segments],
                                        self.engine.snapshot(share_sketch=True), self.memory.snapshot(),
                                        self.gate.state())
            self.saver.save(state, self._state_key())
        except (OSError, ValueError, llama.LlamaError) as err:
            log.warning("could not save the state of conversation %s (%s); reopening it will re-read the log",
                        self.conversation_id, err)

    # -- the turn ------------------------------------------------------------------------------
    def send(self, text: str, on_event: EventSink = _ignore, cancel: threading.Event | None = None) -> ev.TurnResult:
        """Answer one user message; events stream to ``on_event`` from this thread."""
        turn = self.begin_turn(text, on_event, cancel)
        self.answer(turn, on_event, cancel)
        return self.finish_turn(turn, on_event)

    def begin_turn(self, text: str, on_event: EventSink = _ignore, cancel: threading.Event | None = None,
                   meta: dict | None = None) -> Turn:
        """Log the message, prefill it (evicting at the question, if so configured) and gate it; ``meta`` is
        logged with the turn's messages (replays mark independent probes ``discarded``)."""
        turn = self._log_question(text, meta, on_event)
        self._prefill(turn, on_event, cancel)
        self._gate_question(turn, on_event, cancel)
        return turn

    def answer(self, turn: Turn, on_event: EventSink = _ignore, cancel: threading.Event | None = None) -> None:
        """Generate the answer into the log (on a mid-answer breach: re-read, and answer again)."""
        try:
            gen, stream = self._generate(turn, on_event, cancel)
        except InterruptedError:  # stopped during a mid-answer re-read
            self._abandon(turn, "reprefill")
            raise
        turn.generation = gen
        turn.answer_id = self._close_answer(gen, stream, turn.clock)

    def force_answer(self, turn: Turn, text: str, score: bool = False) -> None:
        """Teacher forcing: ``text`` enters the cache and the log as the answer, as if generated. With ``score``
        the generation's ``logprobs`` are the model's log-probabilities of ``text``'s tokens after the first."""
        if turn.reread_path == "copied":
            self.memory.set_readout(False)  # as _generate: nothing is evicted, there is no error to certify
        turn.generation, turn.answer_id = self._forced(text, turn.meta, score)

    def finish_turn(self, turn: Turn, on_event: EventSink = _ignore, evict: bool = True) -> ev.TurnResult:
        """Close the turn: the turn-end eviction (unless ``evict`` is False), the turn record, ``TurnFinished``.
        A design-core refusal of the eviction is raised after the turn is recorded (the answer is logged, and
        the cache, left over its budget, is still the log's)."""
        refused: poisson.DesignError | None = None
        if evict:
            try:
                self.evict_turn_end(turn, on_event)
            except poisson.DesignError as err:
                refused = err
        self.engine.restore_biases()
        gen, clock = turn.generation, turn.clock
        assert gen is not None and turn.answer_id is not None, "answer or force_answer the turn first"
        with clock("certificate"):
            stat = self.gate.turn_certificate()
        self._turn_certs.append((len(self._turn_certs) + 1, stat, turn.gate_fired))
        self._last_tok_s = gen.tok_per_s
        result = ev.TurnResult(
            conversation_id=self.conversation_id, user_message_id=turn.user.id, assistant_message_id=turn.answer_id,
            answer=gen.text, stop=gen.stop, policy=self.config.policy, budget_cells=self.memory.budget_cells(),
            live_cells=self.engine.live_cells, allocated_cells=self.engine.n_ctx, certificate=stat,
            certificate_detail=self.gate.turn.detail(), gate_threshold=self.gate.threshold(),
            gate_fired=turn.gate_fired, gate_deferred=turn.gate_deferred, reprefill_tokens=turn.reprefill_tokens,
            restored_tokens=turn.restored_tokens, reread_path=turn.reread_path,
            reread_messages=list(turn.reread_messages), restore_indices=list(turn.restore_indices),
            restore_best=turn.restore_best,
            prefill_ms=turn.prefill_ms, decode_ms=gen.decode_ms,
            decode_tok_s=gen.tok_per_s, answer_tokens=len(gen.tokens),
            logprob_mean=float(np.mean(gen.logprobs)) if gen.logprobs else None, timings=clock.ms,
        )
        with clock("store"):
            self._record_turn(result, turn.answer_id, refused)
        on_event(ev.TurnFinished(result, self.memory_view(turn.reread_indices)))
        if refused is not None:
            raise refused
        self._save_state(turn.answer_id)
        return result

    def evict_turn_end(self, turn: Turn, on_event: EventSink = _ignore) -> None:
        """The turn's end: what a targeted re-read put back leaves again; with ``evict_at = "turn-end"``, the
        cache comes back to its budget, keeping only the sinks and the recent window (as the next question will
        find it)."""
        self.engine.evict_reinserted()
        if self.config.evict_at == "turn-end":
            self._evict(self.engine.next_pos, turn.user.id, turn.clock, on_event)

    def checkpoint(self) -> Checkpoint:
        """The cache (and what describes it) as it is now, for :meth:`rollback`."""
        return Checkpoint(self.engine.snapshot(), self.memory.snapshot(), list(self._segments),
                          list(self._turn_certs))

    def rollback(self, checkpoint: Checkpoint) -> None:
        """Put the cache back as :meth:`checkpoint` found it (the eviction rounds since then stay logged)."""
        self.gate.discard_turn()
        self.engine.restore(checkpoint.engine)
        self.memory.roll_back(checkpoint.memory)
        self._segments, self._turn_certs = list(checkpoint.segments), list(checkpoint.certificates)

    def replace_answer(self, turn: Turn, text: str, score: bool = False) -> list[float]:
        """Swap the turn's answer (the newest cells) for ``text`` in the cache and the log; the generated one
        stays logged, marked discarded. With ``score``: the log-probabilities of ``text``'s tokens after the
        first (else empty)."""
        assert turn.answer_id is not None
        generated = self.store.get_message(turn.answer_id)
        first = (self.engine.frame_position(int(generated.first_pos)) if generated.first_pos is not None
                 else self.engine.next_pos)
        self.engine.truncate(first)
        self.store.update_message_meta(turn.answer_id, {"discarded": True, "replaced": True})
        self._segments.pop()
        gen, _ = self._forced(text, None, score)
        return gen.logprobs

    # -- the turn's steps -------------------------------------------------------------------
    def _log_question(self, text: str, meta: dict | None, on_event: EventSink) -> Turn:
        """Commit the message, then tokenize its template suffix and make room for it and its answer."""
        self.gate.begin_turn()
        clock = _Clock()
        with clock("store"):
            user = self.store.append_user_message(self.conversation_id, text, meta=meta)
        on_event(ev.TurnStarted(self.conversation_id, user.id))
        self._tell_full_reason(on_event)
        suffix = self.template.user_suffix(self._rendered(), {"role": "user", "content": text}) \
            if self._segments else self.template.render([{"role": "user", "content": text}], True)
        tokens = self._tokenize(suffix, first=not self._segments)
        room = self.engine.n_ctx - self.config.max_tokens - 16
        if len(tokens) > room:
            self.store.mark_refused(user.id, "too long")
            raise InputError(
                f"your message is {len(tokens)} tokens but the context has room for {room} "
                f"(n_ctx {self.engine.n_ctx} minus {self.config.max_tokens} for the answer): shorten it or "
                "raise --n-ctx; it was saved to the log")
        self._make_room(len(tokens) + self.config.max_tokens + 16, user.id, on_event)
        # room for the answer and for what a firing gate may re-read at fresh positions before it
        self._keep_frame(len(tokens) + self.config.max_tokens + 16 + self.config.reread_budget, on_event)
        return Turn(user, _Segment(user.index, "user", text), tokens, self.engine.next_pos, meta, clock)

    @property
    def full_cache_notice(self) -> str | None:
        """Why the evicting policy keeps the full cache at any length and how to evict anyway; None when it applies."""
        reason = self.memory.full_reason
        return f"{reason}; {self.memory.full_how}" if reason is not None else None

    @property
    def budget_notice(self) -> str | None:
        """The one line an explicit budget the model's record does not certify gets; None otherwise."""
        return self.memory.budget_notice

    def _tell_full_reason(self, on_event: EventSink) -> None:
        """Say once per conversation (and again when it changes) why the evicting policy keeps the full cache, or
        that the budget it runs is not certified for the model."""
        notice = self.full_cache_notice
        if notice is not None and notice != self._told_reason:
            on_event(ev.Notice(notice, "warning"))
        self._told_reason = notice
        budget = self.budget_notice
        if budget is not None and budget != self._told_budget:
            on_event(ev.Notice(budget, "warning"))
        self._told_budget = budget

    def _prefill(self, turn: Turn, on_event: EventSink, cancel: threading.Event | None) -> None:
        """Feed the message; the gate reads its certificate on the cache that will answer. Evicting at the
        question, its last cert_window tokens wait until the cache is evicted, so they are read once, on that
        cache (a message too short to split is re-read instead)."""
        tokens, clock, index = turn.tokens, turn.clock, turn.user.index
        at_question = self.config.evict_at == "question"
        held = self.memory.split_question(len(tokens)) if at_question else 0
        sampled = self.memory.policy.sampled
        self.memory.set_readout(True)
        try:
            self._restore(turn, on_event)
            turn.prefill_ms = self.engine.feed(tokens[:len(tokens) - held], segment=index, cancel=cancel)
            with clock("certificate"):
                reading = self.memory.after_prefill()
                if reading is not None:
                    self.gate.read_question(self.engine, self.config.cert_window, sampled, reading, self._texts)
            with clock("store"):
                self.store.set_message_tokens(turn.user.id, tokens, self.engine.log_position(turn.first_pos))
            self._segments.append(turn.segment)
            if at_question:
                self._evict(turn.first_pos, turn.user.id, clock, on_event,
                            then=None if held else lambda: self._requestion(turn))
            if held:
                turn.prefill_ms += self.engine.feed(tokens[len(tokens) - held:], segment=index, cancel=cancel)
                with clock("certificate"):
                    self.gate.read_question(self.engine, held, sampled, texts=self._texts)
        except BaseException:
            self._abandon(turn, "prefill")
            raise
        on_event(ev.Prefilled(len(tokens), turn.prefill_ms))

    def _restore(self, turn: Turn, on_event: EventSink) -> None:
        """Copy back the evicted messages nearest the question (config ``restore``, ranked ``restore_by``), before the
        question is fed, so it is read once, over them (agent/gate/restore.py); they leave at the turn's end."""
        if (self.config.restore <= 0 or self.config.evict_at != "turn-end" or self.engine.rows is None
                or not self.memory.evicting()):
            return
        candidates = restore.evicted(self.engine, self._logged(turn))
        if not candidates:
            return
        if self._ranker is None or self._ranker.asked != self.config.restore_by:
            self._ranker = restore.Ranker(self.config.restore_by)
        plan = restore.plan(self._ranker, turn.user.content, candidates, self._texts(list(candidates)), self.engine,
                            self.config.restore, self.config.reread_budget)
        turn.restore_best = self._ranker.best
        if self._ranker.missing is not None:
            on_event(ev.Notice(self._ranker.missing, "warning"))
            self._ranker.missing = None  # said once
        if plan is not None and self.engine.copy_back(plan.runs()):
            # as after a targeted re-read: the biases of the sampled stand-ins would drown the exact cells that
            # came back; they return with the turn-end eviction
            self.engine.lift_biases()
            turn.restored_tokens += plan.tokens
            turn.restore_indices = tuple(plan.indices)
            on_event(ev.Restored(tuple(self._message_words(i) for i in plan.indices), plan.tokens))

    def _requestion(self, turn: Turn) -> None:
        """Re-decode the question's last tokens on the evicted cache to certify that cache (only when the
        eviction was not foreseen, so nothing was held back: a one-token message)."""
        w = min(self.config.cert_window, len(turn.tokens))
        if not self.memory.reads_attention or w == 0:
            return
        self.memory.set_readout(True)
        self.engine.truncate(self.engine.next_pos - w)
        self.engine.feed(turn.tokens[-w:], segment=turn.user.index)
        self.gate.read_question(self.engine, w, self.memory.policy.sampled, texts=self._texts)

    def _texts(self, indices: Sequence[int]) -> dict[int, str]:
        """The log's text of this conversation's messages at ``indices`` (what the gate compares the question with)."""
        return self.store.contents(self.conversation_id, indices)

    def _gate_question(self, turn: Turn, on_event: EventSink, cancel: threading.Event | None) -> None:
        """Re-read the history when the question's certificate reaches τ (or the turn is uncertified)."""
        with turn.clock("certificate"):
            decision = self.gate.question_decision()
        if decision.value is not None:
            on_event(ev.CertificateRead("question", decision.value, decision.threshold))
        if not decision.fire:
            return
        try:
            with turn.clock("reprefill"):
                self._reread(turn, decision, "question", on_event, cancel)
        except InterruptedError:
            self._abandon(turn, "reprefill")
            raise
        if turn.gate_deferred:
            return
        if self.config.evict_at == "turn-end" and turn.reread_path not in ("copied", "restored"):
            # the re-read ends with this message: its window's attention scores the turn-end eviction (after a
            # copied re-read the cells that stay are those the first prefill's attention already scored)
            self.memory.read_importance()

    def _defers(self, turn: Turn) -> bool:
        """A firing that would name messages leaves this turn to its restore (config ``gate_defers_to_restore``, and
        messages came back)."""
        return self.config.gate_defers_to_restore and bool(turn.restore_indices)

    def _generate(self, turn: Turn, on_event: EventSink,
                  cancel: threading.Event | None) -> tuple[Generation, AssistantStream]:
        """Generate; on a mid-answer breach, re-read the history and generate again from the start."""
        allow_gate = not turn.gate_fired
        self.sampler.reset()
        while True:
            with turn.clock("store"):
                stream = self.store.stream_assistant(self.conversation_id,
                                                     first_pos=self.engine.log_position(self.engine.next_pos),
                                                     meta=turn.meta)
            self.gate.begin_answer()
            # after a copied re-read the answer reads the whole history: no evicted cell, no error to certify
            self.memory.set_readout(self.gate.wants_answer_certificates() and turn.reread_path != "copied")
            breach: list[GateDecision] = []

            def on_text(piece: str) -> None:
                stream.append(piece)
                on_event(ev.TextDelta(piece))

            def step_hook(step: int) -> bool:
                decision = self.gate.step_decision(self.engine)
                if allow_gate and decision.fire:
                    breach.append(decision)
                    return False
                return True

            gen = self.engine.generate(self.sampler, self.config.max_tokens, segment=stream.index, cancel=cancel,
                                       on_text=on_text, step_hook=step_hook)
            if not breach:
                return gen, stream
            # Mid-answer breach: drop what was streamed, re-read the history, answer again.
            stream.cancel()
            self.store.set_message_status(stream.message_id, "interrupted")
            on_event(ev.Regenerating(len(gen.text)))
            try:
                with turn.clock("reprefill"):
                    self._reread(turn, breach[0], "answer", on_event, cancel)
            except InterruptedError:
                self.store.update_message_meta(stream.message_id, {"discarded": True, "cancelled": "reprefill"})
                raise
            allow_gate = False
            self.sampler.reset()

    def _abandon(self, turn: Turn, phase: str) -> None:
        """Cancelled (or Ctrl-C) before the answer: take the message out of the cache and keep it in the log
        marked as never answered, so cache and log stay in step."""
        self.engine.truncate(turn.first_pos)
        if self._segments and self._segments[-1] is turn.segment:
            self._segments.pop()
        self.store.update_message_meta(turn.user.id, {"discarded": True, "cancelled": phase})

    def _evict(self, protect_from: int, message_id: int | None, clock: _Clock, on_event: EventSink,
               then: Callable[[], None] | None = None) -> None:
        """Bring the cache back to its budget, keeping positions ≥ ``protect_from``, and log the round;
        ``then`` runs on the evicted cache before ``Evicted`` is announced."""
        started = time.perf_counter()
        with clock("evict"):
            report = self.memory.evict(protect_from=protect_from)
            if report is not None:
                self._log_round(report, message_id)
        if report is None:
            return
        if then is not None:
            with clock("certificate"):
                then()
        on_event(ev.Evicted(report.round, report.cells_before, report.cells_after, report.budget_cells,
                            (time.perf_counter() - started) * 1000.0))

    def _log_round(self, report: EvictionReport, message_id: int | None) -> None:
        self.store.record_eviction_round(EvictionRound(
            conversation_id=self.conversation_id, round=report.round, message_id=message_id, policy=report.policy,
            cells_before=report.cells_before, cells_after=report.cells_after,
            expected_budget=float(report.budget_cells), seed=report.seed, sum_pi=report.sum_pi))

    def _forced(self, text: str, meta: dict | None, score: bool = False) -> tuple[Generation, int]:
        """Feed a given answer as if generated (replays are teacher-forced); ``score``: keep its tokens'
        log-probabilities."""
        index = self.store.messages(self.conversation_id)[-1].index + 1
        first = self.engine.next_pos
        tokens = self._tokenize(text, first=False)
        closing = self._tokenize(self.template.assistant_closing(self._rendered(), text), first=False)
        started = time.perf_counter()
        scores: list[float] | None = [] if score else None
        if tokens:
            self.engine.feed(tokens, segment=index, logits_last=False, scores=scores)
        if self._feed_closing(closing, index):
            self.memory.read_importance(add=True)
        msg = self.store.append_message(self.conversation_id, "assistant", text, tokens=tokens + closing,
                                        first_pos=self.engine.log_position(first),
                                        meta={**(meta or {}), "forced": True})
        assert msg.index == index
        self._segments.append(_Segment(msg.index, "assistant", text))
        gen = Generation(tokens=tokens, text=text, stop="forced",
                         decode_ms=(time.perf_counter() - started) * 1000.0, logprobs=scores or [])
        return gen, msg.id

    def _feed_closing(self, closing: list[int], segment: int) -> bool:
        """Feed an answer's closing text (e.g. ``<|im_end|>``); True when a turn-end eviction follows, whose
        scores then need the closing rows' attention (the question's window never saw the answer; call
        ``memory.read_importance(add=True)``)."""
        if not closing:
            return False
        scores_answer = self.config.evict_at == "turn-end"
        if scores_answer:
            self.memory.set_readout(True)
        self.engine.feed(closing, segment=segment, logits_last=False)
        return scores_answer

    def _close_answer(self, gen: Generation, stream: AssistantStream, clock: _Clock) -> int:
        closing = self.template.assistant_closing(self._rendered(), gen.text)
        closing_tokens = self._tokenize(closing, first=False)
        # The closing text belongs to the answer's message; it is fed, not sampled.
        if closing_tokens and self.engine.free_cells() >= len(closing_tokens):
            with clock("closing"):
                scores_answer = self._feed_closing(closing_tokens, stream.index)
            if scores_answer:
                with clock("certificate"):
                    self.memory.read_importance(add=True)
        with clock("store"):
            stream.append("", tokens=list(gen.tokens) + closing_tokens)
            if gen.stop == "cancelled":
                stream.cancel()
            else:
                stream.finish()
        self._segments.append(_Segment(stream.index, "assistant", gen.text))
        return stream.message_id

    # -- re-reading the history ---------------------------------------------------------------
    def _reread(self, turn: Turn, decision: GateDecision, phase: str, on_event: EventSink,
                cancel: threading.Event | None) -> None:
        """The gate fired: before answering, re-read only the messages the question points at when the gate
        can name them (:meth:`Gate.plan_targeted`), else the whole history from the log into a fresh cache.
        Cancelled part-way (``InterruptedError``), the cache is put back as it was before the re-read."""
        assert decision.value is not None and decision.threshold is not None
        why_full = "mid-answer breach"
        if phase == "question":
            logged = self._logged(turn)
            copied = self._plan_copied(logged, decision) if self.config.copy_back != "named" else None
            if copied is not None:
                self._reread_copied(turn, decision, copied, on_event, cancel)
                return
            if self._defers(turn):
                # a named re-read would second-guess the restore's rank with the question's attention
                turn.gate_deferred = True
                on_event(ev.GateDeferred("question", decision.value, decision.threshold))
                return
            target, why_full = self.gate.plan_targeted(decision, logged, self.engine, self.engine.free_cells())
            if target is not None and not target.indices:
                # everything the firing names came back with the restore, and the question was read over it
                self._record_reread(turn, decision, "restored", [], 0)
                return
            if target is not None:
                self._reread_targeted(turn, decision, target, on_event, cancel)
                return
        plan = self._plan_reread(in_flight=turn.user.id)
        on_event(ev.GateFired(phase, decision.value, decision.threshold, plan.prefill_tokens, plan.truncated,
                              decision.uncertified, plan.restored_tokens, self._points_at(), why_full=why_full,
                              second=decision.second))
        if plan.truncated:
            on_event(ev.Notice("the history is longer than the context; re-read the system prompt and the most "
                               "recent messages that fit", "warning"))
        with self._undone_if_cancelled(cancel):
            self._read_history(plan, cancel=cancel, on_event=on_event, keep_copy=True)
        self._record_reread(turn, decision, "full", [m.id for m in plan.messages], plan.prefill_tokens,
                            plan.restored_tokens)

    def _logged(self, turn: Turn) -> dict[int, Message]:
        """The log's messages a re-read may bring back, by index (the question in flight among them)."""
        history = self.store.history(self.conversation_id)
        return {m.index: m for m in _readable(history.messages, turn.user.id)}

    def _plan_copied(self, logged: dict[int, Message], decision: GateDecision) -> TargetedRead | None:
        # the question comes out and goes back in; the answer needs its room too
        most = WHOLE_REREAD_FACTOR * self.config.reread_budget if self.config.copy_back == "auto" else None
        return self.gate.plan_copied(logged, self.engine, self.engine.free_cells() - self.config.max_tokens, most,
                                     decision)

    def _reread_copied(self, turn: Turn, decision: GateDecision, plan: TargetedRead, on_event: EventSink,
                       cancel: threading.Event | None) -> None:
        """Put every evicted token of the history back from the engine's evicted rows, as the cache first
        computed them, and prefill the question again on top: the question and the answer read every token of the
        history at the cost of a copy (the full cache's rows where no eviction came before them). At the turn's
        end they are evicted again (``Engine.evict_reinserted``)."""
        assert decision.value is not None and decision.threshold is not None
        fresh = sum(len(m.tokens) for m in plan.fresh)  # packed away by a frame shift: fed, not copied
        kept = self._question_kept(turn, plan)
        question = len(turn.tokens) - kept
        on_event(ev.GateFired("question", decision.value, decision.threshold, question + fresh,
                              uncertified=decision.uncertified, restored_tokens=plan.tokens - fresh,
                              points_at=self._points_at(), question_tokens=question, second=decision.second))
        self._put_back(turn, plan, kept, on_event, cancel, readout=False)
        self._record_reread(turn, decision, "copied", plan.ids, question + fresh, restored=plan.tokens - fresh,
                            indices=plan.indices)

    def _reread_targeted(self, turn: Turn, decision: GateDecision, target: TargetedRead, on_event: EventSink,
                         cancel: threading.Event | None) -> None:
        """Take the question out, put the implicated messages' evicted tokens back at their old positions from
        the log's exact token ids, and prefill the question again on top, so its rows attend to them. The
        re-inserted cells are unbiased and stay for the turn; at its end they are evicted again
        (``Engine.evict_reinserted``)."""
        assert decision.value is not None and decision.threshold is not None
        words = ", ".join(self._message_words(i) for i in target.indices)
        kept = self._question_kept(turn, target)
        question = len(turn.tokens) - kept
        on_event(ev.GateFired("question", decision.value, decision.threshold, target.tokens,
                              points_at=self._points_at(), reread=words, messages=len(target.messages),
                              question_tokens=question, second=decision.second))
        copied = self.engine.copied_tokens
        self._put_back(turn, target, kept, on_event, cancel)
        # messages the engine put back from its evicted rows were copied, not prefilled
        copied = self.engine.copied_tokens - copied
        self._record_reread(turn, decision, "targeted", target.ids, target.tokens + question - copied,
                            restored=copied, indices=target.indices)

    def _put_back(self, turn: Turn, target: TargetedRead, kept: int, on_event: EventSink,
                  cancel: threading.Event | None, readout: bool = True) -> None:
        """Take the question out but for its first ``kept`` tokens (:meth:`_question_kept`), put ``target``'s
        evicted runs back at their old positions (copied from the engine's evicted rows, else decoded from the
        log's token ids), lift the biases and prefill the question again on top (``readout``: with the attention
        readout, whose importance then scores the turn-end eviction; a whole history put back leaves nothing
        evicted to certify)."""
        total = target.tokens + len(turn.tokens) - kept
        with self._undone_if_cancelled(cancel):
            self.engine.truncate(turn.first_pos + kept)
            on_event(ev.Rereading(0, total))
            every = target.runs()
            if self.engine.copy_back(every):
                on_event(ev.Rereading(target.tokens, total))
            else:
                done = 0
                for tokens, p0, index in every:
                    self.engine.reinsert(tokens, p0, index, cancel=cancel,
                                         progress=functools.partial(_rereading, on_event, done, total))
                    done += len(tokens)
            done = sum(len(t) for t, _, _ in every)
            for message in target.fresh:
                self.engine.feed_transient([int(t) for t in message.tokens], message.index, cancel=cancel,
                                           progress=functools.partial(_rereading, on_event, done, total))
                done += len(message.tokens)
            # The named messages are back exactly; the answer reads the cache as it is. Under the −log π biases a
            # sampled stand-in weighs up to 1/π cells (×50 at π = 0.02) and drowns the exact cells the re-read
            # brought back: measured on recall30 (docs/results/NOTES.md), lifting them for this turn is what lets
            # the answer use them. The biases come back with the turn-end eviction (or finish_turn).
            self.engine.lift_biases()
            self.memory.set_readout(readout)
            self.engine.feed(turn.tokens[kept:], segment=turn.user.index, cancel=cancel)
            on_event(ev.Rereading(total, total))

    def _question_kept(self, turn: Turn, target: TargetedRead) -> int:
        """How many of the question's first tokens a re-read leaves in the cache (``reread_refeed``): none when
        packed messages are fed at fresh positions, which must come before the whole question."""
        refeed = self.config.reread_refeed
        if refeed <= 0 or target.fresh:
            return 0
        return max(len(turn.tokens) - refeed, 0)

    @contextmanager
    def _undone_if_cancelled(self, cancel: threading.Event | None) -> Iterator[None]:
        """A re-read that ``cancel`` stops part-way (``InterruptedError``) leaves the cache as it was before."""
        saved = self.checkpoint() if cancel is not None else None
        try:
            yield
        except InterruptedError:
            assert saved is not None
            self.rollback(saved)
            raise

    def _record_reread(self, turn: Turn, decision: GateDecision, path: str, message_ids: list[int], tokens: int,
                       restored: int = 0, indices: Sequence[int] = ()) -> None:
        """The turn re-read ``path`` ("full", "targeted", "copied"; "restored": nothing more than the restore brought
        back) on ``decision``: what it cost and what came back
        (``indices``: a targeted re-read's messages, for the memory panel)."""
        self.gate.record_firing(decision)
        turn.gate_fired = True
        turn.reprefill_tokens += tokens
        turn.restored_tokens += restored
        turn.reread_path = path
        turn.reread_messages = message_ids
        turn.reread_indices = tuple(indices)

    def _points_at(self) -> str:
        """The evicted message a gate whose signal names messages (the sketch) fired on, in words; "" for any other."""
        if not self.gate.signal.names_messages or not self.gate.turn.implicated:
            return ""
        return self._message_words(self.gate.turn.implicated[0][0])

    def _message_words(self, index: int) -> str:
        """A message in words: "your turn 4 ('My gym locker code is…')"."""
        segment = next((s for s in self._segments if s.index == index), None)
        if segment is None:
            return f"message {index}"
        turn = sum(1 for s in self._segments if s.role == "user" and s.index <= index)
        text = " ".join(segment.content.split())
        who = "your" if segment.role == "user" else "the answer at"
        return f"{who} turn {turn} ('{text[:32]}…')" if len(text) > 32 else f"{who} turn {turn} ('{text}')"

    def _plan_reread(self, reserve: int | None = None, pending: int | None = None,
                     in_flight: int | None = None) -> ReadPlan:
        """What a re-read holds: the logged messages (exact token ids) that fit with ``reserve`` cells free
        (default: the answer's room); ``pending``: a message (id) to leave out, as it is prefilled next;
        ``in_flight``: the question being answered, read even when its turn is to be discarded afterwards."""
        history = self.store.history(self.conversation_id)
        msgs = self._tokenized([m for m in _readable(history.messages, in_flight) if m.id != pending])
        # positions start again from 0: no further than the model was trained on
        trained = self.engine.info.n_ctx_train
        cells = min(self.engine.n_ctx, trained) if trained > 0 else self.engine.n_ctx
        room = cells - (self.config.max_tokens + 16 if reserve is None else reserve)
        return self.gate.plan_reread(self.conversation_id, msgs, room)

    def _read_history(self, plan: ReadPlan, cancel: threading.Event | None = None,
                      on_event: EventSink = _ignore, keep_copy: bool = False) -> int:
        """Clear the cache and carry out ``plan``: restore what the host copy serves, prefill the rest from the
        log's exact token ids; returns tokens fed. ``Rereading`` events report the progress; ``cancel`` stops it
        between batches (``InterruptedError``, cache part-filled). ``keep_copy``: offer the result to the gate
        as the next re-read's copy."""
        self.engine.reset()
        self.memory.reset_cache_state()
        if plan.snapshot is not None:
            self.engine.restore(plan.snapshot)
            # the copy may hold messages past the ones it serves: they go
            self.engine.truncate(plan.restored_tokens)
        total = plan.prefill_tokens
        last = plan.messages[-1] if plan.messages else None
        fed = 0
        on_event(ev.Rereading(0, total))
        for m in plan.to_prefill:
            toks = [int(t) for t in m.tokens]
            done = fed
            self.engine.feed(toks, segment=m.index, logits_last=m is last, cancel=cancel,
                             progress=functools.partial(_rereading, on_event, done, total))
            fed += len(toks)
        self._segments = [_Segment(m.index, m.role, m.content) for m in plan.messages]
        if last is not None and last.first_pos is not None:
            self.engine.continue_log(int(last.first_pos) + len(last.tokens))
        if keep_copy:
            self.gate.keep_copy(self.conversation_id, plan.messages, self.engine)
        return fed

    # -- the log's messages ----------------------------------------------------------------------
    def tokenize_log(self, conversation_id: int) -> int:
        """Give every message of a logged conversation its exact token ids (an imported one carries none), as a
        re-read would; returns the tokens of what a re-read gives the model."""
        msgs = [m for m in self.store.history(conversation_id).messages if not m.meta.get("discarded")]
        return sum(len(m.tokens) for m in self._tokenized(msgs))

    def _tokenized(self, msgs: list) -> list:
        """The messages with their token ids; messages logged without them (imported, or
        typed while no model was loaded) are rendered through the template now, in context,
        and their tokens written to the log so the next re-read is exact."""
        out = []
        prior: list[TemplateMessage] = []
        pos = 0
        for m in msgs:
            if m.tokens is None or len(m.tokens) == 0:
                # A message's rendering depends on its neighbours, not on the whole history: the
                # system message (if any) and the last two messages keep the template's view of
                # "first message" and turn boundaries, and keep a long import linear in its length.
                context = (prior[:1] if prior and prior[0]["role"] == "system" else []) + prior[-2:]
                if len(prior) <= 3:
                    context = list(prior)
                this: TemplateMessage = {"role": m.role, "content": m.content}
                if m.role == "assistant":
                    toks = self._tokenize(m.content, first=False) + self._tokenize(
                        self.template.assistant_closing(context, m.content), first=False)
                elif m.role == "user" and prior:
                    toks = self._tokenize(self.template.user_suffix(context, this), first=False)
                else:
                    toks = self._tokenize(self.template.render([this], add_generation_prompt=m.role == "user"),
                                          first=not prior)
                if toks:
                    m = self.store.set_message_tokens(m.id, toks, first_pos=pos)
            prior.append({"role": m.role, "content": m.content})
            if m.tokens is not None and len(m.tokens) > 0:
                out.append(m)
                pos += len(m.tokens)
        return out

    def _make_room(self, needed: int, pending: int, on_event: EventSink) -> None:
        """Guarantee ``needed`` free cells for message ``pending`` (logged, not yet prefilled) and its answer:
        evict (any policy) or, for `full`, re-read only the newest history that leaves them."""
        if self.engine.free_cells() >= needed:
            return
        freed, report = self.memory.make_room(needed)
        if report is not None:
            self._log_round(report, pending)
        if not freed and report is None:
            shifted = self.memory.shift_context(needed)
            if shifted is not None:
                on_event(ev.Notice(f"the context is full: dropped the {shifted.dropped} oldest tokens after the "
                                   f"first {shifted.kept} and moved the rest down (context shift); the log keeps "
                                   "them all", "warning"))
                self.gate.drop_copy()
                return
        if not freed:
            on_event(ev.Notice("the context is full: keeping the system prompt and the most recent messages",
                               "warning"))
            self._read_history(self._plan_reread(reserve=needed, pending=pending))

    def _keep_frame(self, needed: int, on_event: EventSink) -> None:
        """Before positions run past the model's trained context, move the frame down (``CacheManager.keep_frame``)
        and say so; the log keeps the conversation's own positions."""
        shift = self.memory.keep_frame(needed)
        if shift is None:
            return
        self.gate.drop_copy()
        on_event(ev.Notice(f"positions near the model's trained context: moved the cache {shift.delta:,} positions "
                           f"down ({shift.packed} old cells packed behind the first {self.memory.settings.sinks}, "
                           f"{len(shift.homeless)} messages re-read at fresh positions when needed)", "info"))

    # -- helpers --------------------------------------------------------------------------
    def _rendered(self) -> list[TemplateMessage]:
        return [{"role": s.role, "content": s.content} for s in self._segments]

    def _tokenize(self, text: str, first: bool) -> list[int]:
        model = self.engine.model
        if first and model.adds_bos():
            text = strip_bos(text, self.template.bos_token)
            return [model.bos(), *model.tokenize(text, add_special=False, parse_special=True)]
        return model.tokenize(text, add_special=False, parse_special=True)

    def _record_turn(self, result: ev.TurnResult, answer_msg: int,
                     eviction_error: Exception | None = None) -> None:
        detail = result.certificate_detail
        self.store.record_turn(TurnRecord(
            conversation_id=self.conversation_id, message_id=answer_msg, policy=result.policy,
            budget=float(result.budget_cells) if result.budget_cells is not None else None,
            allocated_cells=result.allocated_cells, live_cells=result.live_cells,
            cert_stats={k: float(v) for k, v in detail.items() if isinstance(v, (int, float)) and v is not None},
            cert_layers=detail.get("per_layer", []) if isinstance(detail.get("per_layer"), list) else [],
            gate_stat=result.certificate, gate_threshold=result.gate_threshold, gate_fired=result.gate_fired,
            reprefill_tokens=result.reprefill_tokens, decode_tokens=result.answer_tokens,
            prefill_s=result.prefill_ms / 1000.0, decode_s=result.decode_ms / 1000.0,
            tokens_per_s=result.decode_tok_s, seed=self.config.seed,
            extra={"stop": result.stop, "logprob_mean": result.logprob_mean, "budget": self.config.budget,
                   "budget_in_force": str(self.memory.budget) if self.memory.budget is not None else None,
                   "restored_tokens": result.restored_tokens, "gate": self.gate.history_record(),
                   **({"reread_path": result.reread_path, "reread_messages": result.reread_messages}
                      if result.reread_path else {}),
                   **({"restore_indices": result.restore_indices} if result.restore_indices else {}),
                   **({"restore_best": result.restore_best} if result.restore_best is not None else {}),
                   **({"gate_deferred": True} if result.gate_deferred else {}),
                   **({"eviction_error": str(eviction_error)} if eviction_error is not None else {}),
                   "timings_ms": {k: round(v, 3) for k, v in result.timings.items()}},
        ))

    def memory_view(self, reread: tuple[int, ...] = ()) -> ev.MemoryView:
        retained = self.memory.retained_by_message({s.index: s.role for s in self._segments},
                                                   self._message_lengths())
        return ev.MemoryView(
            model=self.model_name, policy=self.config.policy, budget_cells=self.memory.budget_cells(),
            live_cells=self.engine.live_cells, allocated_cells=self.engine.n_ctx, retained=retained,
            certificates=list(self._turn_certs), gate_threshold=self.gate.threshold(), tok_per_s=self._last_tok_s,
            reread=reread,
            full_cache_until=self.memory.full_until, full_cache_reason=self.memory.full_reason,
            full_cache_hint=self.memory.full_hint, budget_words=self.memory.budget_words,
            certified_risk=self.memory.certified_risk, budget_notice=self.memory.budget_notice,
            opened=self.opened.words() if self.opened is not None else None,
            evicted_rows_bytes=self.engine.rows.nbytes if self.engine.rows is not None else 0,
            frame_offset=self.engine.frame_offset,
        )

    def _message_lengths(self) -> dict[int, int]:
        return {m.index: len(m.tokens) for m in self.store.messages(self.conversation_id)
                if m.tokens is not None}

    def close(self) -> None:
        self.sampler.close()
        if self._owns_engine:
            self.engine.close()


def _rereading(on_event: Callable[[ev.Event], None], done: int, total: int, n: int) -> None:
    """Progress of a re-read: ``n`` more tokens fed after the ``done`` before this run."""
    on_event(ev.Rereading(done + n, total))


def _readable(messages: Sequence[Message], in_flight: int | None) -> list[Message]:
    """The messages a re-read holds: those not discarded, and the question being answered (``in_flight``), which
    a turn to be forgotten afterwards (an independent probe's) logs discarded from the start but still answers."""
    return [m for m in messages if not m.meta.get("discarded") or m.id == in_flight]
