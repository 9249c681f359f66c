"""Shared Mosaic GPU (Pallas) building blocks for the paged attention kernels.

Both kernels (paged_decode_attention.py, paged_prefill_attention.py) run the same inner loop: one warpgroup
holds a 64-row query tile in shared memory (rows are (token, query head) pairs of ONE kv head), streams that
kv head's K/V out of the paged cache block by block with TMA copies `num_stages` deep, and keeps an online
softmax (base-2, f32) with the output accumulator in registers. Differences are only in how work items map to
(query tile, kv head, sequence, kv range) and in the epilogue; each kernel file owns that part.

Cache layout: k/v [L, N_pages, page_size, kv_heads, head_dim]. One TMA copy moves one page's rows of one kv
head (a strided [page_size, head_dim] box) into a [block_kv, head_dim] tile (or part of a page when
page_size > block_kv). The layer index and page ids are scalars read from global memory inside the kernel,
so the stacked cache is never sliced or copied per layer.

Interpret mode (CPU, tests): the Mosaic GPU interpreter of jax 0.10.2 cannot run wgmma with a transposed SMEM
operand or a register operand and has no CPU rule for layout casts, so `Ops(interpret=True)` swaps those three
things for plain jnp on SMEM tiles loaded into values. Everything else (work mapping, page lookups, TMA copies,
barriers and their phases, masks, online softmax, epilogue stores) is the code that runs on the GPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import MASK_VALUE
from pallas_kernels import _score_mma
LOG2E = math.log2(math.e)
ROWS = 64                   # wgmma M: query rows per tile (one warpgroup)


def cdiv(a, b):
    return (a + b - 1) // b


def compiler_params():
    """Lane lowering semantics pinned: it is 0.10.2's default (what CPU cross-lowering checks) but 0.11
    defaults to Warpgroup semantics; approx_math lets exp2/log2 use the fast hardware approximations."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True)


def smem_tile_transforms(dtype) -> tuple:
    """Tiling + swizzle for a [rows, head_dim] 16-bit operand tile (128-byte swizzle)."""
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


class Ops:
    """The few in-kernel operations whose GPU form the CPU interpreter cannot run (see module doc)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def wgmma_layout(self, x):
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

    def row_layout(self, x):
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def qk(self, q_s, k_s, after_issue=None):
        """[ROWS, D] x [BKV, D]^T -> [ROWS, BKV] f32 (both operands in SMEM). `after_issue` runs after the
        wgmma is issued and before its result is awaited."""
        if self.interpret:
            out = jnp.dot(q_s[...], k_s[...].T, preferred_element_type=jnp.float32)
            if after_issue:
                after_issue()
            return out

        def f(acc_ref):
            plgpu.wgmma(acc_ref, q_s, k_s.transpose((1, 0)))
            if after_issue:
                after_issue()
            return acc_ref[...]
        return pl.run_scoped(f, plgpu.ACC((q_s.shape[0], k_s.shape[0]), jnp.float32))

    def col_layout(self, x):
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(0))

    def scores(self, mma: _score_mma.ScoreMMA):
        """One block's score wgmmas (`_score_mma`) issued and awaited -> [rows, cols] f32 (a tuple of them, one an
        accumulator, where `mma` has several)."""
        if self.interpret:
            outs = mma.reference()
        else:
            def f(*acc_refs):
                mma.issue(acc_refs)
                return tuple(r[...] for r in acc_refs)
            outs = pl.run_scoped(f, *[plgpu.ACC(mma.shape, mma.dtype)] * mma.num_accs)
        outs = tuple(o.astype(jnp.float32) for o in outs)
        return outs[0] if mma.num_accs == 1 else outs

    def kq(self, k_s, q_s):
        """[BKV, D] x [GP, D]^T -> [BKV, GP] f32: cache positions are the wgmma rows (both in SMEM)."""
        return self.scores(_score_mma.kq(k_s, q_s))

    def ones_q_int(self, q_s, rows: int):
        """[rows, N] f32 whose every row holds the column sums of q_s's int8 rows (ones @ q^T with the ones as
        wgmma's register operand): the query's sums, broadcast over the rows of a score tile."""
        ones = jnp.ones((rows, q_s.shape[1]), jnp.int8)
        ones = ones if self.interpret else plgpu.layout_cast(ones, plgpu.Layout.WGMMA_8BIT)
        return self.scores(_score_mma.kq_regs([(0, ones)], q_s, jnp.int32))

    def vp(self, acc, p, v_s, p_s):
        """acc + v^T @ p with acc [D, GP] f32, p [BKV, GP] (16-bit, registers), v [BKV, D] in SMEM. On the GPU
        p goes through `p_s` ([GP, BKV] SMEM, the wgmma B operand) with a transposed store."""
        if self.interpret:
            return acc + jnp.dot(v_s[...].T, p, preferred_element_type=jnp.float32)
        p_s.transpose((1, 0))[...] = plgpu.layout_cast(p, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()

        def f(acc_ref):
            plgpu.wgmma(acc_ref, v_s.transpose((1, 0)), p_s.transpose((1, 0)))
        return pl.run_state(f)(plgpu.ACC.init(acc))

    def vp_and_sums(self, acc, sums, p, v_s, p_s, ones):
        """`vp`, plus sums + ones @ p with sums [R, GP] f32 and ones [R, BKV] (16-bit, registers): every row of
        sums accumulates p's column sums in a second wgmma issued beside the first, so the softmax denominator
        needs no cross-warp reduction per block."""
        return self.vp_sums_then(acc, sums, p, v_s, p_s, ones)[:2]

    def vp_sums_then(self, acc, sums, p, v_s, p_s, ones, mma: _score_mma.ScoreMMA | None = None):
        """`vp_and_sums` with the next block's score wgmmas (`mma`) issued behind them and one wait for all three:
        -> (acc, sums, the next block's scores f32 (as `scores` gives them), or None without `mma`). The pipelined
        consumer's step
        (paged_decode_swapped.py)."""
        if self.interpret:
            return (acc + jnp.dot(v_s[...].T, p, preferred_element_type=jnp.float32),
                    sums + jnp.dot(ones, p, preferred_element_type=jnp.float32),
                    None if mma is None else self.scores(mma))
        p_s.transpose((1, 0))[...] = plgpu.layout_cast(p, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()

        def f(refs):
            plgpu.wgmma(refs[0], v_s.transpose((1, 0)), p_s.transpose((1, 0)))
            plgpu.wgmma(refs[1], ones, p_s.transpose((1, 0)))
            if mma is not None:
                mma.issue(refs[2:])
        accs = (plgpu.ACC.init(acc), plgpu.ACC.init(sums))
        if mma is not None:
            accs += tuple(plgpu.ACC.init(self.wgmma_layout(jnp.zeros(mma.shape, mma.dtype)))
                          for _ in range(mma.num_accs))
        out = pl.run_state(f)(accs)
        if mma is None:
            return out[0], out[1], None
        raw = tuple(o.astype(jnp.float32) for o in out[2:])
        return out[0], out[1], raw[0] if mma.num_accs == 1 else raw

    def pv(self, acc, p, v_s):
        """acc + p @ v with p [ROWS, BKV] (16-bit, registers) and v [BKV, D] in SMEM."""
        if self.interpret:
            return acc + jnp.dot(p, v_s[...], preferred_element_type=jnp.float32)

        def f(acc_ref):
            plgpu.wgmma(acc_ref, p, v_s)
        return pl.run_state(f)(plgpu.ACC.init(acc))


def bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def paged_flash_loop(ops: Ops, *, q_s, k_s, v_s, k_bar, v_bar, k_hbm, v_hbm, pt_hbm, layer, seq, kh,
                     kv_lo, kv_hi, scale: float, causal_pos0=None, group: int = 1, wg=None, consumed=None,
                     sched=None, dq=None, aux_hbm=None, sync=None):
    """Online-softmax attention of the query tile in `q_s` over cache positions [kv_lo, kv_hi) of row `seq`
    of the page table, kv head `kh`. Returns (acc [ROWS, D] f32 unnormalised, m [ROWS] base-2 max, l [ROWS]).

    k_s/v_s: SMEM [num_stages, block_kv, D]; k_bar/v_bar: one barrier per stage whose arrival count is the
    number of copies per block. kv_lo must be a multiple of block_kv. With `causal_pos0`, row r (query token
    r // group at position causal_pos0 + r // group) sees only positions <= its own.
    Every copy issued here is waited for here, so barrier phases stay consistent across calls.

    Several warpgroups sharing the K/V stream (`wg` = this warpgroup's index, each with its own 64-row
    `q_s`; `consumed` = one barrier per stage with one arrival per warpgroup): warpgroup 0 issues every copy
    and refills a stage only after all warpgroups arrived on its `consumed` barrier. The arrivals of the last
    stages are drained by warpgroup 0 at the end. Row r of warpgroup w is row w * 64 + r of the whole tile for
    the causal mask.

    `sched` (a barrier with one arrival per warpgroup, two warpgroups, no `consumed`) staggers them
    ("ping-pong"): each meets the other once after issuing q @ k and once after its softmax, and warpgroup 1
    starts half a step late, so one warpgroup's softmax runs while the other's matmuls use the tensor cores.

    A quantized cache (`dq`, a `_kv_dequant.Dequant`, with its aux rows in `aux_hbm`): each block's aux rows
    travel with K, and the stage is dequantized into bf16 tiles before each matmul: by the one warpgroup, or with
    two (`sync`: two barriers of two arrivals, with `consumed`) warpgroup 0 dequantizes K and warpgroup 1 V, they
    meet, the stage is released, both compute on both tiles, and they meet again before the tiles are rewritten.
    """
    coop = dq is not None and dq.on and wg is not None
    if coop and (sync is None or consumed is None or sched is not None):
        raise ValueError("two warpgroups on a quantized cache split its dequantizing: they need `sync` and "
                         "`consumed` barriers and no ping-pong")
    num_stages, block_kv, _ = k_s.shape
    rows, d = q_s.shape
    n_blk = lax.div(jnp.maximum(kv_hi - kv_lo, 0) + (block_kv - 1), block_kv)

    # With ping-pong, warpgroup 1 (always behind) issues the copies: once it is done with a stage, warpgroup
    # 0 is too (the meetings order them), so no `consumed` barrier is needed.
    leader = 1 if sched is not None else 0

    def issue(i, slot):
        if wg is None:
            issue_now(i, slot)
        else:
            pl.when(wg == leader)(lambda: issue_now(i, slot))

    def issue_now(i, slot):
        copy_kv_block(k_hbm=k_hbm, v_hbm=v_hbm, pt_hbm=pt_hbm, k_s=k_s, v_s=v_s, k_bar=k_bar, v_bar=v_bar,
                      layer=layer, seq=seq, kh=kh, tok0=kv_lo + i * block_kv, slot=slot, aux_hbm=aux_hbm,
                      aux_s=None if dq is None else dq.aux_s)

    for i in range(num_stages):
        pl.when(i < n_blk)(lambda i=i: issue(i, i))

    c = scale * LOG2E

    def release(i, slot):
        plgpu.barrier_arrive(consumed.at[slot])

        @pl.when((i + num_stages < n_blk) & (wg == 0))
        def _():
            plgpu.barrier_wait(consumed.at[slot])
            issue_now(i + num_stages, slot)

    def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_bar.at[slot])
        if coop:                            # each warpgroup loads only its own tile's per-row parameters
            plgpu.barrier_wait(v_bar.at[slot])

            @pl.when(wg == 0)
            def _():
                dq.k(k_s.at[slot], dq.rows(slot, "k"))

            @pl.when(wg == 1)
            def _():
                dq.v(v_s.at[slot], dq.rows(slot, "v"))

            plgpu.barrier_arrive(sync.at[0])
            plgpu.barrier_wait(sync.at[0])                         # both tiles written; the stage is read
            release(i, slot)
            kt = dq.k_deq
        else:
            qp = dq.rows(slot) if dq is not None else None         # a quantized cache's per-row parameters
            kt = dq.k(k_s.at[slot], qp) if dq is not None else k_s.at[slot]
        s = ops.qk(q_s, kt, after_issue=meet if sched is not None else None) * c
        if masked:
            col = ops.iota((rows, block_kv), 1)
            tok = col + (kv_lo + i * block_kv)
            ok = tok < kv_hi
            if causal_pos0 is not None:
                row = ops.iota((rows, block_kv), 0)
                if wg is not None:
                    row = row + wg * rows
                ok = ok & ((tok - causal_pos0) * group <= row)
            s = jnp.where(ok, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - bcast_rows(m_new, s.shape))
        l = l * alpha + p.sum(axis=1)
        acc = acc * bcast_rows(alpha, acc.shape)
        if sched is not None:
            plgpu.barrier_arrive(sched)         # softmax done
        if coop:
            vt = dq.v_deq
        else:
            plgpu.barrier_wait(v_bar.at[slot])
            if sched is not None:
                plgpu.barrier_wait(sched)           # the other warpgroup is out of the tensor cores
            vt = dq.v(v_s.at[slot], qp) if dq is not None else v_s.at[slot]
        acc = ops.pv(acc, p.astype(vt.dtype), vt)
        # Both wgmmas on this slot are complete (their results were read), so the slot can be refilled.
        if coop:
            plgpu.barrier_arrive(sync.at[1])
            plgpu.barrier_wait(sync.at[1])      # both are done with the tiles the next block rewrites
        elif consumed is None:
            pl.when(i + num_stages < n_blk)(lambda: issue(i + num_stages, slot))
        else:
            release(i, slot)
        return acc, m_new, l

    def meet():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    if sched is not None:
        pl.when(wg == 1)(meet)                  # warpgroup 1 starts half a step behind
    acc = ops.wgmma_layout(jnp.zeros((rows, d), jnp.float32))
    m = ops.row_layout(jnp.full((rows,), MASK_VALUE, jnp.float32))
    l = ops.row_layout(jnp.zeros((rows,), jnp.float32))
    # Blocks whose every position is visible to every row need no mask: those wholly below the first query
    # position (causal) or wholly below kv_hi (decode).
    last_free = (causal_pos0 + 1) if causal_pos0 is not None else kv_hi
    n_free = jnp.clip(lax.div(jnp.maximum(last_free - kv_lo, 0), block_kv), 0, n_blk)
    carry = lax.fori_loop(0, n_free, lambda i, cr: step(i, cr, masked=False), (acc, m, l))
    carry = lax.fori_loop(n_free, n_blk, lambda i, cr: step(i, cr, masked=True), carry)
    if sched is not None:
        pl.when(wg == 0)(meet)                  # ... and warpgroup 0 ends with the matching meeting
    if consumed is not None:
        # Observe the `consumed` completions of the last stages, which no refill waited for: keeps every
        # barrier phase matched (the interpreter checks this; on the GPU it makes items independent).
        def drain(i, c):
            plgpu.barrier_wait(consumed.at[lax.rem(i, num_stages)])
            return c
        pl.when(wg == 0)(lambda: lax.fori_loop(jnp.maximum(n_blk - num_stages, 0), n_blk, drain, None))
    return carry


def block_pages(pt_hbm, *, seq, tok0, block_kv: int, page_size: int) -> tuple:
    """Page ids (scalars read from the page table in GMEM) holding cache positions [tok0, tok0 + block_kv) of
    page-table row `seq`: one per page, or the one page a smaller block sits in. Column indices are clamped
    to the table, so a block past the end reads a valid (unused) entry."""
    max_pages = pt_hbm.shape[1]
    if block_kv >= page_size:
        first = lax.div(tok0, page_size)
        return tuple(pt_hbm[seq, jnp.minimum(first + j, max_pages - 1)] for j in range(block_kv // page_size))
    return (pt_hbm[seq, jnp.minimum(lax.div(tok0, page_size), max_pages - 1)],)


def copy_kv_pages(*, k_hbm, v_hbm, k_s, v_s, k_bar, v_bar, layer, pages, kh, tok0, slot, aux_hbm=None,
                  aux_s=None):
    """Start the TMA copies of one block (its `pages`, from `block_pages`) of kv head `kh` into stage `slot`
    of k_s/v_s; each copy arrives on k_bar/v_bar[slot]. A quantized cache's aux rows (`aux_hbm` [L, N, PS, KH,
    W] -> `aux_s` [stages, block_kv, W]) arrive on k_bar too."""
    block_kv, page_size = k_s.shape[1], k_hbm.shape[2]
    if block_kv >= page_size:
        per = len(pages)
        for j, page in enumerate(pages):
            dk = k_s.at[slot] if per == 1 else k_s.at[slot, pl.ds(j * page_size, page_size)]
            dv = v_s.at[slot] if per == 1 else v_s.at[slot, pl.ds(j * page_size, page_size)]
            plgpu.copy_gmem_to_smem(k_hbm.at[layer, page, :, kh], dk, k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_hbm.at[layer, page, :, kh], dv, v_bar.at[slot])
            if aux_hbm is not None:
                da = aux_s.at[slot] if per == 1 else aux_s.at[slot, pl.ds(j * page_size, page_size)]
                plgpu.copy_gmem_to_smem(aux_hbm.at[layer, page, :, kh], da, k_bar.at[slot])
    else:
        off = lax.rem(tok0, page_size)
        plgpu.copy_gmem_to_smem(k_hbm.at[layer, pages[0], pl.ds(off, block_kv), kh], k_s.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_hbm.at[layer, pages[0], pl.ds(off, block_kv), kh], v_s.at[slot], v_bar.at[slot])
        if aux_hbm is not None:
            plgpu.copy_gmem_to_smem(aux_hbm.at[layer, pages[0], pl.ds(off, block_kv), kh], aux_s.at[slot],
                                    k_bar.at[slot])


def copy_kv_block(*, k_hbm, v_hbm, pt_hbm, k_s, v_s, k_bar, v_bar, layer, seq, kh, tok0, slot, aux_hbm=None,
                  aux_s=None):
    """Start the TMA copies of cache positions [tok0, tok0 + block_kv) of page-table row `seq`, kv head `kh`,
    into stage `slot` of k_s/v_s; each copy arrives on k_bar/v_bar[slot]. tok0 is a multiple of block_kv."""
    pages = block_pages(pt_hbm, seq=seq, tok0=tok0, block_kv=k_s.shape[1], page_size=k_hbm.shape[2])
    copy_kv_pages(k_hbm=k_hbm, v_hbm=v_hbm, k_s=k_s, v_s=v_s, k_bar=k_bar, v_bar=v_bar, layer=layer,
                  pages=pages, kh=kh, tok0=tok0, slot=slot, aux_hbm=aux_hbm, aux_s=aux_s)


def kv_scratch(num_stages: int, block_kv: int, head_dim: int, dtype, page_size: int, fmt: str = "bfloat16"):
    """SMEM K and V stage buffers and their barriers (arrivals = copies per block). A quantized format's stages
    hold the values as stored, and K's barrier also counts the aux rows' copies."""
    per = max(1, block_kv // page_size)
    if fmt == "bfloat16":
        shape, tf, k_arrivals = (num_stages, block_kv, head_dim), smem_tile_transforms(dtype), per
    else:
        from pallas_kernels._kv_dequant import stage_transforms, value_shape
        shape, tf = (num_stages, *value_shape(fmt, block_kv, head_dim)), stage_transforms(fmt, head_dim)
        k_arrivals = 2 * per
    return [plgpu.SMEM(shape, dtype, transforms=tf),
            plgpu.SMEM(shape, dtype, transforms=tf),
            plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=per, num_barriers=num_stages)]


def check_block(block_kv: int, page_size: int, head_dim: int):
    if head_dim % 64:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 64")
    if block_kv % 64:   # it is the contraction dim of p @ v: wgmma with 128-byte swizzle needs multiples of 64
        raise ValueError(f"block_kv={block_kv} must be a multiple of 64")
    if block_kv % page_size and page_size % block_kv:
        raise ValueError(f"block_kv={block_kv} and page_size={page_size}: one must divide the other")
