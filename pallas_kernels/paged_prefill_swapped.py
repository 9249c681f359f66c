"""Paged prefill attention on a quantized cache through the swapped decode kernel (positions as the wgmma rows).

The heads-as-rows prefill kernel (paged_prefill_attention.py) reads a quantized cache with one warpgroup a tile
that dequantizes each K/V block and then computes, serially: fp8's mixed steps spent ~4 ms more in it than bf16's
(bench/NOTES.md 31.1). Here a prefill tile is one more kind of work item of the swapped decode kernel
(paged_decode_swapped.attention_kernel with `causal_group`), so its producer copies, its dequantizing warpgroups
(V, and K for int8 / int4 in the consumer; fp8's K not at all: `fp8_mma`) and its consumer overlap as in decode.

A tile holds TPT = `tile_cols` / G consecutive query tokens of one sequence times the G query heads of one kv head
(column c = token c // G, head c % G): the kernel's GP columns. Tile layout and the gathers in and out are the
heads-as-rows kernel's (`layout_tiles`); an item is (tile, kv head), one split; column c sees the positions up to
the tile's first position + c // G. Same contract as `paged_prefill_attention`, whose reference is this one's too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._compat import num_sms
from pallas_kernels._kv_dequant import cache_format, check_format
from pallas_kernels._mgpu import check_block
from pallas_kernels.paged_decode_swapped import settings, swapped_call
from pallas_kernels.paged_prefill_attention import _bucket, layout_tiles

TILE_COLS = 32          # query columns a tile (8 tokens of a 4-head group): the consumer's S, P and O^T at 64
                        # columns would not fit one warpgroup's registers beside the dequantizers' share


@functools.partial(jax.jit, static_argnames=("scale", "num_ctas", "tile_cols", "block_kv", "num_stages",
                                             "dequant_wgs", "k_in_consumer", "fp8_mma", "interpret"), inline=True)
def paged_prefill_attention_swapped(q: Float[Array, "T H D"], k_cache, v_cache, layer: Int[Array, ""],
                                    page_table: Int[Array, "S P"], seq_lens: Int[Array, "S"],
                                    query_start: Int[Array, "S1"], first_seq: Int[Array, ""], *, scale: float,
                                    aux_cache, num_ctas: int | None = None, tile_cols: int = TILE_COLS,
                                    block_kv: int = 128, num_stages: int | None = None,
                                    dequant_wgs: int | None = None, k_in_consumer: bool | None = None,
                                    fp8_mma: bool | None = None, interpret: bool = False) -> Float[Array, "T H D"]:
    """Causal attention of each live sequence's query chunk over its cached positions on a quantized cache
    (`aux_cache` [L, N, PS, KH, W]). Tokens outside live sequences (decodes before `first_seq`, padding) give 0.
    `tile_cols`: query columns a tile, a multiple of 8 and of the group G, at most 64. The dequantizing choices
    default as in `paged_decode_attention_swapped` (`settings`), over 2 stages (the wider tiles take SMEM)."""
    t, h, d = q.shape
    kvh = k_cache.shape[3]
    s = page_table.shape[0]
    g = h // kvh
    if g * kvh != h:
        raise ValueError(f"{h} query heads over {kvh} kv heads: need a whole group")
    if aux_cache is None:
        raise ValueError("the swapped prefill reads quantized caches (bfloat16: paged_prefill_attention)")
    if tile_cols % 8 or tile_cols % g or not 8 <= tile_cols <= 64:
        raise ValueError(f"tile_cols={tile_cols}: a multiple of 8 and of the group ({g}), at most 64")
    check_block(block_kv, k_cache.shape[2], d)
    fmt = cache_format(k_cache, aux_cache)
    check_format(fmt, d, aux_cache.shape[-1])
    num_ctas = num_ctas or num_sms()
    tpt = tile_cols // g
    seq_lens, query_start = seq_lens.astype(jnp.int32), query_start.astype(jnp.int32)
    nt, info, tok0, start, live_len = layout_tiles(seq_lens, query_start, first_seq, t, tpt)
    st = settings(fmt, k_cache, aux_cache, nt * kvh, num_ctas=num_ctas, num_stages=num_stages or 2,
                  dequant_wgs=dequant_wgs, k_in_consumer=k_in_consumer, fp8_mma=fp8_mma, prefetch_pages=None,
                  row_sums="reduce")

    # Query tiles [NT * KH, TPT * G, D]: item w = tile w // KH, kv head w % KH; column c = token c // G, head c % G.
    idx = jnp.clip(tok0[:, None] + jnp.arange(tpt)[None, :], 0, t - 1)
    qt = q.reshape(t, kvh, g, d)[idx]                              # [NT, TPT, KH, G, D]
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(nt * kvh, tile_cols, d)
    params = jnp.asarray(layer, jnp.int32).reshape(1)
    o_t, _ = swapped_call(qt, 1, params, info, page_table, k_cache, v_cache, aux_cache, scale=scale,
                          num_ctas=num_ctas, block_kv=block_kv, interpret=interpret, st=st, causal_group=g)

    # Back to token order. Tiles past the live ones (kv_hi == 0) hold zeros, but no live token maps to them.
    ot = o_t.transpose(0, 2, 1).reshape(nt, kvh, tpt, g, d)
    tok = jnp.arange(t)
    seq = jnp.clip(_bucket(query_start[1:], tok), 0, s - 1)
    local = tok - query_start[seq]
    live = (tok >= query_start[0]) & (tok < query_start[s]) & (local < live_len[seq])
    tile = jnp.clip(start[seq] + local // tpt, 0, nt - 1)
    out = ot[tile, :, local % tpt]                                 # [T, KH, G, D]
    return jnp.where(live[:, None, None, None], out, 0).reshape(t, h, d).astype(q.dtype)
