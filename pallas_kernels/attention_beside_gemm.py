"""Decode attention and a GEMM in ONE kernel, split by CTA (horizontal fusion). Pallas Mosaic GPU.

NanoFlow overlaps a memory-bound op (decode attention) with a compute-bound one (a GEMM of other tokens) by
giving each a share of the SMs. With two kernels on two streams that depends on XLA's scheduler issuing them
together, which it does not do for our step programs (docs/design.md section 4). Here one launch holds both:
CTAs [0, A) run the positions-as-rows decode attention (paged_decode_swapped.attention_kernel) over all
of its work items, CTAs [A, A + G) run the persistent GEMM (persistent_gemm.gemm_kernel) over all of its
tiles. A and G are the resource shares (a NanoFlow plan's) as CTA counts. With `spread=True` (the default) the attention
CTAs are instead every (A + G) / A-th grid index rather than a block of consecutive CTAs: 3-11% faster in
all six pairs of bench/results/decode_share-spread-fused-20261123.json. Each branch allocates its own SMEM and
barriers (`run_scoped`, shared by the CTA's warpgroups), so the CTA needs the larger of the two, not the sum.
The CTA has max(2, GEMM warpgroups) warpgroups; warpgroups a branch does not use idle.

Both bodies are the kernels' own code, so correctness follows their tests. The CPU interpreter cannot run
this kernel (its `run_scoped` branches close over the kernel's refs), so its test cross-lowers it for CUDA;
`bench/kernels/decode_share.py --fused-only` compares its outputs with the two kernels run separately on the device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._compat import mosaic_gpu_interpret_params, num_sms
from pallas_kernels._mgpu import compiler_params
from pallas_kernels import paged_decode_swapped as swapped
from pallas_kernels.paged_decode_swapped import attention_kernel
from pallas_kernels._swapped_operands import finish, out_types, prepare
from pallas_kernels.persistent_gemm import DEFAULT_CONFIG, NUM_WGS, TILE_CONFIGS, TileConfig, cdiv, gemm_kernel, \
    gemm_scratch


def gemm_fits(x_shape, w_shapes, cfg: TileConfig) -> bool:
    """Shapes the fused kernel takes without padding: M % 8 == 0 and M >= block_m, K % block_k == 0, every N a
    multiple of block_n (the Llama MLP projections at M >= 128)."""
    m, k = x_shape
    return (m % 8 == 0 and m >= cfg.block_m and k % cfg.block_k == 0
            and all(k2 == k and n % cfg.block_n == 0 for k2, n in w_shapes))


def cta_role(pid, attn_ctas: int, total: int, spread: bool):
    """(is attention, index among the attention CTAs, index among the GEMM CTAs) of grid index pid
    (a traced or plain int). Attention holds [0, A), or with `spread` every grid index where floor(p * A / total)
    steps up."""
    def before(p):          # attention CTAs among grid indices [0, p)
        return (p * attn_ctas) // total if spread else jnp.minimum(p, attn_ctas)
    a = before(pid)
    return before(pid + 1) > a, a, pid - a


@functools.partial(jax.jit, static_argnames=("scale", "attn_ctas", "gemm_ctas", "num_splits", "block_kv",
                                             "num_stages", "config", "spread", "interpret", "dequant_wgs", "act"),
                   inline=True)
def decode_attention_beside_gemm(q: Float[Array, "B H D"], k_cache: Float[Array, "L N PS KH D"],
                                 v_cache: Float[Array, "L N PS KH D"], layer: Int[Array, ""],
                                 page_table: Int[Array, "B P"], seq_lens: Int[Array, "B"],
                                 x: Float[Array, "M K"], w, *, scale: float,
                                 attn_ctas: int, gemm_ctas: int | None = None,
                                 num_splits: int | None = None, block_kv: int = 128, num_stages: int | None = None,
                                 config: TileConfig | str = DEFAULT_CONFIG, spread: bool = True,
                                 interpret: bool = False, aux_cache=None, dequant_wgs: int | None = None,
                                 act: str | None = None) -> tuple[Float[Array, "B H D"], Float[Array, "M N"] | tuple]:
    """(paged_decode_attention_swapped(q, ...), x @ w) from one launch of attn_ctas + gemm_ctas
    CTAs (gemm_ctas=None: the rest of the SMs). `w` may be a tuple of [K, N_i] weights (then x @ w_i
    for each, one GEMM over them side by side: the MLP's gate and up projections). `aux_cache`: a quantized
    cache (kv_quant.py), read by the attention CTAs as the decode kernel reads it on its own (fp8's and int8's K by
    wgmmas against the query's parts, V by a dequantizing warpgroup; `paged_decode_swapped.kernel_options`) with at
    most one dequantizer (`dequant_wgs` None: 1; 0: the consumer dequantizes, the first version). `num_stages`
    None: the decode kernel's choice.
    `act="swiglu"` (one weight, its gate and up columns interleaved in blocks of half a tile): the GEMM's result is
    silu(gate) * up, [M, N / 2] (persistent_gemm.gemm_kernel's epilogue)."""
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    cfg = TILE_CONFIGS[config] if isinstance(config, str) else config
    cfg.check()
    if not gemm_fits(x.shape, [w_i.shape for w_i in ws], cfg):
        raise ValueError(f"x {x.shape} @ w {[w_i.shape for w_i in ws]}: the fused kernel needs M % 8 == 0, "
                         f"M >= {cfg.block_m}, K % {cfg.block_k} == 0 and each N % {cfg.block_n} == 0")
    if act and len(ws) != 1:
        raise ValueError(f"act={act!r} takes one interleaved gate/up weight, got {len(ws)}")
    m, n = x.shape[0], sum(w_i.shape[1] for w_i in ws)
    gp_ = gemm_ctas or max(1, num_sms() - attn_ctas)
    gp_ = min(gp_, cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n))
    # at most one dequantizer: a fourth warpgroup would idle in the GEMM CTAs and halve their registers. An fp8
    # cache once took the consumer's dequantizing here, 4-10x the halves' time (docs/design.md section 5)
    if dequant_wgs not in (None, 0, 1):
        raise ValueError(f"dequant_wgs={dequant_wgs}: the fused kernel takes at most one dequantizing warpgroup")
    opts = swapped.kernel_options(q, k_cache, aux_cache, num_ctas=attn_ctas, num_stages=num_stages,
                                  dequant_wgs=1 if dequant_wgs is None else dequant_wgs)    # 0 on a bf16 cache
    na = opts.dequant_wgs
    qr, ns, attn_scratch, extra = prepare(q, k_cache, num_ctas=attn_ctas, num_splits=num_splits, block_kv=block_kv,
                                          aux_cache=aux_cache, **opts.prepare_kwargs())
    kvh = k_cache.shape[3]
    a_prog, nw = attn_ctas, len(ws)

    total = a_prog + gp_

    def body(params, lens, pt, qr_hbm, k_hbm, v_hbm, *rest):
        aux_hbm, rest = (rest[0], rest[1:]) if aux_cache is not None else (None, rest)
        qs_hbm, rest = (rest[0], rest[1:]) if opts.query_parts else (None, rest)
        x_hbm, rest = rest[0], rest[1:]
        w_hbm, (o_hbm, lse_hbm), y_hbm = rest[:nw], rest[nw:nw + 2], rest[nw + 2:]
        pid = lax.axis_index("p")
        is_attn, a_idx, g_idx = cta_role(pid, a_prog, total, spread)

        @pl.when(is_attn)
        def _():
            pl.run_scoped(lambda *s: attention_kernel(params, lens, pt, qr_hbm, k_hbm, v_hbm, o_hbm, lse_hbm, *s,
                                                      num_kv_heads=kvh, num_splits=ns, num_ctas=a_prog,
                                                      scale=scale, interpret=interpret, cta=a_idx,
                                                      aux_hbm=aux_hbm, qscale_hbm=qs_hbm, **opts.kernel_kwargs()),
                          *attn_scratch, collective_axes="wg")

        @pl.when(jnp.logical_not(is_attn))
        def _():
            pl.run_scoped(lambda *s: gemm_kernel(x_hbm, w_hbm, y_hbm, *s, cfg=cfg, num_ctas=gp_,
                                                 cta=g_idx, act=act),
                          *gemm_scratch(cfg, x.dtype), collective_axes="wg")

    o_t, lse, *ys = plgpu.kernel(
        body, out_type=(*out_types(q, kvh, ns), *(jax.ShapeDtypeStruct((m, w_i.shape[1] // (2 if act else 1)), x.dtype)
                                                  for w_i in ws)),
        grid=(total,), grid_names=("p",), num_threads=max(2 + na, NUM_WGS + int(cfg.producer)),
        thread_name="wg", compiler_params=compiler_params(),
        interpret=mosaic_gpu_interpret_params() if interpret else None,
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), qr,
      k_cache, v_cache, *(() if aux_cache is None else (aux_cache,)), *extra, x, *ws)
    attn = finish(o_t, lse, q.shape, kvh, ns).astype(q.dtype)
    return attn, (tuple(ys) if isinstance(w, (tuple, list)) else ys[0])
