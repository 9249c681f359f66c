"""Issue #23: a prefix-cache tier hit must beat recomputing its page (nfjax/kv/tiers.py `TierRates`): a tier
whose rate makes loading slower than recompute gives no hits (and is not written) but the same tokens; with a
fast tier the hits come back. The counters the bench's progress lines print hold real values, and the host tier
runs from pinned_host arrays where asked (the CPU backend has the memory kind)."""
import numpy as np
import pytest

from nfjax.kv.host_pool import PoolRow
from nfjax.kv.tiers import HostTier, PrefixStats, PrefixTiers, TierRates, flops_per_token
from nfjax.models.random_init import LLAMA3_8B
from tests.engine.conftest import make_engine
from tests.engine.test_prefix_cache import ROW, SCHED, _cache, assert_no_leaks, converse
from tests.kv.test_prefix_allocator import DictTier, h


def test_rates_of_the_h100_decide_host_pinned_yes_pageable_and_disk_no():
    """The issue's numbers: an 8B page (16 tokens, 2 MiB) recomputes in ~0.32 ms at 690 TFLOP/s; from pinned
    host memory (40.8 GB/s) it loads in 0.05 ms, from pageable numpy (5.1) in 0.41, from disk (1.45) in 1.5."""
    f = flops_per_token(LLAMA3_8B)
    assert 13e9 < f < 15e9
    pinned = TierRates(16, 2 << 20, f, 690e12, 40.8e9, 1.45e9)
    assert pinned.recompute_s() == pytest.approx(0.324e-3, rel=0.01)
    assert pinned.wins("host") and not pinned.wins("disk")
    pageable = TierRates(16, 2 << 20, f, 690e12, 5.1e9, 1.45e9)
    assert not pageable.wins("host") and not pageable.wins("disk")
    assert "NOT used" in pageable.line() and pinned.as_dict()["host_load_ms_per_page"] == pytest.approx(0.0514, 0.01)
    # a disk row is numpy: it crosses at the pageable rate even where host rows are pinned
    assert pinned.load_s("disk") == pytest.approx((2 << 20) * (1 / 1.45e9 + 1 / 40.8e9))
    disk_pageable = TierRates(16, 2 << 20, f, 690e12, 40.8e9, 1.45e9, disk_h2d_bytes_s=5.1e9)
    assert disk_pageable.load_s("disk") == pytest.approx(pageable.load_s("disk")) and disk_pageable.wins("host")


def test_fetch_takes_a_tier_only_where_loading_wins():
    stats, disk = PrefixStats(), DictTier()
    slow_disk = TierRates(8, 4, 100.0, 1e3, 1e9, 1.0)          # recompute 0.8 s; host 4 ns; disk 4 s
    tiers = PrefixTiers(HostTier(1, 4, stats, spill=disk), disk, rates=slow_disk)
    assert tiers.use_host and not tiers.use_disk and tiers.host.spill is None    # nothing is spilled to disk
    disk.put(h(0), np.zeros(4, np.uint8))
    tiers.put(h(1), np.ones(4, np.uint8))
    assert tiers.fetch([h(0), h(1)], 4) == [] and stats.skipped_pages_disk == 1 and h(0) in disk
    got = tiers.fetch([h(1), h(0)], 4)                          # host page taken, the disk one ends the run
    assert [t for _, t in got] == ["host"] and stats.skipped_pages_disk == 2 and stats.tier_load_s > 0
    tiers.set_rates(TierRates(8, 4, 100.0, 1e3, 1e9, 1e9))     # a fast disk: read again, and spilled to
    assert tiers.use_disk and tiers.host.spill is disk
    assert [t for _, t in tiers.fetch([h(0)], 4)] == ["disk"]
    tiers.set_rates(TierRates(8, 4, 100.0, 1e3, 1.0, 1e9))     # a slow host: neither tier is read
    tiers.put(h(2), np.ones(4, np.uint8))
    assert not tiers.use_host and not tiers.use_disk and tiers.fetch([h(2)], 4) == []
    assert stats.skipped_pages_host == 1 and h(2) in tiers.host


@pytest.fixture(scope="module")
def off():
    return make_engine(_cache(prefix_cache=False), SCHED)


def _tiered(tmp_path):
    return make_engine(_cache(host_cache_gb=4 * ROW / 2 ** 30, disk_cache_dir=str(tmp_path / "d"),
                              disk_cache_gb=16 * ROW / 2 ** 30), SCHED)


def test_a_slow_tier_gives_no_hits_and_the_same_tokens_a_fast_one_hits_again(off, tmp_path):
    eng = _tiered(tmp_path)
    try:
        st = eng.prefix_stats()
        assert st["host_tier_used"] and st["disk_tier_used"] and st["tier_rates"]["rate_sources"]["gemm_flops"] == \
            "default" and "used" in eng.tier_line()
        # loading from the host at 1 KB/s: every page is cheaper to recompute; evictions are dropped, not copied
        eng.set_tier_rates(host_bytes_s=1e3)
        assert not eng.batcher.tiers.use_host and "NOT used" in eng.tier_line()
        converse([off, eng], n=6, turns=4, seed=5)
        st = eng.prefix_stats()
        assert st["hit_tokens_host"] == st["hit_tokens_disk"] == 0 and st["hit_tokens_gpu"] > 0
        assert st["bytes_to_host"] == st["rows_to_host"] == st["bytes_to_disk"] == 0
        assert st["evictions_dropped"] > 0 and not st["host_tier_used"] and not st["disk_tier_used"]
        assert st["tier_rates"]["rate_sources"]["host_bytes_s"] == "configured"
        assert_no_leaks(eng)
        # a disk that reads at 1 KB/s: the host tier hits, nothing goes to disk
        eng.set_tier_rates(disk_bytes_s=1e3)
        converse([off, eng], n=6, turns=4, seed=6)
        st2 = eng.prefix_stats()
        assert st2["hit_tokens_host"] > 0 and st2["hit_tokens_disk"] == 0 and st2["bytes_to_disk"] == 0
        assert st2["host_tier_used"] and not st2["disk_tier_used"]
        # the defaults again: both tiers hit
        eng.set_tier_rates()
        converse([off, eng], n=6, turns=4, seed=7)
        st3 = eng.prefix_stats()
        assert st3["hit_tokens_host"] > st2["hit_tokens_host"] and st3["hit_tokens_disk"] > 0
        # the counters the progress lines print are real: rows each way, seconds in loads and evictions,
        # the disk writer's seconds and backlog (0 once idle: prefix_stats flushes it)
        assert st3["rows_from_host"] * ROW == st3["bytes_from_host"] > 0
        assert st3["rows_to_host"] * ROW == st3["bytes_to_host"] > 0
        assert 0 < st3["tier_load_s"] < 60 and 0 < st3["evict_s"] < 60 and st3["tier_load_s"] > st["tier_load_s"]
        assert st3["disk_write_s"] > 0 and st3["disk_write_backlog"] == 0 and st3["tier_step_waits"] == 0
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_host_rows_in_pinned_host_memory(off, tmp_path, monkeypatch):
    """NFJAX_TIER_HOST_MEMORY=pinned (the default on a one-GPU mesh): evicted rows are slots of one pinned_host
    pool, hits load them back with the cache-off tokens, and they spill to disk through the writer thread."""
    monkeypatch.setenv("NFJAX_TIER_HOST_MEMORY", "pinned")
    eng = _tiered(tmp_path)
    try:
        assert eng.runner.tier_copies.pinned and "pinned_host" in eng.tier_line()
        # one pinned pool of the host tier's rows (and slack), allocated at start (not while the tier fills)
        pool = eng.runner.tier_copies.pool
        assert pool.capacity >= 4 and pool.pool.sharding.memory_kind == "pinned_host"
        assert eng.prefix_stats()["pinned_reserve_s"] > 0 and "pinned_host pool of" in eng.tier_line()
        converse([off, eng], n=6, turns=4, seed=5)
        st = eng.prefix_stats()
        assert st["host_rows_pinned"] and st["hit_tokens_host"] > 0 and st["hit_tokens_disk"] > 0
        assert st["tier_step_waits"] == 0 and st["rows_to_host"] * ROW == st["bytes_to_host"]
        rows = list(eng.batcher.tiers.host._rows.values())
        assert rows and all(isinstance(r, PoolRow) and r.pool is pool for r in rows)
        # every slot is free or held by the tier's rows: none lost
        held = {r.slot for r in rows}
        assert len(held) == len(rows) and not held & set(pool._free) and len(held) + pool.num_free == pool.capacity
        assert_no_leaks(eng)
    finally:
        eng.close()
