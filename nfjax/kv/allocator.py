"""Host-side page allocator for the paged KV cache: a free list plus reference counts.

Page 0 is reserved as the scratch page (padding tokens write their K/V there) and is never handed out.
Reference counts make prefix sharing possible: `share(pages)` adds an owner to pages already in use, and a
page returns to the free list only when its last owner frees it.
"""
from __future__ import annotations

from collections.abc import Iterable

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    """Raised by `PageAllocator.allocate` when fewer pages are free than asked for; the batcher catches
    it (or checks `num_free` first) to defer or preempt a request. Nothing is allocated when it is raised."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"need {requested} KV pages, only {free} free")
        self.requested, self.free = requested, free


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the scratch page plus at least one usable page")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low page ids first
        self._ref = [0] * num_pages

    @property
    def capacity(self) -> int:
        """Usable pages (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1. Raises OutOfPages (allocating nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
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
        """Drop one owner from each page; pages whose count reaches 0 return to the free list."""
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
                self._free.append(p)

    def _check_live(self, p: int) -> None:
        if not 0 < p < self.num_pages:
            raise ValueError(f"page {p} is not an allocatable page (1..{self.num_pages - 1})")
        if self._ref[p] == 0:
            raise ValueError(f"page {p} is not allocated")
