"""Per-request output text: incremental detokenization plus stop-string handling."""
from __future__ import annotations

from nfjax.engine.sampling_params import SamplingParams
from nfjax.tokenizer import IncrementalDetokenizer


class OutputText:
    """Accumulates decoded text; releases it minus a tail that could still become a stop string.

    A token costs O(1) in the length of the output (the engine adds one per request per step): released text is
    kept in pieces, joined only when read (`released_text`, `text`); the unreleased rest is the stop strings'
    longest less one plus what came since the last release, and a stop string is sought only where a new match
    can end. A stop string never cuts released text, so released text never changes.
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids=()):
        # the prompt's tail is decode context, so the first token's leading space comes out right
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            context_ids=prompt_ids)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._parts: list[str] = []      # released text, in the pieces released
        self._pending = ""               # text not released yet
        self.released = 0                # characters released
        self.stopped = False

    @property
    def released_text(self) -> str:
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]      # joined once per read, not per token
        return parts[0] if parts else ""

    @property
    def text(self) -> str:
        """All text so far (stop strings removed), released or not."""
        return self.released_text + self._pending

    def add(self, token_ids, check_stops: bool = True) -> None:
        """`token_ids`: an id or a list of them. `check_stops=False` (under SamplingParams.min_tokens): no stop
        string ends the text here, and a later match must end in text added after (as vLLM: a stop string is
        sought in the newly added text)."""
        if self.stopped:
            return
        new = self.detok.add(token_ids)
        if not new:
            return
        pend = self._pending + new
        if check_stops and self.stops:
            before = len(pend) - len(new)
            for s in self.stops:
                # only where a new match can end: in the text just added (it starts at or after `released`:
                # released text ends at least `hold` characters before any text added later)
                i = pend.find(s, max(0, before - len(s) + 1))
                if i >= 0:
                    pend, self.stopped = pend[:i], True
        self._pending = pend

    def release(self, final: bool) -> str:
        """The text that can be handed out now (all of it when `final` or stopped), and marks it released."""
        if final and not self.stopped:
            self._pending += self.detok.finish()
        pend = self._pending
        cut = len(pend) if (final or self.stopped) else len(pend) - self.hold
        if cut <= 0:
            return ""
        out, self._pending = pend[:cut], pend[cut:]
        self._parts.append(out)
        self.released += cut
        return out
