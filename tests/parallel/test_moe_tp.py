"""Mixture of experts under tensor parallelism (8 forced host devices): every expert's FFN columns split over
the devices (gate/up column-parallel, down row-parallel; Qwen2-MoE's shared expert likewise), router and shared
gate replicated. TP = 4 (Mixtral) and TP = 2 (Qwen2-MoE) give the unsharded forward's greedy tokens and last-token
logits (one engine compile per model: the CI time budget)."""
import numpy as np
import pytest

import jax.numpy as jnp

from nfjax.config import BatcherConfig, CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from nfjax.engine import Engine, SamplingParams
from nfjax.errors import UserError
from nfjax.models import reference
from nfjax.models.random_init import random_model
from nfjax.tokenizer.silent import SilentTokenizer
from tp_common import prompt_logits

MIXTRAL = ModelConfig(vocab_size=160, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=128, model_type="mixtral",
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
QWEN2_MOE = MIXTRAL.replace(model_type="qwen2_moe", qkv_bias=True, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, norm_topk_prob=False)
NEW_TOKENS = 12
PROMPTS = [np.random.default_rng(i).integers(3, 160, 4 + 7 * i).tolist() for i in range(4)]


def _model(cfg):
    return random_model(cfg, seed=2, std=0.25, host=True)      # wide margins: equality tests TP, not rounding


def _engine(cfg, tp):
    return Engine(_model(cfg), SilentTokenizer(cfg.vocab_size), EngineConfig(
        cfg, CacheConfig(page_size=8, num_pages=48, max_pages_per_seq=8), BatcherConfig(token_buckets=(64,),
                                                                                         max_seqs=4),
        parallel=ParallelConfig(tp)))


# TP = 1 is the unsharded reference forward here (and the engine at TP = 1 in tests/models/test_moe_parity.py,
# which equals HF's tokens)
@pytest.mark.parametrize("cfg,tps", [(MIXTRAL, (4,)), (QWEN2_MOE, (2,))], ids=["mixtral", "qwen2-moe"])
def test_moe_tp_matches_tp1(cfg, tps):
    sp = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
    model = _model(cfg)
    ref_tokens = [reference.greedy(model, p, NEW_TOKENS, width=64) for p in PROMPTS]
    ref_logits = np.stack([np.asarray(reference.logits(model, jnp.asarray([p]))[0, -1]) for p in PROMPTS])
    for tp in tps:
        eng = _engine(cfg, tp)
        w = eng.runner.layer_states[0]["experts_down"]["kernel"][...]            # [E, F, D]: F split
        assert w.sharding.spec[-2] == "tp" and w.addressable_shards[0].data.shape[-2] == w.shape[-2] // tp
        got_logits = prompt_logits(eng, PROMPTS, 64)
        np.testing.assert_allclose(got_logits, ref_logits, rtol=1e-4, atol=1e-4 * np.abs(ref_logits).max())
        assert [o.token_ids for o in eng.generate(PROMPTS, sp)] == ref_tokens, f"tp={tp}"


def test_moe_tp_must_divide_the_expert_width():
    with pytest.raises(UserError, match="moe_intermediate_size"):
        _engine(MIXTRAL.replace(moe_intermediate_size=66), 4)
