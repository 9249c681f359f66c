"""Continuous batching: batch invariance under chunked prefill and forced preemption, page accounting, no
recompiles after warm-up, and the step trace."""
import random

import jax
import pytest

from nfjax.config import CacheConfig, BatcherConfig
from nfjax.engine import SamplingParams

from tests.engine.conftest import CompileCounter, make_engine


@pytest.fixture(scope="module")
def tight_engine():
    # 40 usable pages of 8 tokens for 64 requests of up to ~100 tokens each, admitted while any page is free
    # (memory prediction off): running requests outgrow the pool, so preemption is certain
    return make_engine(CacheConfig(page_size=8, num_pages=41, max_pages_per_seq=16),
                       BatcherConfig(token_buckets=(16, 64), max_seqs=16, predict_memory=False))


def _workload(n=64, seed=0):
    rng = random.Random(seed)
    words = "the of and to in is you that it he was for on are as with his they at be this have from".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(n)]
    lens = [rng.randint(4, 24) for _ in range(n)]
    return prompts, lens


def test_batch_invariance_with_preemption_and_no_recompiles(tight_engine, roomy_engine_alone):
    prompts, lens = _workload()
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in lens]
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        batched = tight_engine.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, "a step compiled after warm-up"
    steps = tight_engine.trace.steps
    assert any(s.decode_tokens and s.prefill_tokens for s in steps), "no mixed prefill/decode step"
    assert tight_engine.preemptions > 0, "the tiny page pool forced no preemption"
    assert tight_engine.pages_used == 0
    for p, sp, out in zip(prompts, params, batched):
        alone = roomy_engine_alone.generate(p, sp)[0]
        assert out.token_ids == alone.token_ids, p
        assert len(out.token_ids) == sp.max_tokens
    assert roomy_engine_alone.pages_used == 0


@pytest.fixture(scope="module")
def roomy_engine_alone():
    # same weights (seed 0) and buckets as tight_engine, roomy cache: each request runs alone
    return make_engine(CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16),
                       BatcherConfig(token_buckets=(16, 64), max_seqs=16))


def test_trace_accounts_every_token(tight_engine):
    tight_engine.trace.steps.clear()
    prompts, lens = _workload(8, seed=1)
    tight_engine.generate(prompts, [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in lens])
    s = tight_engine.trace.summary()
    prompt_tokens = sum(len(tight_engine.tokenizer.encode(p)) for p in prompts)
    assert s["prefill_tokens"] == prompt_tokens - s["prefix_reused_tokens"]     # the prefix cache's reuse skips
    # each request's first token comes from its prefill; the rest from decode steps (plus dropped extras: none,
    # since max_tokens is known ahead)
    assert s["decode_tokens"] == sum(lens) - len(prompts)
    for st in tight_engine.trace.steps:
        assert st.decode_tokens + st.prefill_tokens + st.padding == st.bucket


def test_page_table_wider_than_the_pool():
    # max_pages_per_seq > num_pages: the swap programs are shaped by the page-table width, not the pool
    eng = make_engine(CacheConfig(page_size=8, num_pages=6, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(16,), max_seqs=4, predict_memory=False))
    outs = eng.generate(["one two", "three four five", "six"],
                        SamplingParams.greedy(max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert eng.preemptions > 0      # 5 usable pages for three requests of up to 4 pages each
    assert eng.pages_used == 0


def test_prefill_chunks_per_step_are_capped(roomy_engine_alone):
    eng = make_engine(CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(16, 64), max_seqs=16, max_prefill_seqs=2))
    prompts, lens = _workload(8, seed=2)
    params = [SamplingParams.greedy(max_tokens=n, ignore_eos=True) for n in lens]
    outs = eng.generate(prompts, params)
    chunks = [st.num_seqs - st.decode_tokens for st in eng.trace.steps]
    assert max(chunks) == 2, chunks          # short prompts would fill the 64-token budget with more
    for p, sp, out in zip(prompts, params, outs):
        assert out.token_ids == roomy_engine_alone.generate(p, sp)[0].token_ids
    assert eng.pages_used == 0


def test_overload_finishes_with_rare_preemption():
    """A pool that holds a quarter of the requests at once, after a warm-up of short outputs (whose mean once
    made admission over-commit the cache): every request finishes, and preemption stays the exception."""
    eng = make_engine(CacheConfig(page_size=8, num_pages=49, max_pages_per_seq=16),
                      BatcherConfig(token_buckets=(16, 64), max_seqs=16))
    eng.generate(["warm up"] * 4, SamplingParams.greedy(max_tokens=2, ignore_eos=True))
    rng = random.Random(1)
    n = 48
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(24, 48))] for _ in range(n)]
    lens = [rng.randint(24, 48) for _ in range(n)]
    pages = [-(-(len(p) + o) // 8) for p, o in zip(prompts, lens)]
    assert sum(pages) >= 4 * 48, "the requests need at least 4x the 48 usable pages"
    eng.trace.steps.clear()
    outs = eng.generate(prompts, [SamplingParams.greedy(max_tokens=o, ignore_eos=True) for o in lens])
    assert [len(o.token_ids) for o in outs] == lens and all(o.finish_reason == "length" for o in outs)
    s = eng.trace.summary()
    assert s["steps_with_preemption"] <= 0.01 * s["steps"], s
    assert eng.pages_used == 0
