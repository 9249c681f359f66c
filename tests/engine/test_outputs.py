"""RequestOutput views (nfjax/engine/outputs.py): read late, they hold what the request held at their step."""
from __future__ import annotations

import copy
import pickle

from nfjax.engine.detok import OutputText
from nfjax.engine.outputs import RequestOutput, TokenLogprob
from nfjax.engine.request import Request, Status
from nfjax.engine.sampling_params import SamplingParams
from nfjax.tokenizer import ByteTokenizer


def _run(params: SamplingParams, text: bytes, finish_at: int | None = None) -> list[RequestOutput]:
    """The engine's per-token bookkeeping for one request fed `text` byte by byte; its views, unread."""
    req = Request("r", [256, 65], params, seed=0)
    req.out_text = OutputText(ByteTokenizer(), params, req.prompt_ids)
    outs = []
    for n, tok in enumerate(text, 1):
        req.output_ids.append(tok)
        lp = [TokenLogprob(tok, -0.5 * n, ((tok, -0.5 * n),))] if params.logprobs is not None else None
        if lp:
            req.logprobs.append(lp[0])
            req.cumulative_logprob += lp[0].logprob
        if n == 1:
            req.timings.first_token = req.timings.arrival + 1.0
        req.out_text.add(tok)
        if req.out_text.stopped or n == finish_at:
            req.status, req.finish_reason = Status.FINISHED, "stop"
            req.timings.finished = req.timings.arrival + 2.0
        outs.append(RequestOutput.view(req, [tok], req.out_text.release(req.finished), lp))
        if req.finished:
            break
    return outs


def test_views_read_after_the_run_hold_each_steps_values():
    outs = _run(SamplingParams(stop=["xy"], logprobs=1), b"abcdxyz")
    assert [o.token_ids for o in outs] == [list(b"abcdxy"[:n]) for n in range(1, 7)]
    # "x" is held back (it may start "xy"); the stop string is removed from the final text
    assert [o.text for o in outs] == ["", "a", "ab", "abc", "abcd", "abcd"]
    assert [o.new_text for o in outs] == ["", "a", "b", "c", "d", ""]
    assert [o.finished for o in outs] == [False] * 5 + [True] and outs[-1].finish_reason == "stop"
    assert [len(o.logprobs) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert outs[2].logprobs[-1].logprob == -1.5 and outs[2].cumulative_logprob == -3.0
    assert [o.metrics["e2e_s"] for o in outs] == [None] * 5 + [2.0]       # a running step's, read after finish
    assert all(o.metrics["ttft_s"] == 1.0 for o in outs)


def test_a_view_equals_the_eager_output_copies_and_pickles():
    outs = _run(SamplingParams(), b"hello", finish_at=3)
    o = outs[-1]
    eager = RequestOutput("r", [256, 65], list(b"hel"), "hel", [ord("l")], "l", True, "stop",
                          o.metrics, None, None, None)
    assert o == eager and repr(o) == repr(eager)
    for c in (copy.copy(o), pickle.loads(pickle.dumps(o))):
        assert c == eager and c._req is None
    o.token_ids.append(0)                 # a reader's list is its own: views read later are unchanged
    assert o != eager and outs[1].token_ids == list(b"he") and outs[1].text == "he"


def test_views_without_logprobs_have_none():
    o = _run(SamplingParams(), b"ab")[0]
    assert o.logprobs is None and o.new_logprobs is None and o.cumulative_logprob is None and o.text == "a"
