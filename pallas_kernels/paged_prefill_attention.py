"""Paged prefill attention for chunked prefill (ragged, several sequences per call, GQA). Pallas Mosaic GPU.

Sequence s contributes the query tokens [query_start[s], query_start[s+1]) at the LAST q_len positions of its
seq_lens[s] cached positions (its K/V for this chunk are already in the pages); each token attends causally to
every earlier position of its own sequence plus itself.

Tiling: a query tile holds TPT = 64 * W // G consecutive tokens of one sequence times the G query heads of
one kv head (row r = token r // G, head r % G), so one K/V stream serves the whole GQA group. W = 2
warpgroups (default) each own 64 rows and share the K/V stages; by default they run "ping-pong"
(pallas_kernels/_mgpu.py): one warpgroup's softmax overlaps the other's matmuls. The wrapper lays out tiles with
jnp on device (no host sync): tile -> (sequence, first token, first position), gathers the query tiles into
[tiles * KH, W, 64, D], runs one CTA per (tile, kv head) — the hardware block scheduler balances the
ragged causal work — and gathers the output back to token order. Blocks wholly below a tile's first position
run unmasked; the rest apply the causal / length mask. On a quantized cache the two warpgroups split each block's
dequantizing (one K, the other V) and meet twice a block instead of ping-ponging (`QUANT_WARPGROUPS`).

Measured on H100 (bench/results/attention-20261122.json): 4 x 1024-token chunks after 3072 cached positions,
32q/8kv heads, head_dim 128: 367 TFLOP/s causal, 52% of the measured bf16 GEMM rate; one warpgroup: 244.

Same finite-cache assumption as the decode kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import MASK_VALUE
from pallas_kernels._compat import mosaic_gpu_interpret_params
from pallas_kernels._kv_dequant import Dequant, cache_format, check_format, deq_transforms, quant_scratch
from pallas_kernels.kv_quant import dequantize_kv
from pallas_kernels._mgpu import ROWS, Ops, bcast_rows, cdiv, check_block, compiler_params, kv_scratch, \
    paged_flash_loop, smem_tile_transforms


def paged_prefill_attention_ref(q: Float[Array, "T H D"], k_cache: Float[Array, "L N PS KH D"],
                                v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                                page_table: Int[Array, "S P"], seq_lens: Int[Array, "S"],
                                query_start: Int[Array, "S1"], first_seq: Int[Array, ""],
                                scale: float, aux_cache=None) -> Float[Array, "T H D"]:
    """Pure-jnp reference (f32 math). Tokens of sequences < first_seq and tokens outside
    [query_start[0], query_start[S]) give 0. `aux_cache`: a quantized cache (kv_quant.py), dequantized first."""
    t, h, d = q.shape
    _, _, ps, kh, _ = k_cache.shape
    s, p = page_table.shape
    tok = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(query_start[1:], tok, side="right"), 0, s - 1)
    live = (tok >= query_start[0]) & (tok < query_start[s]) & (seq >= first_seq)
    q_len = query_start[seq + 1] - query_start[seq]
    pos = seq_lens[seq] - q_len + (tok - query_start[seq])
    kl, vl = dequantize_kv(k_cache[layer], v_cache[layer], None if aux_cache is None else aux_cache[layer])
    k = kl[page_table[seq]].reshape(t, p * ps, kh, d)
    v = vl[page_table[seq]].reshape(t, p * ps, kh, d)
    qg = q.reshape(t, kh, h // kh, d).astype(jnp.float32)
    sc = jnp.einsum("tkgd,tlkd->tkgl", qg, k) * scale
    ok = jnp.arange(p * ps)[None, :] <= pos[:, None]
    w = jax.nn.softmax(jnp.where(ok[:, None, None, :], sc, MASK_VALUE), -1)
    out = jnp.einsum("tkgl,tlkd->tkgd", w, v).reshape(t, h, d)
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def _bucket(edges, x):
    """searchsorted(edges, x, side="right") as one compare-and-count fusion: jnp's default 'scan' method is a
    while loop, which on the GPU costs a host round trip per step; S is small, so S x N compares are cheap."""
    return jnp.searchsorted(edges, x, side="right", method="compare_all")


def layout_tiles(seq_lens, query_start, first_seq, num_tokens: int, tokens_per_tile: int):
    """Static-shape tile layout. Returns (num_tiles, info [3, NT] int32 = (seq, first position, kv_hi),
    tile_tok0 [NT], tile_start [S] (first tile of each sequence), live_len [S] (q tokens of live seqs)).
    Tiles past the last live one get kv_hi = 0 and cost one early exit."""
    s = seq_lens.shape[0]
    q_len = query_start[1:] - query_start[:-1]
    live_len = jnp.where(jnp.arange(s) >= first_seq, q_len, 0)
    n_tiles = (live_len + tokens_per_tile - 1) // tokens_per_tile
    cum = jnp.cumsum(n_tiles)
    start = cum - n_tiles
    nt = cdiv(num_tokens, tokens_per_tile) + s          # sum ceil(len / TPT) <= T / TPT + S
    t = jnp.arange(nt)
    seq = jnp.clip(_bucket(cum, t), 0, s - 1)
    local = t - start[seq]
    tok0 = query_start[seq] + local * tokens_per_tile
    pos0 = seq_lens[seq] - q_len[seq] + local * tokens_per_tile
    ntok = jnp.minimum(tokens_per_tile, live_len[seq] - local * tokens_per_tile)
    valid = t < cum[-1]
    kv_hi = jnp.where(valid, jnp.minimum(seq_lens[seq], pos0 + ntok), 0)
    info = jnp.stack([seq, jnp.where(valid, pos0, 0), kv_hi]).astype(jnp.int32)
    return nt, info, tok0, start, live_len


def _kernel(params_hbm, info_hbm, pt_hbm, q_hbm, k_hbm, v_hbm, o_hbm, q_s, q_bar, k_s, v_s, k_bar, v_bar,
            *extra, num_kv_heads, group, num_ctas, num_wgs, pingpong, scale, interpret, kv_format="bfloat16",
            aux_hbm=None):
    ops = Ops(interpret)
    dq, sync = None, None
    if kv_format != "bfloat16":                 # `extra`: the quantized scratch, then (two warpgroups) the barriers
        dq, extra = Dequant(kv_format, q_s.shape[2], extra[:3], interpret), extra[3:]
        if extra:
            extra, sync = extra[:1], extra[1]
    num_items = info_hbm.shape[1] * num_kv_heads
    pid = lax.axis_index("p")
    wg = lax.axis_index("wg") if num_wgs > 1 else None
    layer = params_hbm[0]

    def item(k, carry):
        w = pid + k * num_ctas
        tile = lax.div(w, num_kv_heads)
        kh = lax.rem(w, num_kv_heads)
        seq, pos0, kv_hi = info_hbm[0, tile], info_hbm[1, tile], info_hbm[2, tile]

        @pl.when(kv_hi > 0)
        def _():
            mine = q_s.at[0] if wg is None else q_s.at[wg]
            plgpu.wait_smem_to_gmem(0)              # q_s doubles as the previous item's output buffer
            i = 0 if wg is None else wg
            plgpu.copy_gmem_to_smem(q_hbm.at[w, i], mine, q_bar.at[i])   # each warpgroup loads its half
            plgpu.barrier_wait(q_bar.at[i])
            acc, m, l = paged_flash_loop(ops, q_s=mine, k_s=k_s, v_s=v_s, k_bar=k_bar, v_bar=v_bar, k_hbm=k_hbm,
                                         v_hbm=v_hbm, pt_hbm=pt_hbm, layer=layer, seq=seq, kh=kh,
                                         kv_lo=jnp.int32(0), kv_hi=kv_hi, scale=scale, causal_pos0=pos0,
                                         group=group, wg=wg,
                                         consumed=extra[0] if extra and not pingpong else None,
                                         sched=extra[0].at[0] if pingpong else None, dq=dq, aux_hbm=aux_hbm,
                                         sync=sync)
            o = acc / bcast_rows(jnp.maximum(l, 1e-30), acc.shape)
            mine[...] = o.astype(q_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(mine, o_hbm.at[w, 0] if wg is None else o_hbm.at[w, wg])
        return carry

    n_mine = lax.div(num_items - pid + (num_ctas - 1), num_ctas)
    lax.fori_loop(0, n_mine, item, None)
    plgpu.wait_smem_to_gmem(0)


# A quantized cache's dequantizing split over two warpgroups (K by one, V by the other, a 2 x 64-row tile sharing
# them) instead of one warpgroup dequantizing both for a 64-row tile: a quarter of the dequantizing a query row.
# H200, a 1024/512 mixed step's prefill part (248 tokens after 776, 1,024 and 520 fresh), kernel ms a layer, one
# warpgroup -> two: fp8 0.166 -> 0.122, int8 0.213 -> 0.144, int4 0.216 -> 0.146; bfloat16 0.078
# (`python -m bench.probes.prefill_quant`, bench/results/prefill_quant-20261129.json).
QUANT_WARPGROUPS = 2


@functools.partial(jax.jit, static_argnames=("scale", "num_ctas", "block_kv", "num_stages", "num_warpgroups",
                                             "pingpong", "interpret"), inline=True)
def paged_prefill_attention(q: Float[Array, "T H D"], k_cache: Float[Array, "L N PS KH D"],
                            v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                            page_table: Int[Array, "S P"], seq_lens: Int[Array, "S"],
                            query_start: Int[Array, "S1"], first_seq: Int[Array, ""], *, scale: float,
                            num_ctas: int | None = None, block_kv: int = 128, num_stages: int = 2,
                            num_warpgroups: int | None = None, pingpong: bool = True,
                            interpret: bool = False, aux_cache=None) -> Float[Array, "T H D"]:
    """Causal attention of each live sequence's query chunk over its cached positions (see module doc).
    `num_ctas=None` launches one CTA per (tile, kv head); an int makes the grid persistent (one
    warpgroup only). `num_warpgroups` 64-row parts of a tile share one K/V stream; `pingpong` staggers two.
    Tokens outside live sequences (decodes before `first_seq`, padding) give 0. `aux_cache`: the cache is
    quantized (kv_quant.py) and dequantized in the kernel: with one warpgroup a tile, by it; with two (None: 2 for
    bfloat16, `QUANT_WARPGROUPS` for a quantized cache on its own grid, else 1), one dequantizes K and the other V
    (no ping-pong)."""
    t, h, d = q.shape
    _, _, ps, kvh, _ = k_cache.shape
    s = page_table.shape[0]
    g = h // kvh
    if g * kvh != h:
        raise ValueError(f"{h} query heads over {kvh} kv heads: need a whole group")
    check_block(block_kv, ps, d)
    fmt = cache_format(k_cache, aux_cache)
    check_format(fmt, d, 0 if aux_cache is None else aux_cache.shape[-1])
    # a quantized cache on a persistent grid keeps one warpgroup unless the call names two (and is refused below)
    nw = num_warpgroups or (2 if fmt == "bfloat16" else 1 if num_ctas is not None else QUANT_WARPGROUPS)
    if nw not in (1, 2):
        raise ValueError(f"num_warpgroups={nw}: 1 or 2")
    if nw > 1 and num_ctas is not None:
        raise ValueError("a persistent grid (num_ctas) needs num_warpgroups=1")
    pingpong = pingpong and nw == 2 and fmt == "bfloat16"     # staggering needs two warpgroups and no dequantizing
    rows = ROWS * nw
    if g > rows:
        raise ValueError(f"query group of {g} heads exceeds the {rows}-row tile")
    tpt = rows // g
    seq_lens, query_start = seq_lens.astype(jnp.int32), query_start.astype(jnp.int32)
    nt, info, tok0, start, live_len = layout_tiles(seq_lens, query_start, first_seq, t, tpt)

    # Query tiles [NT * KH, 64, D]: row r = token r // G, head r % G of kv head kh.
    idx = jnp.clip(tok0[:, None] + jnp.arange(tpt)[None, :], 0, t - 1)
    qt = q.reshape(t, kvh, g, d)[idx]                              # [NT, TPT, KH, G, D]
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(nt, kvh, tpt * g, d)
    if tpt * g != rows:
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, rows - tpt * g), (0, 0)))
    qt = qt.reshape(nt * kvh, nw, ROWS, d)
    items = nt * kvh
    progs = items if num_ctas is None else min(num_ctas, items)
    params = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_kernel, num_kv_heads=kvh, group=g, num_ctas=progs, num_wgs=nw,
                               pingpong=pingpong, scale=scale, interpret=interpret, kv_format=fmt)

    def body(params, info, pt, qt, k, v, *rest):
        aux, rest = (rest[0], rest[1:]) if aux_cache is not None else (None, rest)
        kernel(params, info, pt, qt, k, v, *rest, aux_hbm=aux)
    tf = deq_transforms(fmt, d) if fmt == "int4" else smem_tile_transforms(q.dtype)     # one swizzle for wgmma
    threads = {"num_threads": nw, "thread_name": "wg"} if nw > 1 else {}
    ot = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((items, nw, ROWS, d), q.dtype),
        scratch_types=[plgpu.SMEM((nw, ROWS, d), q.dtype, transforms=tf),
                       plgpu.Barrier(num_barriers=nw),
                       *kv_scratch(num_stages, block_kv, d, k_cache.dtype, ps, fmt),
                       *(quant_scratch(fmt, num_stages, block_kv, d, aux_cache.shape[-1]) if fmt != "bfloat16"
                         else []),
                       *([plgpu.Barrier(num_arrivals=2, num_barriers=1)] if pingpong else
                         [plgpu.Barrier(num_arrivals=nw, num_barriers=num_stages)] if nw > 1 else []),
                       *([plgpu.Barrier(num_arrivals=2, num_barriers=2)] if nw > 1 and fmt != "bfloat16" else [])],
        grid=(progs,), grid_names=("p",), compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None, **threads,
    )(params, info, page_table.astype(jnp.int32), qt, k_cache, v_cache, *(() if aux_cache is None else (aux_cache,)))

    # Back to token order. Tiles that were skipped (kv_hi == 0) hold garbage, but no live token maps to them.
    ot = ot.reshape(nt, kvh, rows, d)[:, :, :tpt * g].reshape(nt, kvh, tpt, g, d)
    tok = jnp.arange(t)
    seq = jnp.clip(_bucket(query_start[1:], tok), 0, s - 1)
    local = tok - query_start[seq]
    live = (tok >= query_start[0]) & (tok < query_start[s]) & (local < live_len[seq])
    tile = jnp.clip(start[seq] + local // tpt, 0, nt - 1)
    out = ot[tile, :, local % tpt]                                 # [T, KH, G, D]
    return jnp.where(live[:, None, None, None], out, 0).reshape(t, h, d).astype(q.dtype)
