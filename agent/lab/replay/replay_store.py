"""The replay's conversation log: a ``Store`` with two interim fixes for independent probes.

Both are session/cache-manager bugs reported to the lead; remove each shim when its fix
lands (the tests in tests/test_replay_runner.py pin the behaviour either way):

1. After an independent turn the cache manager restores its round counter, so the next
   eviction records the same (conversation, round) again and the UNIQUE constraint on
   ``eviction_rounds`` fails. Here a repeated round replaces nothing and is skipped (the
   discarded turn's round stays in the log; replays never read rounds back).
2. A gate that fires on an independent turn re-prefills "the history" from the log, which
   leaves out discarded messages — including the question being answered. Here the
   in-flight independent question (the last user message, with nothing but discarded
   messages after it) is shown to the session as part of the history, so the gated answer
   sees its question. The turn is still discarded afterwards (its meta is not changed).
"""

from __future__ import annotations

import dataclasses

from memory_store.errors import StoreError
from memory_store.records import EvictionRound, History
from memory_store.store import Store


class ReplayStore(Store):
    """A ``Store`` for replays (see the module docstring)."""

    def record_eviction_round(self, round_: EvictionRound) -> EvictionRound:
        try:
            return super().record_eviction_round(round_)
        except StoreError as err:
            if "UNIQUE" not in str(err):
                raise
            return round_

    def history(self, conversation_id: int, **kwargs: object) -> History:
        h = super().history(conversation_id, **kwargs)  # type: ignore[arg-type]
        messages = list(h.messages)
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if users:
            last = users[-1]
            tail_discarded = all(m.meta.get("discarded") for m in messages[last:])
            if tail_discarded and not messages[last].meta.get("replaced"):
                meta = {k: v for k, v in messages[last].meta.items() if k != "discarded"}
                messages[last] = dataclasses.replace(messages[last], meta=meta)
        return History(h.conversation_id, messages)
