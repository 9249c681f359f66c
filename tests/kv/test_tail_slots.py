"""kivi64's tail rows on the host (nfjax/kv/tail_slots.py): a sequence keeps one row while its group fills, rows
freed by a step are not reused within it, swapping moves the row, and rows of finished requests come back."""
import pytest

from nfjax.kv.tail_slots import TailRowsExhausted, TailSlots


class Req:
    def __init__(self, pages):
        self.pages, self.finished = pages, False


def test_a_sequence_keeps_its_row_until_its_group_completes():
    t = TailSlots(3)
    a = Req([5, 6, 7])
    r = t.for_step(a, a.pages, 0, 70)            # group 0 completes, group 1 fills: the row follows page 6
    t.end_step()
    assert t.for_step(a, a.pages, 70, 71) == r
    t.end_step()
    assert t.for_step(a, a.pages, 71, 128) == r  # completes group 1 exactly: the row is freed after the step
    t.end_step()
    assert t.num_free == 3
    with pytest.raises(RuntimeError, match="no K tail row"):
        t.for_step(a, a.pages, 130, 131)         # a continuing group without a row is a bug, not silent garbage


def test_rows_freed_by_a_step_are_not_reused_within_it():
    t = TailSlots(2)
    a, b = Req([1, 2]), Req([3, 4])
    ra = t.for_step(a, a.pages, 0, 60)
    t.end_step()
    assert t.for_step(a, a.pages, 60, 64) == ra          # a's group completes in this step
    rb = t.for_step(b, b.pages, 0, 10)
    assert rb != ra                                      # a later nano-batch may still read a's row
    t.end_step()
    assert t.num_free == 1


def test_swapping_moves_the_row_and_finished_requests_give_theirs_back():
    t = TailSlots(2)
    a, b = Req([1, 2]), Req([3, 4])
    t.for_step(a, a.pages, 0, 70)
    t.for_step(b, b.pages, 0, 5)
    t.end_step()
    assert t.num_free == 0
    assert t.take([1, 2]) is not None and t.num_free == 1       # a swapped out: its row with it
    assert t.take([3]) is not None and t.take([9]) is None       # b's row; none for a page holding no group
    r = t.put(8)                                                 # a back, its filling group now at page 8
    a.pages = [7, 8]
    assert t.for_step(a, a.pages, 70, 71) == r
    t.end_step()
    c = Req([3])
    t.for_step(c, c.pages, 0, 3)
    t.end_step()
    c.finished = True                                            # finished mid-group: reclaimed when needed
    d = Req([11])
    t.for_step(d, d.pages, 0, 3)
    t.end_step()
    with pytest.raises(TailRowsExhausted, match="tail rows"):
        t.for_step(Req([12]), [12], 0, 3)
