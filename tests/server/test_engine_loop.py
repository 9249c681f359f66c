"""Engine-loop robustness with a scripted stand-in engine (no JAX, fast): an engine that raises mid-step fails
the requests in flight with a 500 body and the server then answers 503 instead of hanging."""
from __future__ import annotations

import threading
import time
import types

import httpx

from nfjax.config import ServerConfig
from nfjax.engine.outputs import RequestOutput
from nfjax.server import ServerThread
from nfjax.tokenizer.byte import ByteTokenizer


class ScriptedEngine:
    """Emits token 'a' per step per request; raises on the step after a prompt containing 'boom' arrives.
    Records the calling threads: only one thread may ever touch it."""

    def __init__(self):
        self.tokenizer = ByteTokenizer()
        self.model_config = types.SimpleNamespace(vocab_size=258)
        self.max_model_len = 128
        self.pages_total = 10
        self.reqs: dict[str, list] = {}
        self.threads: set[int] = set()

    def _t(self):
        self.threads.add(threading.get_ident())

    def add_request(self, prompt, params, request_id=None):
        self._t()
        self.reqs[request_id] = [prompt, params, []]
        return request_id

    def abort(self, rid):
        self._t()
        self.reqs.pop(rid, None)

    def has_unfinished(self):
        self._t()
        return bool(self.reqs)

    @property
    def num_waiting(self):
        return 0

    @property
    def num_running(self):
        return len(self.reqs)

    @property
    def pages_used(self):
        return len(self.reqs)

    def step(self):
        self._t()
        if any(bytes(p[0][1:]).find(b"boom") >= 0 for p in self.reqs.values()):
            raise RuntimeError("kernel exploded")
        if any(bytes(p[0][1:]).find(b"slow") >= 0 for p in self.reqs.values()):
            time.sleep(1.0)
        outs = []
        for rid, (prompt, params, toks) in list(self.reqs.items()):
            toks.append(97)
            done = len(toks) >= params.max_tokens
            if done:
                del self.reqs[rid]
            outs.append(RequestOutput(rid, prompt, list(toks), "a" * len(toks), [97], "a", done,
                                      "length" if done else None))
        return outs


def test_engine_failure_gives_500_then_503_and_never_hangs():
    eng = ScriptedEngine()
    with ServerThread(eng, ServerConfig(port=0, log_level="critical")) as srv:
        u = srv.url
        r = httpx.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaaaa"
        r = httpx.post(f"{u}/v1/completions", json={"prompt": "boom", "max_tokens": 5}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "kernel exploded" in r.json()["error"]["message"]
        r = httpx.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"]
        assert httpx.get(f"{u}/health", timeout=10).status_code == 503
    assert len(eng.threads) == 1          # every engine call came from the engine-loop thread


def test_slow_engine_steps_do_not_block_http():
    eng = ScriptedEngine()
    with ServerThread(eng, ServerConfig(port=0, log_level="critical")) as srv:
        res = {}
        t = threading.Thread(target=lambda: res.update(r=httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "slow", "max_tokens": 3}, timeout=30)))
        t.start()
        time.sleep(0.3)                         # the engine thread is now inside a 1 s step
        for _ in range(5):
            t0 = time.perf_counter()
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
            assert time.perf_counter() - t0 < 0.5
        t.join(30)
        assert res["r"].status_code == 200 and res["r"].json()["usage"]["completion_tokens"] == 3
