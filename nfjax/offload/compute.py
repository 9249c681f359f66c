"""The compiled programs of offloaded generation: embed, one decoder layer on one GPU batch, head (+ sampling).

A layer program runs the model's own named ops (`nfjax.models.llama.LAYER_OPS`; OPT's layer declares the same
graph), as the reference forward does, with two swaps for a dense per-batch KV cache instead of pages:
`rope_append` writes K/V into the batch's cache [B, S, KH, D] at each token's position (quantized to the KV
cache's int4 format under `compress_cache`), and attention is one masked softmax over that cache (a query at
position p reads positions <= p of its own row). Off-GPU weights
arrive compressed (`Packed`) and are decompressed inside the program. Each program compiles once per shape
(prefill tokens, decode), whatever layer or batch it runs. Under the zig-zag schedule a layer's 4-bit weights are
decompressed once a pass, by a program of their own, before its GPU batches run.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from nfjax.engine.sampler import sample
from nfjax.models.llama import LAYER_OPS, LayerContext
from nfjax.models.rope import inv_frequencies
from nfjax.offload.compress import decompress_tree
from pallas_kernels import MASK_VALUE, kv_quant

_ATTN_DECODE = next(s for s in LAYER_OPS if s.name == "attn_decode")
_ATTN = next(s for s in LAYER_OPS if s.name == "attn_prefill")
assert _ATTN.ins[:2] == ("q_rot", "kv") and _ATTN.outs == ("attn",), "decoder op graph changed: update offload"


@dataclass
class BatchKV:
    """One GPU batch's K/V of one layer, [B, S, KH, D] (or, compressed, int4 codes [B, S, KH, D / 2] with their
    bfloat16 scale/center rows [B, S, KH, W]: pallas_kernels/kv_quant.py); stands in for the paged cache inside
    `rope_append`."""
    arrays: tuple

    @property
    def kv_dtype(self) -> str:
        """kv_quant's format name: "int4" with its aux rows as a third array (policy compress_cache), else
        "bfloat16" (unquantized, in the model's dtype)."""
        return "int4" if len(self.arrays) > 2 else "bfloat16"

    def write(self, layer, slots, k, v, meta=None) -> "BatchKV":
        b, s = self.arrays[0].shape[:2]
        put = dict(mode="drop", unique_indices=True)
        new = kv_quant.quantize_kv(self.kv_dtype, k, v) if kv_quant.is_quantized(self.kv_dtype) else (k, v)
        return BatchKV(tuple(c.reshape(b * s, *c.shape[2:]).at[slots].set(x.astype(c.dtype), **put).reshape(c.shape)
                             for c, x in zip(self.arrays, new)))

    def dense(self):
        """(k, v) [B, S, KH, D] in float32."""
        aux = self.arrays[2] if kv_quant.is_quantized(self.kv_dtype) else None
        return kv_quant.dequantize_kv(*self.arrays[:2], aux, jnp.float32)


def dense_attention(q: Float[Array, "BT H D"], kv: BatchKV, positions: Int[Array, "B T"], scale: float,
                    topk: float = 1.0) -> Float[Array, "BT HD"]:
    """q [B*T, H, D] -> [B*T, H*D]: each query attends to its row's cache positions <= its own (f32 softmax).
    `topk` < 1: Top-K sparse attention (FlexGen section 5): each query keeps the ceil(topk x (p + 1)) largest of
    its p + 1 scores (ties at the threshold kept too) and the softmax runs over those."""
    b, t = positions.shape
    k, v = kv.dense()
    rotated = kv_quant.rotates(kv.kv_dtype)       # K and V stored rotated (kv_quant.ROTATED)
    if rotated:
        q = kv_quant.rotate(q)          # the queries into the cache's frame
    _, s, kh, d = k.shape
    h = q.shape[1]
    qg = q.reshape(b, t, kh, h // kh, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * scale
    ok = jnp.arange(s)[None, None, :] <= positions[:, :, None]                      # [B, T, S]
    scores = jnp.where(ok[:, None, None], scores, MASK_VALUE)
    if topk < 1.0:
        keep = jnp.maximum(jnp.ceil(topk * (positions + 1).astype(jnp.float32)).astype(jnp.int32), 1)   # [B, T]
        desc = -jnp.sort(-scores, axis=-1)
        idx = jnp.broadcast_to((keep - 1)[:, None, None, :, None], desc.shape[:-1] + (1,))
        scores = jnp.where(scores >= jnp.take_along_axis(desc, idx, axis=-1), scores, MASK_VALUE)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", w, v)
    if rotated:
        out = kv_quant.rotate(out)      # and the outputs back out of it
    return out.reshape(b * t, h * d).astype(q.dtype)


def _unfolded_layer(layer_gd, cfg, weights):
    """The layer from its (decompressed) weights. Attention here hands o_proj rows in o_proj's own frame
    (`dense_attention` and `cpu_attention` rotate them back), so a layer whose o_proj took V's rotation (the Runner's
    serving transform, nfjax/models/rotation_fold.py) is refused rather than computed wrong."""
    layer = nnx.merge(layer_gd, decompress_tree(weights, jnp.dtype(cfg.dtype)))
    if layer.v_rotation_folded:
        raise ValueError("the offload engine runs layers with o_proj unfolded (nfjax/models/rotation_fold.py)")
    return layer


def _layer(layer_gd, cfg, topk: float, rows: bool, weights, x, cache: tuple, positions):
    """x [B, T, D], the batch's cache arrays (`BatchKV`), positions [B, T] -> (x out, and the whole cache, or with
    `rows` only the rows this call wrote [B, T, ...], for a cache that lives off the GPU)."""
    layer = _unfolded_layer(layer_gd, cfg, weights)
    b, t, d = x.shape
    s = cache[0].shape[1]
    slots = (jnp.arange(b, dtype=jnp.int32)[:, None] * s + positions).reshape(-1)
    ctx = LayerContext(layer=jnp.int32(0), meta=None, inv_freq=jnp.asarray(inv_frequencies(cfg), jnp.float32))
    env = {"x": x.reshape(b * t, d), "kv": BatchKV(tuple(cache)), "positions": positions.reshape(-1),
           "slots": slots}
    for spec in LAYER_OPS:
        if spec is _ATTN_DECODE:
            continue
        if spec is _ATTN:
            env["attn"] = dense_attention(env["q_rot"], env["kv"], positions, cfg.head_dim ** -0.5, topk)
        else:
            env.update(spec(layer, ctx, env))
    kv, out = env["kv"], env["out"].reshape(b, t, d)
    if not rows:
        return out, kv.arrays
    return out, tuple(c[jnp.arange(b)[:, None], positions] for c in kv.arrays)


_PRE = LAYER_OPS[:LAYER_OPS.index(_ATTN_DECODE)]                 # up to rope_append: q and the new K/V rows
_POST = LAYER_OPS[LAYER_OPS.index(_ATTN) + 1:]                   # o_proj to the residual
_CARRY = tuple(sorted({i for sp in _POST for i in sp.ins} - {o for sp in _POST for o in sp.outs} - {"attn"}))


def _pre_attention(layer_gd, cfg, weights, x, rows: tuple, positions):
    """CPU attention's first half: x [B, T, D] -> (q_rot [B*T, H, D], the new K/V rows in the cache's format
    (`rows`: zero arrays [B, T, ...] to write them into), what the second half needs of the layer's values)."""
    layer = _unfolded_layer(layer_gd, cfg, weights)
    b, t, d = x.shape
    ctx = LayerContext(layer=jnp.int32(0), meta=None, inv_freq=jnp.asarray(inv_frequencies(cfg), jnp.float32))
    env = {"x": x.reshape(b * t, d), "kv": BatchKV(tuple(rows)), "positions": positions.reshape(-1),
           "slots": jnp.arange(b * t, dtype=jnp.int32)}
    for spec in _PRE:
        env.update(spec(layer, ctx, env))
    return env["q_rot"], env["kv"].arrays, {c: env[c] for c in _CARRY}


def _post_attention(layer_gd, cfg, weights, carry: dict, attn):
    """CPU attention's second half: the attention output [B, T, H*D] (back from the CPU) -> the layer's out
    [B, T, D]."""
    layer = _unfolded_layer(layer_gd, cfg, weights)
    ctx = LayerContext(layer=jnp.int32(0), meta=None, inv_freq=jnp.asarray(inv_frequencies(cfg), jnp.float32))
    b, t, _ = attn.shape
    env = {**carry, "attn": attn.reshape(b * t, -1).astype(jnp.dtype(cfg.dtype))}
    for spec in _POST:
        env.update(spec(layer, ctx, env))
    return env["out"].reshape(b, t, -1)


def _embed(rest_gd, rest_state, tokens, positions):
    model = nnx.merge(rest_gd, rest_state)
    b, t = tokens.shape
    return model.embed_input(tokens.reshape(-1), positions.reshape(-1)).reshape(b, t, -1)


def _head(rest_gd, any_sampled: bool, rest_state, x, last, temperature, top_k, top_p, seeds, counters):
    """Each row's token after its position `last` (sampled as the engine samples: same seeds, same tokens)."""
    model = nnx.merge(rest_gd, rest_state)
    h = x[jnp.arange(x.shape[0]), last]
    logits = model.logits(model.norm(h))
    return sample(logits, temperature, top_k, top_p, seeds, counters, any_sampled=any_sampled)


def _token_logprobs(rest_gd, rest_state, x, targets):
    """log p(targets[b, t] | tokens up to t) for every position [B, T] (perplexity), and the argmax token [B, T]
    (top-1 agreement)."""
    model = nnx.merge(rest_gd, rest_state)
    b, t, d = x.shape
    logits = model.logits(model.norm(x.reshape(b * t, d))).reshape(b, t, -1)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], jnp.argmax(logits, axis=-1)


class Programs:
    """The jitted programs of one model (compiled on first use per shape, then cached by jax)."""

    def __init__(self, cfg, rest_gd, layer_gd, topk: float = 1.0):
        self.cfg, self.topk = cfg, topk
        self.layer = {rows: jax.jit(partial(_layer, layer_gd, cfg, topk, rows), donate_argnums=() if rows else (2,))
                      for rows in (False, True)}
        # attention on the CPU (policy cpu_attention): the layer in two programs around it
        self.pre_attention = jax.jit(partial(_pre_attention, layer_gd, cfg))
        self.post_attention = jax.jit(partial(_post_attention, layer_gd, cfg))
        # 4-bit weights decompressed once per layer and pass, before the layer's GPU batches (not once per batch)
        self.decompress = jax.jit(partial(decompress_tree, dtype=jnp.dtype(cfg.dtype)))
        self.embed = jax.jit(partial(_embed, rest_gd))
        self.head = {s: jax.jit(partial(_head, rest_gd, s)) for s in (False, True)}
        self.token_logprobs = jax.jit(partial(_token_logprobs, rest_gd))
