"""One block's attention-score wgmmas as a value: what `Ops.scores` issues and waits for at once, and what the
swapped decode kernel's pipelined consumer issues behind the previous block's P V^T (paged_decode_swapped.py).

A `ScoreMMA` is a list of pieces a @ b^T, each accumulated into one of `num_accs` [rows, cols] accumulators (one
result each; most take one): `a` wgmma's A operand (an SMEM tile, or registers in the WGMMA layout), `b` an SMEM tile
[cols, width] read transposed. On the CPU interpreter (no wgmma) `reference` computes the same sums in plain jnp:
int32 for integer operands (exact, as the GPU's int32 accumulator), f32 otherwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class ScoreMMA:
    pieces: tuple           # ((a, a_in_smem, b_ref, acc), ...): a @ b^T each, summed into accumulator acc
    shape: tuple            # each accumulator's [rows, cols]
    dtype: Any              # f32, or int32 for integer operands
    num_accs: int = 1

    def issue(self, acc_refs) -> None:
        for a, _, b, i in self.pieces:
            plgpu.wgmma(acc_refs[i], a, b.transpose((1, 0)))

    def reference(self) -> list:
        t = jnp.int32 if self.dtype == jnp.int32 else jnp.float32
        outs = [jnp.zeros(self.shape, t) for _ in range(self.num_accs)]
        for a, in_smem, b, i in self.pieces:
            av = a[...] if in_smem else a
            outs[i] = outs[i] + jnp.dot(av.astype(t), b[...].astype(t).T, preferred_element_type=t)
        return outs


def kq(k_s, q_s, dtype=jnp.float32) -> ScoreMMA:
    """[BKV, D] x [GP, D]^T -> [BKV, GP]: cache positions are the wgmma rows (both in SMEM); f32, or `dtype` int32
    for int8 operands (an int8 cache's K codes against the query's int8 parts), exact."""
    return ScoreMMA(((k_s, True, q_s, 0),), (k_s.shape[0], q_s.shape[0]), dtype)


def kq_parts(k_s, q_s, parts: int) -> ScoreMMA:
    """`kq` against a query held as the sum of `parts` row blocks of q_s ([parts * GP, D]), one wgmma a block into one
    accumulator: an fp8 query split into a high and a low e4m3 part keeps about bfloat16's precision."""
    gp = q_s.shape[0] // parts
    return ScoreMMA(tuple((k_s, True, q_s.at[pl.ds(i * gp, gp)], 0) for i in range(parts)), (k_s.shape[0], gp),
                    jnp.float32)


def kq_regs(parts, q_s, dtype=jnp.float32) -> ScoreMMA:
    """Sum over parts (c0, k [BKV, w] in registers) of k @ q_s[:, c0:c0 + w]^T: K as wgmma's register operand, one
    wgmma a column part (16-bit values, f32; or int8 codes, `dtype` int32)."""
    return ScoreMMA(tuple((k, False, q_s.at[:, pl.ds(c0, k.shape[1])], 0) for c0, k in parts),
                    (parts[0][1].shape[0], q_s.shape[0]), dtype)


def kq_regs_apart(parts, q_s, dtype=jnp.float32) -> ScoreMMA:
    """`kq_regs` with each column part's product in its own accumulator (results in the parts' order): a grouped
    cache's groups apart without zero blocks in the query (paged_decode_swapped's `group_accs`)."""
    return ScoreMMA(tuple((k, False, q_s.at[:, pl.ds(c0, k.shape[1])], i) for i, (c0, k) in enumerate(parts)),
                    (parts[0][1].shape[0], q_s.shape[0]), dtype, len(parts))
