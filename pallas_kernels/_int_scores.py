"""Attention scores from a grouped integer cache's K codes without dequantizing them (paged_decode_swapped's
`int8_mma`): int8's codes as stored, or int4's unpacked to int8 in registers, meet the query's int8 parts
(`kv_quant.int8_query_parts`) in int8 wgmmas with an int32 accumulator.

A group g of K's columns holds x = (s + 0.5) scale_g + center_g for its signed codes s. The wgmma reads codes c with
s = a c + b: int8's as stored (a = 1, b = 0); int4's low nibbles u as they are (a = 1, b = -8, since u - 7.5 =
(u - 8) + 0.5) and its high nibbles as (byte & 0xF0) ^ 0x80 = 16 (u - 8) (a = 1 / 16, b = 0): bitwise operations
only, which Mosaic GPU allows on 8-bit registers (no shifts or subtractions). For a query q = s_q (hi + lo / 254):
    q . x = s_q sum_g [ scale_g (a_g dot_g + (b_g + 0.5) qsum_g) + center_g qsum_g ],
dot_g = hi_g . c + lo_g . c / 254 and qsum_g = sum over the group of hi + lo / 254. The query's parts lie once per
group with zeros off that group's columns (block (p, g) of GP rows at (p G + g) GP), so a wgmma over any columns
returns each group's dot products apart; `query_sums` gets the qsum_g of an item from one ones @ q^T wgmma.
Apart (`grouped=False`, the kernel's `group_accs`): the parts are [hi; lo] over all of D, with no zero blocks, and
each group's wgmma over its own columns goes into its own [rows, 2 GP] accumulator (int4's two halves of D are two
register operands already); the sums take one wgmma a group.
"""
from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import kv_quant
from pallas_kernels._mgpu import bcast_rows


def _part_sum(t, g: int, gp: int, ng: int):
    """hi + lo / 254 of group g from a [rows, 2 G GP] result of the parts' layout."""
    return t[:, g * gp:(g + 1) * gp] + t[:, (ng + g) * gp:(ng + g + 1) * gp] * (1.0 / kv_quant.INT8_LO)


def query_sums(ops, q_s, rows: int, gp: int, ng: int, grouped: bool = True) -> list:
    """[qsum_g as [rows, GP] f32, every row alike] for the G groups of the item's query parts in `q_s` (laid out
    `grouped` or apart: module doc)."""
    if not grouped:
        return [_part_sum(ops.ones_q_int(q_s.at[:, pl.ds(g * kv_quant.GROUP, kv_quant.GROUP)], rows), 0, gp, 1)
                for g in range(ng)]
    t = ops.ones_q_int(q_s, rows)
    return [_part_sum(t, g, gp, ng) for g in range(ng)]


INT8_CODES = ((1.0, 0.0), (1.0, 0.0))          # (a, b) of each group's codes (module doc)
INT4_CODES = ((1.0, -8.0), (1.0 / 16, 0.0))


def scores(s_all, k_rows: dict, k_pairs, qsums: list, gp: int, codes=INT8_CODES):
    """The scores [BKV, GP] in the query's unit s_q from the int8 wgmma's [BKV, 2 G GP] result (or, apart, a tuple
    of each group's [BKV, 2 GP]), K's per-row scale and center of each group (`k_rows` at the columns `k_pairs`,
    `_kv_dequant.load_rows`), `query_sums` and the codes' (a, b) per group."""
    ng = len(qsums)
    s = None
    for g, (sc_col, ce_col) in enumerate(k_pairs[:ng]):
        a, b = codes[g]
        dot = _part_sum(s_all[g], 0, gp, 1) if isinstance(s_all, tuple) else _part_sum(s_all, g, gp, ng)
        part = ((dot * a if a != 1.0 else dot) + (b + 0.5) * qsums[g]) * bcast_rows(k_rows[sc_col], dot.shape) + \
            qsums[g] * bcast_rows(k_rows[ce_col], dot.shape)
        s = part if s is None else s + part
    return s


def int4_codes(src, interpret: bool) -> list[tuple[int, object]]:
    """An int4 stage tile [BKV, D / 2] of packed bytes -> [(first column, codes int8 [BKV, D / 2])] for its two halves
    of D (kv_quant's packing: low nibbles the first half, high nibbles the second) as INT4_CODES reads them: u, and
    16 (u - 8); on the GPU in the 8-bit WGMMA layout, wgmma's int8 register operand."""
    u = src[...] if interpret else plgpu.load(src, (), layout=plgpu.Layout.WGMMA_8BIT)
    h = src.shape[1]
    return [(0, (u & 0x0F).astype(jnp.int8)), (h, ((u & 0xF0) ^ 0x80).astype(jnp.int8))]
