"""certchat's one typed configuration: TOML under the XDG config dir, flags override.

Every field has a docstring (shown by ``certchat config --help``-style listings and the
README); an invalid value raises :class:`ConfigError` whose one-line message names the key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from agent import paths
from agent.eviction import policies
from agent.gate import signals

POLICIES = policies.NAMES
EVICT_AT = ("question", "turn-end")
DEFAULT_EVICT_AT = "turn-end"
# Measured crossover of full vs a 10% cache's turn time (docs/results/NOTES.md, "Where eviction starts to pay").
DEFAULT_EVICT_FROM = 2048
# Tokens a message needs at least beside the answer's room (max_tokens + 16): a context smaller than that
# would refuse every message as too long.
MIN_MESSAGE_ROOM = 64
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repeat_penalty", "top_share", "floor")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key."""


@dataclass
class Config:
    """Settings for the engine, the eviction policy, the gate and the UI."""

    model: str = "qwen2.5-coder-0.5b"
    """Registry name (see `certchat models list`) or a path to any GGUF file."""
    n_ctx: int = 8192
    """KV cells allocated for the conversation (the hard ceiling of the cache)."""
    n_batch: int = 512
    """Tokens per llama_decode call during prefill."""
    threads: int = field(default_factory=lambda: max(1, min(os.cpu_count() or 2, 8)))
    """CPU threads for prefill and decode."""
    gpu_layers: int = 0
    """Layers offloaded to the GPU (needs a CUDA build; 0 = CPU only)."""
    policy: str = "poisson"
    """Eviction policy: full, window, topk, random or poisson (agent/eviction/policies.py)."""
    budget: str = "auto"
    """KV budget: "auto" (the default), a token count ("1024") or a share of the history ("10%"). "auto" runs the
    budget the model's record certifies for ``risk`` (``certchat calibrate`` replays long chats under the full cache
    and several budgets with the model's gate, agent/gate/certification.py): the cheapest budget whose paired loss
    against the full cache is bounded by ``risk``; where no budget is, or the record has no certification, the chat
    keeps its full cache and says why in one line. An explicit budget is honoured, with one line saying whether the
    model's record certifies it. Before certification, a quarter was the default, chosen on long chats
    (docs/results/NOTES.md, "A quarter of the cache, and named re-reads")."""
    risk: str = "10%"
    """How much the chat may forget under ``budget = "auto"``: among the answers the full cache gets right, the share
    an evicting budget may lose, at 95% confidence ("N%", 0 < N < 100). The default is 10% because that is the
    smallest round risk the model's calibration can certify: a calibration of a couple of hours on 2 cores yields
    about 60–100 right answers of the full cache, and the exact (Clopper–Pearson) bound with zero losses stays above
    5% below 59 of them, so a 5% default would keep every model's full cache whatever its quality; at 10% such a
    calibration certifies a budget that lost a few of them."""
    gate: str = "auto"
    """Gate threshold τ on the turn's statistic, "off" to disable, or "auto" for the calibrated default (which follows
    the conversation: its calibrated τ, raised to a multiple of the median of the recent turn statistics when the
    conversation's turns read higher — agent/gate/gate_calibration.json). A number is a fixed τ. "auto" on a model the
    calibration was not fitted on (known by its GGUF's sha256) keeps the full cache and says so: its gate would not
    fire, and eviction would forget silently; a number or "off" evicts on any model."""
    seed: int = 0
    """Seed for sampling and for the Poisson draws (runs are replayable)."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    top_k: int = 40
    """Top-k cut-off when sampling with temperature > 0."""
    top_p: float = 0.95
    """Nucleus cut-off when sampling with temperature > 0."""
    min_p: float = 0.05
    """Min-p cut-off when sampling with temperature > 0."""
    repeat_penalty: float = 1.0
    """Repetition penalty (1.0 disables it)."""
    max_tokens: int = 512
    """Longest answer, in tokens."""
    system_prompt: str = "You are a helpful assistant. Answer concisely."
    """System message that starts every new conversation."""
    sinks: int = 4
    """Attention-sink tokens at the start that are never evicted."""
    recent: int = 32
    """Most recent tokens that are never evicted (the current message is always kept too). The window gives way when the
    budget is small: it takes at most half of the budget beyond the sinks and the message, leaving the rest to sampling,
    so the certificate has something to measure; when fewer than two pages of the evicted history survive as samples
    (e.g. the sinks and the message alone fill the budget), the turn is uncertified and the gate fires."""
    page_size: int = 8
    """Sampling unit: pages of this many contiguous tokens (never straddling a message); 1 = single tokens."""
    top_share: float = 0.5
    """Share of the budget kept deterministically by score (the top slice) before the Poisson tail."""
    floor: float = 0.05
    """Score floor, as a share of the mean unprotected score, so every unprotected π stays > 0."""
    evict_from: int = DEFAULT_EVICT_FROM
    """History length, in tokens, below which the chat runs the full cache: no eviction, no attention readout, no
    certificate, no gate firing, no sketch. From this length on the policy applies (the status line says "full
    cache until …" before). Eviction only pays once attention over the whole history costs more per turn than an
    eviction round, the certificate and the gate add; the default is where the measured turn times cross on a
    2-core CPU (docs/results/NOTES.md, "Where eviction starts to pay"). 0 evicts from the first turn. Eviction starts
    by the time the full cache could no longer take a turn (n_ctx less n_batch and max_tokens) whatever this says."""
    evict_at: str = DEFAULT_EVICT_AT
    """When the cache is brought back to its budget: "turn-end" (the default: after the answer, scored by the
    question's and the closing tokens' attention; the next message's prefill, in one batch, certifies the evicted
    cache itself — cheaper turns, eviction blind to the next question) or "question" (after the user's message
    is prefilled but for its last cert_window tokens, so its attention decides what stays; those tokens are then
    prefilled on the evicted cache and certify it — one more prefill batch per turn). docs/results/NOTES.md
    ("Which timing by default") has the measurements that chose the default."""
    question_window: int = 32
    """Last prompt tokens whose attention scores the cache for eviction (SnapKV's observation window)."""
    cert_window: int = 8
    """Last prompt tokens over which the question-window certificate is computed (with evict_at "question",
    prefilled after the eviction)."""
    gate_stat: str = "auto"
    """Turn statistic the gate compares with τ: "auto" (the one the calibration chose,
    agent/gate/gate_calibration.json), question.max (maximum over the question window's rows × layers × heads of the
    relative certificate), question.q (their 95th percentile) or any key of the turn detail, e.g. answer.step_max_q
    (running maximum)."""
    reread_copy: bool = False
    """Keep the cache a gate's re-read leaves (the full history, in host memory: about 12 KB per token for
    qwen2.5-coder-0.5b) so the next firing restores it and prefills only the messages logged since. The log
    stays the source of truth: the copy is used only when its messages are, token for token, the start of what
    the log says to re-read. Off: every firing prefills the whole history again."""
    reread_budget: int = 512
    """Most evicted tokens a targeted re-read puts back. When a sketch statistic fires the gate, the messages the
    question points at (each with its own anomaly ≥ τ), most anomalous first, are re-read from the log at the
    positions they were evicted from, as many as fit, and the question is prefilled again on top — tens to
    hundreds of tokens instead of the whole history. The whole history is re-read instead when the gate fired on
    another statistic, the turn is uncertified, more than 16 messages stand out, or the ones that fit hold less
    than half of the question's attention above baseline on them — except that a history longer than 4 × this
    budget is never re-read whole for the last two reasons (it would cost more than the full cache saved): the
    most anomalous messages that fit are re-read. 0: always the whole history."""
    reread_refeed: int = 0
    """Question tokens a re-read that puts history back from the evicted rows or the log feeds again on top of it:
    0, the whole question (every row of it then attends to what came back); N, only its last N (the rest keeps
    the rows it computed on the evicted cache, and the last N and the answer read what came back). A firing
    then costs the copy and N tokens rather than the question's length. A whole-history re-read into a fresh
    cache, or a re-read that feeds packed messages at fresh positions, always feeds the whole question."""
    evicted_rows_mb: int = 1024
    """Host memory, in MiB, for every evicted cell's K/V rows (all layers, as the cache first computed them: about
    12 KB per token for qwen2.5-coder-0.5b, 28 KB for the 1.5B). A targeted re-read copies a message back from
    them instead of decoding it again over the evicted cache. With every evicted token's rows at hand, a firing
    gate copies the whole history back, and the question and the answer read every token of it, each row as the
    chat computed it: the full cache's own rows for what came before the first eviction, and for later tokens rows
    that attended to the sampled cache. Kept while an evicting policy runs with a gate. Past the budget the rows
    evicted longest ago go first, and re-reads decode messages again (the targeted path); a reopened chat starts
    with none (saved states do not carry them). The log stays the source of truth: a row is used only where its
    token is the log's. 0: keep none."""
    restore: int = 8
    """Evicted messages brought back before each question is read, ranked by ``restore_by`` among the messages the
    engine's evicted rows can put back whole (agent/gate/restore.py): the best this many, within ``reread_budget``
    evicted tokens, are copied back at their old positions, the question is fed once over them, and they leave again
    at the turn's end. A copy, no decode; the gate stays the fallback for what the rank does not find. Needs
    ``evicted_rows_mb``. 8 by real dialogue (docs/results/NOTES.md): with qwen2.5-coder-0.5b at 25% on five LoCoMo
    conversations, 20 of 79 questions against 13 for the best 3 and the full cache's 22 (qwen2.5-coder-1.5b: 25 of 79,
    full 27); on the four 16k yardstick chats 78 of 120 against 80 for 3 (full 83), at 0.77× the full cache's turn
    time. 0: off."""
    restore_by: str = "meaning"
    """How ``restore`` ranks: "meaning" (each message's best sentence under a small sentence encoder, the shared words
    breaking near ties) or "words" (BM25 alone, no encoder)."""
    gate_sees_restore: bool = True
    """The gate reads a question as though the messages ``restore`` brought back for it were still evicted, so that
    restoring the wrong messages does not silence it: a message the question pays unusual attention to fires the gate
    whether or not the restore brought it back. Where a firing brings back only the messages it names (``copy_back``
    "named", or "auto" past 4 × ``reread_budget`` evicted tokens), one whose messages the restore already brought back
    re-reads nothing (the question was read over them), and one that names others brings those back as well; a
    firing that copies every evicted token back does so as before. false: the gate reads what the restore left
    evicted, and the messages it brought back count as kept."""
    gate_trusts_restore: bool = False
    """With ``gate_sees_restore``, where a firing brings back only the messages it names: a firing whose pull lies
    mostly on messages the restore already brought back (at least half the question's attention above baseline on
    the messages it names) re-reads nothing more, as though it had named those alone; the question was read over
    them. false: it brings back every other message it names, and the question is fed again over them. On the 16k
    yardstick (qwen2.5-coder-0.5b, 25%) it turned 19 of 175 such re-reads into none, with the same recall (80 of
    120, one answer changed each way); its time saving is under what the machine could time, so it stays off. Under
    ``gate_defers_to_restore`` (the default) such a firing re-reads nothing anyway."""
    gate_defers_to_restore: bool = True
    """On a turn whose ``restore`` brought messages back, a firing re-reads nothing unless it copies every evicted
    token back (``copy_back`` "all", or "auto" within 4 × ``reread_budget`` evicted tokens), when the answer reads
    the whole history. Past that a firing would bring back the messages the question's attention at two layers
    names, second-guessing the restore's rank, which has already chosen by meaning. A turn whose rank brought
    nothing back fires as ever. The turn's record says when the gate deferred (``gate_deferred``). On the four 16k
    yardstick chats (qwen2.5-coder-0.5b, 25%) the named firings recalled 2 probes of 120 more (80 against 78; the
    full cache 83, docs/results/NOTES.md) and took the mean turn over the time bar, ungated + 0.10 × full's: with
    the policies run in lockstep on two of the chats, 0.98 s against a bar of 0.93, deferring 0.91. On LoCoMo's
    short chats every firing copies all, so little changes there. false: every firing re-reads."""
    gate_second: str = "auto"
    """A second, independent signal that fires the gate where its statistic stays under the bar: "auto" uses the one
    the model's gate calibration carries, if any (record field ``second``, fitted by ``python -m agent.lab.gate_lab
    … --second STAT --write RECORD`` on long calibration chats; no shipped record carries one, since none has yet
    measured a gain held out); "off" reads only the gate's statistic."""
    copy_back: str = "auto"
    """What a firing gate brings back when the engine keeps the evicted rows (``evicted_rows_mb``): "all" copies
    every evicted token back, whatever statistic fired, so the question and the answer read the cache the whole
    history made (each row as the cache first computed it); "named" copies only the messages a sketch statistic
    names (the targeted re-read, from rows where kept), and otherwise re-reads the whole history from the log;
    "auto" copies all while at most 4 × ``reread_budget`` tokens are evicted (the turn over the whole history
    then costs little more than a targeted one), and the named messages past that."""
    sketch_layers: str = "auto"
    """Model layers whose evicted keys the evicted-key sketch keeps, comma-separated (e.g. "11,13,15,20,22"),
    "auto" for the layers the gate's calibration chose (agent/gate/gate_calibration.json; on a sliding-window model
    the nearest full-attention ones, since a windowed layer never sees an evicted message), or "" for no sketch. With a
    sketch every turn records ``sketch.max`` — how far the question's estimated attention on a mostly evicted
    message exceeds what earlier questions paid it — and the messages it implicates, which a ``sketch.*`` gate
    re-reads; it costs a key read and a quantisation per eviction and a scoring pass per question
    (docs/POISSON.md, "Phase 1")."""
    sketch_bits: int = 8
    """Bits per stored key value in the sketch: 8 or 4 (with a half-precision scale per row and KV head), or 32."""
    answer_certificate: bool = False
    """Also read the certificate at every answer step (the answer.* statistics; replays turn it on). Off, the
    certificate is computed for the question window only, and answer decoding runs at full speed; an answer.*
    gate_stat turns it on regardless."""
    frame_shift: bool = True
    """Keep an evicting chat's positions inside the model's trained context: when the next turn would run past it,
    the cache's positions move down (the sinks stay at the front, the oldest kept cells are packed behind them, the
    recent history keeps its distances; RoPE keys re-rotated by llama.cpp) and the status line says so. Messages
    packed away are re-read at fresh positions when the gate points at them. false: positions run on past it."""
    saved_states_mb: int = 2048
    """Disk budget, in MiB, for saved chat states: after every turn the evicted cache and what describes it are
    saved beside the log, so that reopening the chat (the TUI's list, ``ask --conversation``) resumes it instead of
    re-reading the whole log. The least recently used states go first when they outgrow the budget; a state is
    never the source of truth (deleting them loses nothing but time). 0: save none."""
    theme: str = "textual-dark"
    """Textual theme name for the chat UI."""
    keys: dict[str, str] = field(default_factory=dict)
    """Key binding overrides for the chat UI: binding id → key (e.g. {"new_chat" = "ctrl+n"})."""

    # The settings below are parsed once per Config (a Config is replaced, never changed, once built).
    @functools.cached_property
    def kv_budget(self) -> Budget:
        """``budget`` parsed."""
        return Budget.parse(self.budget)

    @functools.cached_property
    def loss_risk(self) -> float:
        """``risk`` parsed: the share (0.1 for "10%")."""
        return parse_risk(self.risk)

    @functools.cached_property
    def gate_threshold(self) -> GateThreshold:
        """``gate`` parsed."""
        return GateThreshold.parse(self.gate)

    @functools.cached_property
    def sketch_layer_choice(self) -> tuple[int, ...] | None:
        """``sketch_layers`` parsed: the layers, or None for the calibrated ones."""
        return sketch_layers(self.sketch_layers)

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed and validated (flags override the file this way)."""
        merged = dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})
        merged.validate()
        return merged

    def validate(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.type in (bool, "bool") and not isinstance(value, bool):
                raise ConfigError(f"{spec.name}: must be true or false, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name}: must be a finite number, got {value!r}")
        if self.n_ctx < 256:
            raise ConfigError(f"n_ctx: must be at least 256, got {self.n_ctx}")
        if self.n_batch < 1:
            raise ConfigError(f"n_batch: must be positive, got {self.n_batch}")
        if self.threads < 1:
            raise ConfigError(f"threads: must be positive, got {self.threads}")
        if self.gpu_layers < 0:
            raise ConfigError(f"gpu_layers: must be 0 or more, got {self.gpu_layers}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _ = self.kv_budget, self.loss_risk, self.gate_threshold  # parsed once, kept for the components reading them
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be 0 or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p: must be in [0, 1), got {self.min_p}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens: must be positive, got {self.max_tokens}")
        if self.n_ctx < self.max_tokens + 16 + MIN_MESSAGE_ROOM:
            raise ConfigError(
                f"n_ctx: {self.n_ctx} leaves no room for a message beside max_tokens {self.max_tokens} (needs at "
                f"least max_tokens + {16 + MIN_MESSAGE_ROOM} = {self.max_tokens + 16 + MIN_MESSAGE_ROOM}); raise "
                "n_ctx or lower max_tokens")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed: must be in [0, 2^32), got {self.seed}")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be 0 or more (0 = no cut-off), got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise ConfigError(f"repeat_penalty: must be positive (1.0 disables it), got {self.repeat_penalty}")
        if self.sinks < 0 or self.recent < 0:
            raise ConfigError("sinks/recent: must be 0 or more")
        if self.page_size < 1:
            raise ConfigError(f"page_size: must be positive, got {self.page_size}")
        if not 0 <= self.top_share < 1:
            raise ConfigError(f"top_share: must be in [0, 1) (use policy topk for a fully deterministic cache), "
                              f"got {self.top_share}")
        if self.floor < 0:
            raise ConfigError(f"floor: must be 0 or more, got {self.floor}")
        if isinstance(self.evict_from, bool) or not isinstance(self.evict_from, int) or self.evict_from < 0:
            raise ConfigError(f"evict_from: must be a token count, 0 or more (0 evicts from the first turn), "
                              f"got {self.evict_from!r}")
        if self.evict_at not in EVICT_AT:
            raise ConfigError(f"evict_at: must be one of {', '.join(EVICT_AT)}, got {self.evict_at!r}")
        if not 1 <= self.question_window <= 64 or not 1 <= self.cert_window <= 64:
            raise ConfigError("question_window/cert_window: must be in [1, 64]")
        _ = self.sketch_layer_choice
        if isinstance(self.saved_states_mb, bool) or not isinstance(self.saved_states_mb, int) \
                or self.saved_states_mb < 0:
            raise ConfigError(f"saved_states_mb: must be a size in MiB, 0 or more (0 saves no chat states), "
                              f"got {self.saved_states_mb!r}")
        if isinstance(self.evicted_rows_mb, bool) or not isinstance(self.evicted_rows_mb, int) \
                or self.evicted_rows_mb < 0:
            raise ConfigError(f"evicted_rows_mb: must be a size in MiB, 0 or more (0 keeps no evicted rows), "
                              f"got {self.evicted_rows_mb!r}")
        if self.gate_second not in ("auto", "off"):
            raise ConfigError(f"gate_second: expected \"auto\" or \"off\", got {self.gate_second!r}")
        if self.copy_back not in ("auto", "all", "named"):
            raise ConfigError(f"copy_back: expected \"auto\", \"all\" or \"named\", got {self.copy_back!r}")
        if isinstance(self.restore, bool) or not isinstance(self.restore, int) or self.restore < 0:
            raise ConfigError(f"restore: must be 0 (off) or a number of messages, got {self.restore!r}")
        if self.restore_by not in ("meaning", "words"):
            raise ConfigError(f"restore_by: must be \"meaning\" or \"words\", got {self.restore_by!r}")
        if self.reread_budget < 0:
            raise ConfigError(f"reread_budget: must be 0 or more tokens (0 = always re-read the whole history), "
                              f"got {self.reread_budget}")
        if isinstance(self.reread_refeed, bool) or not isinstance(self.reread_refeed, int) or self.reread_refeed < 0:
            raise ConfigError(f"reread_refeed: must be 0 (the whole question) or a number of tokens, "
                              f"got {self.reread_refeed!r}")
        if self.sketch_bits not in (4, 8, 32):
            raise ConfigError(f"sketch_bits: must be 4, 8 or 32, got {self.sketch_bits}")
        if self.gate_stat != "auto" and self.gate_stat not in signals.SIGNALS:
            raise ConfigError(f"gate_stat: must be 'auto' or one of {', '.join(signals.NAMES)} "
                              f"(agent/gate/signals.py), got {self.gate_stat!r}")


@dataclass(frozen=True)
class Budget:
    """A KV budget, parsed once from what the user typed: a share of the history ("10%"), a token count ("1024"), or
    ``auto`` (the budget the model's record certifies for the risk: the cache manager resolves it,
    ``agent.eviction.budget.resolve``, into one of the other two or the full cache). Equal budgets are equal however
    they were written ("10%", " 10.0 %"), which is how calibration records are looked up."""

    share: float | None = None
    tokens: int | None = None
    auto: bool = False

    @classmethod
    def parse(cls, value: str | Budget) -> Budget:
        """The budget ``value`` names; ConfigError otherwise."""
        if isinstance(value, Budget):
            return value
        text = str(value).strip()
        if text.lower() == "auto":
            return cls(auto=True)
        try:
            if text.endswith("%"):
                share = float(text[:-1]) / 100
                if not 0 < share <= 1:
                    raise ValueError
                return cls(share=share)
            tokens = int(text)
            if tokens < 1:
                raise ValueError
            return cls(tokens=tokens)
        except ValueError:
            raise ConfigError(f"budget: expected a token count like 1024, a share like 10% or \"auto\", "
                              f"got {value!r}") from None

    def cells(self, history: int) -> int:
        """Cells this budget allows for a history of ``history`` positions (before the protected minimum); an
        ``auto`` budget has none until it is resolved."""
        if self.auto:
            raise ValueError("an auto budget is resolved for the model before it allows cells")
        if self.tokens is not None:
            return self.tokens
        assert self.share is not None
        return int(round(self.share * max(history, 1)))

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        return str(self.tokens) if self.tokens is not None else f"{(self.share or 0) * 100:g}%"


def parse_risk(value: str | float) -> float:
    """The risk ``value`` names ("10%": 0.1), strictly between 0% and 100%; a one-line ConfigError otherwise."""
    text = str(value).strip()
    try:
        if not text.endswith("%"):
            raise ValueError
        share = float(text[:-1]) / 100
    except ValueError:
        raise ConfigError(f"risk: expected a share like 10%, got {value!r}") from None
    if not math.isfinite(share) or not 0 < share < 1:
        raise ConfigError(f"risk: must lie strictly between 0% and 100%, got {value!r}")
    return share


@dataclass(frozen=True)
class GateThreshold:
    """The gate's setting, parsed once: ``auto`` (the calibrated τ, which follows the conversation), off (``tau``
    None, never fires), or a fixed τ ≥ 0."""

    auto: bool = False
    tau: float | None = None

    @classmethod
    def parse(cls, value: str | float | GateThreshold) -> GateThreshold:
        """The setting ``value`` names ("auto", "off" or a number); ConfigError otherwise."""
        if isinstance(value, GateThreshold):
            return value
        text = str(value).strip().lower()
        if text == "off":
            return cls()
        if text == "auto":
            return cls(auto=True)
        try:
            tau = float(text)
        except ValueError:
            raise ConfigError(f"gate: expected a threshold like 0.3, 'auto' or 'off', got {value!r}") from None
        if not math.isfinite(tau):
            raise ConfigError(f"gate: threshold must be a finite number (or 'off' to disable the gate), "
                              f"got {value!r}")
        if tau < 0:
            raise ConfigError(f"gate: threshold must be 0 or more, got {value!r}")
        return cls(tau=tau)

    @property
    def off(self) -> bool:
        return not self.auto and self.tau is None


def sketch_layers(value: str) -> tuple[int, ...] | None:
    """The sketch's layers from "11,13,15" ("" = none, "auto" = None: the calibrated ones); ConfigError
    otherwise."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        layers = tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"sketch_layers: expected comma-separated layer numbers like 11,13,15, \"auto\" or \"\", "
                          f"got {value!r}") from None
    if any(x < 0 for x in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"sketch_layers: each layer once, 0 or more, got {value!r}")
    return tuple(sorted(layers))


def _coerce(name: str, kind: Any, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{name}: must be a finite number, got {value!r}")
            return float(value)
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    raise ConfigError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__} {value!r}")


def load(path: Path | None = None) -> Config:
    """The config file merged over the defaults (a missing file means defaults)."""
    path = path or paths.config_path()
    config = Config()
    if not path.exists():
        return config
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    hints = get_type_hints(Config)
    known = {f.name for f in fields(Config)}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{key}: unknown setting in {path} (known: {', '.join(sorted(known))})")
        setattr(config, key, _coerce(key, hints[key], value))
    config.validate()
    return config


def save(config: Config, path: Path | None = None) -> Path:
    """Write the settings that differ from the defaults (atomically)."""
    path = path or paths.config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    defaults = Config()
    lines = ["# certchat settings (see README: Configuration)"]
    for f in fields(Config):
        value = getattr(config, f.name)
        if value == getattr(defaults, f.name):
            continue
        lines.append(f"{f.name} = {_toml_value(value)}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def field_docs() -> dict[str, str]:
    """Each field's docstring (parsed from this module's source), for help texts."""
    import ast  # noqa: PLC0415
    import inspect  # noqa: PLC0415

    tree = ast.parse(inspect.getsource(Config))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    return docs
