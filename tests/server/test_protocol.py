"""Request validation and response shapes without a server (fast)."""
import types

import pytest

from nfjax.engine.outputs import RequestOutput
from nfjax.server import schemas
from nfjax.server.protocol import APIError, check_model, derive_seed, parse_chat, parse_completion, parse_json
from nfjax.server.responses import TokenTexts, chunk, full_response
from nfjax.server.sse import event
from nfjax.tokenizer.byte import ByteTokenizer

TOK = ByteTokenizer()
V, CTX = 258, 64


def comp(**body):
    return parse_completion(body, TOK, V, CTX)


def err(fn, *a, status: int = 400, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*a, **kw)
    assert e.value.status == status
    return e.value


def test_completion_defaults_and_sampling_fields():
    r = comp(prompt="abc")
    assert r.prompt_ids == [256, 97, 98, 99] and r.params[0].max_tokens == 16 and r.params[0].temperature == 1.0
    assert not r.stream and not r.include_usage and r.request_id.startswith("cmpl-")
    assert [s.request_id for s in r.subs] == [r.request_id] and r.n == r.best_of == 1 and r.logprobs is None
    r = comp(prompt=["abc"], max_tokens=5, temperature=0, top_p=0.5, top_k=-1, stop="x", seed=3, n=1,
             logprobs=None, stream=True, stream_options={"include_usage": True}, ignore_eos=True, user="u",
             max_tokens_extra="ignored")
    p = r.params[0]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos) == (
        5, 0.0, 0.5, 0, ("x",), 3, True)
    assert r.stream and r.include_usage
    assert comp(prompt=[[1, 2, 3]]).prompt_ids == [1, 2, 3]
    assert comp(prompt="abc", max_tokens=5.0).params[0].max_tokens == 5        # an integral number is an integer
    assert comp(prompt="a" * 60).params[0].max_tokens == CTX - 61     # the default is clamped to the room left


def test_context_limits_name_the_field():
    assert err(comp, prompt="a" * 63).param == "prompt"            # 64 tokens with BOS: no room left
    e = err(comp, prompt="abc", max_tokens=61)
    assert e.param == "max_tokens" and "64" in e.message
    assert comp(prompt="abc", max_tokens=60).params[0].max_tokens == 60
    assert err(comp, prompt=["abc", "a" * 50], max_tokens=20).param == "max_tokens"    # each prompt must fit
    assert err(comp, prompt="a" * 50, min_tokens=14).param == "min_tokens"   # default max_tokens clamped to 13


def test_fan_out_and_derived_seeds():
    assert err(comp, prompt=["ab", [5, 6]]).param == "prompt"          # a batch is all strings or all id lists
    r = comp(prompt=[[256, 97, 98], [5, 6]], n=2, best_of=3, seed=11)
    assert r.prompts == [[256, 97, 98], [5, 6]] and r.n == 2 and r.best_of == 3
    assert [(s.prompt_index, s.candidate) for s in r.subs] == [(i, j) for i in range(2) for j in range(3)]
    assert len({s.request_id for s in r.subs}) == 6
    seeds = [s.params.seed for s in r.subs]
    assert seeds[:3] == seeds[3:] == [11, derive_seed(11, 1), derive_seed(11, 2)]     # per candidate, not prompt
    assert len(set(seeds[:3])) == 3 and all(0 <= x < 2**63 for x in seeds)
    assert [s.params.seed for s in comp(prompt="a", n=3).subs] == [None] * 3         # no seed: the engine's own


def test_chat_template_and_defaults():
    r = parse_chat({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                 {"role": "user", "content": [{"type": "text", "text": "yo"}]}]}, TOK, V, 256)
    assert TOK.decode(r.prompt_ids) == "User: hi\n\nAssistant:\n\nUser: yo\n\nAssistant:"
    assert r.params[0].max_tokens == 256 - len(r.prompt_ids) and r.kind == "chat"
    r = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}, TOK, V, 256)
    assert r.params[0].max_tokens == 7


def test_json_and_model_checks():
    assert err(parse_json, b"{").param is None
    assert "object" in err(parse_json, b"3").message
    check_model({"model": "m"}, "m")
    check_model({}, "m")
    e = err(check_model, {"model": "x"}, "m", status=404)
    assert e.body() == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}
    assert err(check_model, {"model": 3}, "m").param == "model"


def test_validation_errors_name_the_field():
    cases = [({"prompt": "x", "n": 17}, "n"), ({"prompt": "x", "stop": ["a", 3]}, "stop"),
             ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
             ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"), ({"prompt": [1, True]}, "prompt")]
    for body, param in cases:
        assert err(schemas.validate, schemas.CompletionRequest, body).param == param, body
    e = err(schemas.validate, schemas.ChatCompletionRequest, {"messages": [{"role": "user"}]})
    assert e.param == "messages[0].content" and "required" in e.message
    assert schemas.param_of(("messages", 2, "content", "array", 1, "text")) == "messages[2].content[1].text"


def _out(rid, ids, text, reason="length"):
    return RequestOutput(rid, [1], ids, text, ids, text, True, reason)


def test_response_shapes():
    r = comp(prompt="abc")
    body = full_response(r, "m", {r.request_id: _out(r.request_id, [120, 121, 122], "xyz")}, TOK)
    assert body["choices"] == [{"index": 0, "text": "xyz", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    c = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, TOK, V, 256)
    assert chunk(c, "m", 0, None, role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk(c, "m", 3, None, "stop")["choices"][0] == {"index": 3, "delta": {}, "logprobs": None,
                                                             "finish_reason": "stop"}
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_best_of_ranks_by_cumulative_logprob_and_usage_counts_all():
    r = comp(prompt=["a", "b"], n=1, best_of=3)
    assert all(s.params.logprobs == 0 for s in r.subs) and r.logprobs is None   # computed to rank, not returned
    cum = [-5.0, -1.0, -3.0, -2.0, -9.0, -0.5]
    finals = {}
    for s, c in zip(r.subs, cum):
        o = _out(s.request_id, [97] * (s.candidate + 1), f"{s.prompt_index}{s.candidate}")
        o.cumulative_logprob = c
        finals[s.request_id] = o
    body = full_response(r, "m", finals, TOK)
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [(0, "01"), (1, "12")]
    assert body["usage"]["completion_tokens"] == 2 * (1 + 2 + 3)


def test_token_texts():
    tt = TokenTexts(TOK)
    assert tt.get(97) == ("a", b"a") and tt.get(0xE2) == ("bytes:\\xe2", b"\xe2") and tt.get(257)[0] == "<|eos|>"
    from nfjax.tokenizer.silent import SilentTokenizer
    assert TokenTexts(SilentTokenizer(100)).get(7) == ("token_id:7", b"")
    lp = types.SimpleNamespace(token_id=97, logprob=float("-inf"), top=((98, -0.1),))
    from nfjax.server.responses import completion_logprobs
    assert completion_logprobs(tt, [lp], [0]) == {"tokens": ["a"], "token_logprobs": [-9999.0],
                                                  "top_logprobs": [{"b": -0.1, "a": -9999.0}], "text_offset": [0]}


def test_token_texts_of_a_byte_level_bpe_tokenizer_reassemble_the_text():
    """Each token's bytes (GPT-2's byte alphabet undone) joined give the text's UTF-8, characters split across
    tokens included; a token that is part of a character is written `bytes:\\x..`."""
    from nfjax.tokenizer import HFTokenizer
    from tests.tokenizer.conftest import train_bpe
    tok = HFTokenizer(train_bpe(), {"bos_token": "<s>"})
    tt = TokenTexts(tok)
    text = "Emoji 🙂 and café, 你好 world"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tt.get(i)[1] for i in ids) == text.encode()
    for i in ids:
        s, b = tt.get(i)
        try:
            assert s == b.decode() == tok.decode([i])
        except UnicodeDecodeError:
            assert s == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
    assert any(tt.get(i)[0].startswith("bytes:") for i in ids)      # the emoji is split across tokens
    bos = tok.bos_token_id
    assert tt.get(bos) == ("<s>", b"<s>")                          # special tokens: their text
