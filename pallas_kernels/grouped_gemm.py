"""Grouped (ragged) bf16 GEMM for mixture-of-experts layers: rows sorted by expert, y[r] = x[r] @ w[e(r)].
Pallas Mosaic GPU (Hopper, wgmma); one persistent kernel over all experts.

Layout. Rows of x come sorted by group (expert) and each group is padded to a multiple of the kernel's block_m
(the model's router lays tokens out so: nfjax/models/moe_routing.py). Then every block_m-row tile belongs to one
expert and every tile's output rows can be written with whole TMA boxes: no masking, no clipping. Rows after
the last group (the layout's static tail) are not computed and not written.

The kernel is the dense persistent GEMM's body (pallas_kernels/persistent_gemm.py: the same stages, warp
specialisation, epilogue, `num_ctas` knob = NanoFlow's resource share) over another tile grid: the valid tiles
are (M tile of a group) x (N tile), numbered in groups of `group_m` M-tiles as the dense kernel's, and each
tile's B slabs come from its expert's weight `w[e]`. The tile -> expert table and the number of valid M tiles
are computed by XLA before the launch (a cumulative sum over E group sizes) and read by the kernel from GMEM.
CTAs whose share of the (data-dependent) tile count is empty exit at once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._compat import mosaic_gpu_interpret_params, num_sms
from pallas_kernels._mgpu import cdiv, compiler_params
from pallas_kernels.grouped_gemm_ref import grouped_gemm_ref  # noqa: F401  (re-exported beside the kernel)
from pallas_kernels.persistent_gemm import (DEFAULT_CONFIG, NUM_WGS, TILE_CONFIGS, TileConfig, TileGrid,
                                            check_act_shape, gemm_kernel, gemm_scratch)


def group_alignment(config: TileConfig | str = DEFAULT_CONFIG) -> int:
    """The row multiple each group must be padded to for `grouped_gemm` with `config`."""
    return (TILE_CONFIGS[config] if isinstance(config, str) else config).block_m


def tile_table(group_sizes: Int[Array, "E"], m: int, block_m: int, tiles_n: int) -> Int[Array, "1+MT"]:
    """[number of valid tiles, expert of M tile 0, expert of M tile 1, ...] (E past the last group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = jnp.arange(m // block_m, dtype=jnp.int32) * block_m
    # compare_all: one fused E x MT compare; the default method is a while loop (log2 E iterations of small
    # kernels, serial launches in every MoE layer: 4 loops in a 4-layer program compiled for an H200)
    expert = jnp.searchsorted(ends, starts, side="right", method="compare_all").astype(jnp.int32)
    valid_m = jnp.minimum(ends[-1], m) // block_m
    return jnp.concatenate([(valid_m * tiles_n)[None], expert])


def grouped_tile_grid(table_hbm, *, n: int, block_m: int, block_n: int, group_m: int) -> TileGrid:
    """The kernel's tiles: t -> (m0, n0) over the valid M tiles only (their count is table[0] / N tiles), in
    groups of `group_m` M tiles (M fastest), and the expert weight of each tile."""
    tn = cdiv(n, block_n)
    num_tiles = table_hbm[0]
    nm = lax.div(num_tiles, tn)
    per_group = group_m * tn

    def m_tile(t):
        first_m = lax.div(t, per_group) * group_m
        gsz = jnp.maximum(jnp.minimum(nm - first_m, group_m), 1)
        r = lax.rem(t, per_group)
        return first_m + lax.rem(r, gsz), lax.div(r, gsz)

    def origin(t):
        tm, tn_i = m_tile(t)
        return tm * block_m, jnp.minimum(tn_i * block_n, n - block_n)   # the last N tile shifted back

    def weight(w_hbm, t):
        return w_hbm.at[table_hbm[1 + m_tile(t)[0]]]

    return TileGrid(num_tiles, origin, weight)


def swiglu_block(config: TileConfig | str = DEFAULT_CONFIG) -> int:
    """The column block a gate/up weight interleaves its gate and up columns in for `grouped_gemm(act="swiglu")`:
    [gate 0 | up 0 | gate 1 | up 1 | ...], each block half a tile's width."""
    return (TILE_CONFIGS[config] if isinstance(config, str) else config).block_n // 2


@functools.partial(jax.jit, static_argnames=("num_ctas", "config", "act", "interpret"), inline=True)
def grouped_gemm(x: Float[Array, "M K"], w: Float[Array, "E K N"], group_sizes: Int[Array, "E"], *,
                 num_ctas: int | None = None, config: TileConfig | str = DEFAULT_CONFIG, act: str | None = None,
                 interpret: bool = False) -> Float[Array, "M N"]:
    """y[r] = x[r] @ w[e] for the rows r of group e (bf16 in, f32 accumulation, x.dtype out) on `num_ctas`
    persistent CTAs (None: one per SM). Groups are consecutive row ranges of `group_sizes` rows, each a multiple
    of `group_alignment(config)`; M must be one too. Rows past the groups are left unwritten.
    `act="swiglu"`: w's columns interleave gate and up in blocks of `swiglu_block(config)` (N a multiple of the
    tile width) and the result is silu(gate) * up, [M, N / 2], with no [M, N] array written."""
    cfg = TILE_CONFIGS[config] if isinstance(config, str) else config
    cfg.check()
    m, k_dim = x.shape
    e, k2, n = w.shape
    if k_dim != k2 or group_sizes.shape != (e,):
        raise ValueError(f"x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}: need x [M, K], w [E, K, N], "
                         "group_sizes [E]")
    if x.dtype != w.dtype or jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"need matching 16-bit dtypes, got {x.dtype} and {w.dtype}")
    if m % cfg.block_m:
        raise ValueError(f"M={m} rows must be a multiple of block_m={cfg.block_m} (groups padded to it)")
    check_act_shape(act, n, k_dim, cfg)
    kp = cdiv(k_dim, cfg.block_k) * cfg.block_k
    np_ = max(cdiv(n, 64) * 64, cfg.block_n)
    if kp != k_dim:
        x = jnp.pad(x, ((0, 0), (0, kp - k_dim)))
    if (kp, np_) != (k_dim, n):
        w = jnp.pad(w, ((0, 0), (0, kp - k_dim), (0, np_ - n)))      # copies w: shapes the models never take
    tn = cdiv(np_, cfg.block_n)
    table = tile_table(group_sizes, m, cfg.block_m, tn)
    progs = max(1, min(num_ctas or num_sms(), (m // cfg.block_m) * tn))

    def body(table_hbm, x_hbm, w_hbm, o_hbm, *scratch):
        grid = grouped_tile_grid(table_hbm, n=np_, block_m=cfg.block_m, block_n=cfg.block_n, group_m=cfg.group_m)
        gemm_kernel(x_hbm, w_hbm, o_hbm, *scratch, cfg=cfg, num_ctas=progs, grid=grid, act=act)

    y = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, np_ // 2 if act else np_), x.dtype),
        scratch_types=gemm_scratch(cfg, x.dtype),
        grid=(progs,), grid_names=("p",), num_threads=NUM_WGS + int(cfg.producer), thread_name="wg",
        compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None,
    )(table, x, w)
    return y if np_ == n else y[:, :n]
