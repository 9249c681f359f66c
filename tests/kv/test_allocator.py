"""Page allocator invariants under random alloc / share / free sequences."""
import pytest
from hypothesis import given, settings, strategies as st

from nfjax.kv.allocator import SCRATCH_PAGE, OutOfPages, PageAllocator


def test_basic_and_scratch_page():
    a = PageAllocator(5)
    assert a.capacity == 4 and a.num_free == 4 and a.num_used == 0
    got = a.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and SCRATCH_PAGE not in got
    with pytest.raises(OutOfPages) as e:
        a.allocate(1)
    assert e.value.requested == 1 and e.value.free == 0
    a.free(got)
    assert a.num_free == 4


def test_out_of_pages_allocates_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert a.num_free == 1


def test_share_keeps_pages_until_last_owner():
    a = PageAllocator(4)
    p = a.allocate(2)
    a.share(p)
    assert a.refcount(p[0]) == 2
    a.free(p)
    assert a.num_free == 1 and a.refcount(p[0]) == 1
    a.free(p)
    assert a.num_free == 3


def test_bad_frees_change_nothing():
    a = PageAllocator(4)
    p = a.allocate(1)
    for bad in ([0], [3], [p[0], p[0]], [99]):
        with pytest.raises(ValueError):
            a.free(bad)
    assert a.refcount(p[0]) == 1 and a.num_free == 2
    with pytest.raises(ValueError):
        a.share([3])


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 6), st.integers(0, 10 ** 6)),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 24), script=ops)
def test_random_sequences_keep_invariants(num_pages, script):
    a = PageAllocator(num_pages)
    owners: list[list[int]] = []          # each entry: one owner's pages (a request)
    for op, n, pick in script:
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfPages):
                    a.allocate(n)
            else:
                before = {p for pages in owners for p in pages}
                new = a.allocate(n)
                assert len(set(new)) == n and not set(new) & before     # never a page someone holds
                owners.append(new)
        elif op == "share" and owners:
            pages = owners[pick % len(owners)]
            a.share(pages)
            owners.append(list(pages))
        elif op == "free" and owners:
            a.free(owners.pop(pick % len(owners)))
        # invariants: refcount == number of owners holding the page; a page is free iff nobody holds it;
        # no page is both free and held, none twice in the free list, the scratch page never handed out
        held: dict[int, int] = {}
        for pages in owners:
            assert len(set(pages)) == len(pages)
            for p in pages:
                held[p] = held.get(p, 0) + 1
        assert SCRATCH_PAGE not in held
        free = a._free
        assert len(set(free)) == len(free) and not set(free) & set(held)
        assert set(free) | set(held) == set(range(1, num_pages))
        assert all(a.refcount(p) == c for p, c in held.items())
        assert a.num_free + len(held) == a.capacity
    for pages in owners:
        a.free(pages)
    assert a.num_free == a.capacity
