"""On-device token sampling: greedy, temperature, top-k, top-p, with a per-request key (seed, step).

A sampled row draws argmax(logits / T + Gumbel noise) over the tokens it keeps: a draw from softmax(logits / T)
restricted to them. The noise is indexed by token id and keyed by (seed, step), so a row draws the same token
whichever path computed its kept set: the plain path keeps every token and sorts nothing; the limits path
sorts each row to find its top-k / top-p set (the engine compiles it as a head of its own and runs it only for
batches with such a row, and in the full head: nfjax/engine/step_programs.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32


# Rows sampled at a time. A row's sort, mask, softmax and draw hold ~9 vocab-sized temporaries (the plain draw ~4):
# for 1,024 rows of a 128k vocab the sort's were 4.65 GiB of scratch on the H100, more than the ~10% of memory the
# KV sizing leaves free, and a sampled step at bucket 1,024 ran out of memory. Chunks bound it by the chunk, not
# by max_seqs.
SAMPLE_CHUNK = 128


def _scaled(logits: Float[Array, "V"], temperature) -> Float[Array, "V"]:
    return logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)


def _noise(scaled: Float[Array, "V"], seed, counter) -> Float[Array, "V"]:
    """Gumbel noise, token j's from (seed, counter, j)."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), counter), scaled.shape, jnp.float32)


def _plain_row(logits, temperature, seed, counter):
    scaled = _scaled(logits, temperature)
    return jnp.argmax(scaled + _noise(scaled, seed, counter))


def _limited_row(logits, temperature, top_k, top_p, seed, counter):
    scaled = _scaled(logits, temperature)
    v = scaled.shape[-1]
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs                   # mass strictly before each rank
    keep = keep & (before < top_p)                       # the top token always survives
    # the plain row's draw over the kept ranks: token order[r] carries its own noise (a gather, not a scatter)
    noisy = sorted_logits + _noise(scaled, seed, counter)[order]
    return order[jnp.argmax(jnp.where(keep, noisy, -jnp.inf))]


def _in_chunks(row_fn, *rows):
    """`row_fn` over the rows, `SAMPLE_CHUNK` rows at a time (vmapped within a chunk)."""
    if rows[0].shape[0] <= SAMPLE_CHUNK:            # no loop at all
        return jax.vmap(row_fn)(*rows)
    # a loop of a constant trip count: XLA:GPU runs it without reading its predicate back to the host
    return jax.lax.map(lambda r: row_fn(*r), rows, batch_size=SAMPLE_CHUNK)


def sample(logits: Float[Array, "S V"], temperature: Float[Array, "S"], top_k: Int[Array, "S"],
           top_p: Float[Array, "S"], seeds: UInt32[Array, "S"], counters: Int[Array, "S"], *,
           any_sampled: bool = True, limits: bool = True) -> Int[Array, "S"]:
    """Rows with temperature 0 take the argmax. Two static switches, known on the host from the batch:
    `any_sampled` False compiles the argmax alone; `limits` False promises no sampled row has a top-k or top-p
    (they are ignored) and compiles no sort. Neither is a `lax.cond` on the values: XLA:GPU reads a
    conditional's predicate back to the host, so enqueueing the program would wait for the GPU to reach it, and
    the host could never run a step ahead (docs/design.md section 2)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not any_sampled:
        return greedy
    if limits:
        sampled = _in_chunks(_limited_row, logits, temperature, top_k, top_p, seeds, counters)
    else:
        sampled = _in_chunks(_plain_row, logits, temperature, seeds, counters)
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
