"""The prefix cache's disk tier: pages evicted from the host tier, one file each in a directory, LRU.

A file is a header (magic, the engine's fingerprint: model, KV format and page layout; the page's prefix hash;
the payload's length and BLAKE2b checksum) and the page's row (nfjax/kv/prefix_cache.py). A file that is
missing, unreadable or fails any check is a miss: the engine warns and recomputes the page, never loads it. The
directory belongs to one engine at a time (an exclusive lock on `LOCK`); an unwritable directory or too little
free space for the tier is an error at start; a write that fails later (disk full, I/O error) drops the page with
a warning and the engine goes on. Page files left by an earlier engine are removed at start and at close.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import struct
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from nfjax.config import ConfigError

MAGIC = b"NFJXKV01"
_HEAD = struct.Struct("<8s16s16sQ16s")          # magic, fingerprint, page hash, payload bytes, checksum
SUFFIX = ".kvpage"


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity: int, row_bytes: int, stats, fingerprint: bytes):
        self.dir = Path(directory)
        self.capacity, self.row_bytes, self.stats, self.fingerprint = capacity, row_bytes, stats, fingerprint
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._lock = None
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

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    def put(self, h: bytes, row: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        data = np.ascontiguousarray(row).tobytes()
        head = _HEAD.pack(MAGIC, self.fingerprint, h, len(data), hashlib.blake2b(data, digest_size=16).digest())
        tmp = self.dir / (h.hex() + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(data)
            os.replace(tmp, self.path(h))
        except OSError as e:
            self.stats.disk_errors += 1
            warnings.warn(f"prefix cache disk tier: writing a page failed ({e.strerror or e}); the page is dropped "
                          "and will be recomputed", RuntimeWarning, stacklevel=2)
            tmp.unlink(missing_ok=True)
            return
        self.stats.bytes_to_disk += len(data)
        self._lru[h] = None
        self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            old, _ = self._lru.popitem(last=False)
            self.path(old).unlink(missing_ok=True)

    def pop(self, h: bytes) -> np.ndarray | None:
        """The page's row, or None (a miss: not here, or its file missing or corrupt, with a warning)."""
        if h not in self._lru:
            return None
        del self._lru[h]
        p = self.path(h)
        why = None
        try:
            raw = p.read_bytes()
        except OSError as e:
            raw, why = b"", f"unreadable ({e.strerror or e})"
        p.unlink(missing_ok=True)
        if why is None:
            if len(raw) < _HEAD.size:
                why = "truncated"
            else:
                magic, fp, hh, n, digest = _HEAD.unpack_from(raw)
                data = raw[_HEAD.size:]
                if magic != MAGIC or fp != self.fingerprint or hh != h:
                    why = "written for another engine or page"
                elif n != len(data) or n != self.row_bytes:
                    why = "truncated"
                elif hashlib.blake2b(data, digest_size=16).digest() != digest:
                    why = "checksum mismatch"
        if why is not None:
            self.stats.disk_errors += 1
            warnings.warn(f"prefix cache disk tier: {p.name} is {why}; recomputing the page", RuntimeWarning,
                          stacklevel=2)
            return None
        self.stats.bytes_from_disk += len(data)
        return np.frombuffer(data, np.uint8).copy()

    def _clear(self) -> None:
        for f in list(self.dir.glob("*" + SUFFIX)) + list(self.dir.glob("*.tmp")):
            f.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the page files and release the directory."""
        if self._lock is None:
            return
        self._clear()
        self._lru.clear()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None
