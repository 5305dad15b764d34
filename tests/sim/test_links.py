"""Flows on a link: exact fair share within a class, 99:1 between classes, conservation."""

from __future__ import annotations

import math

import pytest

from dualpath.sim.events import EventPriority, EventQueue
from dualpath.sim.links import SimLink, TrafficClass


def _run(link_flows, capacity=100.0, **kwargs):
    """Start (start_s, size, class, name) flows on one link; return name -> finish time."""
    queue = EventQueue()
    link = SimLink("l", capacity, queue, **kwargs)
    done = {}

    def finish(name):
        done[name] = queue.now_s

    for start_s, size, traffic_class, name in link_flows:
        queue.push(
            start_s,
            EventPriority.ARRIVAL,
            lambda entry: link.start(entry[0], entry[1], finish, entry[2]),
            (size, traffic_class, name),
        )
    queue.run()
    return done, link


def test_fair_share_within_a_class_is_exact():
    # 100 B/s; a=100 B and b=300 B start at 0: both at 50 B/s until a ends at 2 s (b has
    # 200 B left), then b alone at 100 B/s: ends at 4 s. c=50 B joins at 3 s with b (100 B
    # left): both at 50 B/s, c ends at 4 s, b has 50 B left and ends at 4.5 s.
    done, link = _run(
        [
            (0.0, 100.0, TrafficClass.KV, "a"),
            (0.0, 300.0, TrafficClass.KV, "b"),
            (3.0, 50.0, TrafficClass.KV, "c"),
        ]
    )
    assert done["a"] == pytest.approx(2.0)
    assert done["c"] == pytest.approx(4.0)
    assert done["b"] == pytest.approx(4.5)
    assert link.finished_bytes[TrafficClass.KV] == pytest.approx(450.0)


def test_inference_class_gets_99_percent_and_kv_is_never_starved():
    # KV flow of 100 B alone at 100 B/s; at 0.5 s an inference flow of 99 B arrives: it gets
    # 99 B/s and ends at 1.5 s; meanwhile KV gets 1 B/s (1 B), then 100 B/s for its last 49 B.
    done, _ = _run(
        [(0.0, 100.0, TrafficClass.KV, "kv"), (0.5, 99.0, TrafficClass.INFERENCE, "inf")]
    )
    assert done["inf"] == pytest.approx(1.5)
    assert done["kv"] == pytest.approx(1.5 + 49.0 / 100.0)


def test_uncapped_link_finishes_after_zero_delay_and_counts_bytes():
    done, link = _run([(1.0, 1e9, TrafficClass.KV, "x")], capacity=math.inf)
    assert done == {"x": 1.0}
    assert link.started_bytes[TrafficClass.KV] == link.finished_bytes[TrafficClass.KV] == 1e9


def test_window_bytes_spread_over_one_second_windows():
    queue = EventQueue()
    link = SimLink("snic", 100.0, queue, window_s=1.0)
    queue.push(
        0.5,
        EventPriority.ARRIVAL,
        lambda _: link.start(200.0, TrafficClass.KV, lambda _: None, None),
        None,
    )
    queue.run()
    # Busy from 0.5 s to 2.5 s at 100 B/s.
    assert link.window_bytes == pytest.approx([50.0, 100.0, 50.0])


def test_many_flows_all_finish_and_bytes_are_conserved():
    sizes = [float(10 + 7 * i % 13) for i in range(200)]
    flows = [(0.01 * i, size, TrafficClass(i % 2), i) for i, size in enumerate(sizes)]
    done, link = _run(flows, capacity=1000.0)
    assert sorted(done) == list(range(200))
    assert sum(link.finished_bytes) == pytest.approx(sum(sizes))
    assert link.num_flows == 0


def test_unpaced_bytes_spread_over_their_interval_and_take_no_bandwidth():
    # 30 B counted at 2.5 s since 0.5 s: 15 B/s over [0.5, 2.5] -> windows 7.5, 15, 7.5 B. A
    # 100 B flow started at 0 still ends at 1 s on the 100 B/s link.
    queue = EventQueue()
    link = SimLink("l", 100.0, queue, window_s=1.0)
    done = {}
    link.start(100.0, TrafficClass.KV, lambda name: done.setdefault(name, queue.now_s), "flow")
    queue.push(
        2.5,
        EventPriority.ARRIVAL,
        lambda _: link.count_unpaced(30.0, TrafficClass.KV, since_s=0.5),
        None,
    )
    queue.run()
    assert done == {"flow": pytest.approx(1.0)}
    assert link.window_bytes == pytest.approx([100.0 + 7.5, 15.0, 7.5])
    assert link.finished_bytes[TrafficClass.KV] == pytest.approx(130.0)
    with pytest.raises(ValueError, match="after now"):
        link.count_unpaced(1.0, TrafficClass.KV, since_s=queue.now_s + 1.0)


def test_a_capacity_change_keeps_the_bytes_served_and_reschedules_both_ways():
    # 100 B/s; a=300 B and b=100 B start at 0 (50 B/s each). At 1 s (50 B served each) the
    # capacity drops to 20 B/s: 10 B/s each, b's last 50 B end at 6 s; a alone at 20 B/s has
    # 200 B left, but at 7 s (180 B left) the capacity rises to 180 B/s: a ends at 8 s.
    queue = EventQueue()
    link = SimLink("l", 100.0, queue)
    done = {}
    for size, name in ((300.0, "a"), (100.0, "b")):
        link.start(size, TrafficClass.KV, lambda n: done.setdefault(n, queue.now_s), name)
    queue.push(1.0, EventPriority.ARRIVAL, lambda _: link.set_capacity(20.0), None)
    queue.push(7.0, EventPriority.ARRIVAL, lambda _: link.set_capacity(180.0), None)
    queue.run()
    assert done["b"] == pytest.approx(6.0)
    assert done["a"] == pytest.approx(8.0)
    assert link.finished_bytes[TrafficClass.KV] == pytest.approx(400.0)
    # Between classes the weights hold at the new capacity.
    link.set_capacity(50.0)
    assert link.class_rates_bytes_per_s() == (0.0, 0.0)
    assert link._shared_rates == pytest.approx((49.5, 0.5))


def test_an_uncapped_link_keeps_its_capacity():
    queue = EventQueue()
    with pytest.raises(ValueError, match="finite"):
        SimLink("oracle", math.inf, queue).set_capacity(10.0)
    with pytest.raises(ValueError, match="finite"):
        SimLink("l", 10.0, queue).set_capacity(0.0)
