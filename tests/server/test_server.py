"""The OpenAI-compatible server on real uvicorn (127.0.0.1), driven by the official `openai` client and raw HTTP.

One server per module (small buckets) keeps this fast; every client call has a timeout, so nothing can hang.
"""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx
import openai
import pytest

from nfjax.config import ServerConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.server import ServerThread, model_name_for
from tests.server.conftest import raw_sse, scrape, wait_idle

PROMPTS = ["The class", "def f(x):", "Hello", "In Python, a list is", "import", "The quick brown fox jumps over",
           "x = 1\n", "Return the"]
MAX_TOKENS = 24
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a Python keyword."}]
T = 30.0   # per-call client timeout (s)
REQUEST_TIMEOUT = 1.5   # the server's time limit for receiving a request body (s)


@dataclass
class Served:
    url: str
    model: str
    srv: ServerThread
    ref: dict[str, tuple[str, int, str]]      # prompt -> offline greedy (text, n_tokens, finish_reason)
    chat_ref: tuple[str, int, int]            # (text, n_tokens, prompt_tokens)
    prompt_tokens: dict[str, int]


@pytest.fixture(scope="module")
def served(model_dir):
    engine = Engine.from_pretrained(model_dir, dtype="float32", token_buckets=(32, 128), max_seqs=16, num_pages=256)
    greedy = SamplingParams.greedy(max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS, greedy)      # offline reference, before the server owns the engine
    ref = {p: (o.text, len(o.token_ids), o.finish_reason) for p, o in zip(PROMPTS, outs)}
    chat_ids = engine.tokenizer.encode_chat(CHAT)
    c = engine.generate(chat_ids, greedy)[0]
    prompt_tokens = {p: len(engine.tokenizer.encode(p)) for p in PROMPTS}
    name = model_name_for(model_dir)
    srv = ServerThread(engine, ServerConfig(port=0, max_queue=64, log_level="warning", request_timeout_s=REQUEST_TIMEOUT), name).start()
    try:
        yield Served(srv.url, name, srv, ref, (c.text, len(c.token_ids), len(chat_ids)), prompt_tokens)
    finally:
        srv.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=T, max_retries=0)


# ---- the official client ---------------------------------------------------------------------------------------
def test_models_and_health(served, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [served.model]
    assert client.models.retrieve(served.model).id == served.model
    h = httpx.get(f"{served.url}/health", timeout=T)
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_completion_stream_and_raw_sse_agree_with_offline_greedy(served, client):
    p = PROMPTS[0]
    text, n, reason = served.ref[p]
    r = client.completions.create(model=served.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == served.prompt_tokens[p]
    assert r.usage.total_tokens == n + served.prompt_tokens[p]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == served.model

    parts, finish, usage = [], None, None
    for ch in client.completions.create(model=served.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == text and finish == reason and usage.completion_tokens == n

    chunks, lines = raw_sse(served.url, "/v1/completions",
                            {"model": served.model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "stream": True})
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_and_chat_stream(served, client):
    text, n, n_prompt = served.chat_ref
    r = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and m.content == text
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == n_prompt
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    parts, roles, finish = [], [], None
    for ch in client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True):
        d = ch.choices[0].delta
        roles += [d.role] if d.role else []
        parts.append(d.content or "")
        finish = ch.choices[0].finish_reason or finish
    assert "".join(parts) == text and roles == ["assistant"] and finish == r.choices[0].finish_reason

    chunks, lines = raw_sse(served.url, "/v1/chat/completions", {"model": served.model, "messages": CHAT,
                                                                  "max_tokens": MAX_TOKENS, "temperature": 0,
                                                                  "stream": True})
    assert lines[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["object"] == "chat.completion.chunk"


def test_stop_seed_top_k_and_token_prompt(served, client):
    p = PROMPTS[3]
    text, _, _ = served.ref[p]
    stop = text[5:8]
    assert stop and stop in text
    r = client.completions.create(model=served.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    kw = dict(model=served.model, prompt=p, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kw, extra_body={"top_k": 20}).choices[0].text
    b = client.completions.create(**kw, extra_body={"top_k": 20}).choices[0].text
    assert a == b
    ids = [256] + list(p.encode())      # the byte tokenizer: BOS + UTF-8 bytes
    r = client.completions.create(model=served.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == text


# ---- bad input -------------------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "a"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "model": 5}, "model"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 1100}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{f}-{i}" for i, (p, _, f) in
                                                      enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(served, path, body, param):
    r = httpx.post(f"{served.url}{path}", json=body, timeout=T)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_malformed_requests_and_routes(served, client):
    u = served.url
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(f"{u}/v1/completions", content=raw, timeout=T, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], raw
    assert httpx.get(f"{u}/v1/nothing", timeout=T).json()["error"]["code"] == "not_found"
    r = httpx.get(f"{u}/v1/completions", timeout=T)
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = httpx.post(f"{u}/v1/completions", content=b"x" * (9 << 20), timeout=T)
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert httpx.get(f"{u}/v1/models/other", timeout=T).status_code == 404
    with pytest.raises(openai.BadRequestError) as e:        # the official client surfaces our error body
        client.completions.create(model=served.model, prompt="x", top_p=3)
    assert e.value.body["param"] == "top_p"
    # nothing above stalled the loop
    r = client.completions.create(model=served.model, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{u}/health", timeout=T).status_code == 200


def test_queue_over_bound_is_429(served):
    loop = served.srv.state.loop
    old = loop.max_queue
    loop.max_queue = 2          # live limit: 16 run at once, 2 may wait; the rest of a burst of 40 is refused

    async def burst():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*[c.post(f"{served.url}/v1/completions", json={
                "prompt": "The class", "max_tokens": 40, "temperature": 0}) for _ in range(40)])
    try:
        rs = asyncio.run(burst())
    finally:
        loop.max_queue = old
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and codes.count(429) >= 10 and codes.count(200) >= 2, codes
    err = next(r for r in rs if r.status_code == 429).json()["error"]
    assert "queue" in err["message"] and err["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in rs if r.status_code == 200)
    wait_idle(served.url)


def test_non_streaming_client_timeout_aborts_request(served):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json={"prompt": "The class", "max_tokens": 900,
                                                         "temperature": 0, "ignore_eos": True}, timeout=0.5)
    m = wait_idle(served.url)
    assert m['nfjax_requests_total{finish_reason=abort}'] >= 1


# ---- soak ------------------------------------------------------------------------------------------------------
def test_soak_concurrent_streams_with_disconnects(served):
    """32 concurrent streaming clients, 96 requests, a third hang up at random points: completed streams are
    well-formed and equal offline greedy output token for token; afterwards nothing is held."""
    rng = random.Random(1234)
    jobs = []
    for i in range(96):
        p = PROMPTS[i % len(PROMPTS)]
        cut = rng.randint(-1, 12) if i % 3 == 0 else None    # hang up after cut+1 lines (-1: before any)
        jobs.append((p, cut))
    queue: asyncio.Queue = asyncio.Queue()
    results: list[tuple[str, int | None, object]] = []

    async def one(c: httpx.AsyncClient, p: str, cut: int | None):
        body = {"model": served.model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        lines = []
        async with c.stream("POST", f"{served.url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            if cut == -1:
                return lines              # gone as soon as the headers arrived (often still queued)
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    if cut is not None and len(lines) > cut:
                        return lines          # leaving the block closes the connection mid-stream
        return lines

    async def worker(c):
        while not queue.empty():
            p, cut = queue.get_nowait()
            results.append((p, cut, await one(c, p, cut)))

    async def main():
        for j in jobs:
            queue.put_nowait(j)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.wait_for(asyncio.gather(*[worker(c) for _ in range(32)]), timeout=240)

    asyncio.run(main())
    assert len(results) == len(jobs)
    complete = 0
    for p, cut, lines in results:
        if cut is not None and lines[-1:] != ["data: [DONE]"]:
            continue                            # hung up before the end
        text, n, reason = served.ref[p]
        assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        body, usage = chunks[:-1], chunks[-1]
        assert "".join(ch["choices"][0]["text"] for ch in body) == text, p
        assert body[-1]["choices"][0]["finish_reason"] == reason
        assert all(ch["choices"][0]["finish_reason"] is None for ch in body[:-1])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
        assert len({ch["id"] for ch in chunks}) == 1
        complete += 1
    assert complete >= 64
    m = wait_idle(served.url)
    assert m["nfjax_kv_pages_used"] == 0 and m["nfjax_running_requests"] == 0
    assert m['nfjax_requests_total{finish_reason=abort}'] >= 10


def test_metrics_exposition(served):
    m = scrape(served.url)
    for name in ("nfjax_queue_depth", "nfjax_running_requests", "nfjax_kv_pages_used", "nfjax_kv_pages_total",
                 "nfjax_generation_tokens_per_second", "nfjax_generation_tokens_total",
                 "nfjax_time_to_first_token_seconds_count", "nfjax_inter_token_latency_seconds_count",
                 "nfjax_e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["nfjax_time_to_first_token_seconds_count"] > 0 and m["nfjax_inter_token_latency_seconds_count"] > 0
    assert m["nfjax_kv_pages_total"] == 255
    r = httpx.get(f"{served.url}/metrics", timeout=T)
    assert r.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "ok"}, '
                             '{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages[1].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], '
                             '"max_tokens": 2}', "messages[0].content[0].text"),
])
def test_lone_surrogate_is_400_naming_the_field(served, client, path, body, param):
    """JSON can spell a lone surrogate ("\\ud800") that no UTF-8 tokenizer can encode: a 400, not a 500."""
    r = httpx.post(f"{served.url}{path}", content=body.encode(), timeout=T,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    # (the official Python client cannot send one: its encoder fails first; a JS client sends it as above.)
    # the server goes on serving
    r = client.completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("sent", [b"", b'{"prompt": "Hel'])
def test_half_sent_body_is_408_and_closed_within_the_timeout(served, client, sent):
    """Headers promise 200 bytes, fewer arrive, the client stalls: 408 and the connection closed, in time."""
    import socket
    import time

    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=T) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n" + sent)
        t0 = time.monotonic()
        data = b""
        while chunk := s.recv(65536):            # until the server closes the connection
            data += chunk
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"request_timeout" in data and b"not received within 1.5 s" in data, data
    assert REQUEST_TIMEOUT - 0.1 < took < REQUEST_TIMEOUT + 5, took
    r = client.completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
