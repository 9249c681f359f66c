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

Eviction order. Plain LRU is the worst order for a chat workload: a conversation's next turn waits in a FIFO
queue while its history's pages sit unreferenced, so the least recently freed pages are those of the request
admitted next (a cyclic access pattern) and LRU evicts exactly them. So (1) pages are freed tail first, so that a
request's last pages are evicted before its first ones and the head of a prefix survives longest (a lookup only
uses a run from the first page); (2) pages whose hash a waiting request's prompt holds (`want`) are evicted only
when no other cached page is left, the most recently wanted first (the request at the back of the queue).
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
        self._wanted_lru: OrderedDict[int, None] = OrderedDict()  # ... whose hash a waiting request wants
        self._want: dict[bytes, int] = {}                # hash -> how many waiting requests want it
        self._evicted: list[tuple[int, bytes]] = []

    @property
    def capacity(self) -> int:
        """Usable pages (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: the free list plus unreferenced cached pages (evicted on demand)."""
        return len(self._free) + len(self._lru) + len(self._wanted_lru)

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
            if self._lru:
                page, _ = self._lru.popitem(last=False)
            else:                                        # only wanted ones left: the last wanted goes first
                page, _ = self._wanted_lru.popitem(last=True)
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
        the LRU list, most recently used last, a request's pages tail first: its last page is evicted first)."""
        pages = list(pages)
        drop: dict[int, int] = {}
        for p in pages:
            drop[p] = drop.get(p, 0) + 1
        for p, n in drop.items():           # validate everything before changing anything
            self._check_live(p)
            if n > self._ref[p]:
                raise ValueError(f"page {p} freed {n} times but has {self._ref[p]} owner(s)")
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                h = self._hash_of.get(p)
                if h is None:
                    self._free.append(p)
                elif h in self._want:
                    self._wanted_lru[p] = None
                else:
                    self._lru[p] = None

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
                if p in self._lru:
                    del self._lru[p]
                else:
                    del self._wanted_lru[p]
            self._ref[p] += 1
        return out

    def want(self, hashes: Iterable[bytes]) -> None:
        """A waiting request's prompt holds `hashes`: their cached pages are evicted last (see the module doc)."""
        if not self.prefix:
            return
        for h in hashes:
            self._want[h] = self._want.get(h, 0) + 1
            p = self._page_of.get(h)
            if p is not None and self._ref[p] == 0:
                self._lru.pop(p, None)
                self._wanted_lru.pop(p, None)
                self._wanted_lru[p] = None               # the newest want: evicted first among the wanted

    def unwant(self, hashes: Iterable[bytes]) -> None:
        """Undo one `want(hashes)` (the request was admitted or left the queue)."""
        if not self.prefix:
            return
        for h in hashes:
            n = self._want.get(h, 0) - 1
            if n > 0:
                self._want[h] = n
                continue
            self._want.pop(h, None)
            p = self._page_of.get(h)
            if p is not None and p in self._wanted_lru:
                del self._wanted_lru[p]
                self._lru[p] = None                      # back among the others, as just used

    def contains(self, h: bytes) -> bool:
        return h in self._page_of

    def num_wanted(self) -> int:
        """Unreferenced cached pages some waiting request wants."""
        return len(self._wanted_lru)

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
