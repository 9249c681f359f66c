"""The MoE layer's op graph (router ... combine: sorted-row values with no token axis) under the step strategies:
the paged forward of a prefill of two sequences gives the reference forward's logits with the op-major split
strategies (each nano-batch routes and sorts its own tokens); a NanoFlow plan recorded for the dense layer is refused, naming the op."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nfjax.config import CacheConfig, ModelConfig, StrategyConfig
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import build_metadata
from nfjax.models import reference
from nfjax.models.random_init import random_model
from nfjax.schedule import ScheduleContext, layer_graph
from nfjax.schedule.executor import schedule_layer_fn
from nfjax.schedule.plan import PlanError
from nfjax.schedule.variants import build_strategy

QWEN2_MOE = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, model_type="qwen2_moe", qkv_bias=True, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24)
BUCKET = 96


# (Sequential: the engine and reference tests of tests/models/test_moe_parity.py)
@pytest.mark.parametrize("spec", ["nanobatch:1-1", "dual_batch:1-1", "fused_reduce_norm:1-3"])
def test_moe_layer_under_strategies_matches_reference(spec):
    model = random_model(QWEN2_MOE, seed=4, std=0.3, host=True)
    rows = np.random.default_rng(0).integers(0, QWEN2_MOE.vocab_size, size=(2, 40)).astype(np.int32)
    dense = np.asarray(reference.logits(model, jnp.asarray(rows)))
    layer_fn = schedule_layer_fn(build_strategy(StrategyConfig.from_spec(spec)).record(
        ScheduleContext(BUCKET, layer_graph(QWEN2_MOE), 1)))
    ps, n = 16, 3
    kv = KVCache.create(QWEN2_MOE, CacheConfig(page_size=ps, num_pages=1 + 2 * n, max_pages_per_seq=n))
    meta = build_metadata([([1, 2, 3], 0, 40), ([4, 5, 6], 0, 40)], BUCKET, 2, n, ps).to_device()
    tokens = np.zeros(BUCKET, np.int32)
    tokens[:80] = rows.reshape(-1)

    @nnx.jit
    def fwd(model, tokens, kv, meta):
        return model.logits(model(tokens, kv, meta, layer_fn=layer_fn)[0])

    paged = np.asarray(fwd(model, jnp.asarray(tokens), kv, meta))[:80].reshape(2, 40, -1)
    np.testing.assert_allclose(paged, dense, atol=2e-5, rtol=1e-4)


def test_dense_plan_on_moe_graph_names_the_op():
    sc = StrategyConfig.from_spec("nanoflow:llama3-8b_h100_tp1_beside_mact")
    with pytest.raises(PlanError, match="unknown op 'up_gate'"):
        build_strategy(sc, layer_graph(QWEN2_MOE))
