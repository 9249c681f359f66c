"""Attention dispatch over the paged cache: Pallas kernels on GPU, pure-jnp references elsewhere.

On GPU a step's flat token batch (decode tokens first, then prefill chunks, then padding) is split statically,
because `num_decode` is a traced value:
  * the decode kernel runs over the first min(S, T) token rows as if each were a decode query; rows at or past
    num_decode get sequence length 0, so their work items exit at once (no K/V read);
  * the prefill kernel plans its query tiles on device over sequences >= num_decode only; its tile bound is
    static (T / tokens_per_tile + max_prefill_seqs) and tiles past the live ones exit at once;
  * the result takes row t from the decode output if t < num_decode, else from the prefill output.
What padding costs: one early-exit CTA per empty work item and the prefill query-tile gather, which is
proportional to the static tile bound; pass `max_prefill_seqs` (the scheduler's cap on prefill chunks per
step) to shrink it. Kernels read the stacked cache with the layer index inside the kernel: no per-layer copy.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.compat import num_sms, on_gpu
from nfjax.kv.cache import KVCache
from nfjax.kv.metadata import AttentionMetadata
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.paged_prefill_attention import paged_prefill_attention
from pallas_kernels.ragged_paged_attention_ref import ragged_paged_attention_ref


def kernels_support(q, kv: KVCache) -> bool:
    h, d = q.shape[1], q.shape[2]
    kvh = kv.k.shape[3]
    return (d % 64 == 0 and h % kvh == 0 and h // kvh <= 64
            and jnp.dtype(kv.k.dtype).itemsize == 2 and q.dtype == kv.k.dtype)


def paged_attention(q: Float[Array, "T H D"], kv: KVCache, layer: Int[Array, ""], meta: AttentionMetadata,
                    scale: float, *, use_kernels: bool | None = None, interpret: bool = False,
                    num_programs: int | None = None, max_prefill_seqs: int | None = None) -> Float[Array, "T H D"]:
    """use_kernels=None: kernels on GPU when the shapes/dtypes suit them, else the jnp reference.
    interpret=True runs the kernels through the Mosaic GPU interpreter (CPU tests only)."""
    if use_kernels is None:
        use_kernels = on_gpu() and kernels_support(q, kv)
    if not use_kernels:
        return ragged_paged_attention_ref(q, kv.k[layer], kv.v[layer], meta.positions, meta.token_seq,
                                          meta.page_table, meta.seq_lens, scale)
    return _paged_attention_kernels(q, kv, layer, meta, scale, interpret=interpret,
                                    num_programs=num_programs or num_sms(), max_prefill_seqs=max_prefill_seqs)


def _paged_attention_kernels(q, kv: KVCache, layer, meta: AttentionMetadata, scale: float, *, interpret: bool,
                             num_programs: int, max_prefill_seqs: int | None):
    t = q.shape[0]
    s = meta.seq_lens.shape[0]
    b = min(s, t)
    nd = meta.num_decode
    dec_lens = jnp.where(jnp.arange(b) < nd, meta.seq_lens[:b], 0)
    dec = paged_decode_attention(q[:b], kv.k, kv.v, layer, meta.page_table[:b], dec_lens, scale=scale,
                                 num_programs=num_programs, interpret=interpret)
    pt, lens, qs = meta.page_table, meta.seq_lens, meta.query_start
    if max_prefill_seqs is not None and max_prefill_seqs < s:
        # Prefill sequences sit right after the decodes: take the window [nd, nd + max_prefill_seqs).
        w = max_prefill_seqs
        idx = nd + jnp.arange(w)
        pt = pt[jnp.clip(idx, 0, s - 1)]
        lens = jnp.where(idx < s, lens[jnp.clip(idx, 0, s - 1)], 0)
        qs = qs[jnp.clip(nd + jnp.arange(w + 1), 0, s)]      # window ends where sequence nd + w starts
        first = jnp.int32(0)
    else:
        first = nd
    pre = paged_prefill_attention(q, kv.k, kv.v, layer, pt, lens, qs, first, scale=scale, interpret=interpret)
    dec_full = jnp.zeros_like(q).at[:b].set(dec)
    return jnp.where((jnp.arange(t) < nd)[:, None, None], dec_full, pre)
