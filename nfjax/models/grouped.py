"""Grouped (ragged) GEMM ops of a MoE layer: rows sorted by expert times each expert's weight.

On a GPU with 16-bit weights: the persistent Pallas grouped GEMM (pallas_kernels/grouped_gemm.py) on
`num_ctas` CTAs (None: every SM), its groups padded to its tile height (`group_alignment`, which the router's
layout reads). Elsewhere (CPU, f32): XLA's `jax.lax.ragged_dot`, unpadded groups. XLA lowers ragged_dot on
CPU to a masked dense dot over all experts (E times the FLOPs; fine for tests, not a GPU path).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from nfjax.compat import on_gpu


def use_pallas(dtype) -> bool:
    return on_gpu() and jnp.dtype(dtype).itemsize == 2


def group_alignment(dtype) -> int:
    """Rows each expert's group is padded to in the sorted layout (1: none)."""
    if not use_pallas(dtype):
        return 1
    from pallas_kernels.grouped_gemm import group_alignment as kernel_alignment
    return kernel_alignment()


def swiglu_block() -> int:
    """The column block the experts' joined gate/up weight alternates gate and up in (nfjax/models/fused.py): the
    kernel's, half its tile width, so each tile holds matching gate and up columns and writes silu(gate) * up."""
    from pallas_kernels.grouped_gemm import swiglu_block as kernel_block
    return kernel_block()


def grouped_swiglu(x: Float[Array, "R K"], w: Float[Array, "E K N"], group_sizes: Int[Array, "E"], block: int,
                   num_ctas: int | None = None) -> Float[Array, "R H"]:
    """silu(x @ gate[e]) * (x @ up[e]) for the rows of group e, w's columns interleaving gate and up in blocks of
    `block`: on the Pallas path in the GEMM's epilogue (no [R, N] array), elsewhere de-interleaved after it."""
    from nfjax.models.llama import swiglu
    from pallas_kernels.grouped_gemm_ref import deinterleave
    fits = block == swiglu_block() and w.shape[2] % (2 * block) == 0 and x.shape[1] % 64 == 0
    if use_pallas(w.dtype) and x.dtype == w.dtype and fits:
        from pallas_kernels.grouped_gemm import grouped_gemm
        return grouped_gemm(x, w, group_sizes, num_ctas=num_ctas, act="swiglu")
    return swiglu(*deinterleave(grouped_matmul(x, w, group_sizes, num_ctas), block))


def grouped_matmul(x: Float[Array, "R K"], w: Float[Array, "E K N"], group_sizes: Int[Array, "E"],
                   num_ctas: int | None = None) -> Float[Array, "R N"]:
    """y[r] = x[r] @ w[e] for the rows of group e (f32 accumulation, x's dtype out)."""
    if use_pallas(w.dtype) and x.dtype == w.dtype:
        from pallas_kernels.grouped_gemm import grouped_gemm
        return grouped_gemm(x, w, group_sizes, num_ctas=num_ctas)
    return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)
