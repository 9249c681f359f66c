"""Request validation and response shapes without a server (fast)."""
import pytest

from nfjax.server.protocol import APIError, check_model, chunk, full_response, parse_chat, parse_completion, parse_json
from nfjax.server.sse import event
from nfjax.tokenizer.byte import ByteTokenizer

TOK = ByteTokenizer()
V, CTX = 258, 64


def comp(**body):
    return parse_completion(body, TOK, V, CTX)


def err(fn, *a, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*a, **kw)
    assert e.value.status == 400
    return e.value


def test_completion_defaults_and_sampling_fields():
    r = comp(prompt="abc")
    assert r.prompt_ids == [256, 97, 98, 99] and r.params.max_tokens == 16 and r.params.temperature == 1.0
    assert not r.stream and not r.include_usage and r.request_id.startswith("cmpl-")
    r = comp(prompt=["abc"], max_tokens=5, temperature=0, top_p=0.5, top_k=-1, stop="x", seed=3, n=1,
             logprobs=None, stream=True, stream_options={"include_usage": True}, ignore_eos=True, user="u")
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos) == (
        5, 0.0, 0.5, 0, ("x",), 3, True)
    assert r.stream and r.include_usage
    assert comp(prompt=[[1, 2, 3]]).prompt_ids == [1, 2, 3]
    assert comp(prompt="a" * 60).params.max_tokens == CTX - 61     # the default is clamped to the room left


def test_context_limits_name_the_field():
    assert err(comp, prompt="a" * 63).param == "prompt"            # 64 tokens with BOS: no room left
    e = err(comp, prompt="abc", max_tokens=61)
    assert e.param == "max_tokens" and "64" in e.message
    assert comp(prompt="abc", max_tokens=60).params.max_tokens == 60


def test_chat_template_and_defaults():
    r = parse_chat({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                 {"role": "user", "content": [{"type": "text", "text": "yo"}]}]}, TOK, V, 256)
    assert TOK.decode(r.prompt_ids) == "User: hi\n\nAssistant:\n\nUser: yo\n\nAssistant:"
    assert r.params.max_tokens == 256 - len(r.prompt_ids) and r.kind == "chat"
    r = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}, TOK, V, 256)
    assert r.params.max_tokens == 7


def test_json_and_model_checks():
    assert err(parse_json, b"{").param is None
    assert "object" in err(parse_json, b"3").message
    check_model({"model": "m"}, "m")
    check_model({}, "m")
    e = err(check_model, {"model": "x"}, "m")
    assert e.param == "model" and e.code == "model_not_found"
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}


def test_response_shapes():
    r = comp(prompt="abc")
    body = full_response(r, "m", "xyz", "length", 3)
    assert body["choices"][0]["text"] == "xyz" and body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                                                     "total_tokens": 7}
    c = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, TOK, V, 256)
    assert chunk(c, "m", None, role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk(c, "m", None, "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                          "finish_reason": "stop"}
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
