import datetime

import jinja2
import pytest

from nfjax.tokenizer import ByteTokenizer, ChatTemplateError, load_tokenizer
from nfjax.tokenizer.chat_template import render_chat_template

LLAMA3_LIKE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")

# namespace, loop controls, tojson with options, tools, a {% generation %} block, None-valued keys, reasoning
FEATURES = """{%- set ns = namespace(system='none', n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {%- if ns.n > 3 -%}{%- break -%}{%- endif -%}
  [{{ m.role }}{% if m.content is defined %}|{{ m.content }}{% else %}|<no content>{% endif %}]
  {%- if m.reasoning_content is defined %}(think: {{ m.reasoning_content }}){% endif %}
  {%- if m.role == 'assistant' %}{% generation %}<{{ m.get('tool_calls', []) | tojson }}>{% endgeneration %}{% endif %}
{% endfor -%}
system={{ ns.system }}
{% if tools %}tools={{ tools | tojson(indent=2, sort_keys=True) }}{% endif %}
{%- if add_generation_prompt %}
>>> {% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief. Ünïcödé ok: 你好 🙂"},
    {"role": "user", "content": "Hi <there> & \"friends\""},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": "é"}}],
     "reasoning": "let me think"},
    {"role": "user", "content": "  and then?  "},
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "déjà", "parameters": {"type": "object"}}}]


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


@pytest.fixture(scope="module")
def tok(bpe_dir):
    t = load_tokenizer(bpe_dir)
    assert t.chat_template == CHATML      # the template the bpe_dir fixture wrote
    return t


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE, FEATURES], ids=["chatml", "llama3", "features"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_matches_transformers(tok, hf_reference, template, gen_prompt):
    msgs = [m for m in MESSAGES if m["content"] is not None] if template != FEATURES else MESSAGES
    kw = {"tools": TOOLS} if template == FEATURES else {}
    tok.chat_template = template
    try:
        ours = tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt, **kw)
    finally:
        tok.chat_template = CHATML
    ref = hf_reference.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                           add_generation_prompt=gen_prompt, **kw)
    assert ours == ref


def test_checkpoint_template_is_used_and_encodes_like_transformers(tok, hf_reference):
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode_chat(msgs) == hf_reference.apply_chat_template(msgs, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)


def test_raise_exception_is_a_user_error(tok, hf_reference):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    tok.chat_template = ALTERNATING
    try:
        with pytest.raises(ChatTemplateError, match="must alternate"):
            tok.apply_chat_template(bad)
        good = bad[:1] + [{"role": "assistant", "content": "c"}] + bad[1:]
        assert tok.apply_chat_template(good) == hf_reference.apply_chat_template(
            good, chat_template=ALTERNATING, tokenize=False, add_generation_prompt=True)
    finally:
        tok.chat_template = CHATML
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        hf_reference.apply_chat_template(bad, chat_template=ALTERNATING, tokenize=False)


def test_sandbox_blocks_python_internals():
    msgs = [{"role": "user", "content": "x"}]
    for evil in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
                 "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ namespace(__init__=1) }}",
                 "{{ messages.append(1) }}"):
        with pytest.raises(ChatTemplateError):
            render_chat_template(evil, msgs)


def test_bad_template_and_messages_are_user_errors():
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("x", "not a list")
    with pytest.raises(ChatTemplateError):
        render_chat_template("x", ["not a dict"])


def test_strftime_now_and_rich_objects():
    year = str(datetime.datetime.now().year)
    assert render_chat_template("{{ strftime_now('%Y') }}", []) in (year, str(int(year) + 1))

    class Rich:
        def dangerous(self):
            raise AssertionError("must not be reachable")

    out = render_chat_template("{{ messages[0].content }}|{{ obj }}", [{"role": "user", "content": Rich()}],
                               obj=Rich())
    assert out == "<Rich>|<Rich>"


def test_default_template():
    tok = ByteTokenizer()     # no chat template: the documented plain-text default
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Tell"}, {"type": "image_url", "url": "u"},
                                         {"type": "text", "text": "more"}]}]
    assert tok.apply_chat_template(msgs) == (
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Tell more\n\nAssistant:")
    assert tok.apply_chat_template(msgs[:2], add_generation_prompt=False) == "System: Be brief.\n\nUser: Hi\n\n"
    assert tok.encode_chat(msgs[1:2]) == list(b"User: Hi\n\nAssistant:")   # no BOS added twice or at all
    assert ByteTokenizer(chat_template="{{ bos_token }}!").apply_chat_template([]) == "<|bos|>!"
