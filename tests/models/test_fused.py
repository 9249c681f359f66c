"""Joined projections (nfjax/models/fused.py): each device's shard of a joined weight holds its own q/k/v (gate/up)
columns, and an engine with joined weights computes what one with the checkpoint's separate weights computes."""
import jax
import numpy as np
import pytest

from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ExecutionConfig, ModelConfig, ParallelConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.models.random_init import random_model
from nfjax.tokenizer.byte import ByteTokenizer
from tests.parallel.tp_common import prompt_logits

CFG = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8, num_kv_heads=2,
                  head_dim=8, rope_theta=10000.0, max_position_embeddings=256, eos_token_ids=(257,))
QWEN2 = CFG.replace(model_type="qwen2", num_heads=4, head_dim=16, qkv_bias=True)
MOE = CFG.replace(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)
PROMPTS = [[5, 9, 44, 100, 3], [7, 7, 8], [200, 1, 2, 3, 4, 5, 6, 7, 8]]
CACHE = CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=4)
SCHED = BatcherConfig(token_buckets=(32,), max_seqs=4)


def engine(cfg, tp, join):
    model = random_model(cfg, seed=3, std=0.2)
    return Engine(model, ByteTokenizer(), EngineConfig(cfg, CACHE, SCHED, parallel=ParallelConfig(tp),
                                                       execution=ExecutionConfig(join_projections=join)))


def test_each_shard_holds_its_own_columns():
    tp = 2
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    model = random_model(CFG, seed=3, std=0.2)
    sep = {n: np.asarray(getattr(model.layers, n).kernel[...]) for n in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                         "up_proj")}     # [L, D, out]
    # the weights as the engine places them (Engine's sharding, then the Runner that joins them), without the
    # engine's compile of every step program: nothing runs here (~35 s of compiling on 2 cores)
    from nfjax.engine.runner import Runner
    from nfjax.parallel import make_mesh, shard_model
    mesh = make_mesh(tp)
    shard_model(model, mesh)
    runner = Runner(model, EngineConfig(CFG, CACHE, SCHED, parallel=ParallelConfig(tp)), mesh, take_weights=True)
    assert runner.config.execution.join_projections          # the default, as an Engine gets it
    for layer, st in enumerate(runner.layer_states):
        assert "q_proj" not in st and "gate_proj" not in st
        for joined, names in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            w = st[joined]["kernel"][...]
            assert w.sharding.spec[-1] == "tp"
            shards = sorted(w.addressable_shards, key=lambda s: s.index[-1].start or 0)
            assert len(shards) == tp
            for i, shard in enumerate(shards):
                want = np.concatenate([np.split(sep[n][layer], tp, axis=-1)[i] for n in names], axis=-1)
                np.testing.assert_array_equal(np.asarray(shard.data), want)


@pytest.mark.parametrize("cfg,tp", [(QWEN2, 2), (MOE, 2), (CFG, 4)],
                         ids=["qwen2-bias-tp2", "moe-shared-tp2", "llama-tp4-kv-replicated"])
def test_joined_engine_computes_what_separate_weights_do(cfg, tp):
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    sp = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    out = {}
    for join in (True, False):
        eng = engine(cfg, tp, join)
        names = set(eng.runner.layer_states[0])
        assert ("qkv_proj" in names) == join and ("q_proj" in names) != join
        if cfg.num_experts:
            assert ("experts_gate_up" in names) == join and ("experts_gate" in names) != join
        if cfg.shared_expert_intermediate_size:
            assert ("shared_gate_up_proj" in names) == join
        out[join] = (prompt_logits(eng, PROMPTS, 32), [o.token_ids for o in eng.generate(PROMPTS, sp)])
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    assert out[True][1] == out[False][1]
