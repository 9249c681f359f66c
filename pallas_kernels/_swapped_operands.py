"""The swapped decode kernel's operands (pallas_kernels/paged_decode_swapped.py): the queries grouped per kv head (as
f16 beside dequantizers, or as their fp8 / int8 parts for K read undequantized), the scratch of a call's
configuration, the output types and the split combine after it. The horizontal kernel
(pallas_kernels/attention_beside_gemm.py) builds its attention half from the same pieces."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import kv_quant
from pallas_kernels._kv_dequant import cache_format, check_format, deq_transforms, quant_scratch, stage_transforms
from pallas_kernels._mgpu import cdiv, kv_scratch, smem_tile_transforms
from pallas_kernels.paged_decode_attention import combine_splits, grouped_queries


def prepare(q, k_cache, *, num_ctas: int, num_splits: int | None, block_kv: int, num_stages: int, aux_cache=None,
            dequant_wgs: int = 1, k_in_consumer: bool = False, fp8_mma: bool = False, int8_mma: bool = False,
            deq_tiles: int = 2, group_accs: bool = False):
    """(q as [B * KH, GP, D] with query heads padded to GP = 8k, number of splits, scratch types, the kernel's
    inputs after the cache's); a quantized cache's scratch for `dequant_wgs` dequantizing warpgroups (0: for the
    consumer's dequantizing; with `k_in_consumer` no K tiles, and two arrivals free a stage). `fp8_mma`: q as its
    two fp8 parts [B * KH, 2 GP, D] (`kv_quant.fp8_query_parts`), their scales the one more input; `int8_mma`: q as
    its int8 parts [B * KH, 2 G GP, D] (`kv_quant.int8_query_parts`; [B * KH, 2 GP, D] with `group_accs`), their
    scales likewise."""
    d, ps = q.shape[2], k_cache.shape[2]
    fmt = cache_format(k_cache, aux_cache)
    check_format(fmt, d, 0 if aux_cache is None else aux_cache.shape[-1])
    qr, gp, ns = grouped_queries(q, k_cache, block_kv=block_kv, num_ctas=num_ctas, num_splits=num_splits)
    qr_in, cd = qr, q.dtype
    tf = smem_tile_transforms(cd)
    if fmt == "int4" and not dequant_wgs:
        tf = deq_transforms(fmt, d)                        # the consumer's bf16 tiles' swizzle (see below)
    if fmt != "bfloat16" and dequant_wgs:
        # f16 operands: the e4m3 -> f16 conversion is the hardware's, and f16 math does two values an instruction.
        # wgmma wants one swizzle for both operands: int4 at head_dim 64 writes its dequantized halves as
        # 32-column slices, so every operand tile then takes the 64-byte swizzle of the dequantized tiles.
        cd, tf = jnp.float16, deq_transforms(fmt, d)
        qr = qr.astype(cd)
    extra, q_scratch = (), plgpu.SMEM((2, gp, d), cd, transforms=tf)
    if fp8_mma or int8_mma:     # the query's parts meet K's stage in wgmma: one type, one swizzle for both (int8's
        if fp8_mma:                                                                        # 64-byte tiles)
            qr, qscale = kv_quant.fp8_query_parts(qr_in)
        else:
            qr, qscale = kv_quant.int8_query_parts(qr_in, grouped=not group_accs)
        extra, q_scratch = (qscale,), plgpu.SMEM((2, *qr.shape[1:]), qr.dtype,
                                                 transforms=stage_transforms("fp8" if fp8_mma else "int8", d))
    scratch = [q_scratch,
               plgpu.SMEM((gp, block_kv), cd, transforms=tf),
               plgpu.SMEM((d, gp), jnp.float32),
               plgpu.SMEM((gp,), jnp.float32),
               plgpu.Barrier(num_barriers=2),                     # q loaded (per q buffer)
               plgpu.Barrier(num_barriers=2),                     # q buffer free again
               *kv_scratch(num_stages, block_kv, d, k_cache.dtype, ps, fmt),
               plgpu.Barrier(num_arrivals=2 if k_in_consumer else 1, num_barriers=num_stages)]   # stage consumed
    if fmt != "bfloat16" and not dequant_wgs:
        scratch += quant_scratch(fmt, num_stages, block_kv, d, aux_cache.shape[-1])
    elif fmt != "bfloat16":
        scratch += [plgpu.SMEM((num_stages, block_kv, aux_cache.shape[-1]), aux_cache.dtype),
                    *([] if k_in_consumer else [plgpu.SMEM((deq_tiles, block_kv, d), cd, transforms=tf)]),  # K
                    plgpu.SMEM((deq_tiles, block_kv, d), cd, transforms=tf),   # ... and V, dequantized
                    plgpu.Barrier(num_barriers=deq_tiles),                     # tiles ready
                    plgpu.Barrier(num_barriers=deq_tiles)]                     # tiles free again
    return qr, ns, scratch, extra


def out_types(q, kvh: int, ns: int):
    b, h, d = q.shape
    gp = cdiv(h // kvh, 8) * 8
    return (jax.ShapeDtypeStruct((b * kvh * ns, d, gp), jnp.float32),
            jax.ShapeDtypeStruct((b * kvh * ns, gp), jnp.float32))


def split_parts(o_t, lse, q_shape, kvh: int, ns: int, live=None):
    """The kernel's outputs as (o [B, KH, ns, GP, D], lse [B, KH, ns, GP]), each split normalised with its base-2
    log-sum-exp; rows at or past `live` (unwritten by the kernel) empty: o 0, lse EMPTY_LSE."""
    b, _, d = q_shape
    gp = lse.shape[-1]
    o, lse = o_t.transpose(0, 2, 1).reshape(b, kvh, ns, gp, d), lse.reshape(b, kvh, ns, gp)
    if live is not None:
        on = jnp.arange(b) < live
        o, lse = jnp.where(on[:, None, None, None, None], o, 0), jnp.where(on[:, None, None, None], lse, EMPTY_LSE)
    return o, lse


def finish(o_t, lse, q_shape, kvh: int, ns: int, extra=None):
    """The kernel's splits merged (and `extra`'s, `split_parts`' of another call over other positions)."""
    b, h, d = q_shape
    if extra is None:
        return combine_splits(o_t.transpose(0, 2, 1), lse, b, kvh, ns, h // kvh)
    o, lse = split_parts(o_t, lse, q_shape, kvh, ns)
    o, lse = jnp.concatenate([o, extra[0].astype(o.dtype)], 2), jnp.concatenate([lse, extra[1]], 2)
    return combine_splits(o.reshape(-1, *o.shape[3:]), lse.reshape(-1, lse.shape[-1]), b, kvh, o.shape[2], h // kvh)


EMPTY_LSE = -1e30       # an empty split's log-sum-exp: no weight in the merge, and never -inf - -inf
