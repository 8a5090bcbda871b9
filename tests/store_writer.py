"""A writer process for the conversation-log tests (spawned, never imported by pytest).

Modes:
  crash DB    — append a user message, then stream an assistant answer forever
                (one chunk every 20 ms) until killed; prints one JSON line with
                the ids once the stream has started.
  stress DB SECONDS OUT — for SECONDS, create conversations, append user
                messages and stream answers (flushes every 0.5 s, answers of
                ~1–2 s), set tokens, record turns and eviction rounds; then write
                what it wrote, exactly, to OUT as JSON.
Chunk i of an answer is ``f"c{i} "`` with token id ``i``, so a reader can check
that committed content and tokens belong to the same moment.
"""

from __future__ import annotations

import json
import sys
import time

from memory_store import EvictionRound, Store, Turn


def chunk(i: int) -> str:
    return f"c{i} "


def crash(db: str) -> None:
    store = Store(db)
    conversation = store.create_conversation("crash test")
    user = store.append_user_message(conversation.id, "Tell me a long story.", tokens=[7, 8, 9], first_pos=0)
    stream = store.stream_assistant(conversation.id, first_pos=3)
    print(json.dumps({"conversation": conversation.id, "user": user.id, "assistant": stream.message_id}), flush=True)
    i = 0
    while True:
        stream.append(chunk(i), [i])
        i += 1
        time.sleep(0.02)


def stress(db: str, seconds: float, out: str) -> None:
    store = Store(db)
    written: list[dict] = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        conversation = store.create_conversation(f"stress {n} Purrnickel")
        messages: list[dict] = []
        pos = 0
        for turn in range(3):
            text = f"user {n}.{turn} asks about Tromsø and the number 8311 \x00\x1b[0m"
            user = store.append_user_message(conversation.id, text)
            store.set_message_tokens(user.id, list(range(turn, turn + 5)), pos)
            messages.append({"role": "user", "content": text, "tokens": list(range(turn, turn + 5)), "first_pos": pos})
            pos += 5
            store.record_eviction_round(
                EvictionRound(conversation.id, round=turn, message_id=user.id, cells_before=pos, cells_after=pos // 2, sum_pi=pos / 2)
            )
            n_chunks = 40 + 20 * (n % 3)
            with store.stream_assistant(conversation.id, first_pos=pos) as stream:
                for i in range(n_chunks):
                    stream.append(chunk(i), [i])
                    time.sleep(0.025)
            answer = "".join(chunk(i) for i in range(n_chunks))
            messages.append({"role": "assistant", "content": answer, "tokens": list(range(n_chunks)), "first_pos": pos})
            pos += n_chunks
            store.record_turn(Turn(conversation.id, message_id=stream.message_id, policy="poisson", decode_tokens=n_chunks))
            if time.monotonic() >= deadline:
                break
        written.append({"id": conversation.id, "messages": messages})
        n += 1
    store.close()
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(written, handle)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "crash":
        crash(sys.argv[2])
    elif mode == "stress":
        stress(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
