"""Penalties, min_tokens and logprobs on the device (nfjax/engine/penalties.py), checked against an independent
computation: the reference forward's logits (nfjax/models/reference.py, no cache, no batching) teacher-forced on
the engine's tokens, with HF transformers' RepetitionPenaltyLogitsProcessor and OpenAI's formula in numpy."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import RepetitionPenaltyLogitsProcessor

from nfjax.config import BatcherConfig, CacheConfig
from nfjax.engine import SamplingParams
from nfjax.errors import UserError
from nfjax.models import reference
from tests.engine.conftest import TINY, CompileCounter, make_engine

GAP = 1e-3          # a step whose expected top-2 logits are closer than this is not judged (f32 rounding)


@partial(jax.jit, static_argnums=0)
def _ref_logits(graphdef, state, tokens):
    return reference.logits(nnx.merge(graphdef, state), tokens[None])[0]


class Reference:
    """Logits of every position of a token sequence by the reference forward (causal: padded to a fixed width,
    so it compiles once)."""

    def __init__(self, engine, width: int = 128):
        self.graphdef, self.state = nnx.split(engine.runner.model())
        self.width = width

    def logits(self, ids: list[int]) -> np.ndarray:
        toks = np.zeros(self.width, np.int32)
        toks[:len(ids)] = ids
        return np.asarray(_ref_logits(self.graphdef, self.state, toks), np.float64)[:len(ids)]


def penalized(raw: np.ndarray, prompt: list[int], generated: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's order: HF's repetition penalty over prompt + generated ids, then OpenAI's frequency/presence over
    the generated ones: logits -= frequency * count + presence * (count > 0)."""
    x = torch.tensor(raw[None])
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + generated]), x)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=raw.shape[-1])
    return x.numpy()[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def check_greedy(ref: Reference, prompt: list[int], out: list[int], p: SamplingParams) -> int:
    """Each greedy token is the argmax of the penalized reference logits given the tokens before it; returns
    the number of steps too close to call."""
    logits = ref.logits(prompt + out)
    close = 0
    for t, tok in enumerate(out):
        want = penalized(logits[len(prompt) + t - 1], prompt, out[:t], p)
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] < GAP:
            close += 1
            continue
        assert tok == int(np.argmax(want)), (t, p)
    return close


PROMPTS = ["Hello there, hello there", "aaaa bbbb aaaa", "The quick brown fox", "x", "penalties: none"]


def test_penalties_change_greedy_tokens_as_the_reference_predicts(roomy_engine):
    """One batch, requests with different penalties and some with none, 16 greedy tokens each."""
    eng = roomy_engine
    params = [SamplingParams.greedy(max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams.greedy(max_tokens=16, ignore_eos=True, presence_penalty=2.0, repetition_penalty=1.3),
              SamplingParams.greedy(max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams.greedy(max_tokens=16, ignore_eos=True, frequency_penalty=-1.5, presence_penalty=0.5),
              SamplingParams.greedy(max_tokens=16, ignore_eos=True)]
    outs = eng.generate(PROMPTS, params)
    plain = eng.generate(PROMPTS, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    ref = Reference(eng)
    close = 0
    for text, p, o in zip(PROMPTS, params, outs):
        close += check_greedy(ref, eng.tokenizer.encode(text), o.token_ids, p)
    assert close <= 3, f"{close} of 80 steps too close to judge"
    changed = [o.token_ids != q.token_ids for o, q in zip(outs, plain)]
    assert changed[:4] == [True] * 4 and not changed[4], changed
    assert eng.pages_used == 0 and len(eng.batcher.free_penalty_slots) == eng.runner.penalty_slots


def test_repetition_penalty_counts_the_prompt_and_openai_penalties_do_not(roomy_engine):
    eng = roomy_engine
    ref = Reference(eng)
    base = eng.tokenizer.encode("prompt tokens")
    cont = eng.generate(base, SamplingParams.greedy(max_tokens=24, ignore_eos=True))[0].token_ids
    k = next(k for k in range(24) if cont[k] in base + cont[:k])
    prompt = base + cont[:k]                  # greedy's next token is a prompt token
    plain = eng.generate(prompt, SamplingParams.greedy(max_tokens=1))[0].token_ids[0]
    assert plain == cont[k] and plain in prompt
    row = ref.logits(prompt)[-1]
    rep = SamplingParams.greedy(max_tokens=1, repetition_penalty=2.0)
    freq = SamplingParams.greedy(max_tokens=1, frequency_penalty=2.0, presence_penalty=2.0)
    got_rep, got_freq = (o.token_ids[0] for o in eng.generate([prompt, prompt], [rep, freq]))
    assert got_rep == int(np.argmax(penalized(row, prompt, [], rep))) != plain
    assert got_freq == plain                  # OpenAI's penalties see generated tokens only


def test_min_tokens_holds_back_stop_ids_eos_and_stop_strings(roomy_engine):
    eng = roomy_engine
    prompt = eng.tokenizer.encode("stop here")
    greedy = eng.generate(prompt, SamplingParams.greedy(max_tokens=24, ignore_eos=True))[0]
    tok = greedy.token_ids[2]
    first = greedy.token_ids.index(tok)
    stopped = eng.generate(prompt, SamplingParams.greedy(max_tokens=24, stop_token_ids=(tok,)))[0]
    assert stopped.token_ids == greedy.token_ids[:first + 1] and stopped.finish_reason == "stop"
    m = first + 4
    held = eng.generate(prompt, SamplingParams.greedy(max_tokens=24, stop_token_ids=(tok,), min_tokens=m))[0]
    assert held.token_ids[:first] == greedy.token_ids[:first]
    assert tok not in held.token_ids[:m] and len(held.token_ids) > m
    assert held.finish_reason == "length" or held.token_ids[-1] in (tok, *TINY.eos_token_ids)
    # the banned step takes the reference's best token other than the stop id
    ref = Reference(eng)
    row = ref.logits(prompt + held.token_ids)[len(prompt) + first - 1]
    row[tok] = -np.inf
    assert held.token_ids[first] == int(np.argmax(row))
    # a stop string inside the first min_tokens tokens does not end the request (and is not cut from the text)
    text = greedy.text
    i = next(i for i in range(1, 6) if text.find(text[i:i + 2]) == i)
    stop = text[i:i + 2]
    assert stop in eng.tokenizer.decode(greedy.token_ids[:8])
    cut = eng.generate(prompt, SamplingParams.greedy(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:i]
    kept = eng.generate(prompt, SamplingParams.greedy(max_tokens=24, ignore_eos=True, stop=(stop,), min_tokens=8))[0]
    assert kept.text.startswith(text[:i + 2]) and len(kept.token_ids) > 8


def test_min_tokens_bans_the_models_eos():
    """An engine whose EOS is a token greedy picks: it stops there, unless min_tokens holds it back or
    ignore_eos (then EOS is neither a stop nor banned)."""
    cache, sched = CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16), BatcherConfig((32,), max_seqs=4)
    plain = make_engine(cache, sched)
    prompt = plain.tokenizer.encode("end of text")
    greedy = plain.generate(prompt, SamplingParams.greedy(max_tokens=12, ignore_eos=True))[0].token_ids
    eos = greedy[1]
    eng = make_engine(cache, sched, cfg=TINY.replace(eos_token_ids=(eos,)))
    first = greedy.index(eos)
    assert eng.generate(prompt, SamplingParams.greedy(max_tokens=12))[0].token_ids == greedy[:first + 1]
    held = eng.generate(prompt, SamplingParams.greedy(max_tokens=12, min_tokens=first + 3))[0].token_ids
    assert eos not in held[:first + 3] and held[:first] == greedy[:first]
    ignored = eng.generate(prompt, SamplingParams.greedy(max_tokens=12, min_tokens=6, ignore_eos=True))[0]
    assert ignored.token_ids == greedy


def test_logprobs_are_the_reference_log_softmax(roomy_engine):
    """Raw logprobs (before temperature and penalties) of each generated token, the top k best first, and their
    running sum; a request without logprobs gets None, also in a batch that computes them."""
    eng = roomy_engine
    prompts = ["log probs", "with penalties and sampling", "top twenty", "off"]
    params = [SamplingParams.greedy(max_tokens=10, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=1.3, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=5,
                             frequency_penalty=1.0, repetition_penalty=1.2),
              SamplingParams.greedy(max_tokens=10, ignore_eos=True, logprobs=20),
              SamplingParams.greedy(max_tokens=10, ignore_eos=True)]
    outs = eng.generate(prompts, params)
    ref = Reference(eng)
    for text, p, o in zip(prompts, params, outs):
        if p.logprobs is None:
            assert o.logprobs is None and o.new_logprobs is None and o.cumulative_logprob is None
            continue
        prompt = eng.tokenizer.encode(text)
        logits = ref.logits(prompt + o.token_ids)[len(prompt) - 1:-1]
        m = logits.max(-1, keepdims=True)
        want = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))        # log_softmax
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
        got = np.array([lp.logprob for lp in o.logprobs])
        np.testing.assert_allclose(got, want[np.arange(len(got)), o.token_ids], atol=1e-4)
        assert o.cumulative_logprob == pytest.approx(got.sum(), abs=1e-9)
        for t, lp in enumerate(o.logprobs):
            assert len(lp.top) == p.logprobs
            ids, vals = [i for i, _ in lp.top], np.array([v for _, v in lp.top])
            assert np.all(np.diff(vals) <= 0)
            np.testing.assert_allclose(vals, want[t, ids], atol=1e-4)
            order = np.argsort(-want[t], kind="stable")[:p.logprobs]
            if p.logprobs and np.min(-np.diff(want[t][np.argsort(-want[t])][:p.logprobs + 1])) > GAP:
                assert ids == order.tolist()
        if p.temperature == 0 and p.logprobs:
            assert all(lp.top[0][0] == lp.token_id for lp in o.logprobs)     # greedy: the sample is the best


def test_streamed_logprobs_add_up(roomy_engine):
    sp = SamplingParams.greedy(max_tokens=12, ignore_eos=True, logprobs=2)
    outs = list(roomy_engine.stream("stream log probs", sp))
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)
    final = outs[-1]
    assert sum((o.new_logprobs for o in outs), []) == final.logprobs and len(final.logprobs) == 12
    assert final.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in final.logprobs))


def test_only_batches_that_need_it_run_the_full_head(roomy_engine):
    """Greedy and sampling batches run the plain heads (no logprobs read back); a request with penalties puts
    every step it is in on the full head, one with logprobs or min_tokens only the steps where it samples."""
    eng = roomy_engine
    calls = []
    run_step = eng.runner.run_step
    eng.runner.run_step = lambda *a, **kw: calls.append(kw.get("full") is not None) or run_step(*a, **kw)
    try:
        eng.generate(["plain", "sampled"], [SamplingParams.greedy(max_tokens=4),
                                             SamplingParams(temperature=1.0, seed=1, max_tokens=4)])
        assert calls and not any(calls)
        calls.clear()
        eng.generate("x" * 200, SamplingParams.greedy(max_tokens=3, ignore_eos=True, repetition_penalty=1.1))
        assert len(calls) >= 4 and all(calls)             # two prompt chunks (128-token bucket) and the decodes
        calls.clear()
        eng.generate("y" * 200, SamplingParams.greedy(max_tokens=3, ignore_eos=True, min_tokens=1))
        assert calls[:2] == [False, True] and not any(calls[2:])   # mid-prompt chunk; first token; then past
    finally:
        eng.runner.run_step = run_step


def test_same_seed_same_tokens_whatever_the_batch_with_penalties(roomy_engine):
    eng = roomy_engine
    sp = SamplingParams(temperature=1.0, top_k=40, seed=77, max_tokens=12, ignore_eos=True, frequency_penalty=0.8,
                        presence_penalty=0.3, repetition_penalty=1.2, logprobs=1)
    alone = eng.generate("Sampling with penalties", sp)[0]
    crowd = eng.generate(["other", "prompts", "here", "Sampling with penalties"],
                         [SamplingParams(temperature=1.0, seed=1, max_tokens=5),
                          SamplingParams(temperature=0.7, seed=2, max_tokens=9, repetition_penalty=1.5),
                          SamplingParams.greedy(max_tokens=14, presence_penalty=-1.0), sp])
    assert crowd[-1].token_ids == alone.token_ids
    np.testing.assert_allclose([lp.logprob for lp in crowd[-1].logprobs], [lp.logprob for lp in alone.logprobs],
                               atol=1e-5)
    other = eng.generate("Sampling with penalties", dataclasses.replace(sp, seed=78))[0]
    assert other.token_ids != alone.token_ids


def test_requests_wait_for_a_free_penalty_slot_and_reuse_it(roomy_engine):
    """With one penalty slot, penalized requests run one at a time (each reusing the slot the previous one
    held, cleared on its first step) and get the tokens they get alone; plain requests do not wait."""
    eng = roomy_engine
    prompts = ["one slot", "aaaa bbbb aaaa", "Hello there, hello there", "plain"]
    params = [SamplingParams.greedy(max_tokens=8, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams.greedy(max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, presence_penalty=1.0),
              SamplingParams.greedy(max_tokens=8, ignore_eos=True)]
    alone = [eng.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    saved = list(eng.batcher.free_penalty_slots)
    eng.batcher.free_penalty_slots = saved[-1:]
    held = []
    try:
        for p, sp in zip(prompts, params):
            eng.add_request(p, sp, request_id=p)
        outs = {}
        while eng.has_unfinished():
            held.append(sum(r.penalty_slot is not None for r in eng.batcher.running))
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
    finally:
        eng.batcher.free_penalty_slots = saved
    assert max(held) == 1
    assert [outs[p] for p in prompts] == alone


@pytest.mark.parametrize("kw,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(UserError, match=field):
        SamplingParams(**kw)


def test_too_many_stop_ids_under_min_tokens(roomy_engine):
    ids = tuple(range(20))
    with pytest.raises(UserError, match="stop_token_ids"):
        roomy_engine.add_request("x", SamplingParams(stop_token_ids=ids, min_tokens=2))
    roomy_engine.abort(roomy_engine.add_request("x", SamplingParams(stop_token_ids=ids)))    # no min_tokens: fine


def test_preemption_keeps_penalties_and_logprobs_and_compiles_nothing():
    """A pool that forces swapping out: penalized, seeded, min_tokens and logprobs requests get the tokens (and
    logprobs) of a roomy engine that never preempts; a swapped-out request keeps its penalty slot."""
    import random
    sched = BatcherConfig(token_buckets=(16, 64), max_seqs=16, predict_memory=False)
    tight = make_engine(CacheConfig(page_size=8, num_pages=41, max_pages_per_seq=16), sched)
    roomy = make_engine(CacheConfig(page_size=8, num_pages=512, max_pages_per_seq=16), sched)
    rng = random.Random(3)
    words = "the of and to in is you that it he was for on are as with his they at be this have from".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(32)]
    kinds = [lambda n, i: SamplingParams.greedy(max_tokens=n, ignore_eos=True, frequency_penalty=1.2),
             lambda n, i: SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True,
                                         repetition_penalty=1.4, presence_penalty=0.5),
             lambda n, i: SamplingParams.greedy(max_tokens=n, logprobs=3, min_tokens=n // 2),
             lambda n, i: SamplingParams.greedy(max_tokens=n, ignore_eos=True)]
    params = [kinds[i % 4](rng.randint(4, 24), i) for i in range(len(prompts))]
    swapped_slots = []
    swap_out = tight.runner.swap_out
    tight.runner.swap_out = lambda pages: swapped_slots.extend(
        r.penalty_slot for r in tight.batcher.swapped if r.penalized) or swap_out(pages)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        got = tight.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    want = roomy.generate(prompts, params)
    assert counter.count == 0, "a step compiled after warm-up"
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert swapped_slots and None not in swapped_slots, "no penalized request was swapped out holding its slot"
    for p, g, w in zip(prompts, got, want):
        assert g.token_ids == w.token_ids, p
        if g.logprobs is not None:
            np.testing.assert_allclose([lp.logprob for lp in g.logprobs], [lp.logprob for lp in w.logprobs],
                                       atol=1e-5)
    assert tight.pages_used == 0 and len(tight.batcher.free_penalty_slots) == tight.runner.penalty_slots


@pytest.mark.parametrize("k", [1, 16, 17, 20, 37])
def test_top_k_in_rounds_is_lax_top_k(k):
    """The logprobs' top-k runs in rounds of 16 (XLA:GPU sorts whole rows above that): same values, ids and
    order as one `lax.top_k`, ties (lowest id first) across a round's boundary included."""
    from nfjax.engine.penalties import top_k
    x = jnp.asarray(np.random.default_rng(k).integers(0, 6, (5, 300)), jnp.float32)      # many ties
    got, want = top_k(x, k), jax.lax.top_k(x, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_full_head_has_no_conditional(roomy_engine):
    """Like the plain heads (docs/design.md section 2): no device-predicated conditional in the full head."""
    for b, prog in roomy_engine.runner._full_head.items():
        assert "conditional(" not in prog.as_text(), b
