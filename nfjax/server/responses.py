"""Response bodies, shaped as OpenAI's: completions and chat completions, whole and streamed, with logprobs.

Logprobs: completions `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}` (the
top dict holds the k most likely tokens and the sampled one); chat `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}`. A token's string is its text; a token whose bytes are not
valid UTF-8 on their own (a piece of a character) is written `bytes:\\xe2\\x80` as OpenAI does; a model without a
tokenizer writes `token_id:N`. `bytes` are the token's raw bytes where the tokenizer exposes them (the byte
tokenizer), else the UTF-8 bytes of its text. JSON has no -inf: logprobs below -9999 are sent as -9999.0.
`text_offset` is each token's character offset in the choice's text (the echoed prompt included).
"""
from __future__ import annotations

from nfjax.server.protocol import GenerateRequest, Sub
from nfjax.tokenizer import IncrementalDetokenizer
from nfjax.tokenizer.silent import SilentTokenizer

LOGPROB_FLOOR = -9999.0


def _lp(v: float) -> float:
    v = float(v)
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _byte_level_map() -> dict[str, int]:
    """GPT-2 byte-level BPE's alphabet: the character standing for each byte (printable bytes stand for
    themselves, the others for 256 + their rank)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(extra)}}


_BYTE_LEVEL = _byte_level_map()


class TokenTexts:
    """Token id -> (string, bytes) for logprobs, cached.

    Raw bytes come from the byte tokenizer's `token_bytes`, from a byte-level BPE piece (GPT-2's alphabet: Llama-3,
    Qwen2, SmolLM2) or a byte-fallback piece (`<0xE2>`); otherwise they are the UTF-8 bytes of the token's text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._raw = getattr(tokenizer, "token_bytes", None)
        self._silent = isinstance(tokenizer, SilentTokenizer)
        backend = getattr(tokenizer, "backend", None)
        self._backend = backend
        self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._added = frozenset(backend.get_added_tokens_decoder()) if backend is not None else frozenset()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, tid: int) -> tuple[str, bytes]:
        hit = self._cache.get(tid)
        if hit is None:
            hit = self._cache[tid] = self._make(int(tid))
        return hit

    def _piece_bytes(self, tid: int) -> bytes | None:
        piece = self._backend.id_to_token(tid)
        if piece is None or tid in self._added:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None

    def _make(self, tid: int) -> tuple[str, bytes]:
        if self._silent:
            return f"token_id:{tid}", b""
        try:
            b = (self._raw(tid, skip_special_tokens=False) if self._raw is not None else
                 self._piece_bytes(tid) if self._backend is not None else None)
            if b is None:
                s = self.tok.decode([tid], skip_special_tokens=False)
                return s, s.encode("utf-8", errors="surrogatepass")
        except (ValueError, IndexError, OverflowError):
            return f"token_id:{tid}", b""
        try:
            return b.decode("utf-8"), b
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b), b


class Offsets:
    """Running character offsets of a choice's tokens in its text (for completions' `text_offset`)."""

    def __init__(self, tokenizer, prompt_ids, start: int, skip_special_tokens: bool):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                                             context_ids=prompt_ids)
        self._pos = start

    def add(self, ids) -> list[int]:
        out = []
        for t in ids:
            out.append(self._pos)
            self._pos += len(self._detok.add(int(t)))
        return out


def completion_logprobs(tt: TokenTexts, lps, offsets: list[int]) -> dict:
    tokens, values, tops = [], [], []
    for lp in lps:
        s = tt.get(lp.token_id)[0]
        tokens.append(s)
        values.append(_lp(lp.logprob))
        top = {tt.get(t)[0]: _lp(v) for t, v in lp.top}
        top.setdefault(s, _lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(tt: TokenTexts, tid: int, logprob: float) -> dict:
    s, b = tt.get(tid)
    return {"token": s, "logprob": _lp(logprob), "bytes": list(b)}


def chat_logprobs(tt: TokenTexts, lps, k: int) -> dict:
    return {"content": [dict(_chat_entry(tt, lp.token_id, lp.logprob),
                             top_logprobs=[_chat_entry(tt, t, v) for t, v in lp.top[:k]]) for lp in lps]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(req: GenerateRequest, model: str, obj: str, choices: list) -> dict:
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model,
            "system_fingerprint": None, "choices": choices}


def cumulative_logprob(o) -> float:
    c = getattr(o, "cumulative_logprob", None)
    if c is None:
        c = sum(lp.logprob for lp in (getattr(o, "logprobs", None) or ()))
    return float(c)


def returned_choices(req: GenerateRequest, finals: dict) -> list[tuple[int, Sub, object]]:
    """(choice index, sub, final output) of each returned choice: per prompt, the first n candidates, or with
    best_of > n the n with the highest cumulative logprob (best first)."""
    out = []
    for i in range(len(req.prompts)):
        cands = [(s, finals[s.request_id]) for s in req.subs if s.prompt_index == i]
        if req.best_of > req.n:
            cands = sorted(cands, key=lambda so: -cumulative_logprob(so[1]))
        out += [(i * req.n + j, s, o) for j, (s, o) in enumerate(cands[:req.n])]
    return out


def full_response(req: GenerateRequest, model: str, finals: dict, tokenizer) -> dict:
    """The non-streaming body. `finals`: engine request id -> its final RequestOutput. Usage counts every
    generated token, best_of candidates that were not returned included."""
    tt = TokenTexts(tokenizer) if req.logprobs is not None else None
    choices = []
    for index, sub, o in returned_choices(req, finals):
        lps = None
        if req.kind == "completion":
            echo = req.echo_texts[sub.prompt_index] if req.echo_texts is not None else ""
            if tt is not None:
                offs = Offsets(tokenizer, sub.prompt_ids, len(echo), sub.params.skip_special_tokens)
                lps = completion_logprobs(tt, o.logprobs or [], offs.add(o.token_ids[:len(o.logprobs or [])]))
            choices.append({"index": index, "text": echo + o.text, "logprobs": lps, "finish_reason": o.finish_reason})
        else:
            if tt is not None:
                lps = chat_logprobs(tt, o.logprobs or [], req.logprobs)
            choices.append({"index": index, "message": {"role": "assistant", "content": o.text}, "logprobs": lps,
                            "finish_reason": o.finish_reason})
    body = _envelope(req, model, "text_completion" if req.kind == "completion" else "chat.completion", choices)
    body["usage"] = usage(req.prompt_tokens, sum(len(o.token_ids) for o in finals.values()))
    return body


def chunk(req: GenerateRequest, model: str, index: int, text: str | None, finish_reason: str | None = None,
          role: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed chunk for choice `index`. Chat: `role` sends the opening `{"role": "assistant"}` delta;
    text=None sends `{}`."""
    if req.kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(req, model, "text_completion", [choice])
    delta: dict = {"role": "assistant", "content": ""} if role else {}
    if text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(req, model, "chat.completion.chunk", [choice])


def usage_chunk(req: GenerateRequest, model: str, completion_tokens: int) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    body = _envelope(req, model, obj, [])
    body["usage"] = usage(req.prompt_tokens, completion_tokens)
    return body
