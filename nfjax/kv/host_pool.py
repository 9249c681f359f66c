"""The host tier's rows in one pinned host array allocated at start (docs/design.md section 13).

Rows were one pinned array each, allocated by the copy program that wrote them: on the H100 the runtime's pinned
allocator held the engine thread ~30 s of a 2-minute multi-round run once ~50k rows had come and gone. Here the
pool is allocated once; a row is a slot of it. `put` gathers pages into rows on the device and writes them into
their slots (one dynamic-update-slice each, the pool donated: no copy of it); `load` reads slots and scatters them
into pages. Every program runs on the device's one stream in launch order, so a slot freed after a `load` is
launched and written again by a later `put` is read first. A slot is freed when its row is loaded back (at
the load's launch) or dropped by the tier; a pool with no free slot drops the eviction."""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int, UInt8

from nfjax.kv.prefix_cache import pack_pages, size_runs, transfer_sizes, unpack_pages


class PoolRow:
    """Slot `slot` of a `HostPool`, held by the host tier (or by a batch loading it). Its slot is freed when a
    load of it is launched, or when it is dropped. `get()` reads its bytes back as numpy (a spill to disk; waits
    for the write)."""
    __slots__ = ("pool", "slot", "nbytes", "__weakref__")

    def __init__(self, pool: "HostPool", slot: int, nbytes: int):
        self.pool, self.slot, self.nbytes = pool, slot, nbytes

    def ready(self) -> bool:
        return True

    def get(self) -> np.ndarray:
        return self.pool.read(self.slot)

    def release(self) -> None:
        """The slot back to the pool (once): at a load's launch, or when the row is dropped."""
        if self.slot >= 0:
            self.pool._free.append(self.slot)
            self.slot = -1

    def __del__(self):
        self.release()


def put_rows(host, pool: UInt8[Array, "C B"], kv, pages: Int[Array, "P"], slots: Int[Array, "P"]) -> UInt8[Array, "C B"]:
    """`pages` packed on the device, moved to `host` memory (None: where the pool's type is not in host memory)
    and written at `slots` of the pool."""
    rows = pack_pages(kv, pages)
    if host is not None:
        rows = jax.device_put(rows, host)
    for i in range(rows.shape[0]):
        pool = lax.dynamic_update_slice(pool, rows[i:i + 1], (slots[i], 0))
    return pool


def take_rows(device, pool: UInt8[Array, "C B"], slots: Int[Array, "P"]) -> UInt8[Array, "P B"]:
    """The rows at `slots`, on `device`."""
    rows = jnp.concatenate([lax.dynamic_slice(pool, (slots[i], 0), (1, pool.shape[1]))
                            for i in range(slots.shape[0])])
    return jax.device_put(rows, device)


def load_rows(device, kv, pool: UInt8[Array, "C B"], pages: Int[Array, "P"], slots: Int[Array, "P"]):
    return unpack_pages(kv, pages, take_rows(device, pool, slots))


class HostPool:
    """`capacity` rows of `row_bytes` in `host_sharding`'s memory, and the programs that move pages in and out."""

    def __init__(self, kv, kv_sharding, replicated, host_sharding, capacity: int, row_bytes: int, max_pages: int):
        self.capacity, self.row_bytes = capacity, row_bytes
        t0 = time.perf_counter()
        self.pool = jax.jit(lambda: jnp.zeros((capacity, row_bytes), jnp.uint8), out_shardings=host_sharding)()
        jax.block_until_ready(self.pool)
        self.alloc_s = time.perf_counter() - t0
        pool = jax.ShapeDtypeStruct(self.pool.shape, jnp.uint8, sharding=host_sharding)
        dev = replicated.with_memory_kind("device")
        self._put, self._load = {}, {}

        def compile_put(ids, host):
            return jax.jit(partial(put_rows, host), donate_argnums=0, out_shardings=host_sharding,
                           in_shardings=(host_sharding, kv_sharding, replicated, replicated)).lower(
                pool, kv, ids, ids).compile()
        for n in transfer_sizes(max_pages):
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=replicated)
            try:
                self._put[n] = compile_put(ids, host_sharding)
            except ValueError:      # jax typed the pool as device memory (a single-device sharding on a CPU)
                self._put[n] = compile_put(ids, None)
            self._load[n] = jax.jit(partial(load_rows, dev), donate_argnums=0, out_shardings=kv_sharding,
                                    in_shardings=(kv_sharding, host_sharding, replicated, replicated)).lower(
                kv, pool, ids, ids).compile()
        one = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
        self._read = jax.jit(partial(take_rows, dev), in_shardings=(host_sharding, replicated),
                             out_shardings=replicated).lower(pool, one).compile()
        self.sizes = sorted(self._put)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def put(self, kv, pages: list[int]) -> list[PoolRow]:
        """`pages` written into free slots (launched, not waited for): their rows. As many pages as there are free
        slots, the first ones first; the rest are not copied."""
        pages = pages[:len(self._free)]
        slots = [self._free.pop() for _ in pages]
        for i, k in size_runs(self.sizes, len(pages)):
            self.pool = self._put[k](self.pool, kv, np.asarray(pages[i:i + k], np.int32),
                                     np.asarray(slots[i:i + k], np.int32))
        return [PoolRow(self, s, self.row_bytes) for s in slots]

    def load(self, kv, pages: list[int], rows: list[PoolRow]):
        """`kv` with `rows` written at `pages` (launched; the rows' slots are freed at once)."""
        for i, k in size_runs(self.sizes, len(pages)):
            kv = self._load[k](kv, self.pool, np.asarray(pages[i:i + k], np.int32),
                               np.asarray([r.slot for r in rows[i:i + k]], np.int32))
        for r in rows:      # free now, not when the batch holding them is collected (cycles: seconds later on the
            r.release()     # H100, 3k rows short of slots); a later put into these slots runs after this load
        return kv

    def read(self, slot: int) -> np.ndarray:
        return np.asarray(self._read(self.pool, np.asarray([slot], np.int32)))[0]
