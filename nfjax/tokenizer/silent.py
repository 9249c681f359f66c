"""A tokenizer for token-id workloads (benchmarks on random-weight models): no text in, no text out."""
from __future__ import annotations

from nfjax.errors import UserError
from nfjax.tokenizer.base import Tokenizer


class SilentTokenizer(Tokenizer):
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 reason: str = "this model has no tokenizer"):
        self._vocab = vocab_size
        self._eos = tuple(eos_token_ids)
        self._reason = reason

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise UserError(f"{self._reason}: pass prompts as token ids")

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        return b""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    @property
    def bos_token_id(self):
        return None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab
