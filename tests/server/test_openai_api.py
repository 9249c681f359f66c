"""The OpenAI API surface a vLLM user expects, on real uvicorn (127.0.0.1) with the official `openai` client and
raw HTTP: n / best_of / batched prompts, logprobs, echo, penalties, min_tokens, /tokenize, /detokenize, /version,
/openapi.json, and 404 for an unknown model. References come from Engine.generate before the server owns the
engine. One server for the module.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import httpx
import openai
import pytest

from nfjax.config import ServerConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.engine.outputs import RequestOutput
from nfjax.server import ServerThread, model_name_for
from nfjax.tokenizer.byte import ByteTokenizer
from tests.server.conftest import raw_sse, wait_idle

T = 30.0
P = ["The class", "def f(x):", "Hello"]
CHAT = [{"role": "user", "content": "Name a Python keyword."}]
LP_MAX = 16
PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


@dataclass
class Served:
    url: str
    model: str
    max_model_len: int
    greedy: RequestOutput           # P[0], greedy, logprobs=5
    chat: RequestOutput             # CHAT, greedy, logprobs=3
    penalized: RequestOutput        # P[0], greedy with PENALTIES
    min_tok: RequestOutput          # P[0], greedy, stop early unless min_tokens
    stop: str


@pytest.fixture(scope="module")
def served(model_dir):
    engine = Engine.from_pretrained(model_dir, dtype="float32", token_buckets=(32, 128), max_seqs=16, num_pages=256)
    tok = engine.tokenizer
    greedy = engine.generate(P[0], SamplingParams.greedy(max_tokens=LP_MAX, logprobs=5))[0]
    chat = engine.generate(tok.encode_chat(CHAT), SamplingParams.greedy(max_tokens=LP_MAX, logprobs=3))[0]
    pen = engine.generate(P[0], SamplingParams.greedy(max_tokens=LP_MAX, **PENALTIES))[0]
    stop = greedy.text[1:3]
    assert stop and greedy.text.index(stop) < 4
    min_tok = engine.generate(P[0], SamplingParams.greedy(max_tokens=LP_MAX, stop=(stop,), min_tokens=12))[0]
    name = model_name_for(model_dir)
    srv = ServerThread(engine, ServerConfig(port=0, max_queue=64, log_level="warning"), name).start()
    try:
        yield Served(srv.url, name, engine.max_model_len, greedy, chat, pen, min_tok, stop)
    finally:
        srv.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=T, max_retries=0)


def post(served, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{served.url}{path}", json=body, timeout=T)
    assert r.status_code == status, r.text
    return r.json()


def texts(body: dict) -> list[str]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]]


# ---- n, best_of, batched prompts -------------------------------------------------------------------------------
def test_n_with_seed_is_reproducible_and_choices_differ(served, client):
    kw = dict(model=served.model, prompt=P[0], max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    a = client.completions.create(n=4, **kw)
    b = client.completions.create(n=4, **kw)
    got = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert got == [c.text for c in b.choices] and len(set(got)) == 4
    assert client.completions.create(n=1, **kw).choices[0].text == got[0]    # choice 0 keeps the seed itself
    assert a.usage.completion_tokens == 48
    c = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=8, temperature=1.0, seed=3, n=3)
    d = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [x.index for x in c.choices] == [0, 1, 2]
    assert [x.message.content for x in c.choices] == [x.message.content for x in d.choices]
    assert len({x.message.content for x in c.choices}) > 1


def test_best_of_returns_the_highest_cumulative_logprobs(served):
    kw = dict(prompt=P[1], max_tokens=10, temperature=1.0, seed=21, logprobs=0, ignore_eos=True)
    every = post(served, "/v1/completions", dict(kw, n=5))["choices"]
    assert all(len(c["logprobs"]["token_logprobs"]) == 10 for c in every)
    assert len({sum(c["logprobs"]["token_logprobs"]) for c in every}) == 5
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = post(served, "/v1/completions", dict(kw, n=2, best_of=5))
    assert texts(best) == [c["text"] for c in ranked[:2]]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in best["choices"]]
    assert sums[0] >= sums[1] >= max(sum(c["logprobs"]["token_logprobs"]) for c in ranked[2:])
    assert best["usage"]["completion_tokens"] == 50            # every candidate generated counts
    kw.pop("logprobs")
    plain = post(served, "/v1/completions", dict(kw, n=2, best_of=5))
    assert texts(plain) == texts(best) and all(c["logprobs"] is None for c in plain["choices"])


def test_batched_prompts_equal_single_prompts(served):
    kw = dict(max_tokens=10, temperature=1.0, seed=9, n=2)
    batch = post(served, "/v1/completions", dict(kw, prompt=P))
    singles = [post(served, "/v1/completions", dict(kw, prompt=p)) for p in P]
    assert texts(batch) == [t for s in singles for t in texts(s)]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    ids = post(served, "/tokenize", {"prompt": P[0]})["tokens"], post(served, "/tokenize", {"prompt": P[1]})["tokens"]
    assert texts(post(served, "/v1/completions", dict(kw, prompt=list(ids)))) == texts(batch)[:4]


def test_streaming_with_n_and_batch_carries_indices_and_reassembles(served, client):
    body = dict(model=served.model, prompt=P[:2], n=3, max_tokens=10, temperature=1.0, seed=4)
    whole = post(served, "/v1/completions", body)
    chunks, lines = raw_sse(served.url, "/v1/completions", dict(body, stream=True,
                                                                  stream_options={"include_usage": True}))
    assert lines[-1] == "[DONE]"
    parts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        assert c["index"] not in finish          # nothing after a choice's finish_reason
        parts.setdefault(c["index"], []).append(c["text"])
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert ["".join(parts[i]) for i in range(6)] == texts(whole)
    assert [finish[i] for i in range(6)] == [c["finish_reason"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    chat = dict(model=served.model, messages=CHAT, max_tokens=8, temperature=1.0, seed=2, n=2)
    want = [c.message.content for c in client.chat.completions.create(**chat).choices]
    got, roles = {0: "", 1: ""}, []
    for ch in client.chat.completions.create(stream=True, **chat):
        d = ch.choices[0].delta
        roles += [ch.choices[0].index] if d.role else []
        got[ch.choices[0].index] += d.content or ""
    assert [got[0], got[1]] == want and sorted(roles) == [0, 1]


def test_a_stream_of_many_choices_left_early_frees_them_all(served):
    body = {"prompt": P[0], "n": 4, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=T) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    m = wait_idle(served.url)
    assert m["nfjax_running_requests"] == 0 and m["nfjax_kv_pages_used"] == 0


# ---- logprobs ----------------------------------------------------------------------------------------------------
def _tok(i: int) -> str:
    """The string of a byte tokenizer's token: a character, a lone byte of a longer one, or a special token."""
    return chr(i) if i < 128 else f"bytes:\\x{i:02x}" if i < 256 else ("<|bos|>", "<|eos|>")[i - 256]


def _bytes(i: int) -> list[int]:
    return [i] if i < 256 else list(_tok(i).encode())


def test_completion_logprobs_equal_the_engines(served):
    ref = served.greedy
    body = {"prompt": P[0], "max_tokens": LP_MAX, "temperature": 0, "logprobs": 5}
    c = post(served, "/v1/completions", body)["choices"][0]
    assert c["text"] == ref.text
    lp = c["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [_tok(t) for t in ref.token_ids] and len(ref.logprobs) == len(ref.token_ids)
    for k, want in enumerate(ref.logprobs):
        assert lp["token_logprobs"][k] == pytest.approx(want.logprob, abs=1e-4)
        top = lp["top_logprobs"][k]
        assert len(want.top) == 5 and set(top) == {_tok(t) for t, _ in want.top}    # greedy: sampled is in top
        for t, v in want.top:
            assert top[_tok(t)] == pytest.approx(v, abs=1e-4)
        assert lp["token_logprobs"][k] == pytest.approx(max(top.values()), abs=1e-6)
    tok = ByteTokenizer()
    assert lp["text_offset"] == [len(tok.decode(ref.token_ids[:k])) for k in range(len(ref.token_ids))]
    chunks, _ = raw_sse(served.url, "/v1/completions", dict(body, stream=True))
    streamed = {k: [x for ch in chunks if ch["choices"][0]["logprobs"] for x in ch["choices"][0]["logprobs"][k]]
                for k in lp}
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    zero = post(served, "/v1/completions", dict(body, logprobs=0))["choices"][0]["logprobs"]
    assert [list(d) for d in zero["top_logprobs"]] == [[t] for t in lp["tokens"]]     # the sampled token only


def test_chat_logprobs_equal_the_engines(served, client):
    ref = served.chat
    kw = dict(model=served.model, messages=CHAT, max_tokens=LP_MAX, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == ref.text
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [_tok(t) for t in ref.token_ids]
    for e, want in zip(content, ref.logprobs):
        assert e.logprob == pytest.approx(want.logprob, abs=1e-4) and e.bytes == _bytes(want.token_id)
        assert [(x.token, x.bytes) for x in e.top_logprobs] == [(_tok(t), _bytes(t)) for t, _ in want.top]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-4)
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    plain = client.chat.completions.create(**dict(kw, top_logprobs=None))
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(**dict(kw, logprobs=False, top_logprobs=None)).choices[0].logprobs is None


# ---- echo, penalties, min_tokens ---------------------------------------------------------------------------------
def test_echo(served):
    kw = {"max_tokens": 8, "temperature": 0}
    plain = texts(post(served, "/v1/completions", dict(kw, prompt=P[0])))[0]
    assert texts(post(served, "/v1/completions", dict(kw, prompt=P[0], echo=True)))[0] == P[0] + plain
    ids = post(served, "/tokenize", {"prompt": P[0]})["tokens"]
    assert texts(post(served, "/v1/completions", dict(kw, prompt=ids, echo=True)))[0] == P[0] + plain
    chunks, _ = raw_sse(served.url, "/v1/completions", dict(kw, prompt=P[0], echo=True, stream=True))
    assert chunks[0]["choices"][0]["text"] == P[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == P[0] + plain
    e = post(served, "/v1/completions", dict(kw, prompt=P[0], echo=True, logprobs=1), status=400)["error"]
    assert e["param"] == "echo" and "prompt logprobs" in e["message"]


def test_penalties_and_min_tokens_reach_the_engine(served):
    base = {"prompt": P[0], "max_tokens": LP_MAX, "temperature": 0}
    pen = texts(post(served, "/v1/completions", dict(base, **PENALTIES)))[0]
    assert pen == served.penalized.text and pen != served.greedy.text
    stopped = post(served, "/v1/completions", dict(base, stop=[served.stop]))
    assert stopped["usage"]["completion_tokens"] < 4
    r = post(served, "/v1/completions", dict(base, stop=[served.stop], min_tokens=12))
    assert texts(r)[0] == served.min_tok.text and r["usage"]["completion_tokens"] >= 12


# ---- tokenizer endpoints, version, openapi, unknown model --------------------------------------------------------
def test_tokenize_detokenize_version(served):
    r = post(served, "/tokenize", {"prompt": "Hi é", "model": served.model})
    assert r == {"tokens": [256, 72, 105, 32, 0xC3, 0xA9], "count": 6, "max_model_len": served.max_model_len}
    assert post(served, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})["tokens"] == [72, 105]
    with_gen = post(served, "/tokenize", {"messages": CHAT})["tokens"]
    without = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
    assert bytes(with_gen).decode() == "User: Name a Python keyword.\n\nAssistant:"
    assert bytes(without).decode() == "User: Name a Python keyword.\n\n"
    assert post(served, "/detokenize", {"tokens": r["tokens"]}) == {"prompt": "Hi é"}
    assert post(served, "/detokenize", {"tokens": [1, 9999]}, 400)["error"]["param"] == "tokens"
    assert post(served, "/detokenize", {"tokens": "abc"}, 400)["error"]["param"] == "tokens"
    assert post(served, "/tokenize", {}, 400)["error"]["param"] == "prompt"
    assert post(served, "/tokenize", {"messages": [{"role": "x"}]}, 400)["error"]["param"] == "messages[0].role"
    v = httpx.get(f"{served.url}/version", timeout=T).json()
    assert v == {"version": importlib.metadata.version("nfjax")}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}), ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [65]})])
def test_unknown_model_is_404(served, path, body):
    r = httpx.post(f"{served.url}{path}", json=dict(body, model="gpt-4"), timeout=T)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}
    assert httpx.post(f"{served.url}{path}", json=dict(body, model=served.model), timeout=T).status_code == 200


def test_unknown_model_through_the_client(served, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "The model `nope` does not exist." in str(e.value)
    r = httpx.get(f"{served.url}/v1/models/nope", timeout=T)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def _out_of_range(prop: dict) -> list:
    """Values just outside a numeric property's declared bounds (from its JSON schema)."""
    out = []
    for s in prop.get("anyOf", [prop]):
        if s.get("type") in ("integer", "number"):
            step = 1 if s["type"] == "integer" else 0.5
            out += [s["minimum"] - step] if "minimum" in s else []
            out += [s["maximum"] + step] if "maximum" in s else []
            out += [s[k] for k in ("exclusiveMinimum", "exclusiveMaximum") if k in s]
    return out


def test_openapi_documents_the_enforced_schemas(served):
    doc = httpx.get(f"{served.url}/openapi.json", timeout=T).json()
    assert doc["openapi"].startswith("3.")
    comps = doc["components"]["schemas"]
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/version", "/v1/models"):
        assert path in paths, path
    assert paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    comp, chat = comps["CompletionRequest"]["properties"], comps["ChatCompletionRequest"]["properties"]
    assert {"prompt", "n", "best_of", "logprobs", "echo", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_tokens", "logit_bias", "seed", "top_k", "ignore_eos", "stream"} <= set(comp)
    assert {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "n"} <= set(chat)
    assert {"tokens", "count", "max_model_len"} <= set(comps["TokenizeResponse"]["properties"])
    # every declared numeric bound is the one enforced: just outside it is a 400 naming the field
    checked = set()
    for name, props, path, base in (("completions", comp, "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                                    ("chat", chat, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})):
        for field, prop in props.items():
            for v in _out_of_range(prop):
                body = dict(base, **{field: v})
                if field == "top_logprobs":
                    body["logprobs"] = True
                e = post(served, path, body, 400)["error"]
                assert e["param"] == field, (name, field, v, e)
                checked.add(field)
    assert {"max_tokens", "temperature", "top_p", "top_k", "min_tokens", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "n", "best_of", "logprobs", "top_logprobs",
            "max_completion_tokens"} <= checked


BAD = [
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 0}, "echo"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"65": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ["x"] * 70, "n": 16}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 3, "max_completion_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{f}-{i}" for i, (p, _, f) in
                                                      enumerate(BAD)])
def test_new_fields_bad_input_is_400_naming_the_field(served, path, body, param):
    e = post(served, path, body, 400)["error"]
    assert e["param"] == param and e["type"] == "invalid_request_error" and f"'{param}'" in e["message"], e
    assert set(e) == {"message", "type", "param", "code"}
