"""The tokenizer interface the engine and server use; both implementations (HF, bytes) follow it."""
from __future__ import annotations

import abc
from typing import Any

from nfjax.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat_template


class Tokenizer(abc.ABC):
    """Text <-> token ids, special token ids, and chat prompt rendering.

    `chat_template` is the checkpoint's jinja2 template (None: `DEFAULT_CHAT_TEMPLATE` is used).
    """

    chat_template: str | None = None

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer adds by itself (e.g. BOS)."""

    @abc.abstractmethod
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 decodes to U+FFFD replacement characters."""

    @property
    @abc.abstractmethod
    def bos_token_id(self) -> int | None:
        ...

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (first: the tokenizer's own eos token, when it has one)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (special tokens included); a model's vocab may be larger."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """Special token strings by role (`bos_token`, `eos_token`, ...), passed to chat templates."""
        return {}

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset()

    # ---- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) to the prompt string.

        The string already holds whatever special tokens the template writes (often BOS), so encode it with
        `add_special_tokens=False` (or use `encode_chat`), as transformers does.
        Extra keyword arguments (e.g. `tools`) are passed to the template.
        """
        template = self.chat_template if self.chat_template is not None else DEFAULT_CHAT_TEMPLATE
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt (no special tokens added beyond the template's own)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)
