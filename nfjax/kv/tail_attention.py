"""The GPU's reading of fp8r's K tail rows (docs/design.md section 14.3): the kernels read fp8r's pages as fp8, up
to each sequence's last complete group of 64 positions, and the positions past it take their K from the tail row.

* Decodes: the decode kernel runs over the complete groups only; `decode_tail_split` attends to the rest (at most
  63 positions a sequence, K from the tail row, V dequantized from the group's page) and hands the result as one
  more split, merged with the kernel's by their log-sum-exps (`paged_decode_attention_swapped`'s `extra_split`).
* Prefill chunks: the bfloat16 prefill kernel reads a dequantized copy of the step's pages
  (`attention.dequantized_pages`); `splice_tail` writes each sequence's tail row over its filling group's page
  in that copy.
A group is a page (the format needs pages of 64), so the filling group is the one page at floor(len / 64).
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._mgpu import LOG2E
from pallas_kernels.kv_kivi64 import GROUP
from pallas_kernels.kv_quant import dequantize_kv

EMPTY_LSE = -1e30       # an empty split's log-sum-exp: its weight in the merge is 0 (the kernel's empty splits alike)


def _group_page(page_table: Int[Array, "R P"], lens: Int[Array, "R"]) -> Int[Array, "R"]:
    """The page of each row's filling group (the one at floor(len / 64))."""
    idx = jnp.minimum(lens // GROUP, page_table.shape[1] - 1)
    return jnp.take_along_axis(page_table, idx[:, None], axis=1)[:, 0]


def decode_tail_split(q: Float[Array, "R H D"], kv, layer: Int[Array, ""], page_table: Int[Array, "R P"],
                      lens: Int[Array, "R"], tail_rows: Int[Array, "R"], scale: float):
    """Attention of decode queries over their positions [64 floor(len / 64), len): (o [R, KH, GP, D] normalised,
    lse [R, KH, GP] base 2 of the scaled scores), GP the kernel's padded heads per kv head (rows past G empty).
    A row with no such position (len a multiple of 64, or 0) is empty: o = 0, lse = EMPTY_LSE."""
    r, h, d = q.shape
    kh = kv.k.shape[3]
    g = h // kh
    gp = -(-g // 8) * 8
    full = (lens // GROUP) * GROUP
    kt = kv.k_tail[layer][tail_rows]                                            # [R, 64, KH, D] bfloat16
    page = _group_page(page_table, lens)
    _, vt = dequantize_kv(kv.k[layer, page], kv.v[layer, page], kv.aux[layer, page], kt.dtype)    # [R, 64, KH, D]
    # 16-bit operands, f32 sums (batched GEMMs on the GPU; the f32 copies of K and V would double the bytes)
    s = jnp.einsum("rkgd,rjkd->rkgj", q.reshape(r, kh, g, d).astype(kt.dtype), kt,
                   preferred_element_type=jnp.float32) * scale
    ok = (jnp.arange(GROUP)[None, :] < (lens - full)[:, None])[:, None, None, :]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(s - m_safe[..., None]), 0.0)
    l = p.sum(-1)
    o = jnp.einsum("rkgj,rjkd->rkgd", p.astype(vt.dtype), vt, preferred_element_type=jnp.float32) \
        / jnp.maximum(l, 1e-30)[..., None]
    lse = jnp.where(l > 0, (m_safe + jnp.log(jnp.maximum(l, 1e-30))) * LOG2E, EMPTY_LSE)
    pad = gp - g
    return (jnp.pad(o, ((0, 0), (0, 0), (0, pad), (0, 0))),
            jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=EMPTY_LSE))


def splice_tail(k_copy: Float[Array, "1 C PS KH D"], table: Int[Array, "W P"], lens: Int[Array, "W"], kv,
                layer: Int[Array, ""], tail_rows: Int[Array, "W"]) -> Float[Array, "1 C PS KH D"]:
    """The copy's K with each row's filling group (positions [64 floor(len / 64), len), len not a multiple of 64)
    taken from its tail row. `table` indexes the copy (`dequantized_pages`); rows of length 0 take nothing."""
    c = k_copy.shape[1]
    slot = jnp.where(lens % GROUP > 0, _group_page(table, lens), c)              # the rest: past the copy, dropped
    rows = kv.k_tail[layer][tail_rows].astype(k_copy.dtype)                     # [W, 64, KH, D]
    return k_copy.at[0, slot].set(rows, mode="drop")
