"""A prompt (text, or token ids) as the checked token ids a request starts from: one rule for every engine."""
from __future__ import annotations

from typing import Sequence

from nfjax.errors import UserError

Prompt = str | Sequence[int]


def encode_prompt(tokenizer, prompt: Prompt, vocab_size: int, max_model_len: int) -> list[int]:
    """Text through the tokenizer, or ids as given; a UserError for an id out of the vocabulary, an empty prompt, or
    one that leaves the context no room for a generated token."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is out of range [0, {vocab_size})")
    if not ids:
        raise UserError("prompt is empty")
    if len(ids) >= max_model_len:
        raise UserError(f"prompt has {len(ids)} tokens; the context holds {max_model_len} "
                        "(prompt + at least one generated token)")
    return ids
