"""The prefix cache's disk tier: LRU files with checksums; a missing or corrupt file is a miss with a warning;
one engine per directory; unwritable directory or too little space is an error at start; later write failures
drop the page and go on."""
import os

import numpy as np
import pytest

from nfjax.config import ConfigError
from nfjax.kv.disk_tier import SUFFIX, DiskTier
from nfjax.kv.prefix_cache import ROOT, chain_hash
from nfjax.kv.tiers import PrefixStats

FP = b"f" * 16


def h(i):
    return chain_hash(ROOT, [i])


def row(i, n=64):
    return np.arange(n, dtype=np.uint8) + i


def test_round_trip_lru_and_cleanup(tmp_path):
    st = PrefixStats()
    d = DiskTier(tmp_path, 2, 64, st, FP)
    for i in range(3):
        d.put(h(i), row(i))
    assert len(d) == 2 and not d.path(h(0)).exists() and d.pop(h(0)) is None      # LRU: the oldest went
    np.testing.assert_array_equal(d.pop(h(1)), row(1))
    assert not d.path(h(1)).exists() and h(1) not in d                            # taken out: the GPU holds it
    assert st.bytes_to_disk == 3 * 64 and st.bytes_from_disk == 64 and st.disk_errors == 0
    d.close()
    assert not list(tmp_path.glob("*" + SUFFIX))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "other_engine"])
def test_damaged_file_is_a_miss_with_a_warning(tmp_path, damage):
    st = PrefixStats()
    d = DiskTier(tmp_path, 4, 64, st, FP)
    d.put(h(0), row(0))
    p = d.path(h(0))
    raw = bytearray(p.read_bytes())
    if damage == "flip":
        raw[-1] ^= 1
        p.write_bytes(bytes(raw))
    elif damage == "truncate":
        p.write_bytes(bytes(raw[:-8]))
    elif damage == "delete":
        p.unlink()
    else:
        other = DiskTier(tmp_path / "x", 4, 64, PrefixStats(), b"g" * 16)
        other.put(h(0), row(0))
        p.write_bytes(other.path(h(0)).read_bytes())
        other.close()
    with pytest.warns(RuntimeWarning, match="recomputing"):
        assert d.pop(h(0)) is None
    assert st.disk_errors == 1 and st.bytes_from_disk == 0
    d.close()


def test_one_engine_per_directory_and_stale_files_removed(tmp_path):
    (tmp_path / ("ab" * 16 + SUFFIX)).write_bytes(b"stale")
    d = DiskTier(tmp_path, 4, 64, PrefixStats(), FP)
    assert not list(tmp_path.glob("*" + SUFFIX))
    with pytest.raises(ConfigError, match="in use by another engine"):
        DiskTier(tmp_path, 4, 64, PrefixStats(), FP)
    d.close()
    DiskTier(tmp_path, 4, 64, PrefixStats(), FP).close()       # free again after close


def test_unwritable_directory_is_an_error_at_start(tmp_path, monkeypatch):
    """(The tests run as root, which writes into read-only directories: the probe write fails as it would.)"""
    import pathlib

    def denied(self, data):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(pathlib.Path, "write_bytes", denied)
    with pytest.raises(ConfigError, match="--disk-cache-dir.*is not writable: Permission denied"):
        DiskTier(tmp_path, 4, 64, PrefixStats(), FP)
    monkeypatch.undo()
    DiskTier(tmp_path, 4, 64, PrefixStats(), FP).close()         # the failed start released the directory


def test_a_file_in_the_way_and_a_too_large_tier_are_errors_at_start(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="--disk-cache-dir.*cannot be used"):
        DiskTier(f, 4, 64, PrefixStats(), FP)
    with pytest.raises(ConfigError, match="--disk-cache-gb.*GiB free"):
        DiskTier(tmp_path / "big", 1 << 40, 1 << 20, PrefixStats(), FP)
    DiskTier(tmp_path / "big", 4, 64, PrefixStats(), FP).close()     # and the lock was released


def test_a_failing_write_drops_the_page_and_goes_on(tmp_path, monkeypatch):
    st = PrefixStats()
    d = DiskTier(tmp_path, 4, 64, st, FP)
    real = os.replace

    def full(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.warns(RuntimeWarning, match="No space left"):
        d.put(h(0), row(0))
    monkeypatch.setattr(os, "replace", real)
    assert h(0) not in d and st.disk_errors == 1 and not list(tmp_path.glob("*.tmp"))
    d.put(h(1), row(1))
    np.testing.assert_array_equal(d.pop(h(1)), row(1))
    d.close()


def test_background_writer_round_trip_lru_and_cleanup(tmp_path):
    """The engine's mode: `put` queues the row, a writer thread checksums and writes it (at 8B ~2 MiB a page:
    BLAKE2b and the write ran on the engine's loop for every spilled page)."""
    st = PrefixStats()
    d = DiskTier(tmp_path, 2, 64, st, FP, background=True)
    for i in range(3):
        d.put(h(i), row(i))
    assert len(d) == 2 and h(0) not in d                    # in the tier at once, LRU as before
    d.flush()
    assert not d.path(h(0)).exists() and d.path(h(1)).exists() and d.path(h(2)).exists()
    np.testing.assert_array_equal(d.pop(h(1)), row(1))
    assert not d.path(h(1)).exists()
    assert 2 * 64 <= st.bytes_to_disk <= 3 * 64 and st.bytes_from_disk == 64 and st.disk_errors == 0
    writer = d._writer
    d.close()
    assert not writer.is_alive() and not list(tmp_path.glob("*" + SUFFIX)) and not list(tmp_path.glob("*.tmp"))


def _hold_writes(d, monkeypatch):
    """Make `d`'s writer thread stop inside each write until `go` is set; `started`: it reached one."""
    import threading
    started, go = threading.Event(), threading.Event()
    real = d._write

    def slow(hh, r):
        started.set()
        go.wait(10)
        return real(hh, r)
    monkeypatch.setattr(d, "_write", slow)
    return started, go


def test_background_writer_pages_taken_back_before_or_while_written(tmp_path, monkeypatch):
    st = PrefixStats()
    d = DiskTier(tmp_path, 8, 64, st, FP, background=True)
    started, go = _hold_writes(d, monkeypatch)
    d.put(h(0), row(0))
    assert started.wait(10)                                 # the writer is inside h(0)'s write
    d.put(h(1), row(1))                                     # queued behind it
    np.testing.assert_array_equal(d.pop(h(1)), row(1))      # handed back from the queue, no file
    np.testing.assert_array_equal(d.pop(h(0)), row(0))      # taken back while being written
    go.set()
    d.flush()
    assert len(d) == 0 and not list(tmp_path.glob("*" + SUFFIX))     # the late file was removed, h(1) never written
    assert st.bytes_from_disk == 2 * 64 and st.disk_errors == 0
    d.close()


def test_background_write_failure_is_warned_on_the_callers_thread(tmp_path, monkeypatch):
    st = PrefixStats()
    d = DiskTier(tmp_path, 4, 64, st, FP, background=True)

    def full(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    d.put(h(0), row(0))
    with pytest.warns(RuntimeWarning, match="No space left"):
        d.flush()
    monkeypatch.undo()
    assert h(0) not in d and st.disk_errors == 1 and not list(tmp_path.glob("*.tmp"))
    d.put(h(1), row(1))
    d.flush()
    np.testing.assert_array_equal(d.pop(h(1)), row(1))
    d.close()


def test_a_full_write_queue_drops_the_page_instead_of_waiting(tmp_path, monkeypatch):
    """The writer behind (a disk slower than the spills): `put` drops the page and returns at once (it used to
    wait for the writer, holding the engine's loop to the disk's write rate)."""
    import time

    import nfjax.kv.disk_tier as dt
    monkeypatch.setattr(dt, "MAX_QUEUED", 2)
    st = PrefixStats()
    d = DiskTier(tmp_path, 16, 64, st, FP, background=True)
    started, go = _hold_writes(d, monkeypatch)
    d.put(h(0), row(0))
    assert started.wait(10)                                 # the writer holds h(0); two more fill the queue
    d.put(h(1), row(1))
    d.put(h(2), row(2))
    t0 = time.perf_counter()
    d.put(h(3), row(3))                                     # dropped, not waited for
    assert time.perf_counter() - t0 < 1 and h(3) not in d and st.disk_writes_dropped == 1
    assert d.backlog() == 3
    go.set()
    d.flush()
    assert d.backlog() == 0 and len(d) == 3 and st.disk_write_s > 0 and st.bytes_to_disk == 3 * 64
    np.testing.assert_array_equal(d.pop(h(2)), row(2))
    d.close()
