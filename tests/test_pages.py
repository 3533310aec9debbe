"""PageManager: unit tests and a property test over random operation sequences."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.runtime.pages import PageManager


def test_a_sequence_gets_the_page_after_its_last_one_else_the_lowest_free():
  """Runs of consecutive pages (the CPU decode call reads them as streams): after frees, a
  new sequence starts at the lowest free page and continues with the next; a growing one
  takes the page after its last when that is free. A first-in-first-out list gave d the
  pages never used yet (12, 13)."""
  pm = PageManager(16, 4)
  for s in "abc":
    assert pm.add_sequence(s) and pm.grow(s, 16) == []
  assert [pm.page_table(s) for s in "abc"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
  pm.free("c")
  pm.free("a")
  assert pm.add_sequence("d") and pm.grow("d", 8) == []
  assert pm.page_table("d") == [0, 1]
  assert pm.grow("b", 20) == [] and pm.page_table("b")[-1] == 8  # after 7
  assert pm.grow("d", 12) == [] and pm.page_table("d") == [0, 1, 2]
  assert pm.grow("b", 24) == [] and pm.page_table("b")[-1] == 9
  pm.check_invariants()


def test_allocate_grow_free():
  pm = PageManager(8, 4)
  assert pm.add_sequence("a", reserve_tokens=9)  # 3 pages reserved
  assert pm.num_available == 5
  assert pm.grow("a", 5) == []
  assert len(pm.page_table("a")) == 2 and pm.num_available == 5  # taken from the reserve
  assert pm.grow("a", 9) == []
  assert pm.grow("a", 13) == []  # a 4th page, past the reservation: from the free list
  assert pm.num_available == 4
  pm.free("a")
  assert pm.num_free == 8
  pm.check_invariants()


def test_reservation_refuses_without_side_effects():
  pm = PageManager(4, 4)
  assert pm.add_sequence("a", reserve_tokens=12)
  assert not pm.add_sequence("b", reserve_tokens=8)
  assert not pm.has("b")
  assert pm.grow("a", 12) == []
  assert pm.grow("a", 20) is None  # short: nothing changes
  assert pm.num_tokens("a") == 12 and len(pm.page_table("a")) == 3
  pm.check_invariants()


def test_a_window_bound_caps_the_reservation_and_renews_it_as_pages_are_released():
  """A sequence bounded to 3 pages (a sliding window) reserves 3 of the 10 its tokens
  would fill; each page released behind the window that returns to the free list is
  promised to it again, one still read by a step in flight or held by the cache is not."""
  from jaxinfer.runtime.pages import HOLE
  pm = PageManager(8, 4)
  assert pm.add_sequence("a", reserve_tokens=40, bound_pages=3)
  assert pm.num_available == 5
  assert pm.grow("a", 12) == [] and pm.num_available == 5  # 3 pages, from the reserve
  assert pm.release_before("a", 4) == 1  # page 0: free again, and a's again
  assert pm.page_table("a")[0] == HOLE and pm.num_available == 5
  assert pm.grow("a", 16) == [] and pm.num_available == 5
  pm.incref([pm.page_table("a")[1]])  # the prefix cache holds page 1
  step = pm.begin_step(["a"])
  assert pm.release_before("a", 12) == 2  # page 1 cached, page 2 read in flight
  assert pm.num_available == 5  # nothing freed: nothing promised again
  pm.complete_step(step)
  assert pm.num_available == 6  # page 2 came back to the free list, unpromised
  pm.check_invariants(extra_refs={1: 1})


def test_fork_copy_on_write_of_partial_tail_only():
  """8.3.2: branches share full pages; a write into a shared partial tail copies it."""
  pm = PageManager(16, 4)
  pm.add_sequence("p")
  pm.grow("p", 10)  # pages: full, full, 2/4 tail
  pm.fork("p", "b")
  tail = pm.page_table("p")[2]
  assert pm.refcount(tail) == 2
  copies = pm.grow("b", 11)
  assert len(copies) == 1 and copies[0][0] == tail
  assert pm.page_table("b")[:2] == pm.page_table("p")[:2]
  assert pm.page_table("b")[2] != tail and pm.refcount(tail) == 1
  assert pm.grow("p", 11) == []  # the parent now owns its tail alone: no copy
  pm.fork("p", "c")
  pm.grow("p", 12)  # fill the tail: p copies (c still shares it)
  pm.grow("c", 12)  # c now alone: writes in place
  pm.fork("p", "d")
  assert pm.grow("d", 13) == []  # tail page full: shared pages stay shared, new page
  pm.check_invariants()


def test_four_branches_share_a_95_page_prefix():
  """chapter 8.3.2 reference: 4 branches sharing 95 pages with 9 private pages each."""
  pm = PageManager(200, 16)
  pm.add_sequence("root")
  pm.grow("root", 95 * 16)
  for i in range(4):
    pm.fork("root", i)
    pm.grow(i, (95 + 9) * 16)
  pm.free("root")
  assert pm.num_used == 95 + 4 * 9
  assert sum(len(pm.page_table(i)) for i in range(4)) == 4 * 104  # references
  pm.check_invariants()


def test_deferred_release_waits_for_in_flight_step():
  """A cancelled request's pages are not reused while a launched step reads them."""
  pm = PageManager(4, 4)
  pm.add_sequence("a")
  pm.grow("a", 8)
  step = pm.begin_step(["a"])
  pm.free("a")  # cancel while the step is in flight
  assert pm.num_free == 2 and pm.num_pending == 2
  assert pm.allocate_pages(3) is None
  pm.complete_step(step)
  assert pm.num_free == 4 and pm.num_pending == 0
  pm.check_invariants()


def test_rollback_releases_pages_past_the_end():
  pm = PageManager(8, 4)
  pm.add_sequence("a")
  pm.grow("a", 14)
  pm.rollback("a", 5)
  assert len(pm.page_table("a")) == 2 and pm.num_free == 6
  with pytest.raises(ValueError):
    pm.rollback("a", 6)
  pm.check_invariants()


OPS = st.lists(st.tuples(st.sampled_from(["add", "grow", "fork", "rollback", "free", "step",
                                          "complete", "cache_ref", "cache_drop"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_property_no_leak_no_double_free(ops):
  pm = PageManager(12, 4)
  cache = {}  # page -> references held by a stand-in for the prefix cache
  in_flight = []
  for op, a, n in ops:
    sid = a
    if op == "add" and not pm.has(sid):
      pm.add_sequence(sid, reserve_tokens=n % 20)
    elif op == "grow" and pm.has(sid):
      pm.grow(sid, pm.num_tokens(sid) + n % 9)
    elif op == "fork" and pm.has(sid) and not pm.has(sid + 10):
      pm.fork(sid, sid + 10)
    elif op == "rollback" and pm.has(sid):
      pm.rollback(sid, min(n, pm.num_tokens(sid)))
    elif op == "free" and pm.has(sid):
      pm.free(sid)
    elif op == "free" and pm.has(sid + 10):
      pm.free(sid + 10)
    elif op == "step":
      in_flight.append(pm.begin_step(list(pm.sequences())))
    elif op == "complete" and in_flight:
      pm.complete_step(in_flight.pop(0))
    elif op == "cache_ref" and pm.has(sid) and pm.page_table(sid):
      p = pm.page_table(sid)[0]
      pm.incref([p])
      cache[p] = cache.get(p, 0) + 1
    elif op == "cache_drop" and cache:
      p = next(iter(cache))
      pm.decref([p])
      cache[p] -= 1
      if not cache[p]:
        del cache[p]
    pm.check_invariants(cache)
  for sid in list(pm.sequences()):
    pm.free(sid)
  pm.decref([p for p, c in cache.items() for _ in range(c)])
  for s in in_flight:
    pm.complete_step(s)
  assert pm.num_free == pm.num_pages


def test_grouped_pages_release_a_windowed_group_and_keep_the_full_one():
  """Page tables per layer group from one free list: a sequence of 40 tokens with a
  full group and a window-8 group (pages of 4) holds 10 full-group pages and at most
  8 / 4 + 1 = 3 windowed ones after sliding; reserving to its end with the window's bound
  takes 10 + the bound; a grow that does not fit in every group changes nothing."""
  from jaxinfer.runtime.pages import HOLE, GroupedPages, page_manager
  pm = page_manager(40, 4, (0, 8))
  assert isinstance(pm, GroupedPages) and isinstance(page_manager(8, 4), PageManager)
  bound = (0, 4)  # the full group holds everything; the windowed one at most 4 pages
  assert pm.admission_pages(40, bound) == 10 + 4
  assert pm.add_sequence("a", reserve_tokens=40, bound_pages=bound)
  assert pm.num_available == 40 - 14
  for t in range(4, 41, 4):
    assert pm.grow("a", t) == []
    pm.slide("a", t)
    full, local = pm.page_table("a")
    assert len(full) == len(local) == t // 4
    assert sum(p != HOLE for p in local) <= 3 and HOLE not in full
  assert sum(p != HOLE for p in pm.page_table("a")[1]) == 2  # the window of position 40: 33-40
  assert pm.cacheable_pages("a") is None  # released pages: no whole prefix to offer
  pm.check_invariants()
  # b needs 10 + 10 pages from the free list, only 40 - 10 - 4 - (reserved) are there
  assert pm.add_sequence("b") and pm.grow("b", 40) is not None
  pm.check_invariants()
  free = pm.num_available
  assert pm.shortfall("b", 80) == 20 > free and pm.grow("b", 80) is None
  assert [len(t) for t in pm.page_table("b")] == [10, 10] and pm.num_available == free
  pm.rollback("b", 10)
  assert [len(t) for t in pm.page_table("b")] == [3, 3]
  pm.check_invariants()
  pm.free("a")
  pm.free("b")
  assert pm.num_free == 40
  pm.check_invariants()


def test_grouped_pages_share_prefix_pages_per_group():
  """A prefix-cache hit in a grouped pool: each shared page is a tuple (one page per
  group), referenced in every group's table; writing past a shared partial tail copies
  it in each group (copy-on-write)."""
  from jaxinfer.runtime.pages import page_manager
  pm = page_manager(32, 4, (0, 16))
  assert pm.add_sequence("a") and pm.grow("a", 6) == []
  pages = pm.cacheable_pages("a")
  assert len(pages) == 2 and all(len(t) == 2 for t in pages)
  pm.incref(pages)  # the cache's references
  assert pm.add_sequence("b", pages, 6)
  assert pm.shares_tail("b")
  copies = pm.grow("b", 7)
  assert len(copies) == 2 and {c[0] for c in copies} == set(pages[1])  # the tails
  pm.check_invariants({t: 1 for t in pages})
  for s in "ab":
    pm.free(s)
  pm.decref(pages)
  assert pm.num_free == 32
