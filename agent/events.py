"""Messages the agent emits during a turn; the UI and the CLI render them. And the hooks observers subscribe to.

The UI never reaches into the engine: everything it shows (streamed text, gate events,
the memory view) arrives as one of these immutable records. Studies and benchmarks that need to see more
(what the engine fed, what an eviction drew, when the gate read a question) subscribe to a component's
:class:`Hook` instead of replacing its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, ParamSpec, Union

P = ParamSpec("P")


class Hook(Generic[P]):
    """One point of a component's work that observers may hear about; calling it calls each subscriber in turn.
    The component's own behaviour never depends on its subscribers."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[P, None]] = []

    def subscribe(self, observer: Callable[P, None]) -> Callable[[], None]:
        """Call ``observer`` from now on; returns the call that stops it."""
        self._subscribers.append(observer)
        return lambda: self._subscribers.remove(observer)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for observer in list(self._subscribers):
            observer(*args, **kwargs)


@dataclass(frozen=True)
class TurnStarted:
    conversation_id: int
    user_message_id: int


@dataclass(frozen=True)
class Prefilled:
    """The new suffix of the prompt went into the cache."""

    tokens: int
    ms: float


@dataclass(frozen=True)
class Evicted:
    """An eviction round brought the cache back to its budget."""

    round: int
    cells_before: int
    cells_after: int
    budget_cells: int
    ms: float


@dataclass(frozen=True)
class CertificateRead:
    """A certificate value the gate looked at (phase: "question" or "answer")."""

    phase: str
    value: float
    threshold: float | None
    step: int = 0


UNCERTIFIED = "too little of the evicted history was sampled to estimate the error"
"""Why an uncertified gate fired, in the words the chat and the CLI show."""


def gate_reason(event: "GateFired") -> str:
    """Why the gate fired, in the words the chat and the CLI show."""
    if event.uncertified:
        return UNCERTIFIED
    if event.second:
        return (f"the kept sample's error on your question ({event.second} {event.value:.3f} ≥ {event.threshold:.3f}) "
                "says it may need evicted history")
    if event.points_at:
        return f"your question points at {event.points_at}, which is evicted"
    return f"certificate {event.value:.3f} ≥ τ {event.threshold:.3f}"


def reread_words(tokens: int | None, restored: int = 0) -> str:
    """What a gate's re-read costs, in the words the chat and the CLI show."""
    words = f"re-read {tokens if tokens is not None else '?'} tokens of history"
    return f"{words} ({restored} more restored from memory)" if restored else words


def gate_words(event: "GateFired") -> str:
    """What a firing does, in the words the chat and the CLI show: the messages a targeted re-read brings back
    ("re-read your turn 4 ('My gym locker code is…') (21 tokens)"), or the whole history's cost."""
    if event.reread:
        return f"re-read {event.reread} ({event.reprefill_tokens} tokens)"
    return reread_words(event.reprefill_tokens, event.restored_tokens)


def tokens_words(n: int) -> str:
    """A token count as people say it: 4096 → "4k", 1500 → "1.5k", 900 → "900"."""
    if n < 1000:
        return str(n)
    k = n / 1024 if n % 1024 == 0 else n / 1000
    return f"{k:.0f}k" if abs(k - round(k)) < 0.05 else f"{k:.1f}k"


def full_cache_words(until: int) -> str:
    """The status while the history is below config ``evict_from``: nothing is evicted yet."""
    return f"full cache until {tokens_words(until)} tokens"


@dataclass(frozen=True)
class GateFired:
    """The gate fired: the history is re-read from the log ("re-read N tokens of history"); sent before the
    re-read starts, which ``Rereading`` events then follow."""

    phase: str
    value: float
    threshold: float
    reprefill_tokens: int
    truncated: bool = False
    """True when the history exceeded n_ctx and only the system prompt + the most recent part fit."""
    uncertified: bool = False
    """Fired because too little of the evicted history was sampled (fewer than two pages) to estimate the error,
    so no certificate vouches for what was dropped; ``value`` is then not what fired it."""
    restored_tokens: int = 0
    """History tokens restored from host memory, not prefilled: the engine's evicted rows (config
    ``evicted_rows_mb``) or the copy the previous re-read left (config ``reread_copy``)."""
    points_at: str = ""
    """When a sketch statistic fired it: the evicted message the question points at, in words ("turn 4 ('My
    gym locker code is…')")."""
    reread: str = ""
    """A targeted re-read: the messages it brings back, in words; ``reprefill_tokens`` then counts their evicted
    tokens only ("": the whole history is re-read)."""
    messages: int = 0
    """How many messages a targeted re-read brings back."""
    question_tokens: int = 0
    """A targeted or copied re-read prefills the question again on top of what it brings back: how many of its
    tokens (all of them, or the last ``reread_refeed``)."""
    second: str = ""
    """The gate's second signal fired the turn (config ``gate_second``): its statistic; ``value`` and ``threshold``
    are its own."""
    why_full: str = ""
    """Why a sketch-fired gate re-reads the whole history rather than the messages it points at."""


@dataclass(frozen=True)
class Restored:
    """Before the question was read, the evicted messages nearest it came back from host memory at their old
    positions (config ``restore``); they leave again at the turn's end."""

    messages: tuple[str, ...]
    """Each message that came back, in words ("your turn 4 ('My gym locker code is…')"), nearest first."""
    tokens: int


@dataclass(frozen=True)
class GateDeferred:
    """The gate reached its bar on a turn whose restore had brought messages back, where it would have named messages
    to re-read, and left the answer to the restored ones (config ``gate_defers_to_restore``): nothing more is
    re-read."""

    phase: str
    value: float
    threshold: float


def deferred_words(event: GateDeferred) -> str:
    """Why nothing more was re-read, in the words the chat and the CLI show."""
    return f"certificate {event.value:.3g} ≥ τ {event.threshold:.3g}; the restored messages answer"


def restored_words(event: Restored) -> str:
    """What a restore brought back, in the words the chat and the CLI show."""
    more = len(event.messages) - 1
    others = f" and {more} more message{'s' if more != 1 else ''}" if more else ""
    return f"brought back {event.messages[0]}{others} ({event.tokens} tokens)"


@dataclass(frozen=True)
class Rereading:
    """Progress of a re-read of the history from the log (a gate firing or a reopened conversation)."""

    done: int
    total: int


@dataclass(frozen=True)
class Regenerating:
    """A mid-answer breach: what was streamed so far is discarded and the answer restarts."""

    discarded_chars: int


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Notice:
    """Something the user should know (level: info, warning, error)."""

    text: str
    level: str = "info"


@dataclass(frozen=True)
class Opened:
    """How a logged conversation was reopened: resumed from its saved state, or its log re-read (and why)."""

    resumed: bool
    reason: str
    """Why the saved state was not used ("" when it was)."""
    reread_tokens: int
    ms: float

    def words(self) -> str:
        """"resumed" or "re-read 3.2k tokens (no saved state)"."""
        if self.resumed:
            return "resumed"
        return f"re-read {tokens_words(self.reread_tokens)} tokens ({self.reason})"


@dataclass(frozen=True)
class MemoryView:
    """What the model still remembers, for the memory panel."""

    model: str
    policy: str
    budget_cells: int | None
    live_cells: int
    allocated_cells: int
    retained: list[tuple[int, str, float]] = field(default_factory=list)
    """(message index, role, share of its tokens still in the cache) for every earlier message."""
    certificates: list[tuple[int, float | None, bool]] = field(default_factory=list)
    """(turn number, turn certificate, gate fired) for every answered turn."""
    gate_threshold: float | None = None
    tok_per_s: float | None = None
    reread: tuple[int, ...] = ()
    """Indices of the messages the last turn's targeted re-read brought back (the panel marks their turns)."""
    opened: str | None = None
    """How the conversation was reopened ("resumed", "re-read N tokens (why)"); None for one started here."""
    full_cache_until: int | None = None
    """While the history is below config ``evict_from`` an evicting policy runs the full cache: that length, in
    tokens (None once eviction applies, or under a policy that never evicts)."""
    full_cache_reason: str | None = None
    """Why an evicting policy runs the full cache at any length (``CacheManager.full_reason``: under gate "auto",
    a model its calibration does not cover; under budget "auto", a model whose record certifies no budget at the
    risk); None when the policy applies."""
    full_cache_hint: str | None = None
    """How to evict anyway where ``full_cache_reason`` holds, in a few words (``CacheManager.full_hint``)."""
    budget_words: str | None = None
    """How much the chat may forget: "25% · certified ≤ 10% loss", "25% · not certified" or "full cache"
    (``CacheManager.budget_words``); None where unknown."""
    certified_risk: float | None = None
    """The loss the budget in force is certified at on the model's long chats (None: not certified)."""
    budget_notice: str | None = None
    """An explicit budget the model's record does not certify: the one line that says so."""
    evicted_rows_bytes: int = 0
    """Host memory held by the evicted cells' K/V rows a firing gate copies back (config ``evicted_rows_mb``)."""
    frame_offset: int = 0
    """How far the cache's positions have moved down (context shifts) since it was last empty: 0, none."""


@dataclass(frozen=True)
class TurnResult:
    """Everything measured about one answered turn (also what `ask --json` prints)."""

    conversation_id: int
    user_message_id: int
    assistant_message_id: int | None
    answer: str
    stop: str
    policy: str
    budget_cells: int | None
    live_cells: int
    allocated_cells: int
    certificate: float | None
    certificate_detail: dict[str, Any]
    gate_threshold: float | None
    gate_fired: bool
    reprefill_tokens: int
    prefill_ms: float
    decode_ms: float
    decode_tok_s: float
    answer_tokens: int
    logprob_mean: float | None
    restored_tokens: int = 0
    """History tokens a gate's re-read restored from host memory instead of prefilling them: the engine's evicted
    rows, or the previous re-read's copy."""
    reread_path: str = ""
    """How the gate's re-read ran: "copied" (every evicted token copied back from the engine's evicted rows, then
    the question again), "targeted" (only the messages the question points at, at their old positions, then the
    question again), "full" (the whole history), "restored" (the gate fired on messages the turn's restore had already
    brought back: nothing more to read), or "" (no re-read)."""
    reread_messages: list[int] = field(default_factory=list)
    """Ids of the logged messages the re-read brought back."""
    restore_indices: list[int] = field(default_factory=list)
    """Indices of the evicted messages brought back before the question, nearest it (config ``restore``, ranked
    ``restore_by``); their tokens count in ``restored_tokens``."""
    gate_deferred: bool = False
    """The gate reached its bar on a restoring turn where it would have named messages to re-read, and left the
    answer to what the restore brought back (config ``gate_defers_to_restore``): nothing re-read."""
    restore_best: float | None = None
    """The restore's best reading over the evicted messages, over its floor or not: the nearest one's cosine
    (``restore_by = "meaning"``) or BM25 (``"words"``); None where it ranked nothing."""
    timings: dict[str, float] = field(default_factory=dict)
    """Milliseconds by phase besides prefill and decode: evict (design, seq_rm, biases, compaction, its log
    record), certificate (reading the certificate and the attention from the graph, statistics), store (log writes on
    the turn's path), reprefill (a gated re-read of the history), closing (feeding the end-of-turn tokens)."""

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class TurnFinished:
    result: TurnResult
    memory: MemoryView


Event = Union[TurnStarted, Prefilled, Evicted, CertificateRead, GateFired, GateDeferred, Restored, Rereading,
              Regenerating, TextDelta, Notice, TurnFinished]

