"""OpenAI requests -> engine requests: validation against the model (context, vocabulary, tokenizer) and fan-out.

Field types and ranges are declared once in `schemas.py` (pydantic; also served as `/openapi.json`); every
rejected field is `APIError(400, message, param)`, which the app sends as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. An unknown `model` is a 404 ("The model `X` does not exist.",
as vLLM answers); a missing one means the served model. Supported request fields:

- both: `model`, `max_tokens`, `temperature` [0, 2], `top_p` (0, 1], `top_k` (extension; 0 or -1 = off),
  `min_tokens` (extension, <= max_tokens), `presence_penalty` / `frequency_penalty` [-2, 2],
  `repetition_penalty` (extension, > 0, 1 = off), `stop` (a string or up to 4), `stop_token_ids` (extension),
  `seed` (>= 0), `n` (1..16 choices per prompt), `stream`, `stream_options.include_usage`, `ignore_eos` and
  `skip_special_tokens` (extensions), `user` (ignored). `logit_bias` is accepted only empty.
- completions: `prompt` (a string, a list of token ids, or a batch: a list of strings or of token-id lists, up to
  256), `best_of` (n..16: the n candidates with the highest cumulative logprob; streaming needs best_of == n),
  `logprobs` (0..20), `echo` (not with `logprobs`: prompt logprobs are not computed), `suffix` (null only).
- chat: `messages` (roles system/developer/user/assistant/tool; content a string, a list of text parts, or null
  for assistant turns), `max_completion_tokens` (alias of max_tokens), `logprobs` (boolean) and `top_logprobs`
  (0..20, needs logprobs), `tools`/`functions` (empty only), `response_format` (`{"type": "text"}` only).

Fields not declared are ignored, as OpenAI-compatible servers usually do.
Defaults: completions `max_tokens` 16 (clamped to what the context has left next to each prompt); chat
`max_tokens` = what the context has left. An explicit `max_tokens` that does not fit next to a prompt is a 400
naming `max_tokens`.

Fan-out: each prompt becomes max(n, best_of) engine requests ("subs"). With a `seed`, candidate j of every prompt
uses `derive_seed(seed, j)` (candidate 0 the seed itself), so choices differ, are reproducible, and a batched
prompt gives what the same prompt alone gives. Choice index = prompt_i * n + j.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

from nfjax.engine.sampling_params import SamplingParams
from nfjax.errors import UserError
from nfjax.server import schemas
from nfjax.server.errors import APIError, bad, model_not_found

__all__ = ["APIError", "GenerateRequest", "Sub", "bad", "check_model", "derive_seed", "parse_chat",
           "parse_completion", "parse_json", "vocab_check"]


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(None, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served_name: str) -> None:
    """A `model` other than the served one is a 404 (checked before the other fields)."""
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {json.dumps(m)}")
    if m != served_name:
        raise model_not_found(m)


def derive_seed(seed: int | None, j: int) -> int | None:
    """Candidate j's seed: the seed itself for j = 0, else a hash of (seed, j) in [0, 2**63)."""
    if seed is None or j == 0:
        return seed
    h = hashlib.blake2b(f"{seed}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


@dataclass
class Sub:
    """One engine request: candidate `candidate` of prompt `prompt_index`."""
    request_id: str
    prompt_index: int
    candidate: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class GenerateRequest:
    kind: str                          # "completion" | "chat"
    prompts: list[list[int]]           # token ids of each prompt in the batch
    params: list[SamplingParams]       # each prompt's params (candidate 0's seed)
    stream: bool
    include_usage: bool
    request_id: str
    created: int
    n: int = 1
    best_of: int = 1                   # candidates per prompt (>= n)
    logprobs: int | None = None        # returned alternatives per token (None: no logprobs in the response)
    echo_texts: list[str] | None = None   # completions with echo: each prompt's text
    subs: list[Sub] = field(init=False)

    def __post_init__(self):
        many = len(self.prompts) * self.best_of > 1
        self.subs = [Sub(f"{self.request_id}-{i}-{j}" if many else self.request_id, i, j, ids,
                         dataclasses.replace(p, seed=derive_seed(p.seed, j)) if j else p)
                     for i, (ids, p) in enumerate(zip(self.prompts, self.params)) for j in range(self.best_of)]

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def vocab_check(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(param, f"'{param}': token id {bad_ids[0]} is out of range [0, {vocab_size})")
    return list(ids)


def _encode(tokenizer, text: str, param: str, **kw) -> list[int]:
    try:
        return tokenizer.encode(text, **kw)
    except UserError as e:      # e.g. a model without a tokenizer: token ids only
        raise bad(param, str(e)) from None


def _room(prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    if prompt_len >= max_model_len:
        raise bad(prompt_param, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{prompt_len} tokens (at least one token must be left for the completion)")
    return max_model_len - prompt_len


def _max_tokens(r: schemas._Sampling, default: int | None, prompt_len: int, max_model_len: int,
                prompt_param: str) -> int:
    room = _room(prompt_len, max_model_len, prompt_param)
    name, v = r.limit()
    if v is not None:
        if v > room:
            raise bad(name, f"this model's maximum context length is {max_model_len} tokens; you asked for "
                            f"{prompt_len + v} ({prompt_len} in the prompt, {v} in the completion)")
        return v
    mt = room if default is None else min(default, room)
    if (r.min_tokens or 0) > mt:
        raise bad("min_tokens", f"'min_tokens' ({r.min_tokens}) exceeds the {mt} tokens the context leaves for the "
                                "completion")
    return mt


_OPTIONAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


def _params(r: schemas._Sampling, max_tokens: int, vocab_size: int, logprobs: int | None) -> SamplingParams:
    def d(v, default):
        return default if v is None else v
    kw = dict(temperature=float(d(r.temperature, 1.0)), top_p=float(d(r.top_p, 1.0)), top_k=max(d(r.top_k, 0), 0),
              seed=r.seed, stop=tuple(r.stop) if isinstance(r.stop, list) else (r.stop,) if r.stop else (),
              stop_token_ids=tuple(vocab_check(r.stop_token_ids or [], vocab_size, "stop_token_ids")),
              ignore_eos=bool(r.ignore_eos), skip_special_tokens=d(r.skip_special_tokens, True),
              max_tokens=max_tokens)
    # the engine's penalty, min_tokens and logprob fields are passed only when used
    for name, neutral in _OPTIONAL.items():
        v = getattr(r, name)
        if v is not None and v != neutral:
            kw[name] = v
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except UserError as e:   # SamplingParams names the field first in its message
        raise bad(str(e).split()[0], str(e)) from None


def _stream_flags(r: schemas._Sampling) -> tuple[bool, bool]:
    return bool(r.stream), bool(r.stream_options and r.stream_options.include_usage)


def _ids(kind: str) -> tuple[str, int]:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}", int(time.time())


def parse_completion(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> GenerateRequest:
    r: schemas.CompletionRequest = schemas.validate(schemas.CompletionRequest, body)
    prompts, texts = [], []
    for p in r.prompts:
        ids = _encode(tokenizer, p, "prompt") if isinstance(p, str) else vocab_check(p, vocab_size, "prompt")
        if not ids:
            raise bad("prompt", "'prompt' is empty")
        prompts.append(ids)
        texts.append(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=True) if r.echo else "")
    n = r.n or 1
    best_of = r.best_of or n
    # the engine computes logprobs when asked for them, or when best_of must rank candidates by them
    engine_logprobs = r.logprobs if r.logprobs is not None else (0 if best_of > n else None)
    params = [_params(r, _max_tokens(r, 16, len(ids), max_model_len, "prompt"), vocab_size, engine_logprobs)
              for ids in prompts]
    rid, created = _ids("completion")
    return GenerateRequest("completion", prompts, params, *_stream_flags(r), rid, created, n=n, best_of=best_of,
                           logprobs=r.logprobs, echo_texts=texts if r.echo else None)


def parse_chat(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> GenerateRequest:
    r: schemas.ChatCompletionRequest = schemas.validate(schemas.ChatCompletionRequest, body)
    ids = encode_chat(tokenizer, body["messages"], True)
    top = (r.top_logprobs or 0) if r.logprobs else None
    params = _params(r, _max_tokens(r, None, len(ids), max_model_len, "messages"), vocab_size, top)
    rid, created = _ids("chat")
    return GenerateRequest("chat", [ids], [params], *_stream_flags(r), rid, created, n=r.n or 1, best_of=r.n or 1,
                           logprobs=top)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                add_special_tokens: bool = False) -> list[int]:
    """Token ids of validated `messages` (the raw dicts: keys beyond role/content reach the template)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except UserError as e:     # the chat template rejected the conversation, or no tokenizer
        raise bad("messages", str(e)) from None
    if not ids:
        raise bad("messages", "the chat template rendered an empty prompt")
    return ids
