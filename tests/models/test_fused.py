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


def test_dense_gate_up_interleaved_for_the_swiglu_epilogue(monkeypatch):
    """The dense MLP's gate/up joined with gate and up interleaved (as on a GPU, where the persistent GEMM applies
    SwiGLU in its epilogue, nfjax/models/dense.py): `up_gate` + `act` give the separate weights' activation, both on
    the de-interleaving path and through the epilogue kernel itself (Mosaic GPU interpret mode); a nano-batch
    below the row threshold follows its step's path, so a plan's pieces merge."""
    import jax.numpy as jnp
    from flax import nnx
    from nfjax.models import dense, fused, llama
    from nfjax.parallel import make_mesh
    from pallas_kernels.persistent_gemm import persistent_gemm
    cfg = CFG.replace(intermediate_size=256, dtype="bfloat16")
    gd, st = nnx.split(random_model(cfg, seed=5, std=0.2).layers)
    layers = {name: nnx.merge(gd, jax.tree.map(lambda a: a[0], st)) for name in ("sep", "il", "off")}
    monkeypatch.setattr(fused, "epilogue_runs", lambda dtype: True)
    fused.join_projections(layers["il"], make_mesh(1))
    fused.join_projections(layers["off"], make_mesh(1), swiglu_epilogue=False)
    assert layers["il"].gate_up_proj.interleave == 128 and layers["off"].gate_up_proj.interleave == 0
    ctx = llama.LayerContext(layer=jnp.int32(0), meta=None, inv_freq=None)
    h2 = jax.random.normal(jax.random.key(1), (160, cfg.hidden_size), jnp.bfloat16)

    def act(layer):
        return np.asarray(layer.act(ctx, *layer.up_gate(ctx, h2)), np.float32)
    want = act(layers["sep"])
    np.testing.assert_allclose(act(layers["il"]), want, rtol=2e-2, atol=2e-2)     # de-interleaved after XLA's dot
    np.testing.assert_allclose(act(layers["off"]), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(dense, "pallas_gemm_fits", lambda x, w: True)               # as on a GPU
    lin = layers["il"].gate_up_proj
    assert not dense.swiglu_epilogue_fits(lin, h2[:64])                              # a 64-row step: XLA's dot
    assert dense.swiglu_epilogue_fits(lin, h2[:64], step_tokens=256)                 # a nano-batch of a larger step
    assert dense.swiglu_epilogue_fits(lin, h2) and not dense.swiglu_epilogue_fits(layers["off"].gate_up_proj, h2)
    monkeypatch.setattr(llama, "dense_swiglu", lambda lin, x, num_ctas=None: persistent_gemm(
        x, lin.kernel[...], num_ctas=3, act="swiglu", interpret=True))
    gate, up = layers["il"].up_gate(ctx, h2)
    assert up.shape == (160, 0) and gate.shape == (160, cfg.intermediate_size)       # the epilogue ran
    np.testing.assert_allclose(act(layers["il"]), want, rtol=2e-2, atol=2e-2)
