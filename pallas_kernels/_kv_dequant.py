"""Quantized K/V tiles inside the attention kernels: the formats of kv_quant.py turned back into bfloat16 tiles.

A quantized cache's stage buffers hold the values as stored (fp8 / int8 [block_kv, D], or int4 bytes [block_kv, D / 2])
and each block's aux rows ([block_kv, W] bfloat16, copied by TMA beside K's pages: W * 2 = 16 bytes a row). The
consumer turns a stage into one bfloat16 [block_kv, D] SMEM tile (`k_deq` / `v_deq`), after which the kernel's
bfloat16 matmuls run unchanged:
  * the aux tile is loaded once a block in the WGMMA layout, and each needed column becomes a per-row (position)
    f32 vector by a masked row sum (4 lanes of a quad; no cross-warp traffic);
  * fp8: loaded in WGMMA_UPCAST_2X (the layout made for 8-bit -> 16-bit), converted to f16 (the hardware's
    e4m3 conversion; e4m3 -> bf16 needs a newer ptxas), moved to the WGMMA layout, scaled per row in f32;
  * int4: bytes loaded in WGMMA_UPCAST_2X as int16, moved to the WGMMA layout; the low nibbles are the first
    half of head_dim and the high nibbles the second (kv_quant's packing), so each half is a plain column
    slice of the output tile: (u - 7.5) * scale + center per row, with the scale and center of its group (f16
    tiles: the codes become f16 by bit pattern, 0x6400 | u = 1024 + u, and one FMA applies scale and center);
  * int8: int4's arithmetic a group of 64 columns at a time: each group's column slice of the stage (64 bytes a
    row: the stage is tiled in 64-byte swizzle tiles so a group is whole tiles) loaded in WGMMA_UPCAST_2X,
    sign-extended to int16, moved to the WGMMA layout, and written to its column slice of the output tile as
    (s + 0.5) * scale + center (f16 tiles: s + 0x6480 is the f16 bit pattern of 1152 + s, s in [-128, 127]).
Interpret mode (CPU tests) does the same arithmetic with jnp on the loaded tiles.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import kv_quant
from pallas_kernels._mgpu import bcast_rows

QUANT_KERNEL_FORMATS = ("fp8", "int8", "int4")
SKIP_MATH = False       # probe only (bench/probes/dequant_sass.py): loads and stores without the scale arithmetic
# How a stage's 8-bit values reach the WGMMA layout: "upcast" loads them in WGMMA_UPCAST_2X (4 bytes a load) and
# moves them over with shuffles (shfl + selp a register pair, the measured default); "direct" loads them in the
# WGMMA layout itself (2 bytes a load, no shuffle). Mosaic GPU lowers both; "direct" is not timed yet (the probe's
# FORMAT:direct variants).
CODE_LOAD = "upcast"
CODE_LOADS = ("upcast", "direct")
GROUPED_HEAD_DIMS = (64, 128)       # int4 / int8 in the kernels: one or two groups (the 8-wide aux row)


def cache_format(k_cache, aux_cache) -> str:
    """The format of a stacked cache from its arrays (the kernels' static choice)."""
    if aux_cache is None:
        return "bfloat16"
    if jnp.dtype(k_cache.dtype) in kv_quant.GROUP_CODE_DTYPES:
        return kv_quant.GROUP_CODE_DTYPES[jnp.dtype(k_cache.dtype)]
    if k_cache.dtype == kv_quant.FP8:
        return "fp8"
    raise ValueError(f"a quantized cache holds fp8, int8 or uint8 (int4) values, got {k_cache.dtype}")


def kernel_refusal(fmt: str, head_dim: int) -> str | None:
    """Why the kernels cannot read `fmt` at `head_dim` (None: they can; bfloat16 needs only check_block's)."""
    if fmt == "bfloat16":
        return None
    if fmt not in QUANT_KERNEL_FORMATS:
        return f"the kernels read the KV formats {QUANT_KERNEL_FORMATS}, not {fmt!r}"
    if fmt in kv_quant.GROUPED and head_dim not in GROUPED_HEAD_DIMS:
        return f"{fmt} in the kernels needs head_dim 64 or 128 (one or two groups), got {head_dim}"
    return None


def check_format(fmt: str, head_dim: int, aux_width: int) -> None:
    if fmt == "bfloat16":
        return
    why = kernel_refusal(fmt, head_dim)
    if why:
        raise ValueError(why)
    if aux_width != kv_quant.aux_width(fmt, head_dim):
        raise ValueError(f"aux rows of width {aux_width}; the {fmt} format at head_dim {head_dim} has "
                         f"{kv_quant.aux_width(fmt, head_dim)}")


def _transforms(row_bytes: int, itemsize: int) -> tuple:
    swz = min(128, row_bytes)
    return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))


def stage_transforms(fmt: str, head_dim: int) -> tuple:
    """SMEM tiling of a stage of stored values (a TMA destination): [block_kv, D] fp8 / int8 or [block_kv, D / 2]
    u8 (int4). int8 takes 64-byte tiles, so that each group of 64 columns is whole tiles (`dequant_tile`)."""
    return _transforms(kv_quant.GROUP if fmt == "int8" else kv_quant.value_width(fmt, head_dim), 1)


def deq_transforms(fmt: str, head_dim: int) -> tuple:
    """SMEM tiling of the dequantized bf16 tile: int4 writes its two halves as column slices, so a half must be
    whole swizzle tiles (64-byte swizzle at head_dim 64)."""
    return _transforms(head_dim if fmt == "int4" else 2 * head_dim, 2)


def value_shape(fmt: str, block_kv: int, head_dim: int) -> tuple[int, int]:
    return (block_kv, kv_quant.value_width(fmt, head_dim))


def quant_scratch(fmt: str, num_stages: int, block_kv: int, head_dim: int, aux_width: int) -> list:
    """[aux stages, k_deq, v_deq]."""
    return [plgpu.SMEM((num_stages, block_kv, aux_width), kv_quant.AUX_DTYPE),
            plgpu.SMEM((block_kv, head_dim), jnp.bfloat16, transforms=deq_transforms(fmt, head_dim)),
            plgpu.SMEM((block_kv, head_dim), jnp.bfloat16, transforms=deq_transforms(fmt, head_dim))]


def aux_columns(fmt: str, head_dim: int, which: str) -> list[tuple[int, int | None]]:
    """(scale column, center column or None) of K's or V's aux row, one pair per half of head_dim (int4), per group
    of 64 columns (int8) or a single pair (fp8)."""
    if fmt == "fp8":
        return [(0 if which == "k" else 1, None)]
    g = head_dim // kv_quant.GROUP
    base = 0 if which == "k" else 2 * g
    groups = range(g) if fmt == "int8" else [0, 0] if g == 1 else [0, 1]     # int4: the group of each half
    return [(base + 2 * gi, base + 2 * gi + 1) for gi in groups]


def pair_columns(pairs) -> list[int]:
    """The aux columns `pairs` (`aux_columns`) read, each once, in order (what `load_rows` loads)."""
    return sorted({c for p in pairs for c in p if c is not None})


def load_rows(aux_ref, cols: list[int], interpret: bool) -> dict:
    """{column: f32 [block_kv] vector over the tile's rows} from one aux stage [block_kv, W]."""
    if interpret:
        a = aux_ref[...].astype(jnp.float32)
        return {c: a[:, c] for c in cols}
    a = plgpu.load(aux_ref, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    col = plgpu.broadcasted_iota(jnp.int32, a.shape, 1, layout=plgpu.Layout.WGMMA)
    return {c: jnp.where(col == c, a, 0.0).sum(axis=1) for c in cols}


def _upcast(src, interpret: bool):
    """A stage tile of 8-bit codes (uint8: zero-extended; int8: sign-extended) as int16 in the WGMMA layout."""
    if interpret:
        return src[...].astype(jnp.int16)
    if CODE_LOAD not in CODE_LOADS:
        raise ValueError(f"_kv_dequant.CODE_LOAD={CODE_LOAD!r}: one of {CODE_LOADS}")
    if CODE_LOAD == "direct":
        return plgpu.load(src, (), layout=plgpu.Layout.WGMMA).astype(jnp.int16)
    u = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.int16)
    return plgpu.layout_cast(u, plgpu.Layout.WGMMA)


def _levels(codes, f16_bias: int, mid: float, scale, center, math):
    """(codes - mid) * scale + center per row over int16 codes in `math` (f32, or f16 two values an instruction:
    the codes become f16 by bit pattern, 0x6400 + f16_bias + c being the f16 1024 + f16_bias + c for c in
    [-f16_bias, 1023 - f16_bias] (int4: codes | 0x6400, the same for its codes in [0, 15]), then one fused
    multiply-add with the row's scale and center - mid * scale)."""
    if math == jnp.float16:
        if SKIP_MATH:
            return lax.bitcast_convert_type(codes | 0x6400, jnp.float16)
        bits = codes | 0x6400 if f16_bias == 0 else codes + (0x6400 + f16_bias)
        c = lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1024 + f16_bias)
        zp = (center - mid * scale).astype(math)
        return c * bcast_rows(scale.astype(math), c.shape) + bcast_rows(zp, c.shape)
    c = codes.astype(math)
    return (c - mid) * bcast_rows(scale.astype(math), c.shape) + bcast_rows(center.astype(math), c.shape)


def dequant_values(fmt: str, src, rows: dict, pairs, interpret: bool, math) -> list[tuple[int, object]]:
    """Stored stage tile `src` -> [(first column, values [rows, width] in `math`)] covering D: one part (fp8), one
    per group of 64 columns (int8) or one per half of D (int4), with the per-row parameters `rows` (`load_rows`)
    at the columns `pairs` (`aux_columns`). f16 math does two values an instruction; on the GPU the values are in
    the WGMMA layout (a wgmma's register operand, or a store into a tile)."""
    if fmt == "fp8":
        (sc, _), = pairs
        if interpret:
            x = src[...].astype(jnp.float16).astype(math)
        elif CODE_LOAD == "direct":
            x = plgpu.load(src, (), layout=plgpu.Layout.WGMMA).astype(jnp.float16).astype(math)
        else:
            x = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
            x = plgpu.layout_cast(x, plgpu.Layout.WGMMA).astype(math)
        return [(0, x if SKIP_MATH else x * bcast_rows(rows[sc].astype(math), x.shape))]
    if fmt == "int8":
        # int4's pattern a group at a time. New against int4 on the GPU: int8 (signed) stage refs, so the load's
        # astype(int16) is a sign extension (extsi, where int4's uint8 takes extui); the load from a column slice
        # of the stage (whole 64-byte swizzle tiles, stage_transforms); the f16 path's integer add in place of
        # an or.
        w = kv_quant.GROUP
        return [(gi * w, _levels(_upcast(src if len(pairs) == 1 else src.at[:, pl.ds(gi * w, w)], interpret), 128,
                                 -0.5, rows[sc], rows[cc], math))
                for gi, (sc, cc) in enumerate(pairs)]
    h = src.shape[1]                                       # D / 2
    u = _upcast(src, interpret)
    return [(half * h, _levels(codes, 0, kv_quant.INT4_HALF, rows[pairs[half][0]], rows[pairs[half][1]], math))
            for half, codes in enumerate((u & 15, u >> 4))]


def dequant_tile(fmt: str, src, dst, rows: dict, pairs, interpret: bool) -> None:
    """Stored stage tile `src` -> `dst` [rows, D] (bf16: the arithmetic in f32; f16: in f16), `dequant_values`
    stored part by part (int8's groups and int4's halves as column slices: whole swizzle tiles, deq_transforms)."""
    math = jnp.float16 if dst.dtype == jnp.float16 else jnp.float32
    parts = dequant_values(fmt, src, rows, pairs, interpret, math)
    for c0, x in parts:
        if len(parts) == 1:
            dst[...] = x.astype(dst.dtype)
        else:
            dst[:, pl.ds(c0, x.shape[1])] = x.astype(dst.dtype)


def dequant_block(fmt: str, src, dst, aux, pairs, interpret: bool, chunk: int = 64) -> None:
    """`dequant_tile` over a whole stage, `chunk` rows at a time (a 64-row chunk of a 128-wide tile is 64 values a
    thread, where the whole tile would be 128: a dequantizing warpgroup shares the registers with three others)."""
    cols = pair_columns(pairs)
    for r0 in range(0, src.shape[0], chunk):
        rows = load_rows(aux.at[pl.ds(r0, chunk)], cols, interpret)
        dequant_tile(fmt, src.at[pl.ds(r0, chunk)], dst.at[pl.ds(r0, chunk)], rows, pairs, interpret)


class Dequant:
    """A kernel's quantized-K/V state: the format, the aux stages and the two bf16 tiles (None: bfloat16 cache,
    every method a no-op that hands back the stage buffer itself)."""

    def __init__(self, fmt: str, head_dim: int, scratch, interpret: bool):
        self.fmt, self.head_dim, self.interpret = fmt, head_dim, interpret
        self.on = fmt != "bfloat16"
        self.aux_s, self.k_deq, self.v_deq = scratch if self.on else (None, None, None)
        self.k_pairs = aux_columns(fmt, head_dim, "k") if self.on else []
        self.v_pairs = aux_columns(fmt, head_dim, "v") if self.on else []

    def rows(self, slot, which: str = "kv") -> dict:
        """K's and V's per-row parameters of stage `slot` ("k" or "v": one of them; one aux load a block; call after
        K arrived)."""
        if not self.on:
            return {}
        pairs = {"k": self.k_pairs, "v": self.v_pairs, "kv": self.k_pairs + self.v_pairs}[which]
        return load_rows(self.aux_s.at[slot], pair_columns(pairs), self.interpret)

    def k(self, k_stage, rows):
        if not self.on:
            return k_stage
        dequant_tile(self.fmt, k_stage, self.k_deq, rows, self.k_pairs, self.interpret)
        plgpu.commit_smem()                    # generic-proxy stores, read next by wgmma
        return self.k_deq

    def v(self, v_stage, rows):
        if not self.on:
            return v_stage
        dequant_tile(self.fmt, v_stage, self.v_deq, rows, self.v_pairs, self.interpret)
        plgpu.commit_smem()
        return self.v_deq
