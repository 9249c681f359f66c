"""The GPU's reading of fp8r's tail rows (docs/design.md section 14.3): the kernels read fp8r's pages as fp8, up to
each sequence's last complete group of 64 positions, and the positions past it take K and V from the tail rows.

* Decodes: the decode kernel runs over the complete groups; `decode_tail_split` runs the bfloat16 decode kernel
  over the tail rows (a tail row is a page of 64 to it, at most 63 live positions a sequence) and hands its splits
  to the first call, which merges them with its own by their log-sum-exps (`paged_decode_attention_swapped`'s
  `parts` and `extra_split`).
* Prefill chunks: the bfloat16 prefill kernel reads a dequantized copy of the step's pages
  (`attention.dequantized_pages`); `splice_tail` writes each sequence's tail rows over its filling group's page
  in that copy.
A group is a page (the format needs pages of 64), so the filling group is the one page at floor(len / 64).
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.kv_kivi64 import GROUP
from pallas_kernels.paged_decode_swapped import paged_decode_attention_swapped


def decode_tail_split(q: Float[Array, "R H D"], kv, layer: Int[Array, ""], lens: Int[Array, "R"],
                      tail_rows: Int[Array, "R"], scale: float, live_rows: Int[Array, ""], *, num_ctas: int,
                      interpret: bool = False):
    """The splits (o [R, KH, n, GP, D], lse [R, KH, n, GP]) of decode queries attending to their positions
    [64 floor(len / 64), len) in their tail rows: the bfloat16 kernel over `KVCache.k_tail` / `v_tail` as pages of
    64 positions, a row's table its tail row. Rows at or past `live_rows`, and rows with no such position, are
    empty."""
    return paged_decode_attention_swapped(q, kv.k_tail, kv.v_tail, layer, tail_rows[:, None], lens % GROUP,
                                          scale=scale, num_ctas=num_ctas, num_splits=1, block_kv=GROUP,
                                          interpret=interpret, live_rows=live_rows, parts=True)


def splice_tail(k_copy: Float[Array, "1 C PS KH D"], v_copy: Float[Array, "1 C PS KH D"], table: Int[Array, "W P"],
                kept: Bool[Array, "W P"], lens: Int[Array, "W"], kv, layer: Int[Array, ""], tail_rows: Int[Array, "W"]):
    """The copy's K and V with each row's filling group (positions [64 floor(len / 64), len), len not a multiple
    of 64) taken from its tail rows. `table` indexes the copy and `kept` says which of its entries the copy holds
    (`attention.copy_table`); rows of length 0, and a page the copy could not hold, take nothing."""
    c = k_copy.shape[1]
    idx = jnp.minimum(lens // GROUP, table.shape[1] - 1)[:, None]
    page = jnp.take_along_axis(table, idx, axis=1)[:, 0]
    ok = (lens % GROUP > 0) & jnp.take_along_axis(kept, idx, axis=1)[:, 0]
    slot = jnp.where(ok, page, c)                                               # the rest: past the copy, dropped
    return (k_copy.at[0, slot].set(kv.k_tail[layer][tail_rows].astype(k_copy.dtype), mode="drop"),
            v_copy.at[0, slot].set(kv.v_tail[layer][tail_rows].astype(v_copy.dtype), mode="drop"))
