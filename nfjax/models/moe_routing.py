"""Top-k routing and the static-shape token layout of a MoE layer (jit-friendly: no data-dependent shapes).

Each token picks k experts: T * k assignments. They are laid out sorted by expert in a buffer of a static
number of rows, each expert's rows padded to a multiple of `align` (the grouped GEMM kernel's tile height on
a GPU; 1 on the XLA path, no padding), so the grouped GEMM sees consecutive groups. `dest[t, j]` is the row
of token t's j-th assignment; padding rows copy token 0 (finite values, never read back). After the experts,
`unsort` gathers each assignment's row and sums a token's k rows weighted by its router probabilities.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def layout_rows(num_tokens: int, k: int, num_experts: int, align: int) -> int:
    """Static rows of the sorted layout: every assignment, plus the worst case of per-expert padding."""
    if align == 1:
        return num_tokens * k
    return -(-(num_tokens * k + num_experts * (align - 1)) // align) * align


def top_k_routing(logits: Float[Array, "T E"], k: int, normalize: bool) -> tuple[Float[Array, "T k"],
                                                                                  Int[Array, "T k"]]:
    """Softmax over the experts (f32), the k largest probabilities and their experts; renormalised to sum 1
    over the k when `normalize` (Mixtral always, Qwen2-MoE per norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, idx.astype(jnp.int32)


def sort_by_expert(h: Float[Array, "T D"], experts: Int[Array, "T k"], num_experts: int, align: int
                   ) -> tuple[Float[Array, "R D"], Int[Array, "E"], Int[Array, "T k"]]:
    """(rows sorted by expert [R, D], padded group sizes [E], dest [T, k]): see the module doc."""
    t, k = experts.shape
    n = t * k
    flat = experts.reshape(n)
    order = jnp.argsort(flat, stable=True)                       # assignments, expert-major, token order kept
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    padded = -(-counts // align) * align
    start = jnp.cumsum(counts) - counts
    start_padded = jnp.cumsum(padded) - padded
    e_sorted = flat[order]
    dest_sorted = start_padded[e_sorted] + jnp.arange(n, dtype=jnp.int32) - start[e_sorted]
    rows = layout_rows(t, k, num_experts, align)
    src = jnp.zeros((rows,), jnp.int32).at[dest_sorted].set((order // k).astype(jnp.int32))
    dest = jnp.zeros((n,), jnp.int32).at[order].set(dest_sorted)
    return h[src], padded, dest.reshape(t, k)


def unsort(y: Float[Array, "R D"], dest: Int[Array, "T k"], weights: Float[Array, "T k"]) -> Float[Array, "T D"]:
    """Each token's k expert rows, weighted by its router probabilities and summed (f32), in y's dtype."""
    rows = y[dest].astype(jnp.float32)                          # [T, k, D]
    return jnp.einsum("tkd,tk->td", rows, weights.astype(jnp.float32)).astype(y.dtype)
