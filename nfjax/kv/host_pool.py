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


POOL_ALLOC = ("numpy", "jit")     # how the pool's memory is made (`PoolAllocation`)


class PoolAllocation:
    """The pool's pinned array, allocated on a background thread from the moment this is made, so that the engine
    compiles meanwhile (`start_pool`: before the step programs). On the H100 one jitted zeros of 32 GiB into
    pinned_host took 45 s at start (docs/design.md section 13). `method` (NFJAX_TIER_POOL_ALLOC, default numpy):
    `numpy` device_puts a calloc'd numpy array (its pages read as the kernel's zero page: no host memory beside the
    pool, no device program, no device memory); `jit` runs jitted zeros with the output in pinned_host (a device
    program, which may first build the zeros in device memory). A failed `numpy` retries with `jit`. `seconds`:
    how long the allocation took, `method`: the one that made it."""

    def __init__(self, shape: tuple[int, int], sharding, method: str | None = None):
        import os
        import threading
        self.shape, self.sharding = tuple(shape), sharding
        self.method = method or os.environ.get("NFJAX_TIER_POOL_ALLOC", "numpy")
        if self.method not in POOL_ALLOC:
            raise ValueError(f"NFJAX_TIER_POOL_ALLOC={self.method!r}: one of {', '.join(POOL_ALLOC)}")
        self.seconds = 0.0
        self._array = self._error = None
        self._thread = threading.Thread(target=self._run, name="nfjax-host-pool", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            try:
                a = self._make(self.method)
            except Exception:  # noqa: BLE001 - the other way; its error is the one reported
                if self.method != "numpy":
                    raise
                self.method = "jit"
                a = self._make("jit")
            jax.block_until_ready(a)
            self._array = a
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread by `result`
            self._error = e
        self.seconds = time.perf_counter() - t0

    def _make(self, method: str):
        cap, row = self.shape
        if method == "numpy":
            return jax.device_put(np.zeros((cap, row), np.uint8), self.sharding)
        return jax.jit(lambda: jnp.zeros((cap, row), jnp.uint8), out_shardings=self.sharding)()

    def result(self):
        """The pool array (waits for the allocation; its error raised here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._array


def start_pool(runner) -> PoolAllocation | None:
    """A `HostPool`'s array for `runner`'s host tier, allocating from now on (None where the tier would keep no
    pinned pool: no prefix cache, no host tier, rows not pinned). The engine calls it before compiling, so the
    allocation runs beside the compile; `HostPool` takes it if its shape matches (else it is dropped)."""
    from nfjax.kv.prefix_cache import row_bytes
    c = runner.config.cache
    if not (c.prefix_cache and c.host_cache_gb):
        return None
    host = runner._tier_host_sharding()
    row = row_bytes(runner.kv.arrays())
    rows = int(c.host_cache_gb * 2 ** 30) // row
    if host is None or not rows:
        return None
    return PoolAllocation((pool_rows(rows), row), host)


def pool_rows(tier_rows: int) -> int:
    """Slots of a pool for a host tier of `tier_rows`: rows out of the tier but not yet dropped (a batch loading
    them) keep their slots a while."""
    from nfjax.kv.prefix_cache import MAX_RUN
    return tier_rows + 2 * MAX_RUN


class HostPool:
    """`capacity` rows of `row_bytes` in `host_sharding`'s memory, and the programs that move pages in and out,
    compiled in parallel while the pool is allocated (`alloc`: a `PoolAllocation` started earlier and of this
    shape, else one started here). `reads`: compile the one-row read a spill to disk needs. `alloc_s`: the
    allocation's seconds; `alloc_wait_s`: how long this constructor waited for it after compiling."""

    def __init__(self, kv, kv_sharding, replicated, host_sharding, capacity: int, row_bytes: int, max_pages: int,
                 alloc: PoolAllocation | None = None, reads: bool = True):
        from nfjax.kv.prefix_cache import compile_parallel
        self.capacity, self.row_bytes = capacity, row_bytes
        if alloc is None or alloc.shape != (capacity, row_bytes):
            alloc = PoolAllocation((capacity, row_bytes), host_sharding)
        kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), kv)
        pool = jax.ShapeDtypeStruct((capacity, row_bytes), jnp.uint8, sharding=host_sharding)
        dev = replicated.with_memory_kind("device")

        def lower_put(n, host):
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=replicated)
            return jax.jit(partial(put_rows, host), donate_argnums=0, out_shardings=host_sharding,
                           in_shardings=(host_sharding, kv_sharding, replicated, replicated)).lower(pool, kv, ids, ids)

        def lower_load(n):
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=replicated)
            return jax.jit(partial(load_rows, dev), donate_argnums=0, out_shardings=kv_sharding,
                           in_shardings=(kv_sharding, host_sharding, replicated, replicated)).lower(kv, pool, ids, ids)
        host = host_sharding
        try:
            lower_put(1, host)
        except ValueError:      # jax typed the pool as device memory (a single-device sharding on a CPU)
            host = None
        self.sizes = transfer_sizes(max_pages)
        jobs = {("put", n): partial(lower_put, n, host) for n in self.sizes}
        jobs.update({("load", n): partial(lower_load, n) for n in self.sizes})
        if reads:
            one = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
            jobs["read"] = lambda: jax.jit(partial(take_rows, dev), in_shardings=(host_sharding, replicated),
                                           out_shardings=replicated).lower(pool, one)
        progs = compile_parallel(jobs)
        self._put = {n: progs["put", n] for n in self.sizes}
        self._load = {n: progs["load", n] for n in self.sizes}
        self._read = progs.get("read")
        self.num_programs = len(progs)
        t0 = time.perf_counter()
        self.pool = alloc.result()
        self.alloc_wait_s, self.alloc_s, self.alloc_method = time.perf_counter() - t0, alloc.seconds, alloc.method
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
        if self._read is None:
            raise RuntimeError("HostPool(reads=False) reads no row back (a tier without a disk spills nothing)")
        return np.asarray(self._read(self.pool, np.asarray([slot], np.int32)))[0]
