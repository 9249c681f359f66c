"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is BOS, 257 is EOS (vocab 258)."""
from __future__ import annotations

from nfjax.tokenizer.base import Tokenizer

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"


class ByteTokenizer(Tokenizer):
    """Text is its UTF-8 bytes. `encode` never turns text into special ids (a literal "<|eos|>" in the text
    stays bytes); `decode` renders specials as `<|bos|>`/`<|eos|>` unless skipped, and decodes invalid UTF-8
    to U+FFFD (the incremental detokenizer holds an incomplete trailing character back until it completes or
    the stream finishes).
    """

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_special_tokens else ids

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one id stands for (b"" for a skipped special token)."""
        if 0 <= token_id < NUM_BYTES:
            return bytes((token_id,))
        if token_id == BOS_ID:
            return b"" if skip_special_tokens else BOS_TOKEN.encode()
        if token_id == EOS_ID:
            return b"" if skip_special_tokens else EOS_TOKEN.encode()
        raise ValueError(f"token id {token_id} is outside the byte tokenizer's vocabulary (0..{EOS_ID})")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = b"".join(self.token_bytes(int(i), skip_special_tokens) for i in ids)
        return data.decode("utf-8", errors="replace")

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS_ID,)

    @property
    def vocab_size(self) -> int:
        return EOS_ID + 1

    @property
    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset((BOS_ID, EOS_ID))
