"""Paged decode attention with cache positions as the wgmma rows ("swapped"). Pallas Mosaic GPU.

Why a second decode kernel: wgmma's M is 64 rows. The heads-as-rows kernel (paged_decode_attention.py) puts
the G = H / KH query heads of one kv head in those rows, so with G = 4 (padded to 8) seven eighths of its
tensor-core work and softmax are padding. That caps one SM at roughly 60 GB/s of K/V, so decode attention
needs most of the SMs to reach HBM bandwidth, which leaves nothing for a GEMM beside it (NanoFlow's overlap).
Here the roles swap: S^T = K Q^T ([block_kv, GP], block_kv rows, N = GP columns) and O^T += V^T P^T, so
the tensor cores and the softmax do 1/8 of the work per K/V block, and the per-SM rate is set by the copies.

Work mapping, splits, persistence (`num_ctas` = NanoFlow's resource share R), the page-by-page TMA
copies and the split reduction are those of paged_decode_attention.py, whose `paged_decode_attention_ref`
is this kernel's reference too. Two warpgroups per CTA: a producer issues the TMA copies of every K/V
block of the CTA's items through `num_stages` stages (one block counter across items, so the pipeline
does not drain between items; q is double-buffered), and a consumer computes. Copy issue was a measured
third of a block's time at 16-position pages when the computing warpgroup issued them. On a quantized cache
one or two more warpgroups dequantize each stage into f16 tiles beside the consumer (`attention_kernel`); fp8's K
is not dequantized at all but read by fp8 wgmmas against the query's two e4m3 parts (`fp8_mma`).
The softmax runs over axis 0 (positions): its max is a cross-warp reduction through Mosaic's reduction
scratch, which is one buffer per CTA, so only one warpgroup may compute; its sums come from a second wgmma,
ones @ P^T (`row_sums`), which needs no such reduction per block. P^T is stored to SMEM transposed
(WGMMA_TRANSPOSED layout) as wgmma's B operand; V^T is wgmma's transposed A operand (16-bit types allow it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._compat import mosaic_gpu_interpret_params
from pallas_kernels import MASK_VALUE, kv_quant
from pallas_kernels import _int_scores as int_scores
from pallas_kernels import _score_mma as score_mma
from pallas_kernels._mgpu import LOG2E, Ops, bcast_rows, compiler_params, block_pages, copy_kv_pages
from pallas_kernels._kv_dequant import Dequant, aux_columns, dequant_block, dequant_values, load_rows, \
    pair_columns
from pallas_kernels.paged_decode_attention import item_coords, store_partial
from pallas_kernels._swapped_operands import finish, out_types, prepare, split_parts
from pallas_kernels._swapped_options import INT8_MMA_FORMATS, kernel_options

ROW_SUMS = ("wgmma", "reduce")
SUM_ROWS = 64                                   # rows of the ones @ P^T wgmma (wgmma's smallest M)
MAX_DEQUANT_WGS = 4                             # 2 + 4 warpgroups: 768 threads, 85 registers each at most
def _when(live, f) -> None:
    """f() now (live None), or where the traced `live` holds."""
    if live is None:
        f()
    else:
        pl.when(live)(f)


def _cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _item_coords(w, lens_hbm, *, num_kv_heads, num_splits, block_kv):
    """Work item w -> (sequence, kv head, first position, end position, blocks)."""
    b, kh, kv_lo, kv_hi = item_coords(w, lens_hbm, num_kv_heads=num_kv_heads, num_splits=num_splits,
                                      block_kv=block_kv)
    return b, kh, kv_lo, kv_hi, lax.div(jnp.maximum(kv_hi - kv_lo, 0) + (block_kv - 1), block_kv)


def attention_kernel(params_hbm, lens_hbm, pt_hbm, q_hbm, k_hbm, v_hbm, o_hbm, lse_hbm,
                     q_s, p_s, o_s, lse_s, q_bar, q_free, k_s, v_s, k_bar, v_bar, consumed, *quant, num_kv_heads,
                     num_splits, num_ctas, scale, interpret, cta=None, row_sums: str = "wgmma", aux_hbm=None,
                     kv_format: str = "bfloat16", dequant_wgs: int = 2, prefetch_pages: bool = False,
                     k_in_consumer: bool = False, fp8_mma: bool = False, int8_mma: bool = False,
                     qscale_hbm=None, pipeline: bool = False, group_accs: bool = False):
    """Warpgroup 1 streams every K/V block of this CTA's items through the stages (one global block
    counter, so the pipeline stays full across item boundaries); warpgroup 0 computes. `cta`: this
    CTA's index among the `num_ctas` (None: the grid index; a fused kernel gives others other work).

    `row_sums`: how the consumer adds up each block's probabilities for the softmax denominator: "wgmma" = a
    second wgmma, ones @ P^T, beside V^T P^T (no cross-warp reduction; the sum of the bf16 P the numerator
    uses); "reduce" = P's column sums in f32, a cross-warp reduction per block.

    A quantized cache (`kv_format` fp8 / int8 / int4, its aux rows in `aux_hbm`; `quant` from `prepare`): the
    producer copies each block's aux rows with K; `dequant_wgs` more warpgroups (2 + j) turn each stage into f16
    tiles (pallas_kernels/_kv_dequant.py), double-buffered (`deq_ready` / `deq_free`), so dequantizing a block runs
    beside the consumer's matmuls and softmax on the one before; block g is dequantizer g % dequant_wgs's, into
    tile buffer g % deq_tiles. The consumer's operands are then f16 (queries, P, the tiles). A dequantizer sees every
    completion of each stage barrier it waits on: `dequant_wgs` divides the stages (and the tile buffers).
    `dequant_wgs=0`: the first version, kept as a fallback: the consumer dequantizes each stage into bf16 tiles
    itself, serially (0.16-0.58 of copy at 4k context, attention_kv-v1-20261124.json).

    `k_in_consumer` (with dequantizers): the consumer dequantizes each K stage itself into registers, wgmma's
    register operand, and the dequantizers do V alone; no K tile goes through SMEM, which leaves room for more
    stages. The stage then frees after two arrivals: the consumer's (K read) and the dequantizer's (V read).

    `prefetch_pages`: the producer reads a block's page ids from the table before it waits for the stage to
    come free, so their global-memory latency overlaps the wait (False: after it, as measured so far; to be
    timed: bench/probes/dequant_sass.py).

    `fp8_mma` (fp8, with `k_in_consumer`): K is not dequantized at all. The consumer's wgmmas read K's fp8 stage as
    it arrived, against the query's two fp8 parts (`kv_quant.fp8_query_parts`, in `q_hbm`; their scale per query
    row of `q_hbm` in `qscale_hbm`), and K's per-position scale multiplies the scores' rows; the dequantizers do V
    alone.

    `int8_mma` (int8 or int4, with `k_in_consumer`): the same for a grouped cache's K codes (int8's as stored, int4's
    unpacked into registers) in int8 wgmmas against the query's int8 parts, each group's scale and center applied to
    its scores (pallas_kernels/_int_scores.py). `group_accs` (int4): the query's parts without zero blocks, and each
    half of D's wgmma into its own accumulator (`_int_scores`' "apart").

    `pipeline` (with the wgmma row sums; not with K tiles from the dequantizers): each block's score wgmmas are
    issued behind the block before's P V^T and its sums, with one wait for all three (FlashAttention-3's
    intra-warpgroup overlap): the consumer's chain loses a wgmma round trip a block, and the next block's K work
    (its aux rows, int4's unpacking) runs while the P V^T is in flight."""
    if pipeline and (row_sums != "wgmma" or (dequant_wgs and kv_format != "bfloat16" and not k_in_consumer)):
        raise ValueError("pipeline takes the wgmma row sums, and K in the consumer on a cache with dequantizers; got "
                         f"row_sums={row_sums!r}, dequant_wgs={dequant_wgs}, k_in_consumer={k_in_consumer}")
    if fp8_mma and not (k_in_consumer and kv_format == "fp8"):
        raise ValueError("fp8_mma reads an fp8 cache's K with k_in_consumer's stage handling")
    if int8_mma and not (k_in_consumer and kv_format in INT8_MMA_FORMATS):
        raise ValueError(f"int8_mma reads an {' or '.join(INT8_MMA_FORMATS)} cache's K with k_in_consumer's stage "
                         "handling")
    if row_sums not in ROW_SUMS:
        raise ValueError(f"row_sums={row_sums!r}: one of {ROW_SUMS}")
    ops = Ops(interpret)
    num_stages, block_kv, _ = k_s.shape
    if pipeline and num_stages < 2:     # the next block's K must arrive while this block still holds its stage
        raise ValueError(f"pipeline needs at least 2 stages, got {num_stages}")
    if group_accs and not (int8_mma and kv_format == "int4"):
        raise ValueError("group_accs splits int4's int8 score wgmmas by group (int8_mma on an int4 cache)")
    ng = q_s.shape[2] // kv_quant.GROUP if int8_mma else 1         # int8_mma: the query's groups
    gp = q_s.shape[1] // (2 * ng if int8_mma and not group_accs else 2 if fp8_mma or int8_mma else 1)
    nd = dequant_wgs if kv_format != "bfloat16" else 0
    if not 0 <= nd <= MAX_DEQUANT_WGS or (nd and num_stages % nd):
        raise ValueError(f"dequant_wgs={nd} with {num_stages} stages: 0 to {MAX_DEQUANT_WGS}, dividing the stages")
    quantized = nd > 0                              # dequantizing warpgroups beside the consumer
    if k_in_consumer and not quantized:
        raise ValueError("k_in_consumer needs a quantized cache and dequantizing warpgroups (dequant_wgs > 0)")
    dq = Dequant("bfloat16" if quantized else kv_format, q_s.shape[2], quant, interpret)   # in the consumer (nd 0)
    aux_s = dq.aux_s
    if k_in_consumer:
        aux_s, v_deq, deq_ready, deq_free = quant
        k_pairs = aux_columns(kv_format, q_s.shape[2], "k")
        k_cols = pair_columns(k_pairs)
    elif quantized:
        aux_s, k_deq, v_deq, deq_ready, deq_free = quant
    nt = v_deq.shape[0] if quantized else 0     # dequantized tile buffers: block g's is g % nt
    if quantized and nt % nd:
        raise ValueError(f"{nt} dequantized tile buffers over {nd} dequantizers: each needs whole buffers")
    cd = jnp.float16 if fp8_mma or int8_mma else q_s.dtype   # the P V^T operands' dtype (bf16; f16 dequantized)
    # params [layer] or [layer, live rows]: with the second, items of rows past it are not visited at all (an
    # empty item still loads its queries and stores its output: 768 empty rows of a 1,024-row call cost 40 us)
    num_items = (params_hbm[1] if params_hbm.shape[0] > 1 else lens_hbm.shape[0]) * num_kv_heads * num_splits
    pid = lax.axis_index("p") if cta is None else cta
    wg = lax.axis_index("wg")
    layer = params_hbm[0]
    n_mine = lax.div(num_items - pid + (num_ctas - 1), num_ctas)
    coords = functools.partial(_item_coords, lens_hbm=lens_hbm, num_kv_heads=num_kv_heads,
                               num_splits=num_splits, block_kv=block_kv)
    c = scale * LOG2E

    def producer():
        def item(k, g):
            b, kh, kv_lo, _, n_blk = coords(pid + k * num_ctas)
            qslot = lax.rem(k, 2)
            pl.when(k >= 2)(lambda: plgpu.barrier_wait(q_free.at[qslot]))
            plgpu.copy_gmem_to_smem(q_hbm.at[b * num_kv_heads + kh], q_s.at[qslot], q_bar.at[qslot])

            def block(i, g):
                slot = lax.rem(g, num_stages)
                read = functools.partial(block_pages, pt_hbm, seq=b, tok0=kv_lo + i * block_kv, block_kv=block_kv,
                                         page_size=k_hbm.shape[2])
                pages = read() if prefetch_pages else None
                pl.when(g >= num_stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                pages = pages or read()
                copy_kv_pages(k_hbm=k_hbm, v_hbm=v_hbm, k_s=k_s, v_s=v_s, k_bar=k_bar, v_bar=v_bar, layer=layer,
                              pages=pages, kh=kh, tok0=kv_lo + i * block_kv, slot=slot, aux_hbm=aux_hbm,
                              aux_s=aux_s)
                return g + 1
            return lax.fori_loop(0, n_blk, block, g)
        total = lax.fori_loop(0, n_mine, item, jnp.int32(0))
        # every completion of a barrier is awaited by the thread that waits on it: observe the last ones
        def drain(bars, n):
            def body(i, cr):
                plgpu.barrier_wait(bars.at[lax.rem(i, n)])
                return cr
            return body
        lax.fori_loop(jnp.maximum(total - num_stages, 0), total, drain(consumed, num_stages), None)
        lax.fori_loop(jnp.maximum(n_mine - 2, 0), n_mine, drain(q_free, 2), None)

    def consumer():
        by_wgmma = row_sums == "wgmma"
        ones = ops.wgmma_layout(jnp.ones((SUM_ROWS, block_kv), cd)) if by_wgmma else None

        def k_scores(g, q, c, qsums, live=None):
            """Block g's K up to its score wgmmas: (the wgmmas, raw scores -> scores times c). `live` (pipelined:
            whether block g exists in this item): its waits and the K stage's release only then; otherwise the
            wgmmas read a stage nobody filled and their scores are dropped."""
            slot = lax.rem(g, num_stages)
            _when(live, lambda: plgpu.barrier_wait(k_bar.at[slot]))
            if not k_in_consumer:               # bf16: K's stage as it arrived; nd 0: dequantized here into a tile
                return score_mma.kq(dq.k(k_s.at[slot], dq.rows(slot, "k")), q), lambda raw: raw * c
            k_rows = load_rows(aux_s.at[slot], k_cols, interpret)
            if fp8_mma:                         # K's stage straight into the wgmmas; its scale on the score rows
                return (score_mma.kq_parts(k_s.at[slot], q, 2),
                        lambda raw: raw * bcast_rows(k_rows[k_cols[0]], raw.shape) * c)
            if int8_mma:                        # x = (code + 0.5) scale + center per group of K's columns
                codes = int_scores.INT4_CODES if kv_format == "int4" else int_scores.INT8_CODES
                if kv_format == "int4":         # [BKV, 2 G GP], or a [BKV, 2 GP] a group apart
                    halves = int_scores.int4_codes(k_s.at[slot], interpret)
                    mma = (score_mma.kq_regs_apart if group_accs else score_mma.kq_regs)(halves, q, jnp.int32)
                else:
                    mma = score_mma.kq(k_s.at[slot], q, jnp.int32)
                return mma, lambda raw: int_scores.scores(raw, k_rows, k_pairs, qsums, gp, codes) * c
            parts = dequant_values(kv_format, k_s.at[slot], k_rows, k_pairs, interpret, cd)   # K in registers
            return score_mma.kq_regs(parts, q), lambda raw: raw * c

        def release_k(g, live=None):
            """K's stage read (k_in_consumer: V's dequantizer makes the stage's other arrival)."""
            if k_in_consumer:
                _when(live, lambda: plgpu.barrier_arrive(consumed.at[lax.rem(g, num_stages)]))

        def softmax_and_v(g, tok0, kv_hi, s, carry, masked: bool):
            """Block g's online softmax over its scores `s`, then its V operand, waited for."""
            acc, m, l = carry                               # l: [SUM_ROWS, GP] (wgmma sums) or [GP]
            if masked:
                tok = ops.iota((block_kv, gp), 0) + tok0
                s = jnp.where(tok < kv_hi, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - _cols(m_new, s.shape))
            acc = acc * _cols(alpha, acc.shape)
            l = l * _cols(alpha, l.shape) if by_wgmma else l * alpha + p.sum(axis=0)
            slot, dslot = lax.rem(g, num_stages), lax.rem(g, nt) if quantized else None
            if quantized:               # (without k_in_consumer `step` waited for both tiles before K's wgmma)
                if k_in_consumer:
                    plgpu.barrier_wait(deq_ready.at[dslot])
                vt = v_deq.at[dslot]
            else:
                plgpu.barrier_wait(v_bar.at[slot])
                vt = dq.v(v_s.at[slot], dq.rows(slot, "v"))
            return acc, m_new, l, p.astype(cd), vt

        def release_v(g):
            """Both wgmmas on block g's V (its tile buffer, or its stage) are complete."""
            plgpu.barrier_arrive(deq_free.at[lax.rem(g, nt)] if quantized else consumed.at[lax.rem(g, num_stages)])

        def step(g, tok0, kv_hi, q, c, carry, masked: bool, qsums=None):
            if quantized and not k_in_consumer:
                dslot = lax.rem(g, nt)
                plgpu.barrier_wait(deq_ready.at[dslot])
                s = ops.kq(k_deq.at[dslot], q) * c                        # [BKV, GP]
            else:
                mma, post = k_scores(g, q, c, qsums)
                s = post(ops.scores(mma))
                release_k(g)
            acc, m_new, l, p, vt = softmax_and_v(g, tok0, kv_hi, s, carry, masked)
            if by_wgmma:
                acc, l = ops.vp_and_sums(acc, l, p, vt, p_s, ones)
            else:
                acc = ops.vp(acc, p, vt, p_s)
            release_v(g)
            return acc, m_new, l

        def piped_step(g, tok0, kv_hi, q, c, carry, masked: bool, qsums, has_next):
            """`step` with block g's scores carried in from the step before, and block g + 1's score wgmmas issued
            behind its P V^T, one wait for all (`Ops.vp_sums_then`)."""
            *carry, s = carry
            acc, m_new, l, p, vt = softmax_and_v(g, tok0, kv_hi, s, tuple(carry), masked)
            mma, post = k_scores(g + 1, q, c, qsums, live=has_next)
            acc, l, raw = ops.vp_sums_then(acc, l, p, vt, p_s, ones, mma)
            release_k(g + 1, live=has_next)
            release_v(g)
            return acc, m_new, l, post(raw)

        def item(k, g):
            w = pid + k * num_ctas
            b, kh, kv_lo, kv_hi, n_blk = coords(w)
            ci = c * qscale_hbm[b * num_kv_heads + kh] if fp8_mma or int8_mma else c
            qslot = lax.rem(k, 2)
            q = q_s.at[qslot]
            plgpu.barrier_wait(q_bar.at[qslot])
            qsums = int_scores.query_sums(ops, q, block_kv, gp, ng, grouped=not group_accs) if int8_mma else None
            acc = ops.wgmma_layout(jnp.zeros((q.shape[1], gp), jnp.float32))
            m = ops.col_layout(jnp.full((gp,), MASK_VALUE, jnp.float32))
            l = (ops.wgmma_layout(jnp.zeros((SUM_ROWS, gp), jnp.float32)) if by_wgmma
                 else ops.col_layout(jnp.zeros((gp,), jnp.float32)))
            n_free = jnp.clip(lax.div(jnp.maximum(kv_hi - kv_lo, 0), block_kv), 0, n_blk)   # no mask needed
            if pipeline:
                mma, post = k_scores(g, q, ci, qsums, live=n_blk > 0)          # the item's first block
                s = post(ops.scores(mma))
                release_k(g, live=n_blk > 0)

                def body(masked):
                    return lambda i, cr: piped_step(g + i, kv_lo + i * block_kv, kv_hi, q, ci, cr, masked, qsums,
                                                    i + 1 < n_blk)
                carry = lax.fori_loop(0, n_free, body(False), (acc, m, l, s))
                acc, m, l, _ = lax.fori_loop(n_free, n_blk, body(True), carry)
            else:
                carry = lax.fori_loop(0, n_free, lambda i, cr: step(g + i, kv_lo + i * block_kv, kv_hi, q, ci, cr,
                                                                    False, qsums), (acc, m, l))
                acc, m, l = lax.fori_loop(n_free, n_blk, lambda i, cr: step(g + i, kv_lo + i * block_kv, kv_hi, q,
                                                                            ci, cr, True, qsums), carry)
            plgpu.barrier_arrive(q_free.at[qslot])
            if by_wgmma:
                l = l.max(axis=0)                           # every row holds the sums: one reduction per item
            store_partial(acc, m, l, _cols, o_s, lse_s, o_s, lse_s, o_hbm.at[w], lse_hbm.at[w])
            return g + n_blk
        lax.fori_loop(0, n_mine, item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    def dequantizer(j):
        k_pairs, v_pairs = aux_columns(kv_format, q_s.shape[2], "k"), aux_columns(kv_format, q_s.shape[2], "v")

        def item(k, g):
            *_, n_blk = coords(pid + k * num_ctas)

            def block(i, g):
                @pl.when(lax.rem(g, nd) == j)
                def _():
                    slot, dslot = lax.rem(g, num_stages), lax.rem(g, nt)
                    plgpu.barrier_wait(k_bar.at[slot])          # K's copies, and the aux rows with them
                    pl.when(g >= nt)(lambda: plgpu.barrier_wait(deq_free.at[dslot]))
                    if not k_in_consumer:
                        dequant_block(kv_format, k_s.at[slot], k_deq.at[dslot], aux_s.at[slot], k_pairs, interpret)
                    plgpu.barrier_wait(v_bar.at[slot])
                    dequant_block(kv_format, v_s.at[slot], v_deq.at[dslot], aux_s.at[slot], v_pairs, interpret)
                    plgpu.commit_smem()                 # the tiles' stores, read next by the consumer's wgmmas
                    plgpu.barrier_arrive(consumed.at[slot])
                    plgpu.barrier_arrive(deq_ready.at[dslot])
                return g + 1
            return lax.fori_loop(0, n_blk, block, g)
        total = lax.fori_loop(0, n_mine, item, jnp.int32(0))

        def drain(g, cr):                               # the consumer's last releases of this one's buffers
            pl.when(lax.rem(g, nd) == j)(lambda: plgpu.barrier_wait(deq_free.at[lax.rem(g, nt)]))
            return cr
        lax.fori_loop(jnp.maximum(total - nt, 0), total, drain, None)

    pl.when(wg == 1)(producer)
    pl.when(wg == 0)(consumer)
    for j in range(nd):
        pl.when(wg == 2 + j)(functools.partial(dequantizer, j))


@functools.partial(jax.jit, static_argnames=("scale", "num_ctas", "num_splits", "block_kv", "num_stages",
                                             "row_sums", "interpret", "dequant_wgs", "prefetch_pages",
                                             "k_in_consumer", "fp8_mma", "int8_mma", "deq_tiles", "pipeline",
                                             "group_accs", "parts"),
                   inline=True)
def paged_decode_attention_swapped(q: Float[Array, "B H D"], k_cache: Float[Array, "L N PS KH D"],
                                   v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                                   page_table: Int[Array, "B P"], seq_lens: Int[Array, "B"], *, scale: float,
                                   num_ctas: int = 132, num_splits: int | None = None, block_kv: int = 128,
                                   num_stages: int | None = None, row_sums: str | None = None,
                                   interpret: bool = False, aux_cache=None,
                                   dequant_wgs: int | None = None, prefetch_pages: bool | None = None,
                                   k_in_consumer: bool | None = None, fp8_mma: bool | None = None,
                                   int8_mma: bool | None = None, deq_tiles: int = 2,
                                   live_rows: Int[Array, ""] | None = None,
                                   pipeline: bool | None = None,
                                   group_accs: bool | None = None, extra_split=None,
                                   parts: bool = False) -> Float[Array, "B H D"]:
    """Same contract as `paged_decode_attention` (positions-as-rows formulation). `num_stages=None`: 3 on at most 60%
    of the SMs, else 2 (measured best on H100, bench/results/decode_share-20261123.json). `row_sums=None`: "wgmma"
    on at most 60% of the SMs, where the consumer's chain bounds the rate (5-15% faster on 33 H100 SMs), else
    "reduce" (equal on all 132 in one call, 0.50 vs 0.60 ms at 64-position pages in another;
    bench/results/decode_share-rowsums{,2}-fused-20261123.json); see `attention_kernel`. `aux_cache`
    [L, N, PS, KH, W]: the cache is quantized (fp8, int8 or int4 values, kv_quant.py), dequantized here by
    `dequant_wgs` warpgroups (None: `default_dequant_wgs`; the defaults named here are _swapped_options.py's), by
    default over 2 stages (fp8, int8; the f16 tiles take the SMEM of a third) or 4 (int4); `dequant_wgs=0`: by the
    consumer (see `attention_kernel`, and for `prefetch_pages` and `k_in_consumer`). `k_in_consumer=None`: on for
    int8 and int4 with dequantizers, off for fp8; `prefetch_pages=None`: on for quantized caches (see
    K_IN_CONSUMER). `live_rows`: only rows [0, live_rows) are computed (a mixed step's decodes come first in its
    max_seqs rows); the others give 0 without being visited (rows past it must have seq_lens 0 for the result to
    equal a call without it). `fp8_mma` (fp8 only; None: `FP8_MMA`): K read by fp8 wgmmas without dequantizing
    (`attention_kernel`); it takes k_in_consumer's stages and at least one dequantizer. `int8_mma` (int8 or int4;
    None: `INT8_MMA` / `INT4_MMA`): the same for a grouped cache's K codes. `deq_tiles`: the dequantizers' tile
    buffers (2: double-buffered; 1 leaves SMEM for 256-position blocks, the dequantizer then waiting for the
    consumer's release of each tile). `pipeline` (None: `PIPELINE` where it applies): each block's score wgmmas
    issued behind the block before's P V^T (`attention_kernel`). `group_accs` (int4 with int8_mma; None:
    `GROUP_ACCS`): a score wgmma and accumulator a group, the query's parts without zero blocks. `parts`: return
    the splits unmerged, (o [B, KH, ns, GP, D], lse [B, KH, ns, GP]) (`_swapped_operands.split_parts`), for
    another call's `extra_split`, which merges them with its own (positions one call does not read, such as a
    format's K tail rows, nfjax/kv/tail_attention.py)."""
    o = kernel_options(q, k_cache, aux_cache, num_ctas=num_ctas, num_stages=num_stages, row_sums=row_sums,
                       dequant_wgs=dequant_wgs, prefetch_pages=prefetch_pages, k_in_consumer=k_in_consumer,
                       fp8_mma=fp8_mma, int8_mma=int8_mma, pipeline=pipeline, group_accs=group_accs)
    qr, ns, scratch, extra = prepare(q, k_cache, num_ctas=num_ctas, num_splits=num_splits, block_kv=block_kv,
                                     aux_cache=aux_cache, deq_tiles=deq_tiles, **o.prepare_kwargs())
    params = jnp.asarray(layer, jnp.int32).reshape(1)
    if live_rows is not None:
        params = jnp.concatenate([params, jnp.clip(jnp.asarray(live_rows, jnp.int32), 0, q.shape[0]).reshape(1)])
    kvh = k_cache.shape[3]
    kernel = functools.partial(attention_kernel, num_kv_heads=kvh, num_splits=ns, num_ctas=num_ctas,
                               scale=scale, interpret=interpret, **o.kernel_kwargs())

    def body(params, lens, pt, qr, k, v, *rest):
        aux, rest = (rest[0], rest[1:]) if aux_cache is not None else (None, rest)
        qs, rest = (rest[0], rest[1:]) if o.query_parts else (None, rest)
        kernel(params, lens, pt, qr, k, v, *rest, aux_hbm=aux, qscale_hbm=qs)
    o_t, lse = plgpu.kernel(
        body, out_type=out_types(q, kvh, ns), scratch_types=scratch,
        grid=(num_ctas,), grid_names=("p",), num_threads=2 + o.dequant_wgs, thread_name="wg",
        compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None,
    )(params, seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), qr, k_cache, v_cache,
      *(() if aux_cache is None else (aux_cache,)), *extra)
    if parts:
        return split_parts(o_t, lse, q.shape, kvh, ns, None if live_rows is None else params[1])
    out = finish(o_t, lse, q.shape, kvh, ns, extra_split)
    if live_rows is None:
        return out
    return jnp.where((jnp.arange(q.shape[0]) < params[1])[:, None, None], out, 0).astype(out.dtype)   # unwritten
