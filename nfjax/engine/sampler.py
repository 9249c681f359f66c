"""On-device token sampling: greedy, temperature, top-k, top-p, with a per-request key (seed, step)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32


def _sample_rows(logits, temperature, top_k, top_p, seeds, counters):
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass strictly before each rank
    keep = keep & (before < top_p[:, None])               # the top token always survives
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, counter, row):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.categorical(key, row)

    idx = jax.vmap(draw)(seeds, counters, masked)
    return jnp.take_along_axis(order, idx[:, None], axis=-1)[:, 0]


def sample(logits: Float[Array, "S V"], temperature: Float[Array, "S"], top_k: Int[Array, "S"],
           top_p: Float[Array, "S"], seeds: UInt32[Array, "S"], counters: Int[Array, "S"], *,
           any_sampled: bool = True) -> Int[Array, "S"]:
    """Rows with temperature 0 take the argmax. `any_sampled` (static, known on the host from the batch):
    False compiles the argmax alone, True also the sort for top-k/top-p. It is not a `lax.cond` on the
    temperatures: XLA:GPU reads a conditional's predicate back to the host, so enqueueing the program would
    wait for the GPU to reach it, and the host could never run a step ahead (docs/design.md section 2)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not any_sampled:
        return greedy
    sampled = _sample_rows(logits, temperature, top_k, top_p, seeds, counters).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
