"""The reuse distance of shared sources and the leaf policy's test of memory pressure
(``segments/reuse.py``), on a clock the test moves."""

from __future__ import annotations

import pytest

from sglang_kvshare.segments.reuse import ReuseClock, copies_fit


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


@pytest.mark.parametrize("free,rows,lru_age,horizon,fits", [
    (500, 400, None, None, True),   # free slots: no eviction at all
    (500, 400, 0.1, 30.0, True),
    (100, 400, 40.0, 30.0, True),   # evicts what was last used before any source is read again
    (100, 400, 20.0, 30.0, False),  # would evict an entry younger than a source's reuse: pressure
    (100, 400, 20.0, None, True),   # nothing read again yet: nothing to protect
    (100, 400, None, 30.0, False),  # nothing evictable and short of slots
])
def test_copies_fit_when_eviction_takes_nothing_that_is_read_again(free, rows, lru_age, horizon, fits):
    assert copies_fit(free, rows, lru_age, horizon) is fits
