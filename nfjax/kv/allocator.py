"""Host-side page allocator for the paged KV cache: a free list, reference counts, and the prefix cache.

Page 0 is reserved as the scratch page (padding tokens write their K/V there) and is never handed out.
Reference counts make prefix sharing possible: `share(pages)` adds an owner to pages already in use, and a
page returns to the free list only when its last owner frees it.

Prefix cache (`prefix=True`, nfjax/kv/prefix_cache.py for the hashes): a full page whose K/V is written can be
`register`ed under the hash of its tokens chained with every token before it. A registered page whose last owner
frees it stays on the device, unreferenced, in an LRU list; `lookup` hands cached pages to a new request (one
more owner each). Unreferenced cached pages count as free: `allocate` takes the free list first, then evicts the
least recently used cached pages, and reports each evicted (page, hash) through `take_evicted` so a slower tier
can copy it out before the step that overwrites it is launched. Only full pages are ever registered, and a
request never writes into a page before its first uncached position, so a shared page is never written.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised by `PageAllocator.allocate` when fewer pages are free than asked for; the batcher catches
    it (or checks `num_free` first) to defer or preempt a request. Nothing is allocated when it is raised."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"need {requested} KV pages, only {free} free")
        self.requested, self.free = requested, free


class PageAllocator:
    def __init__(self, num_pages: int, prefix: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page plus at least one usable page")
        self.num_pages = num_pages
        self.prefix = prefix
        self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low page ids first
        self._ref = [0] * num_pages
        self._page_of: dict[bytes, int] = {}             # prefix hash -> cached page
        self._hash_of: dict[int, bytes] = {}             # cached page -> its hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recently used first
        self._evicted: list[tuple[int, bytes]] = []

    @property
    def capacity(self) -> int:
        """Usable pages (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: the free list plus unreferenced cached pages (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages some request holds."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered pages (held or not)."""
        return len(self._hash_of)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1. Raises OutOfPages (allocating nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(n, self.num_free)
        while len(self._free) < n:                       # evict the least recently used cached pages
            page, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(page)
            del self._page_of[h]
            self._evicted.append((page, h))
            self._free.append(page)
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._ref[p] = 1
        return out

    def share(self, pages: Iterable[int]) -> None:
        """Add one owner to each page (all must be in use): prefix sharing between requests."""
        pages = list(pages)
        for p in pages:
            self._check_live(p)
        for p in pages:
            self._ref[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one owner from each page; pages whose count reaches 0 return to the free list (cached ones to
        the LRU list, most recently used last)."""
        pages = list(pages)
        drop: dict[int, int] = {}
        for p in pages:
            drop[p] = drop.get(p, 0) + 1
        for p, n in drop.items():           # validate everything before changing anything
            self._check_live(p)
            if n > self._ref[p]:
                raise ValueError(f"page {p} freed {n} times but has {self._ref[p]} owner(s)")
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached pages of the longest run of `hashes` from the first, each with one more owner."""
        if not self.prefix:
            return []
        out = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            out.append(p)
        for p in out:
            if self._ref[p] == 0:
                del self._lru[p]
            self._ref[p] += 1
        return out

    def contains(self, h: bytes) -> bool:
        return h in self._page_of

    def register(self, page: int, h: bytes) -> bool:
        """Cache a held, full, written page under `h`. False (nothing changes) when the prefix cache is off, `h`
        is already cached (another page holds the same tokens) or the page is registered already."""
        self._check_live(page)
        if not self.prefix or h in self._page_of or page in self._hash_of:
            return False
        self._page_of[h] = page
        self._hash_of[page] = h
        return True

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(page, hash) of every cached page evicted since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def _check_live(self, p: int) -> None:
        if not 0 < p < self.num_pages:
            raise ValueError(f"page {p} is not an allocatable page (1..{self.num_pages - 1})")
        if self._ref[p] == 0:
            raise ValueError(f"page {p} is not allocated")
