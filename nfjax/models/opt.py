"""OPT (Meta's Open Pre-trained Transformers, FlexGen's evaluation family) as Flax NNX modules with named ops.

OPT differs from Llama in: learned absolute positions (a table with 2 extra rows: position p reads row p + 2),
LayerNorm (scale and bias) instead of RMSNorm, a ReLU MLP of two projections (fc1, fc2), and biases on every
projection. Pre-norm layers only (`do_layer_norm_before=true`; nfjax/checkpoint/opt_names.py rejects the rest).

The OPT layer declares the Llama layer's op graph: the same op names, inputs and outputs
(`nfjax.models.llama.LAYER_OPS`), with OPT's math in the ops that differ. An op spec calls the op of its name on
the layer's own class (nfjax/models/ops.py), so the engine's runner, every step strategy and the reference
forward run OPT unchanged. Where the graphs differ in kind:
  * `rope_append` appends K/V without rotating (`q_rot` is q);
  * `up_gate` is fc1: `gate` holds fc1's output, `up` is an empty [T, 0] placeholder; `act` is ReLU(gate);
  * the output biases of o_proj and fc2 are added after the row-parallel reduce (`attn_reduce`, `mlp_reduce`),
    so under tensor parallelism they are added once, not once per device.
Module names follow the Llama layer's (o_proj = out_proj, up_proj = fc1, down_proj = fc2), so
nfjax/parallel.py shards OPT's weights by the same column/row rules.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from nfjax.config import ModelConfig
from nfjax.models.dense import dense
from nfjax.models.llama import DecoderLayer, ForwardOptions, LlamaModel, _linear, _tp_sum, layer_forward
from nfjax.models.ops import Resource, op

POSITION_OFFSET = 2      # OPT's learned positions start at row 2 of the table


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))   # [D]
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))   # [D]
        self.eps = eps

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _matmul(lin: nnx.Linear, x):
    """`lin(x)` without its bias (added after the reduce)."""
    w = lin.kernel[...]
    return jnp.dot(x.astype(w.dtype), w)


class OPTDecoderLayer(DecoderLayer):
    """One pre-norm OPT layer; the ops not redefined here (attn_norm, kqv, attn_decode, attn_prefill, ffn_norm,
    residual) are the Llama layer's, reading this layer's modules of the same names."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):      # noqa: super().__init__ builds Llama's modules
        dt = jnp.dtype(cfg.dtype)
        d = cfg.hidden_size
        self.cfg = cfg
        self.input_norm = LayerNorm(d, cfg.rms_norm_eps, dt)        # self_attn_layer_norm
        self.q_proj = _linear(d, cfg.q_size, True, dt, rngs)
        self.k_proj = _linear(d, cfg.kv_size, True, dt, rngs)
        self.v_proj = _linear(d, cfg.kv_size, True, dt, rngs)
        self.o_proj = _linear(cfg.q_size, d, True, dt, rngs)       # out_proj
        self.post_norm = LayerNorm(d, cfg.rms_norm_eps, dt)         # final_layer_norm (of the layer)
        self.up_proj = _linear(d, cfg.intermediate_size, True, dt, rngs)     # fc1
        self.down_proj = _linear(cfg.intermediate_size, d, True, dt, rngs)   # fc2

    @op(Resource.MEMORY, ins=("q", "k", "v", "kv", "positions", "slots"), outs=("q_rot", "kv"))
    def rope_append(self, ctx, q, k, v, kv, positions, slots):
        return q, kv.write(ctx.layer, slots, k, v, ctx.meta)

    @op(Resource.COMPUTE, ins=("attn",), outs=("o_partial",))
    def o_proj_op(self, ctx, attn):
        return _matmul(self.o_proj, attn)

    @op(Resource.NETWORK, ins=("o_partial",), outs=("o",))
    def attn_reduce(self, ctx, o_partial):
        return _tp_sum(o_partial, ctx) + self.o_proj.bias[...].astype(o_partial.dtype)

    @op(Resource.COMPUTE, ins=("h2",), outs=("gate", "up"))
    def up_gate(self, ctx, h2):
        return dense(self.up_proj, h2, ctx.num_ctas), jnp.zeros((h2.shape[0], 0), h2.dtype)

    @op(Resource.MEMORY, ins=("gate", "up"), outs=("a",))
    def act(self, ctx, gate, up):
        return jax.nn.relu(gate)

    @op(Resource.COMPUTE, ins=("a",), outs=("d_partial",))
    def down(self, ctx, a):
        return _matmul(self.down_proj, a)

    @op(Resource.NETWORK, ins=("d_partial",), outs=("d",))
    def mlp_reduce(self, ctx, d_partial):
        return _tp_sum(d_partial, ctx) + self.down_proj.bias[...].astype(d_partial.dtype)


class OPTModel(LlamaModel):
    """Embeddings (tokens + learned positions), the stacked OPT layers, the final LayerNorm and the head (tied
    to the token embedding unless `tie_word_embeddings` is false). `__call__` and `logits` are the Llama
    model's."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):      # noqa: super().__init__ builds Llama's modules
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt, rngs=rngs,
                               embedding_init=init)
        self.positions = nnx.Embed(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size, dtype=dt,
                                   param_dtype=dt, rngs=rngs, embedding_init=init)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r):
            return OPTDecoderLayer(cfg, r)

        self.layers = make_layers(rngs)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dt,
                                                                    rngs)

    def embed_input(self, tokens: Int[Array, "T"], positions: Int[Array, "T"]) -> Float[Array, "T D"]:
        return self.embed(tokens) + self.positions(positions + POSITION_OFFSET)


def model_class(cfg: ModelConfig) -> type[LlamaModel]:
    """The model class of `cfg.model_type`: `OPTModel` for opt, `MoEModel` for a mixture of experts, else the
    Llama family's."""
    if cfg.num_experts:
        from nfjax.models.moe import MoEModel
        return MoEModel
    return OPTModel if cfg.model_type == "opt" else LlamaModel


__all__ = ["OPTModel", "OPTDecoderLayer", "LayerNorm", "model_class", "ForwardOptions", "layer_forward"]
