"""On-device token sampling: greedy, temperature, top-k, top-p, with a per-request key (seed, step)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32


# Rows sampled at a time. A row's sort, mask, softmax and draw hold ~9 vocab-sized temporaries: for 1,024 rows of a
# 128k vocab that was 4.65 GiB of scratch on the H100, more than the ~10% of memory the KV sizing leaves free, and
# a sampled step at bucket 1,024 ran out of memory. Chunks bound it by the chunk, not by max_seqs.
SAMPLE_CHUNK = 128


def _sample_row(logits: Float[Array, "V"], temperature, top_k, top_p, seed, counter) -> Int[Array, ""]:
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs                   # mass strictly before each rank
    keep = keep & (before < top_p)                       # the top token always survives
    key = jax.random.fold_in(jax.random.key(seed), counter)
    return order[jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))]


def _sample_rows(logits, temperature, top_k, top_p, seeds, counters):
    """`_sample_row` over the rows, `SAMPLE_CHUNK` rows at a time (vmapped within a chunk)."""
    rows = (logits, temperature, top_k, top_p, seeds, counters)
    if logits.shape[0] <= SAMPLE_CHUNK:             # no loop at all
        return jax.vmap(_sample_row)(*rows)
    # a loop of a constant trip count: XLA:GPU runs it without reading its predicate back to the host
    return jax.lax.map(lambda r: _sample_row(*r), rows, batch_size=SAMPLE_CHUNK)


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
