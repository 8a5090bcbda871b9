"""certchat's conversation log: one SQLite file, the ground truth of every conversation.

A leaf package: it takes a database path and knows nothing of the agent, the
UI or llama.cpp. ``Store`` is the API; ``export`` writes and reads the replay
JSONL format and Markdown.
"""

from memory_store.errors import (
    ConversationBusyError,
    CorruptDatabaseError,
    DatabaseMissingError,
    DiskFullError,
    ForeignDatabaseError,
    ImportFormatError,
    NotFoundError,
    ReadOnlyError,
    SchemaTooNewError,
    StoreError,
    StreamLostError,
)
from memory_store.records import Conversation, EvictionRound, History, Message, SearchHit, Turn
from memory_store.store import Store
from memory_store.stream import AssistantStream

__all__ = [
    "AssistantStream",
    "ConversationBusyError",
    "DiskFullError",
    "ReadOnlyError",
    "Conversation",
    "CorruptDatabaseError",
    "DatabaseMissingError",
    "EvictionRound",
    "ForeignDatabaseError",
    "History",
    "ImportFormatError",
    "Message",
    "NotFoundError",
    "SchemaTooNewError",
    "SearchHit",
    "Store",
    "StoreError",
    "StreamLostError",
    "Turn",
]
