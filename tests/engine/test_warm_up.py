"""The start-up warm-up (nfjax/engine/warm_up.py) runs every step program on empty batches and changes nothing an
engine computes afterwards: the same tokens and logprobs, with penalties, sampling and chunked prefill."""
import numpy as np

from nfjax.config import BatcherConfig, CacheConfig
from nfjax.engine import SamplingParams
from nfjax.engine.warm_up import warm_up
from tests.engine.conftest import make_engine

CACHE = CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=16)
SCHED = BatcherConfig(token_buckets=(16, 64), max_seqs=8, prefill_bucket=128)      # its programs run too
PROMPTS = ["warm up", "every program once", "a" * 70, "x"]
PARAMS = [SamplingParams.greedy(max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=6, max_tokens=10, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
          SamplingParams(temperature=1.0, top_k=5, seed=7, max_tokens=10, ignore_eos=True)]


def outputs(engine):
    outs = engine.generate(PROMPTS, PARAMS)
    return [(o.token_ids, [round(lp.logprob, 5) for lp in (o.logprobs or [])]) for o in outs]


def test_warm_up_changes_nothing():
    engine = make_engine(CACHE, SCHED)
    want = outputs(engine)
    kv_before = [np.asarray(a) for a in engine.runner.kv.arrays()]
    warm_up(engine.runner)
    for a, b in zip(kv_before, engine.runner.kv.arrays()):
        np.testing.assert_array_equal(a, np.asarray(b))          # all padding: no cache write
    assert outputs(engine) == want
    assert engine.pages_used == 0
