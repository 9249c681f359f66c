"""Horizontal kernels for the scheduling API: ops of different nano-batches side by side in one launch.

`DECODE_BESIDE_UP_GATE` runs one nano-batch's decode attention (`attn_decode`) and another's MLP gate/up
projections (`up_gate`) as one Pallas kernel whose CTAs are split between them
(pallas_kernels/attention_beside_gemm.py): NanoFlow's overlap of a memory-bound and a compute-bound op
without relying on XLA to issue two streams together. The attention part's share (a plan's
`"attn_decode:K"` share) is its CTA count; the GEMM takes the other SMs. Where the fused kernel does not
apply (CPU, shapes it does not take, biases), the two ops run one after the other through their own code,
so every schedule that uses it also runs, with the same results, everywhere.
"""
from __future__ import annotations

import jax.numpy as jnp

from nfjax.compat import num_sms, on_gpu
from nfjax.kv.attention import decode_rows, kernels_support, rotate_queries
from nfjax.models.dense import swiglu_epilogue_fits
from nfjax.schedule.api import Kernel
from pallas_kernels.kv_quant import has_tail

DEFAULT_ATTN_SHARE = 0.25       # 33 of 132 H100 SMs: bench/results/decode_share-fused-20261123.json


def _sequential(layer, ctxs, ins, parts):
    outs = []
    for p, c, i in zip(parts, ctxs, ins):
        r = p.fn(layer, c, *i)
        outs.append(tuple(r) if len(p.outs) > 1 else (r,))
    return outs


def _decode_beside_up_gate(layer, ctxs, ins, parts):
    from pallas_kernels.attention_beside_gemm import decode_attention_beside_gemm, gemm_fits
    from pallas_kernels.persistent_gemm import DEFAULT_CONFIG, TILE_CONFIGS
    ctx_a, ((q, kv), (h2,)) = ctxs[0], ins
    joined = getattr(layer, "gate_up_proj", None)           # nfjax/models/fused.py
    lins = (joined,) if joined is not None else (layer.gate_proj, layer.up_proj)
    ws = tuple(lin.kernel[...] for lin in lins)
    # a format with a K tail (fp8r) reads it beside the decode kernel (nfjax/kv/tail_attention.py), not this one
    fits = (on_gpu() and ctx_a.meta is not None and kernels_support(q, kv) and not has_tail(kv.kv_dtype)
            and h2.dtype == ws[0].dtype
            and gemm_fits(h2.shape, [w.shape for w in ws], TILE_CONFIGS[DEFAULT_CONFIG])
            and all(lin.bias is None for lin in lins))
    if not fits:
        return _sequential(layer, ctxs, ins, parts)
    t = q.shape[0]
    q_r, pt, lens = decode_rows(rotate_queries(q, kv), ctx_a.meta)
    attn_ctas = ctx_a.num_ctas or max(1, round(DEFAULT_ATTN_SHARE * num_sms()))
    # SwiGLU in the GEMM's epilogue where the Sequential step would run it there (nfjax/models/dense.py)
    epilogue = joined is not None and swiglu_epilogue_fits(joined, h2, ctxs[1].step_tokens)
    attn, outs = decode_attention_beside_gemm(
        q_r, kv.k, kv.v, ctx_a.layer, pt, lens, h2, ws, scale=layer.cfg.head_dim ** -0.5,
        attn_ctas=attn_ctas, aux_cache=kv.aux, act="swiglu" if epilogue else None)
    if epilogue:                        # `act` passes the activation on (nfjax/models/llama.py up_gate)
        gate, up = outs[0], jnp.zeros((h2.shape[0], 0), h2.dtype)
    else:
        gate, up = joined.split(outs[0]) if joined is not None else outs
    attn = attn.reshape(attn.shape[0], -1)      # in the cache's frame, as `attn_decode`'s (attn_prefill: o_proj's)
    if attn.shape[0] != t:
        attn = jnp.pad(attn, ((0, t - attn.shape[0]), (0, 0)))
    return [(attn,), (gate, up)]


DECODE_BESIDE_UP_GATE = Kernel("decode_beside_up_gate", replaces=("attn_decode", "up_gate"), ins=(), outs=(),
                               fn=_decode_beside_up_gate, horizontal=True)
HORIZONTAL_KERNELS = {frozenset(k.replaces): k for k in (DECODE_BESIDE_UP_GATE,)}
