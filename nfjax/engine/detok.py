"""Per-request output text: incremental detokenization plus stop-string handling."""
from __future__ import annotations

from nfjax.engine.sampling_params import SamplingParams
from nfjax.tokenizer import IncrementalDetokenizer


class OutputText:
    """Accumulates decoded text; releases it minus a tail that could still become a stop string."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids=()):
        # the prompt's tail is decode context, so the first token's leading space comes out right
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            context_ids=prompt_ids)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.released = 0
        self.stopped = False

    def add(self, token_ids: list[int], check_stops: bool = True) -> None:
        """`check_stops=False` (under SamplingParams.min_tokens): no stop string ends the text here, and a later
        match must end in text added after (as vLLM: a stop string is sought in the newly added text)."""
        if self.stopped:
            return
        before = len(self.text)
        self.text += self.detok.add(token_ids)
        if not check_stops:
            return
        for s in self.stops:
            # search only where a new match can end: in the text just added
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                self.text, self.stopped = self.text[:i], True

    def release(self, final: bool) -> str:
        if final and not self.stopped:
            self.text += self.detok.finish()
        end = len(self.text) if (final or self.stopped) else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released:end]
        self.released = end
        return out
