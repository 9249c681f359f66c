"""Mixture-of-experts decoder (Mixtral, Qwen2-MoE) as Flax NNX modules with named ops.

Attention and norms are the Llama layer's (same modules, same ops). The MLP is a MoE block whose ops are:
  router          h2 -> the top-k experts of each token, its tokens copied into rows sorted by expert
                  (nfjax/models/moe_routing.py: a static-shape layout), the padded group sizes, where each
                  assignment's row went (`dest`) and its router weight;
  expert_up_gate  the grouped GEMMs xs @ w_gate[e], xs @ w_up[e] over the sorted rows and silu(gate) * up
                  (nfjax/models/grouped.py); with the joined weight on a GPU, one GEMM whose epilogue applies
                  SwiGLU, so the [R, 2F] gate/up array is never written;
  expert_down     the grouped GEMM a @ w_down[e];
  combine         each token's k rows gathered back, weighted by the router and summed: `d_partial`.
Qwen2-MoE adds the shared expert (`shared_up_gate`, `shared_down`: a SwiGLU MLP whose output is scaled by
sigmoid(h2 @ w_shared_gate)) and sums it in `combine_shared`. Then the Llama layer's `mlp_reduce` and `residual`.

Tensor parallelism splits every expert's FFN columns (gate/up column-parallel, down row-parallel, as the dense
MLP; nfjax/parallel.py), and the shared expert's likewise; the router and the shared gate are replicated, so every
device routes the same way and `combine`'s partial sums meet in `mlp_reduce`'s all-reduce.

The sorted-row values (xs, group_sizes, expert outputs) have no token axis: a schedule must give the router ...
combine ops the same nano-batches (Sequential and the op-major split strategies do; a NanoFlow plan names the
dense layer's ops and is refused by its validation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nfjax.config import ModelConfig
from nfjax.models.dense import dense
from nfjax.models.grouped import group_alignment, grouped_matmul, grouped_swiglu
from nfjax.models.llama import LAYER_OPS, DecoderLayer, LlamaModel, _linear, swiglu
from nfjax.models.moe_routing import sort_by_expert, top_k_routing, unsort
from nfjax.models.ops import OpSpec, Resource, op


class Experts(nnx.Module):
    """E stacked weights [E, din, dout] (one per expert)."""

    def __init__(self, num_experts: int, din: int, dout: int, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (num_experts, din, dout), dtype))


class MoEDecoderLayer(DecoderLayer):
    """A Llama layer whose MLP is a top-k MoE block (plus Qwen2-MoE's shared expert)."""

    def _init_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router_proj = _linear(d, e, False, dt, rngs)
        self.experts_gate = Experts(e, d, f, dt, rngs)
        self.experts_up = Experts(e, d, f, dt, rngs)
        self.experts_down = Experts(e, f, d, dt, rngs)
        fs = cfg.shared_expert_intermediate_size
        if fs:
            self.shared_gate_proj = _linear(d, fs, False, dt, rngs)
            self.shared_up_proj = _linear(d, fs, False, dt, rngs)
            self.shared_down_proj = _linear(fs, d, False, dt, rngs)
            self.shared_expert_gate = _linear(d, 1, False, dt, rngs)

    def op_specs(self) -> tuple[OpSpec, ...]:
        return layer_ops(self.cfg)

    @op(Resource.MEMORY, ins=("h2",), outs=("xs", "group_sizes", "dest", "topw"))
    def router(self, ctx, h2):
        cfg = self.cfg
        logits = self.router_proj(h2)
        w, experts = top_k_routing(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        xs, sizes, dest = sort_by_expert(h2, experts, cfg.num_experts, group_alignment(h2.dtype))
        return xs, sizes, dest, w

    @op(Resource.COMPUTE, ins=("xs", "group_sizes"), outs=("e_act",))
    def expert_up_gate(self, ctx, xs, group_sizes):
        if hasattr(self, "experts_gate_up"):     # joined for serving (nfjax/models/fused.py)
            j = self.experts_gate_up
            if j.interleave:
                return grouped_swiglu(xs, j.kernel[...], group_sizes, j.interleave, ctx.num_ctas)
            return swiglu(*j.split(grouped_matmul(xs, j.kernel[...], group_sizes, ctx.num_ctas)))
        return swiglu(grouped_matmul(xs, self.experts_gate.kernel[...], group_sizes, ctx.num_ctas),
                      grouped_matmul(xs, self.experts_up.kernel[...], group_sizes, ctx.num_ctas))

    @op(Resource.COMPUTE, ins=("e_act", "group_sizes"), outs=("e_down",))
    def expert_down(self, ctx, e_act, group_sizes):
        return grouped_matmul(e_act, self.experts_down.kernel[...], group_sizes, ctx.num_ctas)

    @op(Resource.MEMORY, ins=("e_down", "dest", "topw"), outs=("d_partial",))
    def combine(self, ctx, e_down, dest, topw):
        return unsort(e_down, dest, topw)

    @op(Resource.COMPUTE, ins=("h2",), outs=("s_gate", "s_up"))
    def shared_up_gate(self, ctx, h2):
        if hasattr(self, "shared_gate_up_proj"):  # joined for serving (nfjax/models/fused.py)
            return tuple(self.shared_gate_up_proj.split(dense(self.shared_gate_up_proj, h2, ctx.num_ctas)))
        return dense(self.shared_gate_proj, h2, ctx.num_ctas), dense(self.shared_up_proj, h2, ctx.num_ctas)

    @op(Resource.COMPUTE, ins=("s_gate", "s_up", "h2"), outs=("s_out",))
    def shared_down(self, ctx, s_gate, s_up, h2):
        s = dense(self.shared_down_proj, swiglu(s_gate, s_up), ctx.num_ctas)
        g = jax.nn.sigmoid(self.shared_expert_gate(h2).astype(jnp.float32))          # [T, 1]
        return (g * s.astype(jnp.float32)).astype(s.dtype)

    @op(Resource.MEMORY, ins=("e_down", "dest", "topw", "s_out"), outs=("d_partial",))
    def combine_shared(self, ctx, e_down, dest, topw, s_out):
        return unsort(e_down, dest, topw) + s_out


def _spec(name: str) -> OpSpec:
    return getattr(MoEDecoderLayer, name).__opspec__


_ATTENTION = tuple(s for s in LAYER_OPS[:[s.name for s in LAYER_OPS].index("ffn_norm") + 1])
_TAIL = tuple(s for s in LAYER_OPS if s.name in ("mlp_reduce", "residual"))
MIXTRAL_OPS = _ATTENTION + tuple(map(_spec, ("router", "expert_up_gate", "expert_down", "combine"))) + _TAIL
SHARED_EXPERT_OPS = _ATTENTION + tuple(map(_spec, ("router", "shared_up_gate", "shared_down", "expert_up_gate",
                                                   "expert_down", "combine_shared"))) + _TAIL


def layer_ops(cfg: ModelConfig) -> tuple[OpSpec, ...]:
    """The op graph of `cfg`'s decoder layer, in sequential order (the dense layer's for dense models)."""
    if not cfg.num_experts:
        return LAYER_OPS
    return SHARED_EXPERT_OPS if cfg.shared_expert_intermediate_size else MIXTRAL_OPS


class MoEModel(LlamaModel):
    """The Llama model with MoE layers (`__call__` runs the layer ops through the layer_fn it is given)."""
    layer_class = MoEDecoderLayer
