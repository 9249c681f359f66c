"""OpenAI request validation and response bodies (completions and chat completions).

Every rejected field raises `APIError(400, message, param)`; the app turns it into OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. Supported request fields:

- both: `model` (must be the served name; may be omitted), `max_tokens`, `temperature` [0, 2], `top_p` (0, 1],
  `top_k` (extension; 0 or -1 = off), `stop` (string or up to 4 strings), `seed` (>= 0), `n` (1 only),
  `stream`, `stream_options.include_usage`, `ignore_eos` (extension), `user` (ignored).
  `presence_penalty`/`frequency_penalty` (0 only), `logit_bias` (empty only), `logprobs` (off only) are
  accepted at their neutral values and rejected otherwise.
- completions: `prompt` (a string, a list of token ids, or a one-element list of either), `echo` (false only),
  `best_of` (1 only), `suffix` (null only).
- chat: `messages` (roles system/developer/user/assistant/tool; content a string, a list of text parts, or null
  for assistant turns), `max_completion_tokens` (alias of max_tokens), `top_logprobs` (unset only),
  `tools` (empty only), `response_format` (`{"type": "text"}` only).

Fields this module does not know are ignored, as OpenAI-compatible servers usually do.
Defaults: completions `max_tokens` 16 (clamped to what the context has left); chat `max_tokens` = what the
context has left. An explicit `max_tokens` that does not fit next to the prompt is a 400 naming `max_tokens`.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nfjax.engine.sampling_params import SamplingParams
from nfjax.errors import UserError


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


# ---- field readers ---------------------------------------------------------------------------------------------
_MISSING = object()


def _get(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    return default if v is _MISSING or v is None else v


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = _get(body, name, default)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer, got {json.dumps(v)}")
    if lo is not None and v < lo:
        raise bad(name, f"'{name}' must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(name, f"'{name}' must be <= {hi}, got {v}")
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _get(body, name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"'{name}' must be a number, got {json.dumps(v)}")
    if v < lo or (lo_open and v == lo) or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(name, f"'{name}' must be in {rng}, got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = _get(body, name, default)
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {json.dumps(v)}")
    return v


def _text(v: str, param: str) -> str:
    """`v` if it is valid Unicode; a lone surrogate (JSON's "\\ud800" without its pair) cannot be encoded."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"'{param}' is not valid Unicode: a lone surrogate "
                         f"{json.dumps(v[e.start])} at character {e.start}") from None
    return v


def _neutral(body: dict, name: str, ok, what: str) -> None:
    v = _get(body, name)
    if v is not None and not ok(v):
        raise bad(name, f"'{name}' is not supported by this server ({what})")


# ---- parsed request ----------------------------------------------------------------------------------------------
@dataclass
class GenerateRequest:
    kind: str                         # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    created: int


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(None, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served_name: str) -> None:
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {json.dumps(m)}")
    if m != served_name:
        raise APIError(400, f"model '{m}' does not exist; this server serves '{served_name}'", "model",
                       code="model_not_found")


def _stop(body: dict) -> tuple[str, ...]:
    v = _get(body, "stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(v) > 4:
        raise bad("stop", f"'stop' holds at most 4 strings, got {len(v)}")
    if any(not s for s in v):
        raise bad("stop", "'stop' strings must be non-empty")
    return tuple(_text(s, "stop") for s in v)


def _common(body: dict, kind: str) -> dict:
    """Validate the fields shared by both endpoints; returns keyword arguments for SamplingParams."""
    if _int(body, "n", 1, 1) != 1:
        raise bad("n", "'n' must be 1: this server returns one choice per request")
    _neutral(body, "presence_penalty", lambda v: v == 0, "only 0")
    _neutral(body, "frequency_penalty", lambda v: v == 0, "only 0")
    _neutral(body, "logit_bias", lambda v: v == {}, "only an empty object")
    if kind == "completion":
        _neutral(body, "logprobs", lambda v: v is False or v == 0, "logprobs are not returned")
    else:
        _neutral(body, "logprobs", lambda v: v is False, "logprobs are not returned")
        _neutral(body, "top_logprobs", lambda v: False, "logprobs are not returned")
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    return dict(temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                top_k=max(top_k, 0), seed=seed, stop=_stop(body),
                ignore_eos=_bool(body, "ignore_eos", False))


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = _get(body, "stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    v = opts.get("include_usage")
    if v is not None and not isinstance(v, bool):
        raise bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    return stream, bool(v)


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, prompt_len: int, max_model_len: int,
                prompt_param: str) -> int:
    if prompt_len >= max_model_len:
        raise bad(prompt_param, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{prompt_len} tokens (at least one token must be left for the completion)")
    room = max_model_len - prompt_len
    for name in names:
        v = _int(body, name, None, 1)
        if v is not None:
            if v > room:
                raise bad(name, f"this model's maximum context length is {max_model_len} tokens; you asked for "
                                f"{prompt_len + v} ({prompt_len} in the prompt, {v} in the completion)")
            return v
    return room if default is None else min(default, room)


def _make_params(kw: dict, max_tokens: int, stop_token_ids=()) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids), **kw)
    except UserError as e:   # SamplingParams names the field first in its message
        raise bad(str(e).split()[0], str(e)) from None


def parse_completion(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> GenerateRequest:
    _neutral(body, "echo", lambda v: v is False, "only false")
    _neutral(body, "suffix", lambda v: False, "suffixes are not supported")
    if _int(body, "best_of", 1, 1) != 1:
        raise bad("best_of", "'best_of' must be 1: this server returns one choice per request")
    kw = _common(body, "completion")
    stream, include_usage = _stream_flags(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]          # a batch of one
    if isinstance(p, str):
        _text(p, "prompt")
        try:
            ids = tokenizer.encode(p)
        except UserError as e:      # e.g. a model without a tokenizer: token ids only
            raise bad("prompt", str(e)) from None
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad_ids = [t for t in p if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad("prompt", f"prompt token id {bad_ids[0]} is out of range [0, {vocab_size})")
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", f"one prompt per request is supported, got a batch of {len(p)}")
    else:
        raise bad("prompt", "'prompt' must be a string or a non-empty list of token ids")
    if not ids:
        raise bad("prompt", "'prompt' is empty")
    max_tokens = _max_tokens(body, ("max_tokens",), 16, len(ids), max_model_len, "prompt")
    return GenerateRequest("completion", ids, _make_params(kw, max_tokens), stream, include_usage,
                           f"cmpl-{uuid.uuid4().hex}", int(time.time()))


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(msgs: Any) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of message objects")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"'{where}' must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(_ROLES)}, got {json.dumps(role)}")
        c = m.get("content")
        if c is None:
            if role != "assistant":
                raise bad(f"{where}.content", f"'{where}.content' is required for role '{role}'")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]' must be a text part "
                                                       "({\"type\": \"text\", \"text\": ...}); only text is supported")
                _text(part["text"], f"{where}.content[{j}].text")
        elif not isinstance(c, str):
            raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of text parts")
        else:
            _text(c, f"{where}.content")
    return msgs


def parse_chat(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> GenerateRequest:
    _neutral(body, "tools", lambda v: v == [], "tools are not supported")
    _neutral(body, "functions", lambda v: v == [], "functions are not supported")
    _neutral(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
             "only {\"type\": \"text\"}")
    kw = _common(body, "chat")
    stream, include_usage = _stream_flags(body)
    msgs = _check_messages(body.get("messages"))
    try:
        ids = tokenizer.encode_chat(msgs, add_generation_prompt=True)
    except UserError as e:     # the chat template rejected the conversation
        raise bad("messages", str(e)) from None
    if not ids:
        raise bad("messages", "the chat template rendered an empty prompt")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None, len(ids), max_model_len,
                             "messages")
    return GenerateRequest("chat", ids, _make_params(kw, max_tokens), stream, include_usage,
                           f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))


# ---- responses -------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: GenerateRequest, model: str, text: str, finish_reason: str, n_out: int) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model,
            "system_fingerprint": None, "choices": [choice], "usage": usage(len(req.prompt_ids), n_out)}


def chunk(req: GenerateRequest, model: str, text: str | None, finish_reason: str | None = None,
          role: bool = False) -> dict:
    """One streamed chunk. Chat: `role` sends the opening `{"role": "assistant"}` delta; text=None sends `{}`."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model,
            "system_fingerprint": None, "choices": [choice]}


def usage_chunk(req: GenerateRequest, model: str, n_out: int) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": usage(len(req.prompt_ids), n_out)}
