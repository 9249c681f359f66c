"""The prefix cache's disk tier: pages evicted from the host tier, one file each in a directory, LRU.

A file is a header (magic, the engine's fingerprint: model, KV format and page layout; the page's prefix hash;
the payload's length and BLAKE2b checksum) and the page's row (nfjax/kv/prefix_cache.py). A file that is
missing, unreadable or fails any check is a miss: the engine warns and recomputes the page, never loads it. The
directory belongs to one engine at a time (an exclusive lock on `LOCK`); an unwritable directory or too little
free space for the tier is an error at start; a write that fails later (disk full, I/O error) drops the page with
a warning and the engine goes on. Page files left by an earlier engine are removed at start and at close.

`background=True` (the engine's): `put` queues the row and returns; one writer thread checksums and writes it
(both release the GIL: at 8B a page is 2 MiB, ~3 ms of BLAKE2b and a few ms of writing, which ran on the
engine's loop between steps for every page the host tier spilled). A queued page is in the tier at once: `pop`
hands back its row without touching the disk. Write failures are warned on the caller's thread (next `put`,
`pop` or `flush`). At most `MAX_QUEUED` rows wait; a `put` beyond that drops its page (`disk_writes_dropped`):
it used to wait for the writer, which held the engine's loop to the disk's write rate (0.63 GB/s on the H100
box: ~300 pages of 2 MiB a second, far below the rate the host tier spills at 8B).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import queue
import shutil
import struct
import threading
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from nfjax.config import ConfigError

MAGIC = b"NFJXKV01"
_HEAD = struct.Struct("<8s16s16sQ16s")          # magic, fingerprint, page hash, payload bytes, checksum
SUFFIX = ".kvpage"
MAX_QUEUED = 256                                 # rows waiting for the background writer (512 MiB at 8B)


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity: int, row_bytes: int, stats, fingerprint: bytes,
                 background: bool = False):
        self.dir = Path(directory)
        self.capacity, self.row_bytes, self.stats, self.fingerprint = capacity, row_bytes, stats, fingerprint
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._lock = None
        self._mu = threading.Lock()                  # _lru, _pending, _failures and the stats, with the writer
        self._pending: dict[bytes, np.ndarray] = {}  # queued rows not yet written
        self._failures: list[str] = []
        self._queue: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        flag = "--disk-cache-dir / cache.disk_cache_dir"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.dir / "LOCK", "a+")
        except OSError as e:
            raise ConfigError(f"{flag} {str(self.dir)!r} cannot be used: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            raise ConfigError(f"{flag} {str(self.dir)!r} is in use by another engine (its LOCK file is held)") from None
        self._clear()
        probe = self.dir / f".probe-{os.getpid()}"
        try:
            probe.write_bytes(b"x" * 4096)
            probe.unlink()
        except OSError as e:
            self.close()
            raise ConfigError(f"{flag} {str(self.dir)!r} is not writable: {e.strerror or e}") from None
        need = capacity * (row_bytes + _HEAD.size)
        free = shutil.disk_usage(self.dir).free
        if need > free:
            self.close()
            raise ConfigError(f"--disk-cache-gb / cache.disk_cache_gb asks for {need / 2 ** 30:.3g} GiB but "
                              f"{str(self.dir)!r} has {free / 2 ** 30:.3g} GiB free")
        if background:
            self._queue = queue.Queue(MAX_QUEUED)
            self._writer = threading.Thread(target=self._write_loop, name="nfjax-disk-tier", daemon=True)
            self._writer.start()

    def __len__(self) -> int:
        return len(self._lru)

    def backlog(self) -> int:
        """Pages queued for the background writer and not written yet."""
        with self._mu:
            return len(self._pending)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    def _write(self, h: bytes, row: np.ndarray) -> str | None:
        """The page's file (written whole, then renamed into place); an error's text, or None."""
        data = memoryview(np.ascontiguousarray(row).reshape(-1))
        head = _HEAD.pack(MAGIC, self.fingerprint, h, data.nbytes, hashlib.blake2b(data, digest_size=16).digest())
        tmp = self.dir / (h.hex() + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(data)
            os.replace(tmp, self.path(h))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            return str(e.strerror or e)
        return None

    def _warn_write(self, why: str) -> None:
        warnings.warn(f"prefix cache disk tier: writing a page failed ({why}); the page is dropped and will be "
                      "recomputed", RuntimeWarning, stacklevel=3)

    def _report(self) -> None:
        """Warn (on this thread) about the background writer's failures since the last call."""
        if self._failures:
            with self._mu:
                failed, self._failures = self._failures, []
            for why in failed:
                self._warn_write(why)

    def _evict_over_capacity(self) -> list[bytes]:
        """(Under _mu) drop the least recently used pages over capacity; the hashes whose files to remove."""
        gone = []
        while len(self._lru) > self.capacity:
            old, _ = self._lru.popitem(last=False)
            if self._pending.pop(old, None) is None:
                gone.append(old)
        return gone

    def put(self, h: bytes, row: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        if self._queue is not None:
            self._report()
            if self._queue.full():                   # the disk cannot keep up: drop the page, never wait for it
                with self._mu:
                    self.stats.disk_writes_dropped += 1
                return
            with self._mu:
                self._pending[h] = row
                self._lru[h] = None
                self._lru.move_to_end(h)
                gone = self._evict_over_capacity()
            for old in gone:
                self.path(old).unlink(missing_ok=True)
            self._queue.put_nowait(h)                # (this thread alone puts: not full, checked above)
            return
        why = self._write(h, row)
        if why is not None:
            self.stats.disk_errors += 1
            self._warn_write(why)
            return
        self.stats.bytes_to_disk += row.nbytes
        self._lru[h] = None
        self._lru.move_to_end(h)
        for old in self._evict_over_capacity():
            self.path(old).unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            h = self._queue.get()
            try:
                if h is None:
                    return
                with self._mu:
                    row = self._pending.get(h)
                if row is None:
                    continue                          # taken back or dropped before its turn
                t0 = time.perf_counter()
                why = self._write(h, row)
                with self._mu:
                    self.stats.disk_write_s += time.perf_counter() - t0
                    current = self._pending.get(h) is row
                    if current:
                        del self._pending[h]
                    if why is not None:
                        self.stats.disk_errors += 1
                        self._failures.append(why)
                        if current:
                            self._lru.pop(h, None)
                    else:
                        self.stats.bytes_to_disk += row.nbytes
                    stale = why is None and not current and h not in self._lru
                if stale:                             # taken back or dropped while it was being written
                    self.path(h).unlink(missing_ok=True)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued page is written (and warn about failures)."""
        if self._queue is not None:
            self._queue.join()
            self._report()

    def pop(self, h: bytes) -> np.ndarray | None:
        """The page's row, or None (a miss: not here, or its file missing or corrupt, with a warning)."""
        self._report()
        with self._mu:
            if h not in self._lru:
                return None
            del self._lru[h]
            row = self._pending.pop(h, None)
            if row is not None:                       # still queued: the row itself, no file involved
                self.stats.bytes_from_disk += row.nbytes
                return row
        p = self.path(h)
        why = None
        try:
            raw = p.read_bytes()
        except OSError as e:
            raw, why = b"", f"unreadable ({e.strerror or e})"
        p.unlink(missing_ok=True)
        data = memoryview(raw)[_HEAD.size:]           # no copies of the payload (2 MiB at 8B) on the way
        if why is None:
            if len(raw) < _HEAD.size:
                why = "truncated"
            else:
                magic, fp, hh, n, digest = _HEAD.unpack_from(raw)
                if magic != MAGIC or fp != self.fingerprint or hh != h:
                    why = "written for another engine or page"
                elif n != len(data) or n != self.row_bytes:
                    why = "truncated"
                elif hashlib.blake2b(data, digest_size=16).digest() != digest:
                    why = "checksum mismatch"
        with self._mu:                                # (the writer thread counts too)
            if why is not None:
                self.stats.disk_errors += 1
            else:
                self.stats.bytes_from_disk += len(data)
        if why is not None:
            warnings.warn(f"prefix cache disk tier: {p.name} is {why}; recomputing the page", RuntimeWarning,
                          stacklevel=2)
            return None
        return np.frombuffer(raw, np.uint8, offset=_HEAD.size)      # read-only: rows are never written

    def _clear(self) -> None:
        for f in list(self.dir.glob("*" + SUFFIX)) + list(self.dir.glob("*.tmp")):
            f.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the page files and release the directory."""
        if self._lock is None:
            return
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
            self._pending.clear()
        self._clear()
        self._lru.clear()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None
