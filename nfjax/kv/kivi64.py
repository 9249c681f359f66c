"""kivi64's write (docs/design.md section 14.1): K enters a bfloat16 tail row of its sequence and is quantized per
channel when its group of 64 positions completes; V is quantized per token as int4 at once. `write_tail` writes
the tail rows of every format with one (kivi64's K; fp8r's K and V, section 14.3).

State after a step's writes, for a sequence of length n (`AttentionMetadata.seq_lens`): groups below
f = 64 * floor(n / 64) are quantized in their pages (a group is a page); positions [f, n) are in
`KVCache.k_tail[layer, kv_tail[seq], pos % 64]`. A token whose position ends a group (pos % 64 == 63) completes
it: the group's 64 rows are taken from this step's K where the same sequence wrote them in this batch (chunked
prefill: whole groups at once) and from the tail for the rest (written by earlier steps, or by an earlier
nano-batch of this step, whose lengths end at its own writes), quantized, and written over the page with K's aux
columns of its 64 rows. Only tokens at or past f go to the tail, so a chunk spanning groups never writes two
positions of the same tail row. Padding tokens (slots past the cache) write nothing.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.kv.metadata import AttentionMetadata
from pallas_kernels import kv_kivi64
from pallas_kernels.kv_kivi64 import GROUP


def write(cache, layer: Int[Array, ""], slots: Int[Array, "T"], k: Float[Array, "T KH D"],
          v: Float[Array, "T KH D"], meta: AttentionMetadata):
    """`KVCache.write` of the kivi64 format (returns the new KVCache)."""
    t = k.shape[0]
    n, ps = cache.k.shape[1], cache.k.shape[2]
    g2 = 2 * (k.shape[-1] // GROUP)                      # K's (and V's) aux columns
    put = dict(mode="drop", unique_indices=True)
    page, off = slots // ps, slots % ps
    valid = slots < n * ps
    seq = meta.token_seq[:t]
    pos = meta.positions[:t]
    qs = meta.query_start[seq]
    row = meta.kv_tail[seq]

    # V: per token, int4 as the int4 format's (K's aux columns of the row are left to the group's completion)
    vq, vaux = kv_kivi64.quantize_v(v)
    vals_v = cache.v.at[layer, page, off].set(vq, **put)
    aux = cache.aux.at[layer, page, off, :, g2:2 * g2].set(vaux, **put)

    # completions: at most one per 64 tokens of a sequence, plus one a sequence
    c = min(t, t // GROUP + meta.seq_lens.shape[0])
    done = valid & (pos % GROUP == GROUP - 1)
    (idx,) = jnp.nonzero(done, size=c, fill_value=t)
    ok = idx < t
    i = jnp.minimum(idx, t - 1)
    src = i[:, None] - (GROUP - 1) + jnp.arange(GROUP)[None, :]            # [C, 64] token index of each row
    here = src >= qs[i][:, None]                                            # written by this batch (same sequence)
    old = cache.k_tail[layer][row[i]]                                       # [C, 64, KH, D]
    rows = jnp.where(here[..., None, None], k[jnp.clip(src, 0, t - 1)].astype(jnp.float32),
                     old.astype(jnp.float32))
    codes, kaux = kv_kivi64.quantize_k_group(rows)
    gpage = jnp.where(ok, page[i], n + jnp.arange(c))       # padding completions: distinct ids past the cache
    vals_k = cache.k.at[layer, gpage].set(codes, **put)
    aux = aux.at[layer, gpage, :, :, :g2].set(kaux, **put)

    return type(cache)(vals_k, vals_v, aux, cache.kv_dtype, *write_tail(cache, layer, slots, k, meta))


def write_tail(cache, layer: Int[Array, ""], slots: Int[Array, "T"], k: Float[Array, "T KH D"],
               meta: AttentionMetadata, v: Float[Array, "T KH D"] | None = None):
    """The new (`k_tail`, `v_tail`): the rows of each sequence's group still filling (positions >= 64 floor(len /
    64)) into its tail row, K's, and V's where the cache keeps a V tail (fp8r)."""
    t = k.shape[0]
    r = cache.k_tail.shape[1]
    seq, pos = meta.token_seq[:t], meta.positions[:t]
    full = (meta.seq_lens[seq] // GROUP) * GROUP
    valid = slots < cache.k.shape[1] * cache.k.shape[2]
    tail_row = jnp.where(valid & (pos >= full), meta.kv_tail[seq], r + jnp.arange(t))   # the rest: distinct, dropped
    put = dict(mode="drop", unique_indices=True)
    k_tail = cache.k_tail.at[layer, tail_row, pos % GROUP].set(k.astype(cache.k_tail.dtype), **put)
    if cache.v_tail is None:
        return k_tail, None
    return k_tail, cache.v_tail.at[layer, tail_row, pos % GROUP].set(v.astype(cache.v_tail.dtype), **put)


def tail_bytes(num_layers: int, rows: int, kv_heads: int, head_dim: int) -> int:
    """Device bytes of `rows` tail rows (bfloat16 K of 64 positions, all layers)."""
    return num_layers * rows * GROUP * kv_heads * head_dim * 2
