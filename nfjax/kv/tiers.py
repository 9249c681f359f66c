"""The prefix cache's slower tiers: host memory (and, below it, disk), LRU, holding pages as uint8 rows
(nfjax/kv/prefix_cache.py). Tiers are exclusive: a page lives in one tier at a time. A page evicted from the
GPU goes to the host tier; one evicted from the host tier goes to the disk tier when there is one (else it is
dropped); a hit moves the page back to the GPU."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class PrefixStats:
    prompt_tokens: int = 0          # prompt tokens of admitted requests
    hit_tokens_gpu: int = 0         # of which reused from cached GPU pages
    hit_tokens_host: int = 0        # ... loaded back from host memory
    hit_tokens_disk: int = 0        # ... loaded back from disk
    bytes_to_host: int = 0          # GPU -> host (evictions)
    bytes_from_host: int = 0        # host -> GPU (hits in either slower tier)
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    disk_errors: int = 0            # tier files missing, corrupt or unwritable: recomputed instead

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_gpu + self.hit_tokens_host + self.hit_tokens_disk

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_tokens"] = self.hit_tokens
        d["hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return d


def _host_row(row) -> np.ndarray:
    """A row, or a `LazyRow` still coming from the device (nfjax/kv/prefix_cache.py) read back now."""
    return row if isinstance(row, np.ndarray) else row.get()


class HostTier:
    """Rows in host memory, at most `capacity` pages, least recently used first out (to `spill`). A row may be
    put while its device->host copy is still running (a `LazyRow`): `settle` replaces it by its bytes in place;
    a hit or a spill before that reads it back first."""
    name = "host"

    def __init__(self, capacity: int, row_bytes: int, stats: PrefixStats, spill=None):
        self.capacity, self.row_bytes, self.stats, self.spill = capacity, row_bytes, stats, spill
        self._rows: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, h: bytes) -> bool:
        return h in self._rows

    def put(self, h: bytes, row) -> None:
        self._rows[h] = row
        self._rows.move_to_end(h)
        self._shrink()

    def _shrink(self) -> None:
        """Over capacity: the least recently used rows to `spill` (dropped without one). A lazy row there waits
        (the tier is over capacity until it settles): reading it back now could wait for the step in flight."""
        while len(self._rows) > self.capacity:
            old, r = next(iter(self._rows.items()))
            if self.spill is not None and not isinstance(r, np.ndarray) and not r.ready():
                return
            del self._rows[old]
            if self.spill is not None:
                self.spill.put(old, _host_row(r))

    def pop(self, h: bytes) -> np.ndarray | None:
        row = self._rows.pop(h, None)
        return None if row is None else _host_row(row)

    def settle(self, h: bytes, lazy) -> None:
        """`lazy`'s bytes in its place, if the tier still holds it (its LRU position unchanged)."""
        if self._rows.get(h) is lazy:
            self._rows[h] = lazy.get()
        self._shrink()


class PrefixTiers:
    """The host tier and an optional disk tier below it, as one lookup."""

    def __init__(self, host: HostTier, disk=None):
        self.host, self.disk = host, disk

    def put(self, h: bytes, row: np.ndarray) -> None:
        self.host.stats.bytes_to_host += row.nbytes
        self.host.put(h, row)

    def fetch(self, hashes: list[bytes], limit: int) -> list[tuple[np.ndarray, str]]:
        """Rows of the longest run of `hashes` (at most `limit`) found in the tiers, with the tier of each;
        taken out of the tiers (the GPU holds them next)."""
        out = []
        for h in hashes[:max(limit, 0)]:
            row = self.host.pop(h)
            tier = "host"
            if row is None and self.disk is not None:
                row, tier = self.disk.pop(h), "disk"
            if row is None:
                break
            out.append((row, tier))
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
