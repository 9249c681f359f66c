"""Which pages the GPU evicts are worth copying to the host tier (docs/design.md section 13).

Copying a row out costs about what loading it back does: the same bytes over the same link, and on a GPU both
run on the one stream, serial with the steps. A later hit saves the page's recompute less its load. So copying
pays when the share R of copied pages that are hit later exceeds load / (recompute - load): 0.38 at 8B on the H100
(0.324 ms recompute, 0.09 ms load at the measured 23 GB/s). Where nothing is ever reused (a single-round
workload) every copy is wasted: on the H100 the tiers made single-round runs 4.9-7.6% slower.

R is measured over the recent evictions (`window` pages, exponentially weighted, starting at 1: copy until shown
otherwise). Hits are tier hits, plus misses on pages this gate left out, *ghosts*: they would have been hits, so
a gate that stopped copying still sees the reuse that would reopen it. While R is under the bar only pages that
were reused before (loaded from a tier, or a ghost hit) are copied, so shared prefixes keep their copies.

Prior art: SGLang's HiCache `write_through_selective` copies a node only after a hit-count threshold; vLLM's CPU
offloading and LMCache copy every computed block, on a separate CUDA stream; NanoFlow copies each layer's new K/V
during the step, overlapped. JAX gives the engine no second stream, so the copies here are serial with the steps
and the gate decides instead what is copied."""
from __future__ import annotations

import math
from collections import OrderedDict


class SaveGate:
    """`admit(evicted)` keeps the pages to copy; `hit(hashes)` and `missed(hashes)` (from the tiers' prefix walk)
    feed R. `bar`: the R above which every page is copied (None: always copy). `capacity`: ghosts and reused
    hashes remembered (the host tier's rows: an older ghost would have left the tier unused anyway)."""

    def __init__(self, capacity: int, bar: float | None = None, window: int = 1024):
        self.capacity, self.window = max(capacity, 1), window
        self.enabled = True
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()    # hashes this gate left out, oldest first
        self.reused: OrderedDict[bytes, None] = OrderedDict()    # hashes reused before: always copied
        self.skipped = self.ghost_hits = 0
        self.reset(bar)

    def reset(self, bar: float | None) -> None:
        """A new bar (the tiers' rates changed) and R back to its prior (1: copy until shown otherwise)."""
        self.bar = bar
        self._hits = self._seen = float(self.window)

    @property
    def rate(self) -> float:
        """R: hits per evicted page over the recent window."""
        return self._hits / self._seen

    @property
    def open(self) -> bool:
        """Every evicted page is copied."""
        return not self.enabled or self.bar is None or self.rate >= self.bar

    def admit(self, evicted: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """The (page, hash) pairs of `evicted` to copy out; the others become ghosts (counted in `skipped`)."""
        if not evicted:
            return evicted
        keep = math.exp(-len(evicted) / self.window)
        self._hits *= keep
        self._seen = self._seen * keep + len(evicted)       # ~`window` in steady state, as the prior
        if self.open:
            for _, h in evicted:                # copied now: no longer a ghost
                self.ghosts.pop(h, None)
            return evicted
        out = []
        for page, h in evicted:
            if h in self.reused:
                out.append((page, h))
                continue
            self._remember(self.ghosts, h)
            self.skipped += 1
        return out

    def hit(self, hashes) -> None:
        """Pages found in a tier: reused (copied whenever they are evicted again)."""
        n = 0
        for h in hashes:
            self._remember(self.reused, h)
            n += 1
        self._hits += n

    def missed(self, hashes) -> int:
        """A prefix walk stopped at `hashes[0]`: the run of ghosts from there would have been hits had they been
        copied. They count as hits, become reused, and stop being ghosts. Returns their number."""
        n = 0
        for h in hashes:
            if h not in self.ghosts:
                break
            del self.ghosts[h]
            self._remember(self.reused, h)
            n += 1
        self._hits += n
        self.ghost_hits += n
        return n

    def _remember(self, d: OrderedDict, h: bytes) -> None:
        d[h] = None
        d.move_to_end(h)
        while len(d) > self.capacity:
            d.popitem(last=False)

    def stats(self) -> dict:
        return {"tier_save_rate": self.rate, "tier_save_bar": self.bar, "tier_save_open": self.open,
                "evictions_skipped": self.skipped, "ghost_hits": self.ghost_hits}


def save_bar(load_s: float, recompute_s: float) -> float:
    """The hit share above which copying evicted pages pays: a copy costs about a load, a hit saves recompute
    less the load (inf where loading loses: the tier is not used then anyway)."""
    gain = recompute_s - load_s
    return load_s / gain if gain > 0 else math.inf
