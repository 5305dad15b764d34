"""The injected clocks: virtual time moves only when told; real time never goes back."""

from __future__ import annotations

import pytest

from dualpath.transfer.clock import MonotonicClock, VirtualClock


def test_virtual_clock_moves_only_when_told() -> None:
    clock = VirtualClock(start_s=5.0)
    assert clock.now_s() == 5.0
    clock.sleep(0.25)
    clock.advance(0.75)
    assert clock.now_s() == 6.0
    assert (clock.num_sleeps, clock.slept_s) == (1, 0.25)  # advance is not a sleep
    clock.advance_to(10.0)
    assert clock.now_s() == 10.0


def test_virtual_clock_rejects_going_back() -> None:
    clock = VirtualClock(start_s=1.0)
    with pytest.raises(ValueError, match="negative"):
        clock.sleep(-0.1)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-0.1)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance_to(0.5)


def test_monotonic_clock_is_monotone_and_instances_are_equal() -> None:
    clock = MonotonicClock()
    first = clock.now_s()
    clock.sleep(0.0)
    assert clock.now_s() >= first
    assert clock == MonotonicClock()
    with pytest.raises(ValueError):
        clock.sleep(-1.0)
