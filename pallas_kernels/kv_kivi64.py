"""The "kivi64" KV format's math (docs/design.md section 14.1): K quantized per channel over groups of 64
consecutive positions, V as int4 (rotated, groups of 64 along head_dim, per token).

K of a complete group of 64 positions: for each kv head and channel, a bfloat16 center and scale over the group's
64 rows (kv_quant's int4 arithmetic along the position axis instead of head_dim), 4-bit codes packed as int4's
(byte j = code j | code j + D/2 << 4), not rotated. The group still filling is kept in bfloat16 beside the pages
(`KVCache.k_tail`, one row of 64 positions per sequence: nfjax/kv/kivi64.py) and quantized when it completes.
A group is one page (the format needs pages of 64), so a complete page is a quantized group and pages move as
stored (swapping, the prefix cache and its tiers).

Aux rows keep int4's layout and width: row r of a group holds, in K's columns (2g, 2g + 1), the scale and center
of channel g * 64 + r (g < D / 64), and in V's its own token's parameters, as int4. Pure jnp, no nfjax import.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from pallas_kernels import kv_quant

GROUP = 64                       # positions a K group spans (= the page size the format needs)


def quantize_k_group(x: Float[Array, "*B 64 KH D"]) -> tuple[UInt8[Array, "*B 64 KH D2"], Float[Array, "*B 64 KH C"]]:
    """A complete group's K rows -> (packed codes, K's aux columns [.., 2 * D / 64]: row r's (scale, center) of
    channels r, 64 + r, ...). Scale and center are bfloat16 values (kv_quant's centered int4 over the 64 rows)."""
    xg = jnp.moveaxis(x.astype(jnp.float32), -3, -1)                          # [*B, KH, D, 64]
    packed_t, scale, center = kv_quant.quantize_int4(xg)                      # codes along positions
    codes = jnp.moveaxis(kv_quant.unpack_int4(packed_t), -1, -3)              # [*B, 64, KH, D]
    *lead, kh, d = scale.shape[:-1]
    sc = scale[..., 0].reshape(*lead, kh, d // GROUP, GROUP)                  # [*B, KH, G, 64]
    ce = center[..., 0].reshape(*lead, kh, d // GROUP, GROUP)
    cols = jnp.moveaxis(jnp.stack([sc, ce], -1), -2, -4)                      # [*B, 64, KH, G, 2]
    return kv_quant.pack_int4(codes), cols.reshape(*cols.shape[:-2], -1).astype(kv_quant.AUX_DTYPE)


def dequantize_k_group(packed: UInt8[Array, "*B 64 KH D2"], aux: Float[Array, "*B 64 KH W"]) -> Float[Array, "*B 64 KH D"]:
    """Complete groups' K back in f32 from their codes and aux rows (K's columns of the format's rows)."""
    c = kv_quant.unpack_int4(packed).astype(jnp.float32)                      # [*B, 64, KH, D]
    d = c.shape[-1]
    g = d // GROUP
    a = aux[..., :2 * g].astype(jnp.float32).reshape(*aux.shape[:-1], g, 2)   # [*B, 64(r), KH, G, 2]
    a = jnp.moveaxis(a, -4, -2)                                               # [*B, KH, G, 64(r), 2]
    a = a.reshape(*a.shape[:-3], d, 2)                                        # [*B, KH, D]: channel g * 64 + r
    scale, center = a[..., 0][..., None, :, :], a[..., 1][..., None, :, :]    # broadcast over positions
    return (c - 7.5) * scale + center


def quantize_v(v: Float[Array, "*T KH D"]) -> tuple[UInt8[Array, "*T KH D2"], Float[Array, "*T KH C"]]:
    """V per token as int4 (rotated): (packed codes, V's aux columns [.., 2 * D / 64])."""
    q, s, c = kv_quant.quantize_int4(kv_quant.rotate(v, jnp.float32))
    return q, jnp.stack([s, c], -1).reshape(*s.shape[:-1], -1).astype(kv_quant.AUX_DTYPE)


def dequantize_v(packed: UInt8[Array, "*T KH D2"], aux: Float[Array, "*T KH W"]) -> Float[Array, "*T KH D"]:
    g = 2 * packed.shape[-1] // GROUP
    a = aux[..., 2 * g:4 * g].astype(jnp.float32).reshape(*aux.shape[:-1], g, 2)
    return kv_quant.dequantize_int4(packed, a[..., 0], a[..., 1])


def read_pages(k: UInt8[Array, "S P 64 KH D2"], v: UInt8[Array, "S P 64 KH D2"], aux: Float[Array, "S P 64 KH W"],
               tail: Float[Array, "S 64 KH D"], seq_lens, start=0, v_tail=None) -> tuple[Float[Array, "S L KH D"],
                                                                                          Float[Array, "S L KH D"]]:
    """Gathered pages of S sequences (positions start, start + 1, ...; start a multiple of 64) of a format with a
    tail -> K and V [S, P * 64, KH, D] f32: K of complete groups dequantized, of the group filling (positions >=
    64 * floor(len / 64)) taken from the sequence's `tail` rows; V from its codes, or for those positions from
    `v_tail` [S, 64, KH, D] where given. kivi64's pages (uint8 codes: K per channel, V rotated int4) or fp8r's
    (fp8 values, kv_quant's per-token rows, and a V tail). Positions past a length: don't-care."""
    s, p = k.shape[:2]
    if k.dtype == jnp.uint8:
        kk = dequantize_k_group(k, aux).reshape(s, p * GROUP, *k.shape[3:-1], -1)
        vv = dequantize_v(v, aux).reshape(s, p * GROUP, *v.shape[3:-1], -1)
    else:
        flat = [a.reshape(s, p * GROUP, *a.shape[3:]) for a in (k, v, aux)]
        kk, vv = kv_quant.dequantize_kv(*flat)
    j = start + jnp.arange(p * GROUP)
    full = (seq_lens // GROUP) * GROUP
    in_tail = (j[None, :] >= full[:, None])[:, :, None, None]
    tk = tail.astype(jnp.float32)[:, j % GROUP]                              # [S, P * 64, KH, D]
    if v_tail is not None:
        vv = jnp.where(in_tail, v_tail.astype(jnp.float32)[:, j % GROUP], vv)
    return jnp.where(in_tail, tk, kk), vv
