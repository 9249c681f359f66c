"""Persistent bf16 GEMM y = x @ w (f32 accumulation, bf16 out). Pallas Mosaic GPU (Hopper, wgmma).

The grid is `num_ctas` persistent CTAs; output tile t is computed by CTA t % P. That count
is NanoFlow's resource share: with P < #SMs the GEMM leaves SMs free for a kernel on another stream.

Tiling: a CTA tile is block_m x block_n; W = 2 consumer warpgroups each own block_m / 2 rows of it (their
accumulator, block_m / 2 x block_n f32, lives in registers) and share the B tile. With `split_n` they split the
columns instead: each owns block_n / 2 columns of all block_m rows and shares the A tile, which allows 64-row tiles
(a warpgroup's wgmma is 64 rows at least; the grouped GEMM pads each expert's rows to a multiple of block_m). At
Mixtral's decode sizes on an H200 the 64-row tiles were within -9% / +4% of the 128-row ones, so no model uses them
(docs/design.md section 15); the config stays for the kernel benches. K streams through SMEM in
block_k slabs `stages` deep with TMA copies. The stream of (tile, k-step) pairs of one CTA is ONE
pipeline: the copies of the next tile's first slabs are in flight while the current tile's epilogue runs.
Each consumer keeps one wgmma in flight: after issuing step s it waits for step s - 1 and releases that slot.
Who refills a released slot: with `producer=True` a third warpgroup (few registers) does only TMA issue
(warp specialisation); otherwise consumer 0 issues after both consumers released the slot.
Epilogue: registers -> bf16 -> SMEM -> TMA store, `epi_cols` columns at a time (a narrower epilogue buffer
leaves SMEM for a deeper pipeline).

Tile order: tiles are numbered in groups of `group_m` M-tiles, M fastest inside a group, so the CTAs
running at one time share the same few w column blocks (w is the large operand here; x stays in L2).

Ragged sizes: TMA offsets into a tiled SMEM layout must be multiples of the tile (8 rows, 64 columns), and
we avoid out-of-bounds boxes altogether. The last M (N) tile is shifted back to end at M (N): it overlaps its
neighbour, which recomputes and rewrites identical values (same inputs, same k order), so no clipping is
needed and the CPU interpreter computes exactly what the GPU does. The wrapper pads only when it must:
M to a multiple of 8 and at least block_m (x is small), K to a multiple of block_k and N to a multiple of 64
and at least block_n (these copy w: a slow path the Llama shapes never take).

Interpret mode (CPU, tests) runs this same code: both wgmma operands are plain (untransposed) SMEM tiles and
no layout casts are used, which the jax 0.10.2 Mosaic GPU interpreter supports; it runs wgmma synchronously.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._compat import mosaic_gpu_interpret_params, num_sms
from pallas_kernels._mgpu import cdiv, compiler_params, smem_tile_transforms

SMEM_BYTES = 227 * 1024      # Hopper's opt-in shared memory per block (what Mosaic GPU checks against)
NUM_WGS = 2                  # consumer warpgroups per CTA


class TileConfig(NamedTuple):
    """Static kernel configuration (hashable: usable as a jit static argument)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64        # 64 bf16 = one 128-byte swizzle row: wgmma's K granule for 16-bit operands
    stages: int = 4
    group_m: int = 16        # M-tiles per tile group (>= M / block_m: all M tiles of a column block together)
    producer: bool = True    # a dedicated TMA warpgroup (warp specialisation)
    epi_cols: int = 128      # epilogue columns per SMEM round trip (a warpgroup's columns: one round)
    split_n: bool = False    # the consumer warpgroups split the tile's columns, not its rows

    @property
    def wg_rows(self) -> int:
        """Rows of a consumer warpgroup's accumulator (and of each A box)."""
        return self.block_m if self.split_n else self.block_m // NUM_WGS

    @property
    def wg_cols(self) -> int:
        """Columns of a consumer warpgroup's accumulator (and of each B box)."""
        return self.block_n // NUM_WGS if self.split_n else self.block_n

    def smem_bytes(self, itemsize: int = 2) -> int:
        stage = (self.block_m + self.block_n) * self.block_k * itemsize
        return self.stages * stage + NUM_WGS * self.wg_rows * self.epi_cols * itemsize

    def check(self):
        rows, cols = self.wg_rows, self.wg_cols
        if rows % 64 or cols % 64 or cols > 256 or self.block_k % 64:
            raise ValueError(f"{self}: need a warpgroup's rows and columns multiples of 64 (columns <= 256) and "
                             "block_k % 64 == 0")
        if rows * cols > 128 * 128:
            raise ValueError(f"{self}: a warpgroup's f32 accumulator over 128 registers per thread")
        if cols % self.epi_cols or self.epi_cols % 64:
            raise ValueError(f"{self}: epi_cols must divide a warpgroup's columns and be a multiple of 64")
        if self.smem_bytes() > SMEM_BYTES - 1024:
            raise ValueError(f"{self}: {self.smem_bytes()} bytes of SMEM > {SMEM_BYTES - 1024}")


TILE_CONFIGS = {
    "128x256_s4_ws": TileConfig(128, 256, 64, 4, 16, True, 128),
    "128x256_s3": TileConfig(128, 256, 64, 3, 16, False, 256),
    "128x128_s5_ws": TileConfig(128, 128, 64, 5, 16, True, 128),
    "256x128_s4_ws": TileConfig(256, 128, 64, 4, 8, True, 64),
    "64x256_s5_ws_n": TileConfig(64, 256, 64, 5, 16, True, 64, split_n=True),
}
DEFAULT_CONFIG = "128x256_s4_ws"


def persistent_gemm_ref(x: Float[Array, "M K"], w: Float[Array, "K N"]) -> Float[Array, "M N"]:
    """Pure-jnp reference: f32 math, output in x's dtype."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)).astype(x.dtype)


def tile_origin(t, *, m: int, n: int, block_m: int, block_n: int, group_m: int):
    """Row and column offsets (m0, n0) of output tile t in the grouped order (works on traced int32 and
    outside kernels). The last tile of each dimension is shifted back to end at the array's edge."""
    tm_n, tn_n = cdiv(m, block_m), cdiv(n, block_n)
    per_group = group_m * tn_n
    first_m = lax.div(t, per_group) * group_m
    gsz = jnp.minimum(tm_n - first_m, group_m)
    r = lax.rem(t, per_group)
    tm = first_m + lax.rem(r, gsz)
    tn = lax.div(r, gsz)
    return jnp.minimum(tm * block_m, m - block_m), jnp.minimum(tn * block_n, n - block_n)


class TileGrid(NamedTuple):
    """Which output tiles a kernel computes (a grouped GEMM's differ from the dense one's): `num_tiles` (a
    traced scalar is fine), `origin(t) -> (m0, n0)`, and `weight(w_hbm, t) -> the [K, N] weight of tile t`."""
    num_tiles: object
    origin: object
    weight: object


def swiglu_tile(acc, dtype):
    """[rows, 2h] f32 tile of [gate | up] columns -> silu(gate) * up [rows, h] in f32, rounded as the unfused
    path rounds (nfjax.models.llama.swiglu on the GEMM's `dtype` outputs): gate and up to `dtype`, the silu in f32
    to `dtype`, their product."""
    h = acc.shape[1] // 2
    g = acc[:, :h].astype(dtype).astype(jnp.float32)
    u = acc[:, h:].astype(dtype).astype(jnp.float32)
    s = (g / (1.0 + jnp.exp(-g))).astype(dtype).astype(jnp.float32)
    return s * u


def check_act_shape(act: str | None, n: int, k_dim: int, cfg: TileConfig) -> None:
    """An epilogue activation reads whole tiles of the weight's [gate | up] columns: N and K unpadded."""
    if act and (n % cfg.block_n or k_dim % cfg.block_k):
        raise ValueError(f"act={act!r} needs N={n} a multiple of block_n={cfg.block_n} and K={k_dim} of block_k")


def gemm_kernel(x_hbm, w_hbm, o_hbm, a_s, b_s, o_s, full, consumed, *, cfg: TileConfig, num_ctas: int,
                cta=None, grid: TileGrid | None = None, act: str | None = None):
    """The kernel body, run by `num_ctas` CTAs; `cta` is this one's index among them (None:
    the grid index; a fused kernel gives other CTAs other work). `w_hbm`/`o_hbm` may be equal-length
    tuples: x @ w_i -> o_i for each i, as one GEMM over the weights side by side (each N_i a multiple of
    block_n, so no tile straddles two). `grid`: the tiles (None: every tile of x @ w, grouped order; see
    pallas_kernels/grouped_gemm.py for the other). `act="swiglu"`: each tile's columns are [gate | up] halves and
    the tile writes silu(gate) * up, block_n / 2 columns at column n0 / 2 of `o_hbm` (one weight, not split_n)."""
    ws = w_hbm if isinstance(w_hbm, tuple) else (w_hbm,)
    if act not in (None, "swiglu") or (act and (len(ws) > 1 or cfg.split_n or (cfg.wg_cols // 2) % cfg.epi_cols)):
        raise ValueError(f"act {act!r}: None, or 'swiglu' over one weight with split_n off and epi_cols dividing "
                         f"half a tile's columns ({cfg})")
    os_ = o_hbm if isinstance(o_hbm, tuple) else (o_hbm,)
    bounds = [0]
    for w_i in ws:
        bounds.append(bounds[-1] + w_i.shape[1])
    if len(ws) > 1 and any(w_i.shape[1] % cfg.block_n for w_i in ws):
        raise ValueError(f"several weights need N multiples of block_n={cfg.block_n}: {[w.shape for w in ws]}")
    m, k_dim = x_hbm.shape
    n = bounds[-1]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    rows, cols = cfg.wg_rows, cfg.wg_cols
    a_boxes = 1 if cfg.split_n else NUM_WGS          # A boxes a stage (one per consumer, or one shared)
    k_steps = k_dim // bk
    pid = lax.axis_index("p") if cta is None else cta
    wg = lax.axis_index("wg")
    if grid is None:
        grid = TileGrid(cdiv(m, bm) * cdiv(n, bn),
                        functools.partial(tile_origin, m=m, n=n, block_m=bm, block_n=bn, group_m=cfg.group_m),
                        lambda w_i, t: w_i)
    num_tiles, origin = grid.num_tiles, grid.origin
    n_mine = lax.div(num_tiles - pid + (num_ctas - 1), num_ctas)
    total = n_mine * k_steps          # (tile, k-step) pairs this CTA streams through the stages

    def issue(s, slot):
        t = pid + lax.div(s, k_steps) * num_ctas
        m0, n0 = origin(t)
        k0 = lax.rem(s, k_steps) * bk
        for i in range(a_boxes):      # untransposed [rows, bk] A boxes: one per consumer (split_n: one shared)
            plgpu.copy_gmem_to_smem(x_hbm.at[pl.ds(m0 + i * rows, rows), pl.ds(k0, bk)], a_s.at[slot, i],
                                    full.at[slot])
        for i in range(NUM_WGS + 1 - a_boxes):      # [bk, cols] B boxes: one shared (split_n: one per consumer)
            for_weight(n0, lambda w_i, o_i, n_i, i=i: plgpu.copy_gmem_to_smem(
                grid.weight(w_i, t).at[pl.ds(k0, bk), pl.ds(n_i + i * cols, cols)], b_s.at[slot, i],
                full.at[slot]))

    def for_weight(n0, fn):
        """fn(w_i, o_i, column in w_i) for the weight holding virtual column n0."""
        if len(ws) == 1:
            fn(ws[0], os_[0], n0)
            return
        for w_i, o_i, lo, hi in zip(ws, os_, bounds, bounds[1:]):
            pl.when((n0 >= lo) & (n0 < hi))(lambda w_i=w_i, o_i=o_i, lo=lo: fn(w_i, o_i, n0 - lo))

    def drain():
        # Observe the `consumed` completions no refill waited for (the last stages): every completion of a
        # barrier must be awaited by the thread that waits on it.
        def body(s, c):
            plgpu.barrier_wait(consumed.at[lax.rem(s, stages)])
            return c
        lax.fori_loop(jnp.maximum(total - stages, 0), total, body, None)

    def release(s):
        """Step s's wgmmas are complete in this warpgroup: hand its slot back (and refill it, no producer)."""
        slot = lax.rem(s, stages)
        plgpu.barrier_arrive(consumed.at[slot])
        if not cfg.producer:
            @pl.when((wg == 0) & (s + stages < total))
            def _():
                plgpu.barrier_wait(consumed.at[slot])     # the other consumer is done with it too
                issue(s + stages, slot)

    def consumer():
        def tile(t, carry):
            m0, n0 = origin(pid + t * num_ctas)
            s0 = t * k_steps

            def acc_scope(acc_ref):
                def kstep(kk, c):
                    s = s0 + kk
                    slot = lax.rem(s, stages)
                    plgpu.barrier_wait(full.at[slot])
                    if cfg.split_n:
                        plgpu.wgmma(acc_ref, a_s.at[slot, 0], b_s.at[slot, wg])
                    else:
                        plgpu.wgmma(acc_ref, a_s.at[slot, wg], b_s.at[slot, 0])
                    plgpu.wgmma_wait(1)                   # step s - 1 is done reading its slot
                    pl.when(kk > 0)(lambda: release(s - 1))
                    return c
                lax.fori_loop(0, k_steps, kstep, None)
                return acc_ref[...]                       # waits for the last wgmma
            acc = pl.run_scoped(acc_scope, plgpu.ACC((rows, cols), jnp.float32))
            release(s0 + k_steps - 1)
            mine = o_s.at[wg]
            r0 = m0 if cfg.split_n else m0 + wg * rows
            c0 = wg * cols if cfg.split_n else 0
            out_cols = cols
            if act == "swiglu":
                acc, out_cols = swiglu_tile(acc, mine.dtype), cols // 2
            for c in range(out_cols // cfg.epi_cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous store has left the buffer
                mine[...] = acc[:, c * cfg.epi_cols:(c + 1) * cfg.epi_cols].astype(mine.dtype)
                plgpu.commit_smem()
                if act:
                    plgpu.copy_smem_to_gmem(mine, os_[0].at[pl.ds(r0, rows),
                                                             pl.ds(lax.div(n0, 2) + c * cfg.epi_cols, cfg.epi_cols)])
                    continue
                for_weight(n0, lambda w_i, o_i, n_i, c=c: plgpu.copy_smem_to_gmem(
                    mine, o_i.at[pl.ds(r0, rows), pl.ds(n_i + c0 + c * cfg.epi_cols, cfg.epi_cols)]))
            return carry
        lax.fori_loop(0, n_mine, tile, None)
        plgpu.wait_smem_to_gmem(0)

    def producer():
        def body(s, c):
            slot = lax.rem(s, stages)
            pl.when(s >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
            issue(s, slot)
            return c
        lax.fori_loop(0, total, body, None)
        drain()

    if cfg.producer:
        @pl.when(wg == NUM_WGS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            producer()

        @pl.when(wg < NUM_WGS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            consumer()
    else:
        @pl.when(wg == 0)
        def _():     # fill the pipeline (a loop, not unrolled: keeps the interpreter's traced code small)
            lax.fori_loop(0, jnp.minimum(total, stages), lambda i, c: issue(i, i), None)
        consumer()
        pl.when(wg == 0)(drain)


def gemm_scratch(cfg: TileConfig, dtype) -> list:
    """SMEM stages, epilogue buffer and barriers of `gemm_kernel`."""
    tf = smem_tile_transforms(dtype)
    stages, rows, cols = cfg.stages, cfg.wg_rows, cfg.wg_cols
    a_boxes = 1 if cfg.split_n else NUM_WGS
    return [plgpu.SMEM((stages, a_boxes, rows, cfg.block_k), dtype, transforms=tf),
            plgpu.SMEM((stages, NUM_WGS + 1 - a_boxes, cfg.block_k, cols), dtype, transforms=tf),
            plgpu.SMEM((NUM_WGS, rows, cfg.epi_cols), dtype, transforms=tf),
            plgpu.Barrier(num_arrivals=NUM_WGS + 1, num_barriers=stages),   # A boxes + B box
            plgpu.Barrier(num_arrivals=NUM_WGS, num_barriers=stages)]      # one per consumer


@functools.partial(jax.jit, static_argnames=("num_ctas", "config", "act", "interpret"), inline=True)
def persistent_gemm(x: Float[Array, "M K"], w: Float[Array, "K N"], *, num_ctas: int | None = None,
                    config: TileConfig | str = DEFAULT_CONFIG, act: str | None = None,
                    interpret: bool = False) -> Float[Array, "M N"]:
    """y = x @ w (bf16 in, f32 accumulation, x.dtype out) on `num_ctas` persistent CTAs (None: one per
    SM). `config`: a TileConfig or a name in TILE_CONFIGS. See the module doc for tiling and padding.
    `act="swiglu"`: w's columns interleave gate and up in blocks of block_n / 2 (N a multiple of block_n) and the
    result is silu(gate) * up, [M, N / 2], with no [M, N] array written (`gemm_kernel`)."""
    cfg = TILE_CONFIGS[config] if isinstance(config, str) else config
    cfg.check()
    m, k_dim = x.shape
    k2, n = w.shape
    if k_dim != k2:
        raise ValueError(f"x {x.shape} @ w {w.shape}: contraction sizes differ")
    if x.dtype != w.dtype or jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"need matching 16-bit dtypes, got {x.dtype} and {w.dtype}")
    check_act_shape(act, n, k_dim, cfg)
    mp = max(cdiv(m, 8) * 8, cfg.block_m)
    kp = cdiv(k_dim, cfg.block_k) * cfg.block_k
    np_ = max(cdiv(n, 64) * 64, cfg.block_n)
    if (mp, kp) != (m, k_dim):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k_dim)))
    if (kp, np_) != (k_dim, n):
        w = jnp.pad(w, ((0, kp - k_dim), (0, np_ - n)))
    num_tiles = cdiv(mp, cfg.block_m) * cdiv(np_, cfg.block_n)
    progs = min(num_ctas or num_sms(), num_tiles)

    y = plgpu.kernel(
        functools.partial(gemm_kernel, cfg=cfg, num_ctas=progs, act=act),
        out_type=jax.ShapeDtypeStruct((mp, np_ // 2 if act else np_), x.dtype),
        scratch_types=gemm_scratch(cfg, x.dtype),
        grid=(progs,), grid_names=("p",), num_threads=NUM_WGS + int(cfg.producer), thread_name="wg",
        compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None,
    )(x, w)
    n_out = n // 2 if act else n
    return y if y.shape == (m, n_out) else y[:m, :n_out]
