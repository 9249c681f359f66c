"""Request schemas: one pydantic declaration per request body, for validation and for `/openapi.json`.

Types are JSON's, strictly ("3" is not an integer, true is not a number), except that an integral number (3.0)
is accepted where an integer is expected. Fields not declared here are ignored. `validate(Model, body)` turns the
first validation error into a 400 whose `param` is the path to the field (`max_tokens`, `messages[0].content`;
the list-of-scalars fields `prompt`, `stop`, `stop_token_ids` and `tokens` are named without an index).
Rules across fields are checked in model validators that raise `field_error(field, message)`, so they name their
field too. Rules that need the model (context length, vocabulary, tokenizer) live in protocol.py.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationError, model_validator)
from pydantic_core import PydanticCustomError

from nfjax.server.errors import bad

MAX_N = 16                  # choices per prompt (n) and candidates per prompt (best_of)
MAX_LOGPROBS = 20           # alternatives per token (completions `logprobs`, chat `top_logprobs`)
MAX_PROMPTS = 256           # prompts in one batched completions request
MAX_FANOUT = 1024           # engine requests one HTTP request may start (prompts x best_of)
SEED_MAX = 2**63 - 1


# ---- field types -------------------------------------------------------------------------------------------------
def field_error(field: str, message: str) -> PydanticCustomError:
    """A validation error of `field` (relative to the model whose validator raises it)."""
    return PydanticCustomError("invalid_field", message, {"field": field})


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _unicode(v: str) -> str:
    """`v` if it is valid Unicode; a lone surrogate (JSON's "\\ud800" without its pair) cannot be encoded."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("lone_surrogate", "is not valid Unicode: a lone surrogate {char} at character "
                                  "{pos}", {"char": json.dumps(v[e.start]), "pos": e.start}) from None
    return v


def _neutral(ok, what: str) -> AfterValidator:
    """A field accepted only at its neutral value(s)."""
    def check(v):
        if v is not None and not ok(v):
            raise PydanticCustomError("unsupported", "is not supported by this server ({what})", {"what": what})
        return v
    return AfterValidator(check)


def Int(**constraints):
    """An integer field type (an integral number such as 3.0 is accepted) with `Field` constraints (ge, le)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _shape(v: Any) -> str | None:
    return "string" if isinstance(v, str) else "array" if isinstance(v, list) else None


def _prompt_shape(v: Any) -> str | None:
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        first = v[0] if v else 0
        if isinstance(first, int) and not isinstance(first, bool):
            return "ids"
        return "strings" if isinstance(first, str) else "id_lists" if isinstance(first, list) else None
    return None


Stop = Annotated[Union[
    Annotated[Annotated[Text, Field(min_length=1)], Tag("string")],
    Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=4), Tag("array")],
], Discriminator(_shape, custom_error_type="invalid_type",
                 custom_error_message="must be a string or a list of up to 4 strings")]

Prompt = Annotated[Union[
    Annotated[Text, Tag("string")],
    Annotated[TokenIds, Tag("ids")],
    Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("strings")],
    Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("id_lists")],
], Discriminator(_prompt_shape, custom_error_type="invalid_type",
                 custom_error_message="must be a string, a list of token ids, a list of strings or a list of "
                                      "token-id lists")]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = Field(None, description="The served model's name (GET /v1/models); omitted: that model. "
                                                "Any other name is a 404.")


# ---- chat messages -----------------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, v: Any) -> Any:
        if not (isinstance(v, dict) and v.get("type") == "text" and isinstance(v.get("text"), str)):
            raise PydanticCustomError("unsupported", 'must be a text part ({"type": "text", "text": ...}); only '
                                                     "text is supported")
        return v


Content = Annotated[Union[Annotated[Text, Tag("string")], Annotated[list[TextPart], Tag("array")]],
                    Discriminator(_shape, custom_error_type="invalid_type",
                                  custom_error_message="must be a string or a list of text parts")]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")   # other keys (name, tool_calls...) go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(None, description="Required except for assistant turns.")

    @model_validator(mode="after")
    def _content(self) -> "Message":
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"is required for role '{self.role}'")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = Field(None, description="A last chunk with `usage` and no choices.")


# ---- generation requests -----------------------------------------------------------------------------------------
class _Sampling(_Body):
    max_tokens: Int(ge=1) | None = Field(None, description="Tokens to generate at most; must fit next to the prompt "
                                                           "in the context (a 400 otherwise).")
    temperature: float | None = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0: greedy.")
    top_p: float | None = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: Int(ge=-1) | None = Field(0, description="Extension: sample among the k most likely tokens (0 or -1: "
                                                    "off).")
    min_tokens: Int(ge=0) | None = Field(0, description="Extension: no EOS or stop token before this many tokens "
                                                        "(<= max_tokens).")
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(1.0, gt=0, allow_inf_nan=False, description="Extension: 1 = off.")
    stop: Stop | None = Field(None, description="Up to 4 strings; the text ends before the first one.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension: token ids that end generation.")
    seed: Int(ge=0, le=SEED_MAX) | None = Field(None, description="Same seed, same tokens. With n > 1 (or "
                                                                  "best_of) choice j uses a seed derived from it.")
    n: Int(ge=1, le=MAX_N) | None = Field(1, description="Choices per prompt.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="Extension: keep generating past EOS.")
    skip_special_tokens: bool | None = Field(True, description="Extension: leave special tokens out of the text.")
    logit_bias: Annotated[dict[str, float] | None, _neutral(lambda v: v == {}, "only an empty object")] = None
    user: str | None = Field(None, description="Ignored.")

    def limit(self) -> tuple[str, int | None]:
        """The field that holds the explicit length limit, and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    @model_validator(mode="after")
    def _sampling_rules(self):
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "is only allowed when 'stream' is true")
        name, limit = self.limit()
        if limit is not None and (self.min_tokens or 0) > limit:
            raise field_error("min_tokens", f"must be <= {name} ({limit}), got {self.min_tokens}")
        return self


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: Prompt = Field(description="A string, a list of token ids, or a batch: a list of strings or of "
                                       "token-id lists (each prompt gets n choices; choice index = prompt_i * n + j).")
    best_of: Int(ge=1, le=MAX_N) | None = Field(None, description="Candidates per prompt (>= n); the n with the "
                                                                  "highest cumulative logprob are returned. Not with "
                                                                  "stream unless equal to n.")
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Logprob of each sampled token and of the "
                                                                          "k most likely ones.")
    echo: bool | None = Field(False, description="Prepend the prompt to the text (not with logprobs: prompt "
                                                 "logprobs are not computed).")
    suffix: Annotated[str | None, _neutral(lambda v: False, "suffixes are not supported")] = None

    @property
    def prompts(self) -> list:
        """The batch: a list of strings or of token-id lists."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @model_validator(mode="after")
    def _completion_rules(self):
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            raise field_error("best_of", f"must be >= n ({n}), got {best_of}")
        if self.stream and best_of is not None and best_of > n:
            raise field_error("best_of", f"cannot stream with best_of ({best_of}) > n ({n}): the best choices are "
                                         "known only at the end")
        if self.echo and self.logprobs is not None:
            raise field_error("echo", "cannot be combined with 'logprobs': echoing the prompt's logprobs needs "
                                      "prompt logprobs, which this server does not compute")
        fan = len(self.prompts) * max(n, best_of or 1)
        if fan > MAX_FANOUT:
            raise field_error("prompt", f"asks for {fan} generations (prompts x max(n, best_of)); the limit is "
                                        f"{MAX_FANOUT} a request")
        return self


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = Field(None, description="Alias of max_tokens (wins over it). "
                                                                      "Default: what the context has left.")
    logprobs: bool | None = Field(False, description="Logprob of each sampled token.")
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Most likely alternatives per token "
                                                                              "(needs logprobs: true).")
    tools: Annotated[list | None, _neutral(lambda v: v == [], "tools are not supported")] = None
    functions: Annotated[list | None, _neutral(lambda v: v == [], "functions are not supported")] = None
    response_format: Annotated[dict | None, _neutral(lambda v: v.get("type") == "text",
                                                     'only {"type": "text"}')] = None

    def limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "requires 'logprobs': true")
        return self


# ---- tokenizer endpoints -----------------------------------------------------------------------------------------
class TokenizeCompletionRequest(_Body):
    """POST /tokenize with a prompt: its token ids as /v1/completions would see them."""
    prompt: Text
    add_special_tokens: bool | None = Field(True, description="Add what the tokenizer adds (e.g. BOS).")


class TokenizeChatRequest(_Body):
    """POST /tokenize with messages: the token ids of the rendered chat template."""
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(True, description="End with the assistant turn's opening.")
    add_special_tokens: bool | None = Field(False, description="Add special tokens beyond the template's own.")


class DetokenizeRequest(_Body):
    """POST /detokenize."""
    tokens: list[TokenId]


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                  DetokenizeRequest)


# ---- validation errors -> 400 --------------------------------------------------------------------------------------
def _field_names(models) -> frozenset[str]:
    names, todo, seen = set(), list(models), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for name, f in m.model_fields.items():
            names.add(name)
            todo += [t for t in _classes(f.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return frozenset(names)


def _classes(tp) -> list:
    out = [tp]
    for a in getattr(tp, "__args__", ()) or ():
        out += _classes(a)
    meta = getattr(tp, "__metadata__", None)
    if meta is not None:
        out += _classes(tp.__origin__)
    return out


_FIELDS = _field_names(REQUEST_MODELS) | {"include_usage"}
_SCALAR_LISTS = frozenset({"prompt", "stop", "stop_token_ids", "tokens", "logit_bias"})


def param_of(loc: tuple) -> str | None:
    """`messages[0].content` from pydantic's loc; union tags and dict keys are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += ("." if out else "") + part
        if out in _SCALAR_LISTS:
            break
    return out or None


def validate(model: type[BaseModel], body: dict) -> Any:
    """`model` validated from `body`, or the first error as a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    param = param_of(tuple(err["loc"]) + ((ctx["field"],) if "field" in ctx else ()))
    where = f"'{param}'" if param else "the request body"
    if err["type"] == "missing":
        raise bad(param, f"{where} is required")
    msg = f"{where} {err['msg']}" if err["type"] in ("invalid_field", "unsupported", "lone_surrogate",
                                                     "invalid_type") else f"{where}: {err['msg']}"
    v = err.get("input")
    if not isinstance(v, (dict, list)) and err["type"] not in ("lone_surrogate", "invalid_field"):
        msg += f", got {json.dumps(v)}"
    raise bad(param, msg)


# ---- response bodies of the tokenizer endpoints and errors (for /openapi.json) ------------------------------------
class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="The request field at fault, when one is.")
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorInfo
