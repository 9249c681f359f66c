"""The host tier's pinned pool (nfjax/kv/host_pool.py) on the CPU backend, which has the pinned_host memory kind:
pages written into slots come back into other pages unchanged, slots free at the load's launch or when a row is
dropped, and a full pool copies only what fits."""
import jax
import jax.numpy as jnp
import numpy as np

from nfjax.compat import pinned_host_sharding
from nfjax.kv.cache import KVCache
from nfjax.kv.host_pool import HostPool
from nfjax.kv.prefix_cache import row_bytes


def _kv():
    shape = (2, 12, 4, 2, 8)            # layers x pages x page_size x kv_heads x head_dim
    k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    return KVCache(k, v, None, "bfloat16")


def test_pages_go_to_slots_and_come_back_into_other_pages():
    kv = _kv()
    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    host = pinned_host_sharding(rep)
    assert host is not None
    pool = HostPool(kv, KVCache(rep, rep, None, "bfloat16"), rep, host, 4, row_bytes(kv.arrays()), 8)
    assert pool.pool.sharding.memory_kind == "pinned_host" and pool.num_free == 4
    rows = pool.put(kv, [1, 2, 3])
    assert pool.num_free == 1 and sorted(r.slot for r in rows) == [0, 1, 2]
    want = [np.asarray(a[:, [1, 2, 3]]) for a in kv.arrays()]
    kv2 = pool.load(kv, [7, 8, 9], rows)
    assert pool.num_free == 4 and all(r.slot == -1 for r in rows)     # freed at the load's launch, once
    for a, w in zip(kv2.arrays(), want):
        np.testing.assert_array_equal(np.asarray(a[:, [7, 8, 9]]), w)
    rows = pool.put(kv2, [4, 5, 6, 10, 11])        # 4 slots: the first 4 pages copied, the fifth not
    assert len(rows) == 4 and pool.num_free == 0
    np.testing.assert_array_equal(rows[2].get(), np.asarray(pool.read(rows[2].slot)))
    del rows[0]                                    # a dropped row frees its slot
    assert pool.num_free == 1


def test_make_room_counts_slots_held_by_rows_out_for_a_load():
    """Rows popped for a load hold their slots until it launches: making room for an eviction drops more of the
    tier so that the pool has the slots (else the eviction would be dropped)."""
    from nfjax.kv.tiers import HostTier, PrefixStats
    kv = _kv()
    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pool = HostPool(kv, KVCache(rep, rep, None, "bfloat16"), rep, pinned_host_sharding(rep), 6,
                    row_bytes(kv.arrays()), 8)
    tier = HostTier(4, pool.row_bytes, PrefixStats())
    for i, r in enumerate(pool.put(kv, [1, 2, 3, 4])):
        tier.put(bytes([i]), r)
    out = [tier.pop(bytes([0])), tier.pop(bytes([1]))]     # taken for a load, not launched yet
    assert len(tier) == 2 and pool.num_free == 2
    tier.make_room(3, free=lambda: pool.num_free)
    assert pool.num_free >= 3 and len(tier) == 1 and len(pool.put(kv, [5, 6, 7])) == 3
    assert all(r.slot >= 0 for r in out)                   # the load's rows are untouched
