"""Streaming detokenization: feed generated ids as they come, get back only text that is complete.

Text is never cut inside a UTF-8 character: the bytes of one character may come from several tokens (byte
tokens, byte-fallback or byte-level BPE pieces), and the text of a character is emitted once all its bytes
arrived. The concatenation of everything returned by `add` and `finish` equals
`tokenizer.decode(all_ids, skip_special_tokens)`. (Grapheme clusters built from several characters, e.g. an
emoji ZWJ sequence, may arrive in pieces; their concatenation is still the right text.)

Two strategies, picked from the tokenizer:
- tokenizers with `token_bytes(id, skip_special_tokens)` (the byte tokenizer): an incremental UTF-8 decoder
  over the bytes; O(1) per token. Invalid bytes become U+FFFD as soon as they are known to be invalid; an
  incomplete character at the end is held back, and `finish()` turns it into U+FFFD.
- any other tokenizer (HF): decode a short window of ids and emit the new suffix of its text, holding it back
  while it ends in U+FFFD (an incomplete character). The window starts a few tokens back (or in the prompt,
  when `context_ids` are given), so decoders that strip a leading space at the start of a text
  (SentencePiece-style) still give the right spaces between chunks.
"""
from __future__ import annotations

import codecs

from nfjax.tokenizer.base import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context_ids=()):
        """`context_ids`: ids that precede the stream (e.g. the prompt's last tokens); they are not emitted."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._text_parts: list[str] = []
        self._finished = False
        self._token_bytes = getattr(tokenizer, "token_bytes", None)
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            ctx = [int(i) for i in context_ids][-_CONTEXT_TOKENS:]
            self._ids: list[int] = ctx
            self._prefix = 0          # start of the decode window
            self._read = len(ctx)     # ids before this have been emitted (or are context)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def add(self, token_ids) -> str:
        """Feed new ids (an int or an iterable of ints); returns the newly completed text (maybe "")."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add after finish()")
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if not ids:
            return ""
        if self._token_bytes is not None:
            data = b"".join(self._token_bytes(i, self.skip_special_tokens) for i in ids)
            return self._emit(self._utf8.decode(data, final=False))
        self._ids.extend(ids)
        return self._emit(self._window_delta(final=False))

    def finish(self) -> str:
        """End of stream: returns what was held back (an incomplete character decodes to U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self._token_bytes is not None:
            return self._emit(self._utf8.decode(b"", final=True))
        return self._emit(self._window_delta(final=True))

    # ---- internals ------------------------------------------------------------------------------------------
    def _emit(self, s: str) -> str:
        if s:
            self._text_parts.append(s)
        return s

    def _window_delta(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        dec = self.tokenizer.decode
        done = dec(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        full = dec(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        if not final and (full.endswith(_REPLACEMENT) or len(full) <= len(done)):
            return ""                 # an incomplete character (or nothing new yet): wait for more ids
        delta = full[len(done):]       # decoders here only ever extend the text of a window
        self._prefix, self._read = self._read, len(self._ids)
        return delta
