"""Host side of the K tail rows of the formats with one (kivi64, fp8r; nfjax/kv/kivi64.py): which row of
`KVCache.k_tail` holds each sequence's filling group, keyed by that group's page (docs/design.md section 14.1).

A group is a page of 64 positions. A step that writes positions [start, end) of a sequence uses one row: the row
of page start // 64 when start is inside a group (its rows [.., start) were written by earlier steps), else a
fresh one; after the step the row belongs to page end // 64 if end is inside a group, else it is free (the step
quantized the group). Rows freed by a step are reused from the next step on (the device runs steps in order),
never within the step, whose nano-batches may read a row after another sequence's writes.

Swapping moves a sequence's row with its pages (`take` / `put`). A request that finishes mid-group leaves its
row behind: it is reclaimed when its page is written again from a group's start, or, when no row is free, if its
owner finished or no longer holds the page.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

GROUP = 64


class TailRowsExhausted(RuntimeError):
    pass


class TailSlots:
    def __init__(self, rows: int):
        self.rows = rows
        self._free = list(range(rows))[::-1]                 # pop(): the lowest
        self._by_page: dict[int, int] = {}                   # filling group's page -> row
        self._owner: dict[int, tuple[object, int]] = {}      # row -> (request or None, page)
        self._released: list[int] = []                      # freed by the step being formed
        self.rows_swapped = 0                                # rows moved out with their sequences

    @property
    def num_free(self) -> int:
        return len(self._free)

    def for_step(self, req, pages: list[int], start: int, end: int) -> int:
        """The row a sequence writing positions [start, end) uses this step (call `end_step` after the batch)."""
        page = pages[start // GROUP]
        if start % GROUP:
            row = self._by_page.pop(page, None)
            if row is None:
                raise RuntimeError(f"no K tail row for a sequence continuing its group at position {start}")
        else:
            stale = self._by_page.pop(page, None)            # the page's earlier owner left mid-group
            if stale is not None:
                self._release(stale)
            row = self._take()
        if end % GROUP:
            self._hold(row, req, pages[end // GROUP])
        else:
            self._release(row)
        return row

    def end_step(self) -> None:
        """Rows freed by the step just formed become free for the next."""
        self._free.extend(self._released[::-1])
        self._released = []

    def take(self, pages: list[int]) -> int | None:
        """Swap-out of a sequence's `pages`: the row of its filling group (None: it has none), released."""
        row = self._by_page.pop(pages[-1], None) if pages else None
        if row is not None:
            self.rows_swapped += 1
            self._release(row)
            self.end_step()            # a swap-out runs between steps: the row is free for the next one
        return row

    def put(self, page: int) -> int:
        """Swap-in: a row for the filling group now at `page` (its owner is set at the sequence's next step)."""
        row = self._take()
        self._hold(row, None, page)
        return row

    def _hold(self, row: int, req, page: int) -> None:
        self._by_page[page] = row
        self._owner[row] = (req, page)

    def _drop(self, row: int) -> None:
        _, page = self._owner.pop(row, (None, None))
        if page is not None and self._by_page.get(page) == row:
            del self._by_page[page]

    def _release(self, row: int) -> None:
        self._drop(row)
        self._released.append(row)

    def _take(self) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            raise TailRowsExhausted(
                f"all {self.rows} K tail rows are held (more running sequences with a filling group than "
                f"the cache's tail rows; lower --max-seqs or use another --kv-dtype)")
        return self._free.pop()

    def _reclaim(self) -> None:
        for row, (req, page) in list(self._owner.items()):
            if req is not None and (getattr(req, "finished", False) or page not in req.pages):
                self._drop(row)            # not used by the step being formed: free at once
                self._free.append(row)


def tail_rows(max_seqs: int) -> int:
    """Tail rows an engine keeps: one per sequence a step holds, twice over (running sequences a step leaves
    out keep theirs)."""
    return 2 * max_seqs


def tail_row(kv, row):
    """Tail row `row` of every layer, [L, 1, 64, KH, D] (kv heads on axis 3, as a page block's); with a V tail
    (fp8r) K's and V's layers one after the other, [2 L, 1, 64, KH, D]."""
    k = lax.dynamic_slice_in_dim(kv.k_tail, row, 1, axis=1)
    return k if kv.v_tail is None else jnp.concatenate([k, lax.dynamic_slice_in_dim(kv.v_tail, row, 1, axis=1)])


def put_tail_row(kv, row, x):
    """`tail_row`'s block written back at `row`."""
    def put(a, blk):
        return lax.dynamic_update_slice_in_dim(a, blk.astype(a.dtype), row, axis=1)
    if kv.v_tail is None:
        return dataclasses.replace(kv, k_tail=put(kv.k_tail, x))
    n = kv.k_tail.shape[0]
    return dataclasses.replace(kv, k_tail=put(kv.k_tail, x[:n]), v_tail=put(kv.v_tail, x[n:]))


class TailCopies:
    """Swapping's part for the formats with a tail: a sequence's tail row leaves and comes back with its pages
    (compiled at start, as the page copies)."""

    def __init__(self, slots: TailSlots, kv, kv_sharding, block_sharding, replicated):
        self.slots, self.replicated, self.block_sharding = slots, replicated, block_sharding
        row = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        blk = jax.eval_shape(tail_row, kv, row).update(sharding=block_sharding)
        self._out = jax.jit(tail_row, out_shardings=block_sharding).lower(kv, row).compile()
        self._in = jax.jit(put_tail_row, donate_argnums=0, out_shardings=kv_sharding).lower(kv, row, blk).compile()

    def out(self, kv, pages: list[int]) -> np.ndarray | None:
        """The row of the filling group at `pages[-1]` on the host (None: none), freed."""
        row = self.slots.take(pages)
        return None if row is None else np.asarray(self._out(kv, jax.device_put(jnp.int32(row), self.replicated)))

    def into(self, kv, page: int, block: np.ndarray | None):
        """`out`'s block into a fresh row for the filling group now at `page` (None: nothing to do)."""
        if block is None:
            return kv
        row = jax.device_put(jnp.int32(self.slots.put(page)), self.replicated)
        return self._in(kv, row, jax.device_put(block, self.block_sharding))
