"""Paged decode attention (one query token per sequence, GQA), split-KV with a reduction. Pallas Mosaic GPU.

Work item = (sequence b, kv head, split s). A split covers ceil(len_b / num_splits) positions of sequence b
(rounded up to whole blocks), so ragged lengths split evenly. The kernel runs a persistent grid of
`num_ctas` CTAs; CTA p takes items p, p + P, p + 2P, ... This CTA count is the
resource share R of NanoFlow: with P < #SMs the kernel leaves SMs free for a kernel on another stream.

Per item: the G = H / KH query heads of the kv head are the rows of the query tile (padded to a multiple of 8;
the 64-row wgmma tile's other rows are never written out), K/V stream through SMEM in `block_kv`-position
blocks `num_stages` deep (pallas_kernels/_mgpu.py), scores and the accumulator are f32; inputs bf16.
Each item writes its normalised partial output (f32) and base-2 log-sum-exp; a small XLA reduction combines
splits (skipped when num_splits == 1).

Measured on H100 (bench/results/attention-20261122.json; 32q/8kv heads, head_dim 128, pages of 16, bf16):
2.76 TB/s at batch 64 x 4k context = 94% of the measured device copy (2.94 TB/s read+write), 99% at batch
256 x 4k; cuDNN paged attention 2.75 / 2.97 TB/s, plain XLA 0.87 / 0.91 TB/s. Short contexts pay a per-item
ramp (Q load, pipeline fill, epilogue): 74-78% of copy at 1k.

Assumes the cache holds finite values everywhere (zeros at creation, real K/V after): masked positions get
weight exactly 0, but 0 * NaN would still poison the output.
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


def paged_decode_attention_ref(q: Float[Array, "B H D"], k_cache: Float[Array, "L N PS KH D"],
                               v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                               page_table: Int[Array, "B P"], seq_lens: Int[Array, "B"],
                               scale: float, aux_cache=None) -> Float[Array, "B H D"]:
    """Pure-jnp reference: query b attends to positions [0, seq_lens[b]) of its pages (f32 math).
    Sequences with seq_lens == 0 give 0. `aux_cache`: a quantized cache (kv_quant.py), dequantized first."""
    b, h, d = q.shape
    _, _, ps, kh, _ = k_cache.shape
    p = page_table.shape[1]
    kl, vl = dequantize_kv(k_cache[layer], v_cache[layer], None if aux_cache is None else aux_cache[layer])
    k = kl[page_table].reshape(b, p * ps, kh, d)
    v = vl[page_table].reshape(b, p * ps, kh, d)
    qg = q.reshape(b, kh, h // kh, d).astype(jnp.float32)
    s = jnp.einsum("bkgd,blkd->bkgl", qg, k) * scale
    ok = jnp.arange(p * ps)[None, :] < seq_lens[:, None]
    w = jnp.where(ok[:, None, None, :], jax.nn.softmax(jnp.where(ok[:, None, None, :], s, MASK_VALUE), -1), 0.0)
    return jnp.einsum("bkgl,blkd->bkgd", w, v).reshape(b, h, d).astype(q.dtype)


def choose_num_splits(work: int, ctas: int, max_splits: int = 16) -> int:
    """Fewest splits that keep the persistent CTAs >= 90% busy (equal-length items assumed)."""
    best, best_eff = 1, 0.0
    ns = 1
    while ns <= max_splits:
        w = work * ns
        eff = w / (cdiv(w, ctas) * ctas)
        if eff >= 0.9:
            return ns
        if eff > best_eff + 1e-9:
            best, best_eff = ns, eff
        ns *= 2
    return best


def _kernel(params_hbm, lens_hbm, pt_hbm, q_hbm, k_hbm, v_hbm, o_hbm, lse_hbm,
            q_s, o_s, lse_s, q_bar, k_s, v_s, k_bar, v_bar, *quant, num_kv_heads, num_splits, num_ctas,
            group_pad, scale, interpret, kv_format="bfloat16", aux_hbm=None):
    ops = Ops(interpret)
    dq = Dequant(kv_format, q_s.shape[1], quant, interpret)
    block_kv = k_s.shape[1]
    num_items = lens_hbm.shape[0] * num_kv_heads * num_splits
    pid = lax.axis_index("p")
    layer = params_hbm[0]

    def item(k, carry):
        w = pid + k * num_ctas
        b, kh, kv_lo, kv_hi = item_coords(w, lens_hbm, num_kv_heads=num_kv_heads, num_splits=num_splits,
                                          block_kv=block_kv)

        plgpu.copy_gmem_to_smem(q_hbm.at[b * num_kv_heads + kh], q_s.at[pl.ds(0, group_pad)], q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        acc, m, l = paged_flash_loop(ops, q_s=q_s, k_s=k_s, v_s=v_s, k_bar=k_bar, v_bar=v_bar, k_hbm=k_hbm,
                                     v_hbm=v_hbm, pt_hbm=pt_hbm, layer=layer, seq=b, kh=kh, kv_lo=kv_lo,
                                     kv_hi=kv_hi, scale=scale, dq=dq, aux_hbm=aux_hbm)
        store_partial(acc, m, l, bcast_rows, o_s, lse_s, o_s.at[pl.ds(0, group_pad)], lse_s.at[pl.ds(0, group_pad)],
                      o_hbm.at[w], lse_hbm.at[w])
        return carry

    n_mine = lax.div(num_items - pid + (num_ctas - 1), num_ctas)
    lax.fori_loop(0, n_mine, item, None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "num_ctas", "num_splits", "block_kv", "num_stages",
                                             "interpret"), inline=True)
def paged_decode_attention(q: Float[Array, "B H D"], k_cache: Float[Array, "L N PS KH D"],
                           v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                           page_table: Int[Array, "B P"], seq_lens: Int[Array, "B"], *, scale: float,
                           num_ctas: int = 132, num_splits: int | None = None, block_kv: int = 128,
                           num_stages: int = 2, interpret: bool = False, aux_cache=None) -> Float[Array, "B H D"]:
    """Decode attention over the paged cache for layer `layer` (a traced scalar; the stacked cache is not
    sliced). Sequences with seq_lens == 0 produce 0. `num_splits=None` picks one for `num_ctas`.
    `aux_cache`: the cache is quantized (kv_quant.py), dequantized in the kernel (pallas_kernels/_kv_dequant.py)."""
    b, h, d = q.shape
    _, _, ps, kvh, _ = k_cache.shape
    g = h // kvh
    qr, gp, ns = grouped_queries(q, k_cache, block_kv=block_kv, num_ctas=num_ctas, num_splits=num_splits)
    params = jnp.asarray(layer, jnp.int32).reshape(1)
    items = b * kvh * ns

    fmt = cache_format(k_cache, aux_cache)
    check_format(fmt, d, 0 if aux_cache is None else aux_cache.shape[-1])
    kernel = functools.partial(_kernel, num_kv_heads=kvh, num_splits=ns, num_ctas=num_ctas,
                               group_pad=gp, scale=scale, interpret=interpret, kv_format=fmt)

    def body(params, lens, pt, qr, k, v, *rest):
        aux, rest = (rest[0], rest[1:]) if aux_cache is not None else (None, rest)
        kernel(params, lens, pt, qr, k, v, *rest, aux_hbm=aux)
    tf = deq_transforms(fmt, d) if fmt == "int4" else smem_tile_transforms(q.dtype)     # one swizzle for wgmma
    o, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((items, gp, d), jnp.float32),
                  jax.ShapeDtypeStruct((items, gp), jnp.float32)),
        scratch_types=[plgpu.SMEM((ROWS, d), q.dtype, transforms=tf),
                       plgpu.SMEM((ROWS, d), jnp.float32),
                       plgpu.SMEM((ROWS,), jnp.float32),
                       plgpu.Barrier(num_barriers=1),
                       *kv_scratch(num_stages, block_kv, d, k_cache.dtype, ps, fmt),
                       *(quant_scratch(fmt, num_stages, block_kv, d, aux_cache.shape[-1]) if fmt != "bfloat16"
                         else [])],
        grid=(num_ctas,), grid_names=("p",), compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None,
    )(params, seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), qr, k_cache, v_cache,
      *(() if aux_cache is None else (aux_cache,)))
    return combine_splits(o, lse, b, kvh, ns, g).astype(q.dtype)


def store_partial(acc, m, l, bcast, o_s, lse_s, o_src, lse_src, o_dst, lse_dst):
    """An item's normalised output and base-2 log-sum-exp, through SMEM (o_s/lse_s; o_src/lse_src: the part
    copied out) to their rows in HBM. `bcast` broadcasts a per-query vector over acc."""
    l_safe = jnp.maximum(l, 1e-30)          # empty split: acc == 0, so o == 0 and lse ~ -1e30
    o = acc / bcast(l_safe, acc.shape)
    lse = m + jnp.log2(l_safe)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous item's stores have left SMEM
    o_s[...] = o
    lse_s[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_src, o_dst)
    plgpu.copy_smem_to_gmem(lse_src, lse_dst)


def grouped_queries(q, k_cache, *, block_kv: int, num_ctas: int, num_splits: int | None):
    """Checks, then (q as [B * KH, GP, D] with each kv head's G query heads padded to GP = 8k, GP, splits)."""
    b, h, d = q.shape
    _, _, ps, kvh, _ = k_cache.shape
    g = h // kvh
    if g * kvh != h or g > ROWS:
        raise ValueError(f"{h} query heads over {kvh} kv heads: need a whole group of at most {ROWS}")
    check_block(block_kv, ps, d)
    gp = cdiv(g, 8) * 8
    ns = num_splits or choose_num_splits(b * kvh, num_ctas)
    qr = q.reshape(b, kvh, g, d)
    if gp != g:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    return qr.reshape(b * kvh, gp, d), gp, ns


def item_coords(w, lens_hbm, *, num_kv_heads: int, num_splits: int, block_kv: int):
    """Work item w -> (sequence, kv head, first position, end position); a split covers whole blocks."""
    b = lax.div(w, num_kv_heads * num_splits)
    r = lax.rem(w, num_kv_heads * num_splits)
    kh = lax.div(r, num_splits)
    sp = lax.rem(r, num_splits)
    seq_len = lens_hbm[b]
    split_len = lax.div(lax.div(seq_len + (num_splits - 1), num_splits) + (block_kv - 1), block_kv) * block_kv
    kv_lo = sp * split_len
    return b, kh, kv_lo, jnp.minimum(kv_lo + split_len, seq_len)


def combine_splits(o: Float[Array, "W GP D"], lse: Float[Array, "W GP"], b: int, kvh: int, ns: int,
                   g: int) -> Float[Array, "B H D"]:
    """Merge per-split normalised outputs with their base-2 log-sum-exps (f32)."""
    gp, d = o.shape[1], o.shape[2]
    o = o.reshape(b, kvh, ns, gp, d)[:, :, :, :g]
    if ns == 1:
        return o[:, :, 0].reshape(b, kvh * g, d)
    lse = lse.reshape(b, kvh, ns, gp)[:, :, :, :g]
    wts = jnp.exp2(lse - lse.max(axis=2, keepdims=True))
    out = (wts[..., None] * o).sum(axis=2) / wts.sum(axis=2)[..., None]
    return out.reshape(b, kvh * g, d)
