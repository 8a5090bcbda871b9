"""A session's state between turns, as a saved state: packing it, unpacking it, and checking it against the log.

After every turn the session hands its parts' own snapshots here (the engine's ``EngineSnapshot``, the cache
manager's round and readings, the gate's ``GateState``) and gets back a ``SavedState`` for
``agent.chat.saved_state``; on reopening, the reverse, after :func:`check_against_log` has confirmed that every
live cell holds the token the log says its message has at that offset, and that the log has nothing the state
has not seen. What must match for a state to serve at all is :func:`cache_key`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from agent.chat.saved_state import SavedState, SavedStates, StateError, key_differences
from agent.gate.decision import GateState
from agent.llm.engine import EngineSnapshot, holds_logged_tokens
from native import patched
from native.sketch import EvictedKeySketch, SketchRows

if TYPE_CHECKING:
    from agent.config import Config
    from agent.llm.engine import Engine

KV_TYPE = "f16"
"""The K/V cell type: certchat's contexts keep llama.cpp's default (``native.llama.ContextParams`` sets none)."""


def cache_key(config: "Config", engine: "Engine", model_sha256: str, patch_level: str,
              statistic: str, budget: str | None = None) -> dict[str, Any]:
    """Everything that shapes the saved cache and what describes it: another value of any of these makes a state
    unusable (the chat re-reads the log instead). ``budget``: the budget in force (``auto`` resolved for the model:
    a new certification can change it); None: the configured one."""
    layers, bits, window = engine.sketch_spec
    return {"model": model_sha256, "patch": patch_level, "policy": config.policy,
            "budget": budget if budget is not None else config.budget,
            "evict_at": config.evict_at, "sketch": f"{','.join(map(str, layers)) or 'none'}/{bits}b/{window}",
            "n_ctx": engine.n_ctx, "n_batch": engine.settings.n_batch, "kv_type": KV_TYPE, "gate_stat": statistic}


@dataclass(frozen=True)
class SessionState:
    """What a session needs to go on from the end of a turn."""

    conversation_id: int
    last_message_id: int
    """The newest logged message the cache has seen (a later one in the log: the state is stale)."""
    segments: list[int]
    """The indices of the messages the cache holds or held, in order (the session's template view)."""
    engine: EngineSnapshot
    memory: tuple[int, list[patched.Importance], int]
    """The cache manager's (round, attention readings, history length)."""
    gate: GateState


def tokens_digest(positions: Sequence[int], tokens: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(positions, dtype=np.int64).tobytes())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


def pack(state: SessionState, key: dict[str, Any]) -> SavedState:
    snap = state.engine
    arrays: dict[str, np.ndarray] = {
        "seq_state": np.frombuffer(snap.state, dtype=np.uint8),
        "positions": np.asarray(snap.positions, dtype=np.int64),
        "tokens": np.asarray(snap.tokens, dtype=np.int64),
        "segments": np.asarray(snap.segments, dtype=np.int64),
        "logpi": np.asarray(snap.logpi, dtype=np.float64),
        "reinserted": np.asarray(snap.reinserted, dtype=np.int64),
        "transient": np.asarray(snap.transient, dtype=np.int64),
        "spans": np.asarray([[m, a, b] for m, (a, b) in sorted(snap.spans.items())], dtype=np.int64).reshape(-1, 3),
    }
    sketch_meta = None
    if snap.sketch is not None:
        sk = snap.sketch
        arrays.update(_rows("sketch", sk.rows()))
        if sk.channel_scale is not None:
            arrays["sketch_channel"] = np.asarray(sk.channel_scale, dtype=np.float32)
        sketch_meta = {"layers": list(sk.layers), "n_kv_head": sk.n_kv_head, "head_dim": sk.head_dim,
                       "bits": sk.bits, "channel_norm": sk.channel_norm}
    if snap.held is not None:
        arrays.update(_rows("held", snap.held))
    round_, readings, history = state.memory
    live = np.asarray(snap.positions, dtype=np.int64)
    for i, reading in enumerate(readings):
        # only the live cells' mass is ever read again (the next round's scores), summed over layers as scoring does
        arrays[f"importance_{i}"] = reading.per_position(live)
    g = state.gate
    lengths = [(m, len(share)) for m, shares in sorted(g.paid.items()) for share in shares]
    arrays["gate_recent"] = np.asarray(g.recent, dtype=np.float64)
    arrays["gate_paid_index"] = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
    arrays["gate_paid"] = (np.concatenate([np.asarray(s, dtype=np.float64).ravel()
                                           for _, shares in sorted(g.paid.items()) for s in shares])
                           if lengths else np.empty(0, np.float64))
    meta = {"conversation_id": state.conversation_id, "last_message_id": state.last_message_id,
            "segments": list(state.segments), "next_pos": snap.next_pos, "rounds": snap.rounds,
            "frame_offset": snap.frame_offset, "homeless": sorted(snap.homeless),
            "memory": {"round": round_, "readings": len(readings), "history": history},
            "gate": {"statistic": g.statistic, "paid_layers": None if g.paid_layers is None else list(g.paid_layers)},
            "sketch": sketch_meta, "held": snap.held is not None,
            "tokens_sha256": tokens_digest(snap.positions, snap.tokens)}
    return SavedState(key, meta, arrays)


def _rows(prefix: str, rows: SketchRows) -> dict[str, np.ndarray]:
    return {f"{prefix}_codes": rows.codes, f"{prefix}_scales": rows.scales, f"{prefix}_positions": rows.positions,
            f"{prefix}_messages": rows.messages, f"{prefix}_lags": rows.lag_array}


def _sketch_rows(prefix: str, a: dict[str, np.ndarray]) -> SketchRows:
    lags = a.get(f"{prefix}_lags")
    return SketchRows(a[f"{prefix}_codes"], a[f"{prefix}_scales"], a[f"{prefix}_positions"].astype(np.int32),
                      a[f"{prefix}_messages"].astype(np.int32), None if lags is None else lags.astype(np.int32))


def unpack(saved: SavedState, threads: int) -> SessionState:
    """The session state a saved state holds (``StateError`` if its parts do not fit together)."""
    m, a = saved.meta, saved.arrays
    try:
        positions = a["positions"].tolist()
        tokens = a["tokens"].tolist()
        if tokens_digest(positions, tokens) != m["tokens_sha256"]:
            raise StateError("its token ids do not match its own record")
        sketch = None
        if m.get("sketch"):
            s = m["sketch"]
            sketch = EvictedKeySketch.from_rows(s["layers"], int(s["n_kv_head"]), int(s["head_dim"]), int(s["bits"]),
                                                bool(s["channel_norm"]), a.get("sketch_channel"),
                                                _sketch_rows("sketch", a), threads=threads)
        spans = {int(r[0]): (int(r[1]), int(r[2])) for r in a["spans"]}
        snap = EngineSnapshot(a["seq_state"].tobytes(), positions, tokens, a["segments"].tolist(),
                              a["logpi"].tolist(), int(m["next_pos"]), sketch, spans,
                              _sketch_rows("held", a) if m.get("held") else None, a["reinserted"].astype(np.int64),
                              int(m["rounds"]), int(m.get("frame_offset", 0)),
                              frozenset(int(x) for x in m.get("homeless", [])),
                              a["transient"].astype(np.int64) if "transient" in a else np.empty(0, np.int64))
        live = np.asarray(positions, dtype=np.int32)
        readings = [patched.Importance(mass=a[f"importance_{i}"][None, :], cell_pos=live[None, :])
                    for i in range(int(m["memory"]["readings"]))]
        paid: dict[int, list[np.ndarray]] = {}
        values, at = a["gate_paid"], 0
        for message, n in a["gate_paid_index"].tolist():
            paid.setdefault(int(message), []).append(values[at:at + n].copy())
            at += n
        layers = m["gate"]["paid_layers"]
        gate = GateState(str(m["gate"]["statistic"]), a["gate_recent"].tolist(), paid,
                         None if layers is None else tuple(int(x) for x in layers))
        memory = (int(m["memory"]["round"]), readings, int(m["memory"]["history"]))
        return SessionState(int(m["conversation_id"]), int(m["last_message_id"]), [int(x) for x in m["segments"]],
                            snap, memory, gate)
    except StateError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise StateError(f"its contents are inconsistent ({type(err).__name__}: {err})") from None


def check_against_log(state: SessionState, messages: Sequence[Any]) -> str | None:
    """Why ``state`` does not describe the log's conversation (None: it does). ``messages``: the messages a re-read
    would give the model (``Store.rereadable``), oldest first. Every live cell must hold the token the log has at
    its offset in its message (measured from where the engine fed the message, its span), every message the state
    holds must still be one a re-read gives, and the log must have nothing newer than the state's last message."""
    if not messages:
        return "the log has no messages for it"
    newest = messages[-1]
    if newest.id != state.last_message_id:
        if newest.id > state.last_message_id:
            return f"the log moved on without it (message {newest.id} is newer than the state)"
        return f"the log no longer has the message it was saved after ({state.last_message_id})"
    by_index = {m.index: m for m in messages}
    missing = [i for i in state.segments if i not in by_index]
    if missing:
        return f"message {missing[0]} of the state is no longer one the log re-reads"
    snap = state.engine
    segs = np.asarray(snap.segments, dtype=np.int64)
    pos = np.asarray(snap.positions, dtype=np.int64)
    toks = np.asarray(snap.tokens, dtype=np.int64)
    for index in np.unique(segs).tolist():
        msg = by_index.get(int(index))
        span = snap.spans.get(int(index))
        if msg is not None and msg.tokens is not None and span is None and int(index) in snap.homeless:
            # packed behind the sinks by a frame shift: its offsets are gone, its tokens keep the log's order
            if not _in_order(toks[segs == index].tolist(), [int(t) for t in msg.tokens]):
                return f"the cache's tokens of message {index} differ from the log's"
            continue
        if msg is None or span is None or msg.tokens is None:
            return f"the cache holds message {index}, which the log has no tokens for"
        if not holds_logged_tokens(pos, toks, segs, index, span[0], msg.tokens):
            return f"the cache's tokens of message {index} differ from the log's"
    return None


def _in_order(kept: list[int], logged: list[int]) -> bool:
    """Whether ``kept`` is ``logged`` with some tokens left out (a subsequence)."""
    it = iter(logged)
    return all(any(t == u for u in it) for t in kept)


class Saver:
    """Where a session's states go and what identifies its model and library: the session saves through it after
    every turn and loads through it when a conversation is reopened."""

    def __init__(self, states: SavedStates, model_sha256: str, patch_level: str) -> None:
        self.states = states
        self.model_sha256 = model_sha256
        self.patch_level = patch_level

    def key(self, config: "Config", engine: "Engine", statistic: str, budget: str | None = None) -> dict[str, Any]:
        return cache_key(config, engine, self.model_sha256, self.patch_level, statistic, budget)

    def save(self, state: SessionState, key: dict[str, Any]) -> int:
        return self.states.save(state.conversation_id, pack(state, key))

    def load(self, conversation_id: int, key: dict[str, Any], threads: int) -> SessionState:
        """The conversation's saved state, if its key is ``key`` (``StateError`` with the reason otherwise)."""
        saved = self.states.load(conversation_id)
        if saved.key != key:
            raise StateError("it was saved with another " + "; ".join(key_differences(saved.key, key)))
        state = unpack(saved, threads)
        if state.conversation_id != conversation_id:
            raise StateError(f"it belongs to conversation {state.conversation_id}")
        return state
