"""The reuse distance of shared sources and the leaf policy's test of memory pressure
(``segments/reuse.py``), on a clock the test moves."""

from __future__ import annotations

import pytest

from sglang_kvshare.segments.reuse import ReuseClock, copies_fit, lru_victims


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_gaps_are_times_between_uses_of_one_source():
    clock = Clock()
    reuse = ReuseClock(clock=clock)
    assert reuse.touch("a") is None and reuse.horizon() is None  # written, not read yet
    clock.now += 3.0
    assert reuse.touch("b") is None
    clock.now += 2.0
    assert reuse.touch("a") == pytest.approx(5.0)  # read 5 s after it was written
    clock.now += 1.0
    assert reuse.touch("b") == pytest.approx(3.0)
    assert reuse.touch("a") == pytest.approx(1.0)
    assert sorted(reuse.gaps) == pytest.approx([1.0, 3.0, 5.0])
    assert reuse.horizon() == pytest.approx(5.0)  # p90 by nearest rank of 3: the largest
    assert reuse.horizon(0.5) == pytest.approx(3.0)


def test_the_horizon_follows_the_last_window_of_gaps():
    clock = Clock()
    reuse = ReuseClock(window=10, clock=clock)
    reuse.touch("s")
    for gap in [50.0] + [1.0] * 10:  # one slow reuse, then ten quick ones push it out
        clock.now += gap
        reuse.touch("s")
    assert reuse.horizon() == pytest.approx(1.0)
    for gap in range(1, 11):  # gaps 1..10 s: the 9th of 10 is the p90
        clock.now += gap
        reuse.touch("s")
    assert reuse.horizon() == pytest.approx(9.0)


def test_forgotten_sources_start_over():
    clock = Clock()
    reuse = ReuseClock(max_sources=2, clock=clock)
    for name in ("a", "b", "c"):  # "a" is the least recently used of three: forgotten
        reuse.touch(name)
    clock.now += 1.0
    assert reuse.touch("a") is None and reuse.touch("c") == pytest.approx(1.0)


@pytest.mark.parametrize(
    "free,rows,lru_age,horizon,fits",
    [
        (500, 400, None, None, True),  # free slots: no eviction at all
        (500, 400, 0.1, 30.0, True),
        (100, 400, 40.0, 30.0, True),  # evicts what was last used before any source is read again
        (100, 400, 20.0, 30.0, False),  # would evict an entry younger than a source's reuse: pressure
        (100, 400, 20.0, None, True),  # nothing read again yet: nothing to protect
        (100, 400, None, 30.0, False),  # nothing evictable and short of slots
    ],
)
def test_copies_fit_when_eviction_takes_nothing_that_is_read_again(free, rows, lru_age, horizon, fits):
    assert copies_fit(free, rows, lru_age, horizon) is fits


class Node:
    """A radix-tree node as ``lru_victims`` reads it."""

    def __init__(self, name, size, used, parent=None, locked=0):
        self.name, self.value, self.last_access_time, self.lock_ref = name, [0] * size, used, locked
        self.parent, self.children = parent, {}
        if parent is not None:
            parent.children[name] = self


def test_lru_victims_follow_eviction_order_into_parents():
    root = Node("root", 0, 0.0, locked=1)
    a = Node("a", 100, 5.0, root)  # a -> a1 (1.0), a2 (3.0)
    a1, a2 = Node("a1", 50, 1.0, a), Node("a2", 50, 3.0, a)
    b = Node("b", 200, 2.0, root, locked=1)  # a running request holds b; its child is a leaf
    b1 = Node("b1", 30, 4.0, b)
    leaves = [a1, a2, b1]
    by_age = lambda n: n.last_access_time  # noqa: E731
    names = lambda v: [n.name for n in v]  # noqa: E731
    assert names(lru_victims(leaves, 40, by_age)) == ["a1"]
    assert names(lru_victims(leaves, 60, by_age)) == ["a1", "a2"]
    # a becomes a leaf once both children went, and is younger than b1
    assert names(lru_victims(leaves, 130, by_age)) == ["a1", "a2", "b1"]
    assert names(lru_victims(leaves, 200, by_age)) == ["a1", "a2", "b1", "a"]
    assert lru_victims(leaves, 231, by_age) is None  # b is locked: 230 slots at most
