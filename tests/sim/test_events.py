"""The event queue's tie rule: (time_s, priority, push order)."""

from __future__ import annotations

import pytest

from dualpath.sim.events import EventPriority, EventQueue


def test_equal_times_run_by_priority_then_push_order():
    queue = EventQueue()
    order = []
    queue.push(1.0, EventPriority.FETCH, order.append, "fetch")
    queue.push(1.0, EventPriority.ARRIVAL, order.append, "arrival-1")
    queue.push(1.0, EventPriority.TRANSFER_DONE, order.append, "transfer")
    queue.push(1.0, EventPriority.ARRIVAL, order.append, "arrival-2")
    queue.push(0.5, EventPriority.FETCH, order.append, "early")
    queue.push(1.0, EventPriority.STEP_DONE, order.append, "step")
    queue.run()
    assert order == ["early", "transfer", "step", "arrival-1", "arrival-2", "fetch"]


def test_zero_delay_events_are_enqueued_not_run_inline():
    queue = EventQueue()
    order = []

    def first(_):
        queue.push(queue.now_s, EventPriority.TRANSFER_DONE, order.append, "follow-up")
        order.append("first-done")

    queue.push(2.0, EventPriority.FETCH, first, None)
    queue.push(2.0, EventPriority.FETCH, order.append, "second")
    queue.run()
    # The follow-up has a higher priority, but it runs after its parent has returned.
    assert order == ["first-done", "follow-up", "second"]
    assert queue.num_events == 3


def test_scheduling_into_the_past_is_a_caller_bug():
    queue = EventQueue()
    queue.push(1.0, EventPriority.FETCH, lambda _: None, None)
    queue.run()
    with pytest.raises(RuntimeError, match="before now"):
        queue.push(0.5, EventPriority.FETCH, lambda _: None, None)


def test_a_reserved_seq_no_keeps_the_push_order():
    # An event scheduled first (reserved seq_no) but pushed after later ones still runs
    # before them at equal time and priority.
    queue = EventQueue()
    order = []
    reserved = queue.reserve_seq_no()
    queue.push(1.0, EventPriority.FETCH, order.append, "pushed-second")
    queue.push_reserved(1.0, EventPriority.FETCH, reserved, order.append, "reserved-first")
    queue.run()
    assert order == ["reserved-first", "pushed-second"]
    with pytest.raises(RuntimeError, match="caller bug"):
        queue.push_reserved(0.5, EventPriority.FETCH, queue.reserve_seq_no(), order.append, 0)


def test_is_next_says_whether_a_key_comes_before_every_pending_event():
    queue = EventQueue()
    assert queue.is_next(5.0, EventPriority.FETCH, queue.reserve_seq_no())  # empty queue
    later = queue.reserve_seq_no()
    queue.push(1.0, EventPriority.FETCH, print, None)
    assert queue.is_next(1.0, EventPriority.FETCH, later - 1)  # pushed after: comes first
    assert not queue.is_next(1.0, EventPriority.FETCH, queue.reserve_seq_no())
    assert queue.is_next(1.0, EventPriority.STEP_DONE, queue.reserve_seq_no())
    assert not queue.is_next(1.5, EventPriority.TRANSFER_DONE, queue.reserve_seq_no())
