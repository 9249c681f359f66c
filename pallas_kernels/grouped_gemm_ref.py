"""Pure-jnp reference of the grouped (ragged) GEMM: one dense GEMM per group, rows selected by mask."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def group_ids(group_sizes: Int[Array, "E"], m: int) -> Int[Array, "M"]:
    """The group of each of `m` rows (groups are consecutive row ranges); E for rows past the last group."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")


def grouped_gemm_ref(x: Float[Array, "M K"], w: Float[Array, "E K N"],
                     group_sizes: Int[Array, "E"]) -> Float[Array, "M N"]:
    """y[r] = x[r] @ w[g(r)] in f32, out in x's dtype; rows past the groups are 0 (as `jax.lax.ragged_dot`)."""
    gid = group_ids(group_sizes, x.shape[0])
    xf = x.astype(jnp.float32)
    y = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for e in range(w.shape[0]):
        y = jnp.where((gid == e)[:, None], xf @ w[e].astype(jnp.float32), y)
    return y.astype(x.dtype)
