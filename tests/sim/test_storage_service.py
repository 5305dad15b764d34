"""The store's aggregate read throughput, shared max-min by the nodes reading from it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.sim.engines import EngineGroup, SimNode, StorageService
from dualpath.sim.events import EventPriority, EventQueue
from dualpath.sim.links import SimLink
from dualpath.sim.profiles import HARDWARE
from dualpath.sim.runner import build_simulator
from tests.sim.test_simulator import small_spec


def _nodes(queue: EventQueue, num_nodes: int, snic: float, service: float, max_inflight=32):
    shared = StorageService(service, snic)
    nodes = []
    for index in range(num_nodes):
        read, write = (SimLink(f"{index}.{way}", snic, queue) for way in ("read", "write"))
        node = SimNode(index, index, read, write, max_inflight)
        node.service = shared
        nodes.append(node)
    EngineGroup(0, [], nodes)  # a node tells its group when its read_q changes
    return nodes, shared


def _jct(simulator) -> float:
    return max(record.finish_s for record in simulator.records)


def test_nodes_reading_share_the_store_equally_up_to_their_snic():
    # SNICs of 10 B/s, a store of 15 B/s. A reads 100 B alone from 0 (10 B/s: min(10, 15));
    # B joins at 2 s with 75 B (7.5 B/s each; A has 80 B left); C joins at 4 s with 50 B
    # (5 B/s each; A 65 B left, B 60 B). C ends at 14 s (A 15 B left, B 10 B): 7.5 B/s each,
    # B ends at 15.333 s (A 5 B left), then A alone at 10 B/s ends at 15.833 s.
    queue = EventQueue()
    (a, b, c), shared = _nodes(queue, 3, snic=10.0, service=15.0)
    done = {}
    for start_s, node, size, name in (
        (0.0, a, 100.0, "a"),
        (2.0, b, 75.0, "b"),
        (4.0, c, 50.0, "c"),
    ):
        queue.push(
            start_s,
            EventPriority.ARRIVAL,
            lambda entry: entry[0].read(
                entry[1], 1, lambda n: done.setdefault(n, queue.now_s), entry[2]
            ),
            (node, size, name),
        )
    queue.run()
    assert done["c"] == pytest.approx(14.0)
    assert done["b"] == pytest.approx(15.0 + 1.0 / 3.0)
    assert done["a"] == pytest.approx(15.0 + 5.0 / 6.0)
    assert shared.num_reading == 0


def test_a_node_with_reads_waiting_keeps_its_share_without_a_pause():
    # One read in flight at a time: the second starts as the first ends, so the node never
    # leaves the store's readers and the other node's share does not jump in between.
    queue = EventQueue()
    (a, b), shared = _nodes(queue, 2, snic=10.0, service=10.0, max_inflight=1)
    done = {}
    record = lambda name: done.setdefault(name, queue.now_s)  # noqa: E731
    a.read(20.0, 1, record, "a1")
    a.read(20.0, 1, record, "a2")
    b.read(60.0, 1, record, "b")
    assert shared.num_reading == 2
    queue.run()
    # 5 B/s each while both read: a1 at 4 s, a2 at 8 s; b has 20 B left at 10 B/s: 10 s.
    assert (done["a1"], done["a2"], done["b"]) == pytest.approx((4.0, 8.0, 10.0))
    assert shared.num_reading == 0


def test_a_store_that_cannot_bind_changes_nothing_and_one_that_can_caps_the_reads():
    hopper = HARDWARE["hopper-8x400"]
    snic = hopper.snic_bytes_per_s * 0.86 / 8  # a --scale-down 8 node's SNIC, as read
    unbounded = build_simulator(small_spec(mode="basic"))
    unbounded.run()
    # Basic reads on the two PE nodes only: a store of 5.9 of the six SNICs never binds it.
    roomy = replace(hopper, storage_service_bytes_per_s=5.9 * snic * 8)
    basic = build_simulator(small_spec(mode="basic", hardware=roomy))
    assert basic.nodes[0].service is not None
    basic.run()
    assert _jct(basic) == _jct(unbounded)
    # DualPath reads on every node; a store of half an SNIC's worth slows it and caps the sum.
    fast = build_simulator(small_spec())
    fast.run()
    tight = replace(hopper, storage_service_bytes_per_s=0.5 * snic * 8)
    slow = build_simulator(small_spec(hardware=tight))
    slow.run()
    assert _jct(slow) > _jct(fast)
    windows = [node.snic_read.window_bytes for node in slow.nodes]
    per_window = [sum(w[i] for w in windows if i < len(w)) for i in range(max(map(len, windows)))]
    assert max(per_window) <= 0.5 * snic * (1 + 1e-9)
    assert max(per_window) > 0.45 * snic
