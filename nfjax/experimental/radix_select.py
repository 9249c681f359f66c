"""EXPERIMENTAL, not part of the engine: the sampler's top-k / top-p kept set without sorting the row (radix
select), for bench/probes/sampler_limits.py to time against the engine's sort (nfjax/engine/sampler.py).

Why: at top-p 0.9 the engine's limits head costs ~21% of 1024/512 throughput on the H100 (its sort of every row's
128k logits, gathers and a prefix sum; docs/design.md section 2). Here the kept set comes from thresholds found a
few bits at a time: each pass tries `DIGITS` candidate thresholds at once (the known high bits with each value of
the next `RADIX_BITS`) and keeps the largest whose running count or mass from the top still reaches the target,
so a 32-bit key takes 8 passes and a row index of a 128k vocabulary 5; a pass is a compare-and-sum over the row.
Measured on the H100 (docs/design.md section 2): 10-35% slower than the sort (1,024 rows: sort 18.0 ms, "column" 19.8,
"siblings" 24.2), so it stays out of the engine. Two ways to write a pass, `FORMS`: "column" sums a [V, DIGITS] compare along V
(XLA:GPU's column reduction reads each key once for all digits); "siblings" writes DIGITS sums of one operand
(one pass if XLA:GPU fuses sibling reductions). On the CPU both materialize their compares (~1 GiB at 128 rows
of a 128k vocabulary), so this is no CPU path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from nfjax.engine.sampler import _in_chunks, _noise, _scaled

RADIX_BITS = 4
DIGITS = 1 << RADIX_BITS
FORMS = ("column", "siblings")


def float_keys(x: Float[Array, "V"]) -> UInt32[Array, "V"]:
    """float32 -> uint32 keys in the same order (negatives: every bit flipped; the rest: the sign bit set)."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def index_keys(v: int) -> UInt32[Array, "V"]:
    """Keys that put lower row indices higher: the first index is the largest key."""
    return (v - 1 - jnp.arange(v)).astype(jnp.uint32)


def key_bits(v: int) -> int:
    """Bits an index key of a row of `v` needs, rounded up to whole passes."""
    bits = max(1, (v - 1).bit_length())
    return -(-bits // RADIX_BITS) * RADIX_BITS


def _digit_sums(keys, w, t, shift: int, form: str):
    """sum(w[keys >= t | d << shift]) for each digit d: [DIGITS], falling."""
    if form == "column":
        cand = t | (jnp.arange(DIGITS, dtype=jnp.uint32) << shift)
        return jnp.sum(jnp.where(keys[:, None] >= cand[None, :], w[:, None], 0.0), axis=0)
    return jnp.stack([jnp.sum(jnp.where(keys >= (t | jnp.uint32(d << shift)), w, 0.0)) for d in range(DIGITS)])


def largest_reaching(keys: UInt32[Array, "V"], weights: Float[Array, "V"], target, bits: int = 32,
                     form: str = "column") -> UInt32[Array, ""]:
    """The largest t with sum(weights[keys >= t]) >= target; 0 when even the whole row falls short (so `keys >= t`
    then keeps everything). Weights >= 0; with weights 1 the largest t is the target-th largest key. Only the low
    `bits` bits of the keys may be set."""
    w = weights.astype(jnp.float32)
    digits = jnp.arange(DIGITS, dtype=jnp.uint32)
    t = jnp.uint32(0)
    for shift in range(bits - RADIX_BITS, -1, -RADIX_BITS):
        reach = _digit_sums(keys, w, t, shift, form) >= target
        # the sums fall as the digit rises: the last digit that reaches (digit 0 is t itself, which reached)
        t = t | (jnp.max(jnp.where(reach, digits, 0)) << shift)
    return t


def first_ties(tie: Bool[Array, "V"], weights: Float[Array, "V"], target, form: str = "column") -> Bool[Array, "V"]:
    """The ties taken in row order up to and including the one where their running weight reaches `target` (all
    of them when it never does; none when target <= 0)."""
    v = tie.shape[0]
    ik = index_keys(v)
    t = largest_reaching(ik, jnp.where(tie, weights, 0.0), target, key_bits(v), form)
    return tie & (ik >= t) & (target > 0)


def radix_kept(scaled: Float[Array, "V"], top_k, top_p, form: str = "column") -> Bool[Array, "V"]:
    """The engine's limits path's kept set (`nfjax.engine.sampler._limited_row`): the top-k set is the tokens above
    the k-th largest value and the first of its ties in token order (a stable sort's order); of those, top-p
    keeps the tokens above v, the largest value whose tokens and those above it hold >= top_p of the top-k set's
    mass, and v's ties in token order up to the one that reaches it. Sums run in another order than the sort's
    prefix sums, so a kept set whose mass lands within float rounding of top_p may differ by its last token."""
    v = scaled.shape[-1]
    keys = float_keys(scaled)
    ones = jnp.ones((v,), jnp.float32)
    kth = largest_reaching(keys, ones, top_k, form=form)          # the k-th largest value's key
    above = keys > kth
    in_k = above | first_ties(keys == kth, ones, top_k - jnp.sum(above), form)
    in_k = jnp.where(top_k > 0, in_k, True)
    probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf))
    mass = jnp.where(in_k, probs, 0.0)
    last = largest_reaching(keys, mass, top_p, form=form)         # 0 (keep all) when rounding leaves it short
    over = in_k & (keys > last)
    return over | first_ties(in_k & (keys == last), mass, top_p - jnp.sum(jnp.where(over, mass, 0.0)), form)


def sample_radix(logits: Float[Array, "S V"], temperature: Float[Array, "S"], top_k: Int[Array, "S"],
                 top_p: Float[Array, "S"], seeds: UInt32[Array, "S"], counters: Int[Array, "S"],
                 form: str = "column") -> Int[Array, "S"]:
    """`nfjax.engine.sampler.sample(..., limits=True)` with the kept set by radix select: the same draw (the
    engine's noise by token id), so the same tokens away from rounding-decided top-p edges."""
    def row(lg, temp, k, p, seed, counter):
        scaled = _scaled(lg, temp)
        keep = radix_kept(scaled, k, p, form)
        return jnp.argmax(jnp.where(keep, scaled + _noise(scaled, seed, counter), -jnp.inf))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = _in_chunks(row, logits, temperature, top_k, top_p, seeds, counters)
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
