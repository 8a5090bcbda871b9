"""A GGUF's Jinja chat template rendered by llama-cpp-python's formatter, bound to certchat's library.

``llama_cpp.llama_chat_format`` imports ``llama_cpp``, which loads a libllama on import: it must be the patched
one, so the formatter is reached only through here, after :func:`native.llama.lib` has bound it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from native import llama


class ChatFormatter:
    """Renders messages through one chat template, with or without the assistant prompt at the end."""

    def __init__(self, source: str, bos_token: str, eos_token: str, add_generation_prompt: bool) -> None:
        llama.lib()
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: PLC0415 — after the library is bound

        self._formatter: Any = Jinja2ChatFormatter(source, eos_token, bos_token,
                                                   add_generation_prompt=add_generation_prompt)

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages``; whatever the template raises (Jinja errors, its own
        ``raise_exception``) passes through."""
        return str(self._formatter(messages=list(messages)).prompt)


__all__ = ["ChatFormatter"]
