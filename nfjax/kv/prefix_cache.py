"""Prefix cache helpers: page hashes, and the device programs that move cached pages to and from host memory.

A full page is keyed by `chain_hash(hash of the page before it, its tokens)` (BLAKE2b, 16 bytes): equal keys
mean equal tokens at equal positions behind an equal prefix, so equal K/V. The allocator keeps the GPU tier
(nfjax/kv/allocator.py); the host and disk tiers (nfjax/kv/tiers.py) keep pages as *rows*: one page of every KV
array (values, and the aux scales of a quantized format, as stored) as one flat uint8 row, all layers.
`pack_pages` gathers pages into rows on the device, so pages leave in one device->host copy; `unpack_pages`
scatters rows back into pages, so a prefix comes back in one host->device copy of [P, row bytes] and one
on-device scatter, never page by page.
"""
from __future__ import annotations

import hashlib
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int, UInt8

ROOT = b"nfjax-prefix-v1"          # the "hash before" the first page


def chain_hash(prev: bytes, tokens) -> bytes:
    return hashlib.blake2b(prev + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def page_hash(req, i: int, page_size: int) -> bytes | None:
    """Hash of `req`'s page i (its tokens and everything before), None while a token of it is unknown to the
    host. Memoised in `req.page_hashes`."""
    hs = req.page_hashes
    while len(hs) <= i:
        j = len(hs)
        toks = req.tokens(j * page_size, (j + 1) * page_size)
        if toks is None:
            return None
        hs.append(chain_hash(hs[-1] if hs else ROOT, toks))
    return hs[i]


def prompt_hashes(req, page_size: int) -> list[bytes]:
    """Hashes of the prompt's full pages before its last token (that token is always computed: its logits give
    the first output)."""
    n = (req.prompt_len - 1) // page_size
    if n:
        page_hash(req, n - 1, page_size)
    return req.page_hashes[:n]


def row_bytes(arrays) -> int:
    """Bytes of one page of every array (values [L, N, PS, KH, W] and aux), all layers."""
    return sum(math.prod(a.shape[:1] + a.shape[2:]) * a.dtype.itemsize for a in arrays)


def pack_pages(kv, pages: Int[Array, "P"]) -> UInt8[Array, "P B"]:
    """Pages of every array as uint8 rows, page-major (ids past the cache give rows that are thrown away)."""
    parts = []
    for a in kv.arrays():
        x = jnp.moveaxis(a[:, pages], 1, 0)                      # [P, L, PS, KH, W]
        parts.append(lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


def pack_rows(kv, pages: Int[Array, "P"]) -> tuple:
    """`pack_pages` as one array a page: each row leaves (and is dropped) on its own, so the host never
    slices, copies or concatenates rows."""
    rows = pack_pages(kv, pages)
    return tuple(rows[i] for i in range(rows.shape[0]))


def unpack_pages(kv, pages: Int[Array, "P"], rows: UInt8[Array, "P B"]):
    """`pack_pages`'s rows written back at `pages` (ids past the cache are dropped)."""
    blocks, off = [], 0
    n = rows.shape[0]
    for a in kv.arrays():
        shape = (n, a.shape[0]) + a.shape[2:]
        size = math.prod(shape[1:]) * a.dtype.itemsize
        raw = rows[:, off:off + size]
        off += size
        raw = raw.reshape(shape + ((a.dtype.itemsize,) if a.dtype.itemsize > 1 else ()))
        blocks.append(jnp.moveaxis(lax.bitcast_convert_type(raw, a.dtype), 0, 1))
    return kv.put_pages(pages, blocks)


def unpack_rows(kv, pages: Int[Array, "P"], *rows):
    """`unpack_pages` of rows given one array a page (stacked on the device)."""
    return unpack_pages(kv, pages, jnp.stack(rows))


MAX_RUN = 64       # rows a copy program moves at most (128 MiB at 8B). Its rows are one array each, which
                   # compiles slower: sizes 1..128 took 10.7 s (CPU, smoke shape) against 3.2 s as one array;
                   # 1..64 take 4.0 s


def transfer_sizes(max_pages: int) -> list[int]:
    """Row counts the copy programs are compiled for: powers of 2 up to `max_pages` (then `max_pages`), at most
    `MAX_RUN`. A copy of n pages runs as n's binary digits (65 = 64 + 1), so no padding row is ever moved: at 8B
    a row is 2 MiB, and padding to powers of 4 moved twice the evicted bytes on average."""
    top = min(max_pages, MAX_RUN)
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


def size_runs(sizes: list[int], count: int):
    """`count` items in runs of the compiled `sizes` (1 among them), largest first, covering them exactly:
    (start, size) of each run."""
    i = 0
    while i < count:
        n = max(s for s in sizes if s <= count - i)
        yield i, n
        i += n


class PendingRows:
    """Rows on their way to the host as numpy (no pinned memory): the gather programs are launched and each
    row's device->host copy started (`copy_to_host_async`); `rows()` waits for those copies only (once; the
    device arrays are dropped then). Launched before a step that may overwrite the pages, they read the pages
    first (one device stream). `launched`: steps launched before them; `reads()`: steps read back so far.
    Reading the rows before every step launched ahead of them was read would wait for that step: counted in
    `waits[0]` (the engine never does)."""

    def __init__(self, rows: list, launched: int = 0, reads=None, waits=None):
        self.parts, self.launched, self.reads, self.waits = rows, launched, reads, waits
        self._host: list[np.ndarray] | None = None

    def rows(self) -> list[np.ndarray]:
        if self._host is None:
            if self.reads is not None and self.launched > self.reads() and self.waits is not None:
                self.waits[0] += 1
            self._host = [np.asarray(a) for a in self.parts]
            self.parts = []
        return self._host


class LazyRow:
    """Row `index` of a `PendingRows`, kept in the host tier until the engine settles it (or a tier hit or a
    spill needs it first)."""
    __slots__ = ("pending", "index", "nbytes")

    def __init__(self, pending: PendingRows, index: int, nbytes: int):
        self.pending, self.index, self.nbytes = pending, index, nbytes

    def ready(self) -> bool:
        """Read back already (getting it waits for nothing)."""
        return self.pending._host is not None

    def get(self) -> np.ndarray:
        return self.pending.rows()[self.index]


def compile_parallel(jobs: dict) -> dict:
    """`jobs` {key: a function giving a lowered program} compiled on a thread pool (XLA compiles outside the GIL;
    lowering traces Python, so it runs first, in turn): {key: compiled}. The tier's copy programs were compiled
    one after the other at start: ~21 s on this repo's 2-core CPU for XLA:GPU at 8B (H200 target, no device)."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    lowered = {k: f() for k, f in jobs.items()}
    if not lowered:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as ex:
        return dict(zip(lowered, ex.map(lambda lo: lo.compile(), lowered.values())))


class Programs(dict):
    """Compiled programs by row count: `make(n)` compiles one on first use. An engine fills the table at start
    (`TierCopies.prepare`), so a step never compiles; the fallback serves direct users (probes, tests)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, n: int):
        self[n] = prog = self.make(n).compile()
        return prog


class TierCopies:
    """Compiled `pack_rows` / `unpack_rows` for each of `transfer_sizes`, and the host side of the copies.
    `host_sharding` (pinned_host): the copies are inside the programs, `pack_rows` writing its rows to pinned host
    memory and `unpack_rows` reading them from there (a DMA at the pinned rate, 8x pageable numpy's on the H100),
    so the host only launches them; None: numpy rows (copy_to_host_async, read back lazily). The first pinned
    version moved the rows by `device_put` after and before the programs: on the H100 that held the engine thread
    64 of a 156 s multi-round run (docs/design.md section 13). With a `HostPool` (`pool`, the engine's default on
    one GPU) rows go out and back through the pool's own programs: here only disk rows (numpy) come back, so
    `prepare` compiles no pack program then, and no unpack program without a disk tier. `rows_to_host` /
    `rows_from_host` count the rows moved."""

    def __init__(self, kv, kv_sharding, replicated, num_pages: int, max_pages: int, host_sharding=None):
        self.replicated, self.num_pages, self.host_sharding = replicated, num_pages, host_sharding
        # the cache's shapes, not its arrays (the engine donates those every step): what the programs are lowered for
        self._kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), kv)
        self.kv_sharding = kv_sharding
        self.row_bytes = row_bytes(kv.arrays())
        self.sizes = transfer_sizes(max_pages)
        self._rows_sharding = host_sharding or replicated     # where unpack's row arguments live
        self._pack, self._unpack = Programs(self._lower_pack), Programs(self._lower_unpack)
        self.pool = None                # a HostPool (nfjax/kv/host_pool.py): rows are slots of one pinned array
        self.rows_to_host = self.rows_from_host = 0
        self._waits = [0]

    def attach_pool(self, tier_rows: int, max_pages: int, alloc=None, disk: bool = True) -> None:
        """Host rows as slots of one pinned pool for a tier of `tier_rows` (nfjax/kv/host_pool.py; `alloc`: its
        array, allocating since `start_pool`), then `prepare`. Where the pool's programs do not compile: no pool,
        numpy rows (a warning)."""
        from nfjax.kv.host_pool import HostPool, pool_rows
        try:
            self.pool = HostPool(self._kv, self.kv_sharding, self.replicated, self.host_sharding, pool_rows(tier_rows),
                                 self.row_bytes, max_pages, alloc=alloc, reads=disk)
        except Exception as e:  # noqa: BLE001 - a backend without host memory in programs
            import warnings
            warnings.warn(f"prefix cache host tier: no pinned pool ({e}); numpy rows", RuntimeWarning, stacklevel=2)
            self.pool, self.host_sharding, self._rows_sharding = None, None, self.replicated
        self.prepare(disk)

    def prepare(self, disk: bool = True) -> None:
        """Compile at start, in parallel, the programs the engine will run: without a pool the packs and unpacks of
        its rows (pinned, or numpy where pinned programs do not compile: a warning); beside a pool only the
        unpacks of disk rows (numpy: their rows go straight to the device), none without a disk tier (`disk`)."""
        if self.pool is not None:
            self._rows_sharding = self.replicated
            if disk:
                self._unpack.update(compile_parallel({n: partial(self._lower_unpack, n) for n in self.sizes}))
            return
        try:
            self._compile_all()
        except Exception as e:  # noqa: BLE001 - a backend without in-program host copies: numpy rows
            if self.host_sharding is None:
                raise
            import warnings
            warnings.warn(f"prefix cache host tier: no copy programs into pinned host memory ({e}); numpy "
                          f"rows", RuntimeWarning, stacklevel=2)
            self.host_sharding, self._rows_sharding = None, self.replicated
            self._pack.clear()
            self._unpack.clear()
            self._compile_all()

    def _compile_all(self) -> None:
        jobs = {("pack", n): partial(self._lower_pack, n) for n in self.sizes}
        jobs.update({("unpack", n): partial(self._lower_unpack, n) for n in self.sizes})
        for (kind, n), prog in compile_parallel(jobs).items():
            (self._pack if kind == "pack" else self._unpack)[n] = prog

    @property
    def num_programs(self) -> int:
        """Compiled copy programs (the pool's own not included)."""
        return len(self._pack) + len(self._unpack)

    def _lower_pack(self, n: int):
        """`pack_rows` of n pages, its rows in the host tier's memory (pinned host, or the device for numpy)."""
        pg = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.replicated)
        rows = self.host_sharding or self.replicated
        return jax.jit(pack_rows, out_shardings=(rows,) * n).lower(self._kv, pg)

    def _lower_unpack(self, n: int):
        """`unpack_rows` of n rows given as arguments in `_rows_sharding`'s memory."""
        unpack = unpack_rows
        if self._rows_sharding is not self.replicated:
            # Rows in host memory are moved to the device first, inside the program: XLA:GPU refuses a scatter
            # whose operand is in host memory ("DynamicUpdateSlice ... shouldn't change layout memory space").
            dev = self.replicated.with_memory_kind("device")

            def unpack(kv, pages, *rows):
                return unpack_rows(kv, pages, *(jax.device_put(r, dev) for r in rows))
        pg = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.replicated)
        row = jax.ShapeDtypeStruct((self.row_bytes,), jnp.uint8, sharding=self._rows_sharding)
        return jax.jit(unpack, donate_argnums=0, out_shardings=self.kv_sharding).lower(self._kv, pg, *([row] * n))

    @property
    def pinned(self) -> bool:
        return self.host_sharding is not None

    def _runs(self, pages: list[int]):
        """`pages` in runs of compiled sizes, largest first, covering them exactly: (start, size, ids). The ids
        stay numpy: a compiled program takes them as they are (7 us a call on the CPU, against 40 us for a
        device_put first)."""
        for i, n in size_runs(self.sizes, len(pages)):
            yield i, n, np.asarray(pages[i:i + n], np.int32)

    def to_host_async(self, kv, pages: list[int], launched: int = 0, reads=None) -> list:
        """Start copying `pages` out, one row each: one gather per run and the rows' device->host copies,
        nothing waited for. Returns the host tier's rows: pinned JAX arrays (ready when their copy is done),
        or `LazyRow`s of one `PendingRows`. `launched`, `reads`: the caller's step counts (PendingRows); early
        reads counted in `step_waits`."""
        if self.pool is not None:
            rows = self.pool.put(kv, pages)
            self.rows_to_host += len(rows)
            return rows
        rows = []
        for _, n, ids in self._runs(pages):
            rows.extend(self._pack[n](kv, ids))
        self.rows_to_host += len(pages)
        if self.host_sharding is not None:
            return rows                     # already in pinned host memory, written by the program
        for r in rows:
            r.copy_to_host_async()
        pending = PendingRows(rows, launched, reads, self._waits)
        return [LazyRow(pending, i, self.row_bytes) for i in range(len(rows))]

    @property
    def step_waits(self) -> int:
        """Evicted rows read back before the steps launched ahead of them were read (each a device sync)."""
        return self._waits[0]

    def from_host(self, kv, pages: list[int], rows: list):
        """`kv` with `rows` (numpy or pinned arrays) written at `pages`: per run its rows go over (no host-side
        stacking) and one scatter writes them."""
        i = 0
        while i < len(pages):         # runs of pool rows and runs of the rest (numpy rows from the disk tier)
            pooled = hasattr(rows[i], "slot")
            j = i
            while j < len(pages) and hasattr(rows[j], "slot") == pooled:
                j += 1
            if pooled:
                kv = self.pool.load(kv, pages[i:j], rows[i:j])
            else:
                for k, n, ids in self._runs(pages[i:j]):
                    run = rows[i + k:i + k + n]     # pinned rows are read by the program; numpy rows go over as arguments
                    kv = self._unpack[n](kv, ids, *run)
            i = j
        self.rows_from_host += len(pages)
        return kv
