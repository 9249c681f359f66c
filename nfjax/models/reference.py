"""The reference forward: a `LlamaModel`'s logits for whole token sequences, causal, no paged cache, pure jnp.

The model's own decoder-layer ops (`layer.op_specs()`: norms, projections, RoPE, MLP or MoE, residuals) run over
the whole batch; only attention is swapped for one dense causal attention (masked scores are `pallas_kernels.MASK_VALUE`,
as in every kernel and paged reference), and the `rope_append` op writes its K/V into a dense stand-in instead of
cache pages. So the engine's paged forward and this one share all the math but attention.

Its users: `nfjax train-tiny` trains with it (the loss), the engine tests compare the engine's greedy tokens with
`greedy` (tests/engine), and the HF parity test compares it with transformers (tests/models/test_hf_parity.py);
tests/models/test_reference.py checks it against the paged forward.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from nfjax.kv.attention import outputs_for_o_proj
from nfjax.models.llama import LAYER_OPS, LayerContext, LlamaModel
from nfjax.models.rope import inv_frequencies
from pallas_kernels import MASK_VALUE

_ATTN = next(s for s in LAYER_OPS if s.name == "attn_prefill")
assert _ATTN.ins[:2] == ("q_rot", "kv") and _ATTN.outs == ("attn",), "decoder op graph changed: update reference"


class _DenseKV:
    """Stand-in for the paged cache inside `rope_append`: `write` just keeps this layer's (roped) K and V."""
    kv_dtype = "bfloat16"           # exact K and V, in no rotated frame

    def __init__(self, k=None, v=None):
        self.k, self.v = k, v

    def write(self, layer, slots, k, v, meta=None) -> "_DenseKV":
        return _DenseKV(k, v)


def causal_attention(q: Float[Array, "BT H D"], k: Float[Array, "BT KH D"], v: Float[Array, "BT KH D"],
                     batch: int, scale: float) -> Float[Array, "BT HD"]:
    """q [B*T, H, D], k/v [B*T, KH, D] -> [B*T, H*D]; each row attends to positions <= its own in its row."""
    bt, h, d = q.shape
    kh = k.shape[1]
    t = bt // batch
    qg = q.reshape(batch, t, kh, h // kh, d).astype(jnp.float32)
    kf = k.reshape(batch, t, kh, d).astype(jnp.float32)
    vf = v.reshape(batch, t, kh, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, kf) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]           # [t (query), s (key)]
    scores = jnp.where(causal, scores, MASK_VALUE)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", w, vf)
    return out.reshape(bt, h * d).astype(q.dtype)


def logits(model: LlamaModel, tokens: Int[Array, "B T"]) -> Float[Array, "B T V"]:
    """Logits [B, T, V] (f32) of a batch of whole sequences [B, T], each starting at position 0. Causal: a
    position's logits do not depend on the tokens after it (padding at the end changes nothing before it)."""
    cfg = model.cfg
    b, t = tokens.shape
    inv_freq = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
    slots = jnp.zeros((b * t,), jnp.int32)
    x = model.embed_input(tokens.reshape(-1), positions)
    graphdef, stacked = nnx.split(model.layers)
    scale = cfg.head_dim ** -0.5

    def body(carry, layer_state):
        x, i = carry
        layer = nnx.merge(graphdef, layer_state)
        ctx = LayerContext(layer=i, meta=None, inv_freq=inv_freq)
        env = {"x": x, "kv": _DenseKV(), "positions": positions, "slots": slots}
        for spec in layer.op_specs():          # the layer's own graph (a MoE layer's differs)
            if spec.name == "attn_decode":
                continue            # no decode rows: attn_prefill covers every token
            if spec.name == _ATTN.name:
                kv = env["kv"]
                attn = causal_attention(env["q_rot"], kv.k, kv.v, b, scale).reshape(b * t, -1, cfg.head_dim)
                env["attn"] = outputs_for_o_proj(attn, kv, layer.v_rotation_folded).reshape(b * t, -1)
            else:
                env.update(spec(layer, ctx, env))
        return (env["out"], i + 1), None

    (x, _), _ = jax.lax.scan(body, (x, jnp.int32(0)), stacked)
    return model.logits(model.norm(x)).reshape(b, t, -1)


@partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, tokens, last):
    return logits(nnx.merge(graphdef, state), tokens[None])[0, last]


def generate(model: LlamaModel, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, stop_ids: Sequence[int] = (), width: int = 128) -> list[int]:
    """Up to `max_new_tokens` tokens after `prompt_ids`, re-running the whole sequence for every token (no cache,
    no batching): greedy at temperature 0, else drawn from softmax(logits / temperature) with
    `jax.random.key(seed)` split once per token. Stops before a token of `stop_ids`. The sequence is padded to
    `width` (a multiple of it when longer) so the loop compiles once."""
    ids = [int(t) for t in prompt_ids]
    width = -(-(len(ids) + max_new_tokens) // width) * width
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    out: list[int] = []
    for _ in range(max_new_tokens):
        toks = np.zeros(width, np.int32)
        toks[:len(ids)] = ids
        row = _logits_at(graphdef, state, jnp.asarray(toks), len(ids) - 1)
        if temperature <= 0:
            nxt = int(jnp.argmax(row))
        else:
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, row / temperature))
        if nxt in stop_ids:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def greedy(model: LlamaModel, prompt_ids: Sequence[int], n: int, width: int = 128) -> list[int]:
    """`n` greedy tokens after `prompt_ids` (no stop token): `generate` at temperature 0."""
    return generate(model, prompt_ids, n, width=width)
