"""The prefix cache in the page allocator: lookup, registration, LRU eviction of unreferenced cached pages,
reference counts; page hashes chained over the prefix; the host tier's LRU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nfjax.kv.allocator import OutOfPages, PageAllocator
from nfjax.kv.prefix_cache import ROOT, chain_hash, transfer_sizes
from nfjax.kv.tiers import HostTier, PrefixStats, PrefixTiers


class DictTier:
    """The tier below the host tier (the disk tier's put / pop), its rows in a dict."""

    def __init__(self):
        self.rows: dict[bytes, np.ndarray] = {}

    def put(self, key, row):
        self.rows[key] = row

    def pop(self, key):
        return self.rows.pop(key, None)

    def __contains__(self, key):
        return key in self.rows


def h(i: int) -> bytes:
    return chain_hash(ROOT, [i])


def test_cached_pages_are_shared_kept_and_evicted_least_recently_used_first():
    a = PageAllocator(6, prefix=True)
    p = a.allocate(3)
    for page, i in zip(p, range(3)):
        assert a.register(page, h(i))
    assert not a.register(p[0], h(9)) and not a.register(a.allocate(1)[0], h(0))    # one hash, one page
    assert a.lookup([h(0), h(1), h(7), h(2)]) == p[:2]          # the longest run from the first page
    assert a.refcount(p[0]) == 2
    a.free(p)
    assert a.num_used == 3 and a.num_free == 2            # p[0], p[1] held by the lookup, the 4th page too
    a.free(p[:2])
    assert a.num_free == 4 and a.num_cached == 3          # unreferenced cached pages count as free, stay cached
    assert a.lookup([h(2)]) == [p[2]]                     # taken back: most recently used now
    a.free([p[2]])
    got = a.allocate(3)                                   # 1 free page, then the LRU: p[1], p[0] (freed tail first)
    assert p[0] in got and p[1] in got and p[2] not in got
    assert a.take_evicted() == [(p[1], h(1)), (p[0], h(0))] and a.take_evicted() == []
    assert a.lookup([h(0)]) == [] and a.lookup([h(2)]) == [p[2]]
    with pytest.raises(OutOfPages):
        a.allocate(1)


def test_a_prefix_is_evicted_tail_first_so_its_head_still_hits():
    """Pages freed together go to the LRU list tail first: evicting some leaves a usable run from the first page
    (freed head first, the head went first and the whole prefix was lost: a lookup needs the first page)."""
    a = PageAllocator(9, prefix=True)
    p = a.allocate(6)
    for page, i in zip(p, range(6)):
        a.register(page, h(i))
    a.free(p)
    a.allocate(2 + 3)                                     # the 2 never-used pages, then 3 cached ones
    assert [e for e, _ in a.take_evicted()] == [p[5], p[4], p[3]]
    assert a.lookup([h(i) for i in range(6)]) == p[:3]


def test_pages_a_waiting_request_wants_are_evicted_last_the_last_wanted_first():
    """A FIFO queue of turns over LRU is a cyclic pattern (the least recently freed pages belong to the request
    admitted next): pages wanted by waiting requests go last, those of the back of the queue first."""
    a = PageAllocator(10, prefix=True)
    p = a.allocate(9)
    for page, i in zip(p, range(9)):
        a.register(page, h(i))
    a.free(p[0:3])                         # conversation A, finished first (least recently used)
    a.free(p[3:6])                         # B
    a.free(p[6:9])                         # C, finished last
    a.want([h(0), h(1), h(2)])             # A's next turn waits at the head of the queue
    a.want([h(3), h(4), h(5)])             # then B's; C's conversation is over
    assert a.num_wanted() == 6 and a.num_free == 9
    a.allocate(5)
    assert [e for e, _ in a.take_evicted()] == [p[8], p[7], p[6], p[5], p[4]]   # C, then the back of the queue
    a.unwant([h(3), h(4), h(5)])           # B left the queue (aborted): its page is an ordinary one again
    a.allocate(1)
    assert [e for e, _ in a.take_evicted()] == [p[3]]
    assert a.lookup([h(0), h(1), h(2)]) == p[0:3] and a.num_wanted() == 0
    a.unwant([h(0), h(1), h(2)])
    a.free(p[0:3])
    assert a.num_wanted() == 0 and a.num_free == 3


def test_off_by_default():
    a = PageAllocator(4)
    p = a.allocate(1)
    assert not a.register(p[0], h(0)) and a.lookup([h(0)]) == []
    a.free(p)
    assert a.num_free == 3 and a.num_cached == 0


def test_hash_chains_the_prefix():
    assert chain_hash(ROOT, [1, 2]) != chain_hash(chain_hash(ROOT, [0]), [1, 2])
    assert chain_hash(ROOT, [1, 2]) == chain_hash(ROOT, np.array([1, 2]))
    assert chain_hash(ROOT, [1, 2]) != chain_hash(ROOT, [2, 1])
    assert transfer_sizes(16) == [1, 2, 4, 8, 16] and transfer_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert transfer_sizes(1) == [1]


def test_host_tier_is_lru_and_spills():
    stats, spill = PrefixStats(), DictTier()
    spilled = spill.rows
    tiers = PrefixTiers(HostTier(2, 4, stats, spill=spill), spill)
    rows = {i: np.full(4, i, np.uint8) for i in range(4)}
    for i in range(3):
        tiers.put(h(i), rows[i])
    assert list(spilled) == [h(0)] and len(tiers.host) == 2 and stats.bytes_to_host == 12
    got = tiers.fetch([h(0), h(1), h(2), h(3)], limit=10)           # disk, host, host, then a miss
    assert [t for _, t in got] == ["disk", "host", "host"] and [r[0] for r, _ in got] == [0, 1, 2]
    assert len(tiers.host) == 0 and not spilled
    tiers.put(h(0), rows[0])
    assert tiers.fetch([h(0)], limit=0) == [] and h(0) in tiers.host


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "lookup", "register"]), st.integers(0, 5),
                         st.integers(0, 10 ** 6)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(2, 16), script=ops)
def test_random_sequences_keep_invariants(num_pages, script):
    """Refcount = owners; a page is free, cached-unreferenced, or held; held pages are never handed out or
    evicted; a lookup's pages carry the hashes asked for."""
    a = PageAllocator(num_pages, prefix=True)
    owners: list[list[int]] = []
    tag: dict[int, bytes] = {}                 # page -> hash registered (the test's view)
    for op, n, pick in script:
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfPages):
                    a.allocate(n)
            else:
                held = {p for pages in owners for p in pages}
                new = a.allocate(n)
                assert not set(new) & held
                for p, hh in a.take_evicted():
                    assert tag.pop(p) == hh and p not in held
                owners.append(new)
        elif op == "free" and owners:
            a.free(owners.pop(pick % len(owners)))
        elif op == "register" and owners:
            pages = owners[pick % len(owners)]
            if pages:
                p = pages[pick % len(pages)]
                if a.register(p, h(pick % 7)):
                    tag[p] = h(pick % 7)
        elif op == "lookup":
            hs = [h((pick + i) % 7) for i in range(n)]
            got = a.lookup(hs)
            assert [tag[p] for p in got] == hs[:len(got)]
            owners.append(got)
        held: dict[int, int] = {}
        for pages in owners:
            for p in pages:
                held[p] = held.get(p, 0) + 1
        assert all(a.refcount(p) == c for p, c in held.items())
        assert a.num_used == len(held) and a.num_cached == len(tag)
    for pages in owners:
        a.free(pages)
    assert a.num_free == a.capacity


def test_host_tier_keeps_rows_still_coming_from_the_device_until_they_settle():
    """Evicted rows enter the host tier while their device->host copy runs (LazyRow): a tier over capacity
    does not spill one before it is read back (that read could wait for the step in flight); `settle` puts
    the bytes in place, then spills; a hit before that reads it back at once."""
    from nfjax.kv.prefix_cache import LazyRow, PendingRows

    class Dev:                                              # stands for a device row: counts reads
        reads = 0

        def __init__(self, i):
            self.i = i

        def __array__(self, dtype=None, copy=None):
            Dev.reads += 1
            return np.arange(4 * self.i, 4 * self.i + 4, dtype=np.uint8)
    stats, spill = PrefixStats(), DictTier()
    spilled = spill.rows
    tiers = PrefixTiers(HostTier(1, 4, stats, spill=spill), spill)
    pending = PendingRows([Dev(0), Dev(1)])
    lazy = [LazyRow(pending, i, 4) for i in range(2)]
    tiers.put(h(0), lazy[0])
    tiers.put(h(1), lazy[1])
    assert len(tiers.host) == 2 and not spilled and Dev.reads == 0 and stats.bytes_to_host == 8
    tiers.host.settle(h(0), lazy[0])                        # read back once; h(0) spilled, as the oldest
    assert Dev.reads == 2 and list(spilled) == [h(0)] and spilled[h(0)].tolist() == [0, 1, 2, 3]
    assert len(tiers.host) == 1 and isinstance(tiers.host._rows[h(1)], LazyRow)
    got = tiers.fetch([h(0), h(1)], limit=2)                # disk, then the lazy host row (already read)
    assert [t for _, t in got] == ["disk", "host"] and got[1][0].tolist() == [4, 5, 6, 7] and Dev.reads == 2
    tiers.host.settle(h(1), lazy[1])                        # gone already: nothing to do
    assert len(tiers.host) == 0
