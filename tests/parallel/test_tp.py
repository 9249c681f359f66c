"""Tensor parallelism on 8 forced host devices: TP = 2/4/8 match TP = 1 in greedy tokens and logits."""
import numpy as np
import pytest

from nfjax.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, BatcherConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.errors import UserError
from nfjax.models.random_init import random_model
from nfjax.tokenizer.byte import ByteTokenizer
from tp_common import prompt_logits as tp_prompt_logits

LLAMA3 = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                     num_kv_heads=2, head_dim=8, rope_theta=500000.0, max_position_embeddings=256,
                     eos_token_ids=(257,))
QWEN2 = LLAMA3.replace(model_type="qwen2", num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                       tie_word_embeddings=True)
PROMPTS = ["Hello there", "tensor parallel", "a", "The quick brown fox jumps"]
CACHE = CacheConfig(page_size=8, num_pages=64, max_pages_per_seq=8)
SCHED = BatcherConfig(token_buckets=(64,), max_seqs=4)


def engine_for(cfg, tp):
    model = random_model(cfg, seed=1, std=0.2)     # wide logit margins: token equality tests TP, not rounding
    return Engine(model, ByteTokenizer(), EngineConfig(cfg, CACHE, SCHED, parallel=ParallelConfig(tp)))


def prompt_logits(engine):
    """Logits of each prompt's last token, through the engine's own sharded forward."""
    return tp_prompt_logits(engine, [engine.tokenizer.encode(p) for p in PROMPTS], 64)


GREEDY = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
_TP1: dict = {}


def tp1_reference(name: str, cfg):
    """The TP = 1 engine and its greedy tokens (`GREEDY`, its first and only generate); once a process (an engine
    compile each: test_tp_full_head_... takes its unpenalized tokens from here)."""
    if name not in _TP1:
        base = engine_for(cfg, 1)
        _TP1[name] = (base, [o.token_ids for o in base.generate(PROMPTS, GREEDY)])
    return _TP1[name]


@pytest.mark.parametrize("cfg,tps", [(LLAMA3, (2, 4, 8)), (QWEN2, (2, 4))], ids=["llama3-gqa", "qwen2-bias"])
def test_tp_matches_tp1(cfg, tps):
    base, ref_tokens = tp1_reference("llama3" if cfg is LLAMA3 else "qwen2", cfg)
    ref_logits = prompt_logits(base)
    for tp in tps:
        eng = engine_for(cfg, tp)
        assert eng.runner.kv.k.sharding.spec[3] == "tp"
        if tp > cfg.num_kv_heads:      # fewer KV heads than devices: heads replicated, one per device
            assert eng.runner.kv.k.shape[3] == tp
        if cfg is LLAMA3 and tp == 4:  # this engine's weights (checked here, not by a second TP = 4 compile)
            check_weights_are_sharded_not_replicated(eng)
        got = prompt_logits(eng)
        np.testing.assert_allclose(got, ref_logits, rtol=2e-2, atol=2e-2 * np.abs(ref_logits).max())
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ref_tokens, f"tp={tp}"
        assert eng.pages_used == 0


def check_weights_are_sharded_not_replicated(eng):
    """LLAMA3 at TP = 4: each device holds a quarter of the q/k/v and o projections."""
    q = eng.runner.layer_states[0]["qkv_proj"]["kernel"]      # q/k/v joined (nfjax/models/fused.py)
    o = eng.runner.layer_states[0]["o_proj"]["kernel"]
    q, o = q[...], o[...]
    assert q.sharding.spec[-1] == "tp" and q.addressable_shards[0].data.shape[-1] == q.shape[-1] // 4
    assert o.sharding.spec[-2] == "tp" and o.addressable_shards[0].data.shape[-2] == o.shape[-2] // 4


def test_bad_tp_is_a_clear_error():
    with pytest.raises(UserError, match="num_attention_heads"):
        engine_for(LLAMA3.replace(num_heads=6, num_kv_heads=2), 4)
    with pytest.raises(UserError, match="devices"):
        engine_for(LLAMA3, 16)


def test_skip_collectives_drops_the_layer_all_reduces():
    """The benchmark-only switch (bench/tp.py) removes the two row-parallel all-reduces per layer."""
    import re
    from nfjax.engine.runner import Runner
    from nfjax.parallel import make_mesh, shard_model
    mesh = make_mesh(2)
    counts = {}
    for skip in (False, True):
        model = random_model(LLAMA3, seed=1)
        shard_model(model, mesh)
        r = Runner(model, EngineConfig(LLAMA3, CACHE, SCHED, parallel=ParallelConfig(2, skip_collectives=skip)), mesh)
        r.compile_all()
        hlo = r._steps[(64, "sequential")].as_text()
        counts[skip] = len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))
    assert counts[False] == 2 * LLAMA3.num_layers and counts[True] == 0, counts     # one program, both layers


def test_tp_full_head_penalties_and_logprobs_match_tp1():
    """The full head (penalties, min_tokens, logprobs; nfjax/engine/penalties.py) runs on the replicated logits
    with its penalty state replicated: TP = 2 gives TP = 1's tokens and logprobs."""
    params = [SamplingParams.greedy(max_tokens=12, ignore_eos=True, frequency_penalty=-2.0, logprobs=3),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams.greedy(max_tokens=12, min_tokens=6, stop_token_ids=(101,), logprobs=0),
              SamplingParams.greedy(max_tokens=12, ignore_eos=True)]
    outs = {tp: engine_for(LLAMA3, tp).generate(PROMPTS, params) for tp in (1, 2)}
    # TP = 1 without penalties, from a fresh engine (test_tp_matches_tp1's; greedy, the same batch: its first 12 of
    # 16 tokens are a 12-token run's)
    plain = [t[:12] for t in tp1_reference("llama3", LLAMA3)[1]]
    assert outs[1][0].token_ids != plain[0]                    # the penalty changed something
    for a, b in zip(outs[1], outs[2]):
        assert a.token_ids == b.token_ids
        if a.logprobs is not None:
            np.testing.assert_allclose([lp.logprob for lp in b.logprobs], [lp.logprob for lp in a.logprobs],
                                       atol=2e-3)
            assert [lp.top[:1] and lp.top[0][0] for lp in b.logprobs] == [lp.top[:1] and lp.top[0][0]
                                                                            for lp in a.logprobs]
