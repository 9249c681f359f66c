"""Chat prompt rendering with a checkpoint's jinja2 template, in the environment HF templates expect.

Templates run in jinja2's immutable sandbox with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension,
a `{% generation %}...{% endgeneration %}` block (rendered as its body), a `tojson` filter that keeps non-ASCII
text and accepts `indent`/`separators`/`sort_keys`, and the globals `raise_exception(msg)` and
`strftime_now(fmt)`. Variables: `messages`, `add_generation_prompt`, `tools`, `documents`, the tokenizer's
special token strings (`bos_token`, `eos_token`, ...) and any extra keyword arguments. As in transformers,
messages are copied to plain JSON data first (other objects become the string `<TypeName>`), keys whose value
is None are dropped, and reasoning given as `reasoning_content`/`thinking`/`reasoning` is visible under the first
two names. Any failure while rendering raises `ChatTemplateError` (a `UserError`: HTTP 400 in the server).

`DEFAULT_CHAT_TEMPLATE` (used when a checkpoint has none) is plain text a base model can continue:

    System: {system content}\\n\\n      (only when there is a system message)
    User: {content}\\n\\n
    Assistant: {content}\\n\\n
    Assistant:                        (with add_generation_prompt)

Each turn is `Role: content` with the role capitalised, turns separated by a blank line; content given as
a list of parts keeps the text parts.
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from nfjax.errors import UserError

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- (message['role'] | capitalize) + ':' -}}"
    "{%- if message['content'] is string -%}{{- ' ' + message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- ' ' + part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '\\n\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


class ChatTemplateError(UserError):
    """The chat template rejected the messages (`raise_exception`) or could not be compiled/rendered."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` (HF uses it to mark assistant tokens)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _check_attr_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} may not start with '_'")


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reaching into Python internals through it)."""

    def __init__(*args, **kwargs):   # same calling convention as jinja2's Namespace (`self` may be a kwarg)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attr_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_attr_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _make_dict(*args, **kwargs) -> dict:
    return dict(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_make_dict)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def plain_data(value: Any) -> Any:
    """A copy made of JSON types only (str/int/float/bool/None, dicts, lists, tuples); any other object becomes
    the inert string `<TypeName>`, so the sandboxed template never sees methods of caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if hasattr(value, "model_dump") and callable(value.model_dump):    # pydantic request models
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def prepare_messages(messages) -> list[dict[str, Any]]:
    """Messages as templates expect them: keys whose value is None dropped (OpenAI clients send
    `content: null`), plain data only, and a message's reasoning available as both `reasoning_content` and
    `thinking` whichever of `reasoning_content`/`thinking`/`reasoning` it came in."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        m = plain_data(m)
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None, tools=None, documents=None,
                         **kwargs: Any) -> str:
    variables = dict(special_tokens or {})
    variables.update(plain_data(kwargs))        # caller's variables win over special token names
    try:
        return compile_chat_template(template).render(
            messages=prepare_messages(messages), add_generation_prompt=add_generation_prompt,
            tools=plain_data(tools), documents=plain_data(documents), **variables)
    except ChatTemplateError:
        raise
    except Exception as e:   # the template is untrusted code over request data: any failure is a bad request
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
