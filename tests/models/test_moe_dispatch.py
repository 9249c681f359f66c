"""A MoE layer's expert ops through the GPU dispatch on the CPU (the grouped kernel interpreted, groups padded to
its tiles, gate/up joined and interleaved so SwiGLU runs in the kernel's epilogue) against the CPU dispatch
(`jax.lax.ragged_dot`, unpadded groups, the joined output de-interleaved), bf16 weights: the same outputs; and
the interleaved join on the CPU computes exactly what the separate gate and up weights do."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nfjax.models.grouped as grouped
import pallas_kernels.grouped_gemm as kernel
from nfjax.config import ModelConfig
from nfjax.models.fused import join_projections
from nfjax.models.moe import MoEDecoderLayer
from nfjax.parallel import make_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=128, model_type="mixtral", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=256, dtype="bfloat16")


def _moe_block(layer, h2):
    ctx = types.SimpleNamespace(num_ctas=3)
    xs, sizes, dest, topw = layer.router(ctx, h2)
    act = layer.expert_up_gate(ctx, xs, sizes)
    return layer.combine(ctx, layer.expert_down(ctx, act, sizes), dest, topw)


def test_gpu_dispatch_with_the_swiglu_epilogue_equals_the_cpu_dispatch(monkeypatch):
    layer = MoEDecoderLayer(CFG, nnx.Rngs(0))
    h2 = jax.random.normal(jax.random.key(1), (24, CFG.hidden_size), jnp.bfloat16)
    separate = np.asarray(_moe_block(layer, h2), np.float32)
    join_projections(layer, make_mesh(1))
    assert layer.experts_gate_up.interleave == kernel.swiglu_block()
    cpu = np.asarray(_moe_block(layer, h2), np.float32)
    np.testing.assert_array_equal(cpu, separate)      # the interleaved join, de-interleaved: the same GEMMs
    calls, real = [], kernel.grouped_gemm

    def interpreted(*a, **kw):
        calls.append(kw.get("act"))
        return real(*a, interpret=True, **kw)
    monkeypatch.setattr(grouped, "use_pallas", lambda dtype: True)
    monkeypatch.setattr(kernel, "grouped_gemm", interpreted)
    gpu = np.asarray(_moe_block(layer, h2), np.float32)
    assert calls == ["swiglu", None]                  # gate/up with the epilogue, then down
    assert np.isfinite(gpu).all()
    assert np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu) < 1e-2
