"""The prefix cache's slower tiers: host memory (and, below it, disk), LRU, holding pages as uint8 rows
(nfjax/kv/prefix_cache.py). Tiers are exclusive: a page lives in one tier at a time. A page evicted from the
GPU goes to the host tier; one evicted from the host tier goes to the disk tier when there is one (else it is
dropped); a hit moves the page back to the GPU.

A hit must beat recomputation (`TierRates`): loading a page from a tier costs its row's bytes over the tier's
rates (disk: read, then host->device), recomputing it costs its tokens x 2 x the active parameters (less the
embedding and the head) over the device's GEMM rate. The walk takes a tier's pages only where loading wins;
a tier that cannot win is not written either (the host tier: evictions are dropped; the disk tier: nothing is
spilled). docs/design.md section 13.

A host row is a numpy array, a `LazyRow` (its device->host copy still running, numpy path), a `PoolRow` (a slot
of the pinned pool, nfjax/kv/host_pool.py), or a JAX array in the `pinned_host` memory kind (its copy may still
run: `is_ready()`)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np

from nfjax.kv.tier_admission import SaveGate, save_bar


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
    skipped_pages_host: int = 0     # pages a prefix walk found in a tier but recomputed: loading was slower
    skipped_pages_disk: int = 0
    evictions_dropped: int = 0      # evicted GPU pages not copied out (the host tier cannot beat recompute)
    evictions_skipped: int = 0      # ... not copied because too few copies are hit (nfjax/kv/tier_admission.py)
    ghost_hits: int = 0             # prefix walks' misses on pages the gate skipped (they count towards reopening it)
    tier_load_s: float = 0.0        # engine thread's seconds in tier hits: fetching rows (disk reads) and loading
    evict_s: float = 0.0            # ... in evictions: launching the copies out, settling them, spilling to disk
    evict_launch_s: float = 0.0     # ... of which launching the copy programs (their host rows allocated)
    disk_write_s: float = 0.0       # the disk tier's writer thread's seconds (beside the loop, not on it)
    disk_writes_dropped: int = 0    # pages spilled while the disk writer's queue was full: dropped, not waited for
    pinned_reserve_s: float = 0.0   # at start: allocating the host tier's pinned pool (nfjax/kv/host_pool.py)
    pinned_reserve_wait_s: float = 0.0   # ... of which start waited for (the rest ran beside the compile)

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_gpu + self.hit_tokens_host + self.hit_tokens_disk

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_tokens"] = self.hit_tokens
        d["hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return d


# Defaults where nothing is measured or configured. GPU: an H100 (docs/design.md section 13, issue #23): host
# -> device 5.1 GB/s from pageable numpy, 40.8 from pinned_host arrays, disk reads 1.45 GB/s, bf16 GEMMs at
# ~690 TFLOP/s. CPU: a small machine's memcpy and disk, and a GEMM rate of a few cores.
DEFAULT_RATES = {
    "gpu": dict(gemm_flops=690e12, host_bytes_s=5.1e9, pinned_bytes_s=40.8e9, disk_bytes_s=1.45e9),
    "cpu": dict(gemm_flops=50e9, host_bytes_s=5e9, pinned_bytes_s=5e9, disk_bytes_s=1e9),
}


@dataclass
class TierRates:
    """What a tier hit costs against recomputing its page (seconds a page). `flops_per_token`: 2 x the active
    parameters a prompt token runs through (embedding and head excluded; attention over the prefix, which
    grows with the position, left out: recompute is estimated low, so a load must win clearly)."""
    page_tokens: int
    row_bytes: int
    flops_per_token: float
    gemm_flops: float               # the recompute's FLOP/s (all devices of the mesh together)
    host_bytes_s: float             # host tier -> device, bytes/s (pinned rows' rate where rows are pinned)
    disk_bytes_s: float             # disk tier reads, bytes/s
    source: dict = field(default_factory=dict)   # rate name -> "default" | "measured" | "configured"
    disk_h2d_bytes_s: float | None = None        # a row read from disk (numpy, pageable) -> device; None: host's

    def recompute_s(self) -> float:
        return self.page_tokens * self.flops_per_token / self.gemm_flops

    def load_s(self, tier: str) -> float:
        if tier == "disk":
            return self.row_bytes / self.disk_bytes_s + self.row_bytes / (self.disk_h2d_bytes_s or self.host_bytes_s)
        return self.row_bytes / self.host_bytes_s

    def wins(self, tier: str) -> bool:
        return self.load_s(tier) < self.recompute_s()

    def as_dict(self) -> dict:
        return {"recompute_ms_per_page": self.recompute_s() * 1e3, "host_load_ms_per_page": self.load_s("host") * 1e3,
                "disk_load_ms_per_page": self.load_s("disk") * 1e3, "gemm_tflops": self.gemm_flops / 1e12,
                "host_gbps": self.host_bytes_s / 1e9, "disk_gbps": self.disk_bytes_s / 1e9,
                "rate_sources": dict(self.source)}

    def line(self) -> str:
        def verdict(t):
            return "used" if self.wins(t) else "NOT used (recompute is cheaper)"
        return (f"prefix tiers: a page ({self.row_bytes / 2 ** 20:.3g} MiB) recomputes in "
                f"{self.recompute_s() * 1e3:.3g} ms ({self.gemm_flops / 1e12:.3g} TFLOP/s); loads from host in "
                f"{self.load_s('host') * 1e3:.3g} ms ({self.host_bytes_s / 1e9:.3g} GB/s): {verdict('host')}; from "
                f"disk in {self.load_s('disk') * 1e3:.3g} ms ({self.disk_bytes_s / 1e9:.3g} GB/s): {verdict('disk')}")


def flops_per_token(model_cfg) -> float:
    """2 x the parameters one prompt token runs through in prefill: the active ones, less the embedding
    (a lookup) and the head (run for the last token only). 8B: 13.9 GFLOP."""
    m = model_cfg
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return 2.0 * max(m.num_active_params() - embed, 1)


def is_ready(row) -> bool:
    """The row's bytes are on the host (reading it waits for nothing)."""
    if isinstance(row, np.ndarray):
        return True
    ready = getattr(row, "ready", None)           # LazyRow
    return ready() if ready is not None else row.is_ready()


def _host_row(row):
    """A row to hand on: numpy and pinned rows as they are; a `LazyRow` or a pool slot (`PoolRow`) read back now."""
    return row.get() if hasattr(row, "pending") or hasattr(row, "slot") else row


class HostTier:
    """Rows in host memory, at most `capacity` pages, least recently used first out (to `spill`). A row may be
    put while its device->host copy is still running (a `LazyRow` or a pinned array not yet ready): the tier
    does not spill it before it is ready, `settle` replaces a lazy row by its bytes in place; a hit before
    that reads it back first."""
    name = "host"

    def __init__(self, capacity: int, row_bytes: int, stats: PrefixStats, spill=None):
        self.capacity, self.row_bytes, self.stats, self.spill = capacity, row_bytes, stats, spill
        self._rows: OrderedDict[bytes, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, h: bytes) -> bool:
        return h in self._rows

    def put(self, h: bytes, row) -> None:
        self._rows[h] = row
        self._rows.move_to_end(h)
        self._shrink()

    def make_room(self, n: int, free=None) -> None:
        """Room for `n` more rows now (least recently used out first): a pool's rows free their slots before
        the copies that need them are launched. `free()`: the pool's free slots, which rows taken out for a
        load still hold until it is launched; rows go until it reaches `n` too."""
        self._shrink(self.capacity - n)
        while free is not None and free() < n and self._rows:
            self._shrink(len(self._rows) - 1)

    def _shrink(self, limit: int | None = None) -> None:
        """Over capacity (or `limit`): the least recently used rows to `spill` (dropped without one). A row still
        coming waits (the tier is over capacity until it is ready): reading it back now could wait for the step
        in flight."""
        limit = self.capacity if limit is None else max(limit, 0)
        while len(self._rows) > limit:
            old, r = next(iter(self._rows.items()))
            if self.spill is not None and not is_ready(r):
                return
            del self._rows[old]
            if self.spill is not None:
                self.spill.put(old, _host_row(r))

    def pop(self, h: bytes):
        row = self._rows.pop(h, None)
        if row is None:
            return None
        return row.get() if hasattr(row, "pending") else row       # a pool row is loaded from its slot

    def settle(self, h: bytes, lazy) -> None:
        """`lazy`'s bytes in its place, if the tier still holds it (its LRU position unchanged)."""
        if hasattr(lazy, "pending") and self._rows.get(h) is lazy:
            self._rows[h] = lazy.get()
        self._shrink()


class PrefixTiers:
    """The host tier and an optional disk tier below it, as one lookup. `rates` (None: every hit is taken)
    decides which tiers are read and written (module doc); `set_rates` applies new ones."""

    def __init__(self, host: HostTier, disk=None, rates: TierRates | None = None):
        self.host, self.disk = host, disk
        self.rates = None
        self.use_host = self.use_disk = True
        self.gate = SaveGate(host.capacity)
        self.set_rates(rates)

    def set_rates(self, rates: TierRates | None) -> None:
        """New rates: which tiers are read and written, and the bar of the save gate (its rate back to 1)."""
        self.rates = rates
        self.use_host = rates is None or rates.wins("host")
        self.use_disk = self.disk is not None and self.use_host and (rates is None or rates.wins("disk"))
        self.host.spill = self.disk if self.use_disk else None
        self.gate.reset(None if rates is None else save_bar(rates.load_s("host"), rates.recompute_s()))

    def admit(self, evicted: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """The evicted (page, hash) pairs worth copying to the host tier (`SaveGate`); the rest are skipped."""
        out = self.gate.admit(evicted)
        self.host.stats.evictions_skipped += len(evicted) - len(out)
        return out

    def put(self, h: bytes, row) -> None:
        self.host.stats.bytes_to_host += row.nbytes
        self.host.put(h, row)

    def fetch(self, hashes: list[bytes], limit: int) -> list[tuple[object, str]]:
        """Rows of the longest run of `hashes` (at most `limit`) found in the tiers where loading beats
        recomputing, with the tier of each; taken out of the tiers (the GPU holds them next). A page found in
        a tier that loses ends the run (it and the rest are recomputed) and is counted in `skipped_pages_*`."""
        t0 = time.perf_counter()
        out = []
        stats = self.host.stats
        for h in hashes[:max(limit, 0)]:
            if h in self.host:
                if not self.use_host:
                    stats.skipped_pages_host += 1
                    break
                row, tier = self.host.pop(h), "host"
            elif self.disk is not None and h in self.disk:
                if not self.use_disk:
                    stats.skipped_pages_disk += 1
                    break
                row, tier = self.disk.pop(h), "disk"
            else:
                row = None
            if row is None:                     # a miss: had the gate copied these pages, they would hit
                stats.ghost_hits += self.gate.missed(hashes[len(out):max(limit, 0)])
                break
            out.append((row, tier))
        self.gate.hit(hashes[:len(out)])
        stats.tier_load_s += time.perf_counter() - t0
        return out

    def stats_dict(self) -> dict:
        """The tiers' decisions and rates, and the disk writer's backlog, for `prefix_stats`."""
        d = {"host_tier_used": self.use_host, "disk_tier_used": self.use_disk,
             "disk_write_backlog": self.disk.backlog() if self.disk is not None else 0}
        if self.rates is not None:
            d["tier_rates"] = self.rates.as_dict()
        g = self.gate
        d.update(tier_save_rate=g.rate, tier_save_bar=g.bar, tier_save_open=g.open)
        return d

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
