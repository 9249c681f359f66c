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


def grouped_matmul(x: Float[Array, "R K"], w: Float[Array, "E K N"], group_sizes: Int[Array, "E"],
                   num_ctas: int | None = None) -> Float[Array, "R N"]:
    """y[r] = x[r] @ w[e] for the rows of group e (f32 accumulation, x's dtype out)."""
    if use_pallas(w.dtype) and x.dtype == w.dtype:
        from pallas_kernels.grouped_gemm import grouped_gemm
        return grouped_gemm(x, w, group_sizes, num_ctas=num_ctas)
    return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)
