"""Render a model's own chat template and cut it into per-message token segments.

The engine prefills only what is new each turn. The rule: the text in the KV cache is
always exactly ``render(history, add_generation_prompt=False)``; a new user message
contributes ``render(history + [user], add_generation_prompt=True)`` minus that, and an
answer contributes its generated text plus whatever the template closes the assistant
turn with (e.g. ``<|im_end|>\\n``), which is fed without being sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from native import llama
from native.chat_format import ChatFormatter

Message = dict[str, str]


class TemplateError(ValueError):
    """The model has no usable chat template, or it does not render incrementally."""


@dataclass
class ChatTemplate:
    """A GGUF's Jinja chat template bound to its special tokens."""

    source: str
    bos_token: str
    eos_token: str

    def __post_init__(self) -> None:
        self._open = ChatFormatter(self.source, self.bos_token, self.eos_token, add_generation_prompt=True)
        self._closed = ChatFormatter(self.source, self.bos_token, self.eos_token, add_generation_prompt=False)

    @classmethod
    def for_model(cls, model: llama.Model) -> "ChatTemplate":
        source = model.chat_template()
        if not source:
            raise TemplateError(
                f"{model.path.name} has no chat template in its GGUF metadata; use an instruct/chat model"
            )
        bos = model.token_to_piece(model.bos(), special=True).decode("utf-8", errors="replace")
        eos = model.token_to_piece(model.eos(), special=True).decode("utf-8", errors="replace")
        return cls(source=source, bos_token=bos, eos_token=eos)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        formatter = self._open if add_generation_prompt else self._closed
        try:
            return formatter.render(messages)
        except Exception as err:  # jinja raises many kinds; the template's own raise_exception too
            raise TemplateError(f"the chat template failed to render: {err}") from err

    def user_suffix(self, history: Sequence[Message], user: Message) -> str:
        """Text that a new user (or system) message adds, ending with the assistant prompt."""
        before = self.render(history, add_generation_prompt=False) if history else ""
        after = self.render([*history, user], add_generation_prompt=True)
        return _suffix(before, after)

    def assistant_closing(self, history: Sequence[Message], answer: str) -> str:
        """Text the template puts after an assistant answer (fed after generation)."""
        prompt = self.render(history, add_generation_prompt=True)
        closed = self.render([*history, {"role": "assistant", "content": answer}], add_generation_prompt=False)
        head = prompt + answer
        if not closed.startswith(head):
            # Templates that strip or rewrite the answer (e.g. trimming whitespace) still
            # close it the same way; find the answer's end by its last occurrence.
            idx = closed.rfind(answer.strip()) if answer.strip() else len(prompt)
            if idx < 0:
                raise TemplateError("the chat template rewrites assistant messages; cannot prefill incrementally")
            return closed[idx + len(answer.strip()):]
        return closed[len(head):]


def _suffix(before: str, after: str) -> str:
    if after.startswith(before):
        return after[len(before):]
    raise TemplateError("the chat template re-renders earlier messages differently; cannot prefill incrementally")


def strip_bos(text: str, bos_token: str) -> str:
    """Drop a leading BOS the template wrote, when the tokenizer adds it anyway."""
    return text[len(bos_token):] if bos_token and text.startswith(bos_token) else text


__all__ = ["ChatTemplate", "TemplateError", "Message", "strip_bos"]
