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


def deinterleave(y: Float[Array, "M N"], block: int) -> tuple[Float[Array, "M H"], Float[Array, "M H"]]:
    """(gate, up) from columns interleaved in blocks of `block`: [gate 0 | up 0 | gate 1 | up 1 | ...]."""
    m, n = y.shape
    z = y.reshape(m, n // (2 * block), 2, block)
    return z[:, :, 0].reshape(m, n // 2), z[:, :, 1].reshape(m, n // 2)


def interleave(gate: Float[Array, "... H"], up: Float[Array, "... H"], block: int) -> Float[Array, "... N"]:
    """`deinterleave`'s inverse along the last axis."""
    *lead, h = gate.shape
    z = jnp.stack([gate.reshape(*lead, h // block, block), up.reshape(*lead, h // block, block)], axis=-2)
    return z.reshape(*lead, 2 * h)
