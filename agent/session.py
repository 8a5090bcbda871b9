"""The turn protocol: log → prefill → evict → certificate → gate → answer → log.

One ``ChatSession`` drives one conversation at a time on one engine:

1. the user's message is committed to the SQLite log before the model sees it;
2. the template suffix it adds is tokenized and prefilled (its exact token ids and first
   position go to the log);
3. the cache manager evicts down to the budget (``evict_at = "question"``: after all but the
   question's last ``cert_window`` tokens are in the cache, so its attention decides what matters;
   those tokens are then prefilled on the evicted cache) and reads the question-window certificate
   (``"turn-end"``: the cache was evicted at the end of the previous turn, so the prefill's own
   window certifies it);
4. if the gate statistic reaches τ, the whole history is re-prefilled from the log's
   exact token ids and the answer comes from the full context;
5. the answer streams into the log (partial → complete / interrupted); per-step
   certificates feed the running maximum; with ``evict_at = "turn-end"`` the cache is evicted
   back to its budget; the turn's measurements are recorded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np

from agent import events as ev
from agent.config import Config, parse_budget
from agent.engine import Engine, EngineSnapshot, Generation
from agent.memory import CacheManager, GateDecision
from agent.template import ChatTemplate, Message as TemplateMessage, strip_bos
from memory_store.records import Turn
from memory_store.store import Store
from native import llama

EventSink = Callable[[ev.Event], None]


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


@dataclass(frozen=True)
class _ReadCopy:
    """The cache as a gate's re-read left it: the logged messages it holds (id, exact tokens) from position 0."""

    conversation_id: int
    messages: tuple[tuple[int, tuple[int, ...]], ...]
    snapshot: EngineSnapshot


@dataclass
class _Segment:
    """One message as the model saw it (the template renders these)."""

    index: int
    role: str
    content: str


class ChatSession:
    """A conversation bound to an engine, a store and a cache manager."""

    def __init__(self, config: Config, store: Store, engine: Engine, model_name: str,
                 conversation_id: int | None = None) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.model_name = model_name
        self.template = ChatTemplate.for_model(engine.model)
        self.memory = CacheManager(engine, config)
        self.sampler = llama.Sampler(self._sampler_params(), engine.info.n_vocab)
        self._segments: list[_Segment] = []
        self._turn_certs: list[tuple[int, float | None, bool]] = []
        self._last_tok_s: float | None = None
        self._copy: _ReadCopy | None = None
        self.conversation_id = -1
        if conversation_id is None:
            self.new_conversation()
        else:
            self.open(conversation_id)

    # -- settings ----------------------------------------------------------------------------
    def _sampler_params(self) -> llama.SamplerParams:
        c = self.config
        return llama.SamplerParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, min_p=c.min_p,
                                   repeat_penalty=c.repeat_penalty, seed=c.seed)

    def reconfigure(self, **changes: object) -> None:
        """Change policy, budget, gate or sampling for the next turns (validated)."""
        self.config = self.config.replace(**changes)
        self.memory.reconfigure(self.config)
        self.sampler.close()
        self.sampler = llama.Sampler(self._sampler_params(), self.engine.info.n_vocab)

    # -- conversations -------------------------------------------------------------------------
    def new_conversation(self, title: str = "New chat") -> int:
        conv = self.store.create_conversation(title=title, model=self.model_name,
                                              settings={"policy": self.config.policy, "budget": self.config.budget})
        self.conversation_id = conv.id
        self._copy = None
        self.engine.reset()
        self.memory.reset()
        self._segments = []
        self._turn_certs = []
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
        """Continue a logged conversation: its exact tokens are re-prefilled (``Rereading`` events report the
        progress), then evicted to budget."""
        self.store.claim_conversation(conversation_id)
        self.conversation_id = conversation_id
        self._copy = None
        self.engine.reset()
        self.memory.reset()
        self.memory.round = self.store.next_eviction_round(conversation_id)
        self._segments = []
        self._turn_certs = [(i + 1, t.gate_stat, t.gate_fired)
                            for i, t in enumerate(self.store.turns(conversation_id))]
        self.memory.before_prefill()
        self._read_history(self._history_to_read()[0], on_event=on_event, keep_copy=True)
        self.memory.after_prefill()
        self.memory.evict(protect_from=self.engine.next_pos, round_hint=0)

    # -- the turn ------------------------------------------------------------------------------
    def send(self, text: str, on_event: EventSink = _ignore, cancel: threading.Event | None = None,
             forced_answer: str | None = None, independent: bool = False,
             history_answer: str | None = None) -> ev.TurnResult:
        """Answer one user message; events stream to ``on_event`` from this thread.

        ``forced_answer``: teacher forcing for replays — this text enters the history as the
        answer instead of a generated one (eviction, certificate and gate still run).
        ``independent``: answer from the current state, then put the cache back as it was
        and mark both messages discarded, so later turns never see them.
        ``history_answer``: generate (and report) the answer, then replace it in the cache and
        the log with this text, so every policy continues from the same history.
        """
        snapshot = self._checkpoint() if independent else None
        meta = {"discarded": True} if independent else None
        clock = _Clock()
        # committed before the model sees it
        with clock("store"):
            user = self.store.append_user_message(self.conversation_id, text, meta=meta)
        on_event(ev.TurnStarted(self.conversation_id, user.id))
        seg = _Segment(user.index, "user", text)
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

        first_pos = self.engine.next_pos
        at_turn_end = self.config.evict_at == "turn-end"
        # Evicting after the question: its last cert_window tokens wait until the cache is evicted, so
        # they are read once, on the cache that will answer, and their certificate is that cache's.
        held = 0 if at_turn_end else self.memory.split_question(len(tokens))
        self.memory.before_prefill()
        try:
            prefill_ms = self.engine.feed(tokens[:len(tokens) - held], segment=user.index, cancel=cancel)
            with clock("certificate"):
                self.memory.after_prefill()
            with clock("store"):
                self.store.set_message_tokens(user.id, tokens, first_pos)
            self._segments.append(seg)
            if not at_turn_end:
                self._evict(first_pos, user.id, clock, on_event, requestion=None if held else (tokens, user.index))
            if held:
                prefill_ms += self.engine.feed(tokens[len(tokens) - held:], segment=user.index, cancel=cancel)
                with clock("certificate"):
                    self.memory.read_question_certificate(held)
        except BaseException:
            self._abandon(user.id, first_pos, seg, "prefill")
            raise
        on_event(ev.Prefilled(len(tokens), prefill_ms))

        reprefill_tokens = restored_tokens = 0
        gate_fired = False
        with clock("certificate"):
            decision = self.memory.question_gate()
        if decision.value is not None:
            on_event(ev.CertificateRead("question", decision.value, decision.threshold))
        fired_detail: dict = {}
        if decision.fire:
            # the re-read clears the cache's certificates: the turn record keeps the question's that fired
            fired_detail = self.memory.turn_detail()
            try:
                with clock("reprefill"):
                    reprefill_tokens, restored_tokens = self._gate_reprefill(decision, "question", on_event, cancel)
            except InterruptedError:
                self._abandon(user.id, first_pos, seg, "reprefill")
                raise
            gate_fired = True
            if at_turn_end:
                # the re-read ends with this message: its window's attention scores the turn-end eviction
                self.memory.read_importance()

        if forced_answer is not None:
            gen, answer_msg = self._forced(forced_answer, meta)
        else:
            try:
                gen, stream, (regen_tokens, regen_restored), fired_mid = self._answer(
                    on_event, cancel, allow_gate=not gate_fired, meta=meta, clock=clock)
            except InterruptedError:  # stopped during a mid-answer re-read
                self._abandon(user.id, first_pos, seg, "reprefill")
                raise
            reprefill_tokens += regen_tokens
            restored_tokens += regen_restored
            gate_fired = gate_fired or fired_mid
            answer_msg = self._close_answer(gen, stream, clock)
        if at_turn_end and snapshot is None and history_answer is None:
            self._evict(self.engine.next_pos, user.id, clock, on_event)

        with clock("certificate"):
            stat = self.memory.turn_statistic()
        if gate_fired and decision.fire and decision.value is not None:
            # The re-read resets the cache's certificate; the turn keeps the value that fired the gate.
            stat = decision.value
        self._turn_certs.append((len(self._turn_certs) + 1, stat, gate_fired))
        self._last_tok_s = gen.tok_per_s
        result = ev.TurnResult(
            conversation_id=self.conversation_id, user_message_id=user.id, assistant_message_id=answer_msg,
            answer=gen.text, stop=gen.stop, policy=self.config.policy, budget_cells=self.memory.budget_cells(),
            live_cells=self.engine.live_cells, allocated_cells=self.engine.n_ctx, certificate=stat,
            certificate_detail={**fired_detail, **self.memory.turn_detail()}, gate_threshold=self.memory.threshold(),
            gate_fired=gate_fired, reprefill_tokens=reprefill_tokens, restored_tokens=restored_tokens,
            prefill_ms=prefill_ms,
            decode_ms=gen.decode_ms, decode_tok_s=gen.tok_per_s, answer_tokens=len(gen.tokens),
            logprob_mean=float(np.mean(gen.logprobs)) if gen.logprobs else None,
            timings=clock.ms,
        )
        with clock("store"):
            self._record_turn(result, answer_msg)
        if history_answer is not None and forced_answer is None and snapshot is None:
            self._replace_last_answer(history_answer, answer_msg)
            if at_turn_end:
                self._evict(self.engine.next_pos, user.id, clock, on_event)
        if snapshot is not None:
            self._rollback(snapshot)
        on_event(ev.TurnFinished(result, self.memory_view()))
        return result

    def _checkpoint(self) -> tuple:
        """The cache (and what describes it) as it is now, for ``_rollback``."""
        return self.engine.snapshot(), self.memory.snapshot(), list(self._segments), list(self._turn_certs)

    def _rollback(self, checkpoint: tuple) -> None:
        engine_snap, memory_snap, segments, certs = checkpoint
        self.engine.restore(engine_snap)
        self.memory.restore(memory_snap)
        self._segments, self._turn_certs = list(segments), list(certs)

    def _abandon(self, message_id: int, first_pos: int, seg: _Segment, phase: str) -> None:
        """Cancelled (or Ctrl-C) before the answer: take the message out of the cache and keep it in the log
        marked as never answered, so cache and log stay in step."""
        self.engine.truncate(first_pos)
        if self._segments and self._segments[-1] is seg:
            self._segments.pop()
        self.store.update_message_meta(message_id, {"discarded": True, "cancelled": phase})

    def _evict(self, protect_from: int, message_id: int, clock: _Clock, on_event: EventSink,
               requestion: tuple[list[int], int] | None = None) -> None:
        """Bring the cache back to its budget, keeping positions ≥ ``protect_from`` (after a question: the
        message; at turn end: nothing beyond the sinks and the recent window, as the next question will find
        it); with ``requestion`` (the message's tokens and index), re-read its window on the evicted cache."""
        started = time.perf_counter()
        with clock("evict"):
            evicted = self.memory.evict(protect_from=protect_from, round_hint=None,
                                        conversation_id=self.conversation_id, store=self.store, message_id=message_id)
        if evicted is None:
            return
        if requestion is not None:
            with clock("certificate"):
                self.memory.requestion(*requestion)
        on_event(ev.Evicted(evicted.round, evicted.cells_before, evicted.cells_after, evicted.budget_cells,
                            (time.perf_counter() - started) * 1000.0))

    def _replace_last_answer(self, text: str, message_id: int) -> None:
        """Swap the generated answer (the newest cells) for ``text`` in the cache and the log."""
        generated = self.store.get_message(message_id)
        first = int(generated.first_pos) if generated.first_pos is not None else self.engine.next_pos
        self.engine.truncate(first)
        self.store.update_message_meta(message_id, {"discarded": True, "replaced": True})
        self._segments.pop()
        self._forced(text, None)

    def _forced(self, text: str, meta: dict | None) -> tuple[Generation, int]:
        """Feed a given answer as if generated (replays are teacher-forced)."""
        index = self.store.messages(self.conversation_id)[-1].index + 1
        first = self.engine.next_pos
        tokens = self._tokenize(text, first=False)
        closing = self._tokenize(self.template.assistant_closing(self._rendered(), text), first=False)
        started = time.perf_counter()
        if tokens:
            self.engine.feed(tokens, segment=index, logits_last=False)
        if self._feed_closing(closing, index):
            self.memory.read_importance(add=True)
        msg = self.store.append_message(self.conversation_id, "assistant", text, tokens=tokens + closing,
                                        first_pos=first, meta={**(meta or {}), "forced": True})
        assert msg.index == index
        self._segments.append(_Segment(msg.index, "assistant", text))
        gen = Generation(tokens=tokens, text=text, stop="forced",
                         decode_ms=(time.perf_counter() - started) * 1000.0, logprobs=[])
        return gen, msg.id

    def _answer(self, on_event: EventSink, cancel: threading.Event | None,
                allow_gate: bool, clock: "_Clock",
                meta: dict | None = None) -> tuple[Generation, object, tuple[int, int], bool]:
        """Generate (and on a mid-answer breach, re-prefill and regenerate from the start); the tokens
        re-prefilled and restored come back with the answer."""
        reprefill = restored = 0
        fired = False
        self.sampler.reset()
        while True:
            with clock("store"):
                stream = self.store.stream_assistant(self.conversation_id, first_pos=self.engine.next_pos, meta=meta)
            index = stream.index
            self.memory.begin_answer()
            breach: list[GateDecision] = []

            def on_text(piece: str) -> None:
                stream.append(piece)
                on_event(ev.TextDelta(piece))

            def step_hook(step: int) -> bool:
                decision = self.memory.step_gate()
                if allow_gate and decision.fire:
                    breach.append(decision)
                    return False
                return True

            gen = self.engine.generate(self.sampler, self.config.max_tokens, segment=index, cancel=cancel,
                                       on_text=on_text, step_hook=step_hook)
            if not breach:
                return gen, stream, (reprefill, restored), fired
            # Mid-answer breach: drop what was streamed, re-read the history, answer again.
            stream.cancel()
            self.store.set_message_status(stream.message_id, "interrupted")
            on_event(ev.Regenerating(len(gen.text)))
            try:
                with clock("reprefill"):
                    fed, kept = self._gate_reprefill(breach[0], "answer", on_event, cancel)
                reprefill += fed
                restored += kept
            except InterruptedError:
                self.store.update_message_meta(stream.message_id, {"discarded": True, "cancelled": "reprefill"})
                raise
            fired = True
            allow_gate = False
            self.sampler.reset()

    def _feed_closing(self, closing: list[int], segment: int) -> bool:
        """Feed an answer's closing text (e.g. ``<|im_end|>``); True when a turn-end eviction follows, whose
        scores then need the closing rows' attention (the question's window never saw the answer; call
        ``memory.read_importance(add=True)``)."""
        if not closing:
            return False
        scores_answer = self.config.evict_at == "turn-end"
        if scores_answer:
            self.memory.before_closing()
        self.engine.feed(closing, segment=segment, logits_last=False)
        return scores_answer

    def _close_answer(self, gen: Generation, stream: object, clock: "_Clock") -> int:
        from memory_store.stream import AssistantStream  # noqa: PLC0415

        assert isinstance(stream, AssistantStream)
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

    # -- gate and re-prefill -----------------------------------------------------------------
    def _gate_reprefill(self, decision: GateDecision, phase: str, on_event: EventSink,
                        cancel: threading.Event | None) -> tuple[int, int]:
        """Re-read the history from the log into a fresh cache; returns the tokens prefilled and those restored
        from the previous re-read's copy. Cancelled part-way (``InterruptedError``), the cache is put back as it
        was before the re-read."""
        chosen, truncated = self._history_to_read()
        kept = self._copy_covers(chosen)
        total = sum(len(m.tokens) for m in chosen[kept:])
        restored = sum(len(m.tokens) for m in chosen[:kept])
        assert decision.value is not None and decision.threshold is not None
        on_event(ev.GateFired(phase, decision.value, decision.threshold, total, truncated, decision.uncertified,
                              restored))
        if truncated:
            on_event(ev.Notice("the history is longer than the context; re-read the system prompt and the most "
                               "recent messages that fit", "warning"))
        saved = self._checkpoint() if cancel is not None else None
        try:
            self._read_history(chosen, cancel=cancel, on_event=on_event, keep_copy=True, kept=kept)
        except InterruptedError:
            assert saved is not None
            self._rollback(saved)
            raise
        return total, restored

    def _history_to_read(self, reserve: int | None = None, pending: int | None = None) -> tuple[list, bool]:
        """The logged messages a re-read prefills (exact token ids): all of them, or when they do not fit with
        ``reserve`` cells free (default: the answer's room), the system prompt and the newest that do (True:
        truncated); ``pending``: a message (id) to leave out, as it is prefilled next."""
        history = self.store.history(self.conversation_id)
        msgs = [m for m in history.messages if not m.meta.get("discarded") and m.id != pending]
        msgs = self._tokenized(msgs)
        room = self.engine.n_ctx - (self.config.max_tokens + 16 if reserve is None else reserve)
        total = sum(len(m.tokens) for m in msgs)
        if total <= room:
            return list(msgs), False
        head = [m for m in msgs[:1] if m.role == "system"]
        budget = room - sum(len(m.tokens) for m in head)
        tail: list = []
        for m in reversed(msgs[len(head):]):
            if len(m.tokens) > budget:
                break
            tail.insert(0, m)
            budget -= len(m.tokens)
        # A truncated history must still start at a user turn for the template to hold.
        while tail and tail[0].role == "assistant":
            tail.pop(0)
        return head + tail, True

    def _read_history(self, chosen: list, cancel: threading.Event | None = None,
                      on_event: EventSink = _ignore, keep_copy: bool = False, kept: int | None = None) -> int:
        """Clear the cache and prefill ``chosen``'s exact token ids; returns tokens fed. The messages the
        previous re-read's copy holds are restored from it instead. ``Rereading`` events report the progress;
        ``cancel`` stops it between batches (``InterruptedError``, cache part-filled). ``keep_copy``: keep the
        result as the next re-read's copy (config ``reread_copy``); ``kept``: ``_copy_covers(chosen)``, when the
        caller already asked."""
        kept = self._copy_covers(chosen) if kept is None else kept
        self.engine.reset()
        self.memory.reset_cache_state()
        if kept:
            assert self._copy is not None
            self.engine.restore(self._copy.snapshot)
            # the copy may hold messages past the ones it serves: they go
            self.engine.truncate(sum(len(toks) for _, toks in self._copy.messages[:kept]))
        rest = chosen[kept:]
        total = sum(len(m.tokens) for m in rest)
        fed = 0
        on_event(ev.Rereading(0, total))
        for m in rest:
            toks = [int(t) for t in m.tokens]
            done = fed
            self.engine.feed(toks, segment=m.index, logits_last=m is chosen[-1], cancel=cancel,
                             progress=lambda n, done=done: on_event(ev.Rereading(done + n, total)))
            fed += len(toks)
        self._segments = [_Segment(m.index, m.role, m.content) for m in chosen]
        if keep_copy and self.config.reread_copy and self.memory.policy.evicts and self.memory.threshold() is not None:
            self._copy = _ReadCopy(self.conversation_id, tuple((m.id, tuple(int(t) for t in m.tokens)) for m in chosen),
                                   self.engine.snapshot())
        return fed

    def _copy_covers(self, chosen: list) -> int:
        """How many of ``chosen``'s first messages the previous re-read's copy holds, token for token (0: none,
        the copy is off or of another conversation). A copy whose later messages the log no longer lists (an
        independent probe, a replaced answer) still serves the messages before them. Never all of ``chosen``:
        the last message is always fed, as the answer starts from its logits."""
        copy = self._copy
        if copy is None or not self.config.reread_copy or copy.conversation_id != self.conversation_id:
            return 0
        n = 0
        for (mid, toks), m in zip(copy.messages[: len(chosen) - 1], chosen):
            if m.id != mid or len(m.tokens) != len(toks) or tuple(int(t) for t in m.tokens) != toks:
                break
            n += 1
        return n

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
        freed = self.memory.make_room(needed)
        if not freed:
            on_event(ev.Notice("the context is full: keeping the system prompt and the most recent messages", "warning"))
            self._read_history(self._history_to_read(reserve=needed, pending=pending)[0])

    # -- helpers --------------------------------------------------------------------------
    def _rendered(self) -> list[TemplateMessage]:
        return [{"role": s.role, "content": s.content} for s in self._segments]

    def _tokenize(self, text: str, first: bool) -> list[int]:
        model = self.engine.model
        if first and model.adds_bos():
            text = strip_bos(text, self.template.bos_token)
            return [model.bos(), *model.tokenize(text, add_special=False, parse_special=True)]
        return model.tokenize(text, add_special=False, parse_special=True)

    def _record_turn(self, result: ev.TurnResult, answer_msg: int) -> None:
        detail = result.certificate_detail
        self.store.record_turn(Turn(
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
                   "restored_tokens": result.restored_tokens,
                   "timings_ms": {k: round(v, 3) for k, v in result.timings.items()}},
        ))

    def memory_view(self) -> ev.MemoryView:
        retained = self.memory.retained_by_message({s.index: s.role for s in self._segments},
                                                   self._message_lengths())
        return ev.MemoryView(
            model=self.model_name, policy=self.config.policy, budget_cells=self.memory.budget_cells(),
            live_cells=self.engine.live_cells, allocated_cells=self.engine.n_ctx, retained=retained,
            certificates=list(self._turn_certs), gate_threshold=self.memory.threshold(), tok_per_s=self._last_tok_s,
        )

    def _message_lengths(self) -> dict[int, int]:
        return {m.index: len(m.tokens) for m in self.store.messages(self.conversation_id)
                if m.tokens is not None}

    def close(self) -> None:
        self.sampler.close()


def budget_cells(budget: str, history_tokens: int) -> int:
    """Cells the budget allows for a history of ``history_tokens`` tokens."""
    kind, value = parse_budget(budget)
    if kind == "tokens":
        return int(value)
    return max(1, int(round(value * history_tokens)))
