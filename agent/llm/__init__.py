"""The language model under the chat: the engine that owns the patched llama.cpp context, its KV cache and the
cache's mirror, and the chat template that turns messages into tokens."""
