"""Llama-family decoder (Llama-2/3, Mistral, Qwen2, DeepSeek-67B) as Flax NNX modules with named ops."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from nfjax.config import ModelConfig
from nfjax.kv.attention import decode_attention, outputs_for_o_proj, prefill_attention
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import AttentionMetadata
from nfjax.models.dense import dense, dense_swiglu, swiglu_epilogue_fits
from nfjax.models.ops import Resource, collect_ops, op, run_ops
from nfjax.models.rope import apply_rope, inv_frequencies


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))   # [D]
        self.eps = eps

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def swiglu(gate, up):
    """silu(gate) * up, the silu in f32 (the dense MLP's `act` and the MoE experts')."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up


def _linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


@dataclass(frozen=True)
class ForwardOptions:
    """Static choices of how a forward runs (each value is a different compiled program)."""
    # Most prefill chunks one step holds (the batcher's cap); bounds the prefill kernel's static tile
    # count. None: as many as sequences (the tile gather then costs ~5 ms per 8B decode step on an H100).
    max_prefill_seqs: int | None = None
    # BENCHMARK ONLY: drop the row-parallel all-reduces, so each device keeps its partial sums (wrong outputs).
    # Step time with vs without them is what the TP collectives cost (bench/tp.py).
    skip_collectives: bool = False
    # Every row of the step is a decode (the host knows): the prefill attention kernel is left out.
    decode_only: bool = False
    # > 0 on a quantized cache: the prefill rows' pages (at most this many, the batcher's limit) are dequantized into
    # a bfloat16 copy first and the bfloat16 prefill kernel reads it (ExecutionConfig.prefill_dequant_first).
    prefill_copy_pages: int = 0


@dataclass(frozen=True)
class LayerContext:
    """What every op of one layer may read besides its named inputs."""
    layer: Int[Array, ""]            # layer index into the stacked KV cache
    meta: AttentionMetadata
    inv_freq: Float[Array, "D2"]
    tp_axis: str | None = None       # mesh axis of the enclosing shard_map; None = not tensor-parallel
    num_ctas: int | None = None  # resource share of this op as a kernel CTA count (None: the whole GPU)
    # The whole step's tokens where an op sees one nano-batch of them (None: the op's own rows are the step's), so
    # every nano-batch of a step takes the same GEMM path and their values merge (`up_gate`)
    step_tokens: int | None = None
    opts: ForwardOptions = ForwardOptions()

    @property
    def skip_collectives(self) -> bool:
        return self.opts.skip_collectives


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer. Its ops, in order, are the plain forward."""
    v_rotation_folded = False     # o_proj takes V's rotated frame (nfjax/models/rotation_fold.py)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self._init_attention(cfg, rngs)
        self._init_mlp(cfg, rngs)

    def _init_attention(self, cfg: ModelConfig, rngs: nnx.Rngs):
        """The norms and attention projections (a MoE layer shares them: nfjax/models/moe.py)."""
        dt = jnp.dtype(cfg.dtype)
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.q_proj = _linear(d, cfg.q_size, cfg.qkv_bias, dt, rngs)
        self.k_proj = _linear(d, cfg.kv_size, cfg.qkv_bias, dt, rngs)
        self.v_proj = _linear(d, cfg.kv_size, cfg.qkv_bias, dt, rngs)
        self.o_proj = _linear(cfg.q_size, d, False, dt, rngs)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps, dt)

    def _init_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        d = cfg.hidden_size
        self.gate_proj = _linear(d, cfg.intermediate_size, False, dt, rngs)
        self.up_proj = _linear(d, cfg.intermediate_size, False, dt, rngs)
        self.down_proj = _linear(cfg.intermediate_size, d, False, dt, rngs)

    def op_specs(self) -> tuple:
        """This layer's op graph in sequential order (`LAYER_OPS`; a MoE layer's differs)."""
        return LAYER_OPS

    @op(Resource.MEMORY, ins=("x",), outs=("h",))
    def attn_norm(self, ctx, x):
        return self.input_norm(x)

    @op(Resource.COMPUTE, ins=("h",), outs=("q", "k", "v"))
    def kqv(self, ctx, h):
        t, hd = h.shape[0], self.cfg.head_dim
        # head counts come from the (possibly tensor-parallel local) weight shapes
        np_ = ctx.num_ctas
        if hasattr(self, "qkv_proj"):             # joined for serving (nfjax/models/fused.py)
            q, k, v = self.qkv_proj.split(dense(self.qkv_proj, h, np_))
        else:
            q, k, v = (dense(lin, h, np_) for lin in (self.q_proj, self.k_proj, self.v_proj))
        return q.reshape(t, -1, hd), k.reshape(t, -1, hd), v.reshape(t, -1, hd)

    @op(Resource.MEMORY, ins=("q", "k", "v", "kv", "positions", "slots"), outs=("q_rot", "kv"))
    def rope_append(self, ctx, q, k, v, kv, positions, slots):
        q = apply_rope(q, positions, ctx.inv_freq)
        k = apply_rope(k, positions, ctx.inv_freq)
        return q, kv.write(ctx.layer, slots, k, v, ctx.meta)

    @op(Resource.MEMORY, ins=("q_rot", "kv"), outs=("attn_d",))
    def attn_decode(self, ctx, q, kv):
        """Decode rows [0, num_decode) (bandwidth-bound) in the cache's frame (rotated where the format stores V
        rotated: `attn_prefill` brings the merged rows into o_proj's frame); other rows are don't-care."""
        t = q.shape[0]
        out = decode_attention(q, kv, ctx.layer, ctx.meta, self.cfg.head_dim ** -0.5, num_ctas=ctx.num_ctas,
                               cache_frame_out=True)
        out = out.reshape(out.shape[0], -1)                 # rows [0, min(S, T))
        return out if out.shape[0] == t else jnp.pad(out, ((0, t - out.shape[0]), (0, 0)))

    @op(Resource.COMPUTE, ins=("q_rot", "kv", "attn_d"), outs=("attn",))
    def attn_prefill(self, ctx, q, kv, attn_d):
        """Prefill rows (compute-bound), merged with the decode rows of `attn_d`, in o_proj's frame."""
        if ctx.opts.decode_only:
            attn = attn_d
        else:
            out = prefill_attention(q, kv, ctx.layer, ctx.meta, self.cfg.head_dim ** -0.5,
                                    max_prefill_seqs=ctx.opts.max_prefill_seqs, copy_pages=ctx.opts.prefill_copy_pages,
                                    cache_frame_out=True).reshape(q.shape[0], -1)
            attn = jnp.where((jnp.arange(q.shape[0]) < ctx.meta.num_decode)[:, None], attn_d, out)
        # one rotation for all rows where they and o_proj differ in frame, not one for each kind
        return outputs_for_o_proj(attn.reshape(q.shape), kv, self.v_rotation_folded).reshape(attn.shape)

    @op(Resource.COMPUTE, ins=("attn",), outs=("o_partial",))
    def o_proj_op(self, ctx, attn):
        return dense(self.o_proj, attn, ctx.num_ctas)

    @op(Resource.NETWORK, ins=("o_partial",), outs=("o",))
    def attn_reduce(self, ctx, o_partial):
        return _tp_sum(o_partial, ctx)

    @op(Resource.MEMORY, ins=("x", "o"), outs=("x2", "h2"))
    def ffn_norm(self, ctx, x, o):
        x2 = x + o
        return x2, self.post_norm(x2)

    @op(Resource.COMPUTE, ins=("h2",), outs=("gate", "up"))
    def up_gate(self, ctx, h2):
        """With SwiGLU in the GEMM's epilogue (`dense.swiglu_epilogue_fits`), `gate` holds silu(gate) * up already
        and `up` is an empty [T, 0] placeholder (as OPT's fc1), which `act` reads as done."""
        if hasattr(self, "gate_up_proj"):
            if swiglu_epilogue_fits(self.gate_up_proj, h2, ctx.step_tokens):
                return dense_swiglu(self.gate_up_proj, h2, ctx.num_ctas), jnp.zeros((h2.shape[0], 0), h2.dtype)
            return tuple(self.gate_up_proj.split(dense(self.gate_up_proj, h2, ctx.num_ctas)))
        return dense(self.gate_proj, h2, ctx.num_ctas), dense(self.up_proj, h2, ctx.num_ctas)

    @op(Resource.MEMORY, ins=("gate", "up"), outs=("a",))
    def act(self, ctx, gate, up):
        if up.shape[-1] == 0:           # up_gate's epilogue applied it
            return gate
        return swiglu(gate, up)

    @op(Resource.COMPUTE, ins=("a",), outs=("d_partial",))
    def down(self, ctx, a):
        return dense(self.down_proj, a, ctx.num_ctas)

    @op(Resource.NETWORK, ins=("d_partial",), outs=("d",))
    def mlp_reduce(self, ctx, d_partial):
        return _tp_sum(d_partial, ctx)

    @op(Resource.MEMORY, ins=("x2", "d"), outs=("out",))
    def residual(self, ctx, x2, d):
        return x2 + d


LAYER_OPS = collect_ops(DecoderLayer)


def sequential_layer_fn(layer, ctx: LayerContext, env: dict) -> dict:
    """The plain layer: every op once, in order, on the whole batch."""
    return run_ops(layer.op_specs(), layer, ctx, env)


def layer_forward(layer: DecoderLayer, i: Int[Array, ""], x, kv: KVCache, meta: AttentionMetadata,
                  inv_freq: Float[Array, "D2"], layer_fn=sequential_layer_fn, tp_axis: str | None = None,
                  opts: ForwardOptions = ForwardOptions()):
    """One decoder layer (index `i` into the stacked cache) through `layer_fn`; returns (out, kv). `x` and `out`
    are the residual stream as `layer_fn` carries it (one array, or nano-batch pieces)."""
    ctx = LayerContext(i, meta, inv_freq, tp_axis, opts=opts)
    env = layer_fn(layer, ctx, {"x": x, "kv": kv, "positions": meta.positions, "slots": meta.slot_mapping})
    return env["out"], env["kv"]


def _tp_sum(x, ctx: LayerContext):
    """The row-parallel all-reduce, explicit so a schedule can issue it per nano-batch."""
    return x if ctx.tp_axis is None or ctx.skip_collectives else jax.lax.psum(x, ctx.tp_axis)


class LlamaModel(nnx.Module):
    layer_class = DecoderLayer      # the decoder layer's class (a MoE model's differs: nfjax/models/moe.py)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r):
            return layer_class(cfg, r)

        layer_class = type(self).layer_class
        self.layers = make_layers(rngs)       # params stacked on a leading layer axis
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dt,
                                                                    rngs)

    def __call__(self, tokens: Int[Array, "T"], kv: KVCache, meta: AttentionMetadata,
                 layer_fn=None, tp_axis: str | None = None,
                 opts: ForwardOptions = ForwardOptions()) -> tuple[Float[Array, "T D"], KVCache]:
        """Run all layers over a flat token batch; returns final-normed hidden states and the updated cache.

        `layer_fn(layer, ctx, env) -> env` executes one layer's ops (default: sequential `run_ops`). If it has
        `split_carry` / `join_carry` attributes, the residual stream crosses layers as `split_carry(x)` (e.g.
        nano-batch pieces) and is joined after the last layer.
        Under a shard_map, `tp_axis` names the mesh axis the row-parallel outputs are summed over.
        `opts`: the static choices of `ForwardOptions` (prefill tile bound, benchmark switches).
        """
        layer_fn = layer_fn or sequential_layer_fn
        inv_freq = jnp.asarray(inv_frequencies(self.cfg), jnp.float32)
        x = self.embed_input(tokens, meta.positions)
        x = getattr(layer_fn, "split_carry", lambda v: v)(x)
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, layer_state):
            x, kv, i = carry
            x, kv = layer_forward(nnx.merge(graphdef, layer_state), i, x, kv, meta, inv_freq, layer_fn, tp_axis,
                                  opts)
            return (x, kv, i + 1), None

        (x, kv, _), _ = jax.lax.scan(body, (x, kv, jnp.int32(0)), stacked)
        x = getattr(layer_fn, "join_carry", lambda v: v)(x)
        return self.norm(x), kv

    def embed_input(self, tokens: Int[Array, "T"], positions: Int[Array, "T"]) -> Float[Array, "T D"]:
        """The residual stream's input: the token embeddings (models with learned positions add theirs)."""
        return self.embed(tokens)

    def logits(self, h: Float[Array, "S D"]) -> Float[Array, "S V"]:
        if self.lm_head is None:
            return self.embed.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)
