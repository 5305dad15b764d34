"""The node-wide SNIC limiter: one cap shared by every engine process of a node (SPEC §1, §4)."""

from __future__ import annotations

import itertools
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from dualpath.errors import StorageTimeout
from dualpath.kv.hashing import block_keys, model_fingerprint
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore
from dualpath.transfer.clock import MonotonicClock, VirtualClock
from dualpath.transfer.links import (
    LinkKind,
    LinkSpec,
    TrafficClass,
    TrafficConfig,
    engine_link_specs,
)
from dualpath.transfer.node_limiter import NodeLimiter
from dualpath.transfer.traffic import TrafficManager

MB = 1_000_000
GBPS_8 = 8.0  # 1e9 bytes/s


def test_reservations_of_two_users_never_overlap(tmp_path: Path) -> None:
    clock = VirtualClock()
    path = tmp_path / "node0.snic"
    with (
        NodeLimiter(path, GBPS_8, clock=clock) as first,
        NodeLimiter(path, GBPS_8, clock=clock) as second,
    ):
        assert first.reserve(100 * MB, timeout_s=1.0) == (0.0, pytest.approx(0.1))
        assert second.reserve(200 * MB, timeout_s=1.0) == (pytest.approx(0.1), pytest.approx(0.3))
        clock.advance(1.0)  # the link went idle: the next booking starts now, not at 0.3
        assert first.reserve(0, timeout_s=1.0) == (1.0, 1.0)


def test_a_short_idle_gap_counts_as_busy(tmp_path: Path) -> None:
    clock = VirtualClock()
    with NodeLimiter(tmp_path / "n.snic", GBPS_8, clock=clock, gap_fill_s=0.001) as limiter:
        assert limiter.reserve(100 * MB, timeout_s=1.0)[1] == pytest.approx(0.1)
        clock.advance_to(0.1005)  # back to back but for the caller's overhead
        assert limiter.reserve(100 * MB, timeout_s=1.0)[0] == pytest.approx(0.1)
        clock.advance_to(0.5)  # a real pause
        assert limiter.reserve(100 * MB, timeout_s=1.0)[0] == 0.5


def test_move_sleeps_only_what_the_real_io_did_not_take(tmp_path: Path) -> None:
    clock = VirtualClock()
    with NodeLimiter(tmp_path / "n.snic", GBPS_8, clock=clock) as limiter:
        result = limiter.move(500 * MB, lambda: clock.advance(0.2) or "read", timeout_s=1.0)
        assert result == "read"
        assert clock.slept_s == pytest.approx(0.3)  # 0.5 s on the link, 0.2 s of real I/O


def test_a_booking_past_the_timeout_is_refused_and_not_made(tmp_path: Path) -> None:
    clock = VirtualClock()
    with NodeLimiter(tmp_path / "n.snic", GBPS_8, clock=clock) as limiter:
        limiter.reserve(800 * MB, timeout_s=1.0)
        with pytest.raises(StorageTimeout, match="timeout"):
            limiter.reserve(300 * MB, timeout_s=1.0)  # would end at 1.1 s
        assert limiter.reserve(200 * MB, timeout_s=1.0)[1] == pytest.approx(1.0)


def test_the_last_user_removes_the_file_and_caps_must_agree(tmp_path: Path) -> None:
    path = tmp_path / "shm" / "node0.snic"
    first = NodeLimiter(path, GBPS_8)
    second = NodeLimiter(path, GBPS_8)
    with pytest.raises(ValueError, match="must agree"):
        NodeLimiter(path, 2 * GBPS_8)
    first.close()
    first.close()  # idempotent
    assert path.exists()
    second.close()
    assert not path.exists()
    with NodeLimiter(path, 2 * GBPS_8):  # a fresh file takes the new cap
        assert path.exists()


def test_uncapped_does_nothing(tmp_path: Path) -> None:
    clock = VirtualClock(start_s=3.0)
    path = tmp_path / "node0.snic"
    with NodeLimiter(path, 0.0, clock=clock) as limiter:
        assert limiter.reserve(10**12, timeout_s=1e-9) == (3.0, 3.0)
        assert limiter.move(10**12, lambda: 7, timeout_s=1e-9) == 7
    assert list(tmp_path.iterdir()) == []
    assert clock.num_sleeps == 0


def test_traffic_managers_of_two_engines_share_the_node_cap(tmp_path: Path) -> None:
    # Two engines of one node, each with its own traffic manager, one SNIC limiter file.
    clock = VirtualClock()
    snic = LinkSpec("node0.snic", LinkKind.SNIC, GBPS_8)
    limiters = [NodeLimiter(tmp_path / "node0.snic", GBPS_8, clock=clock) for _ in range(2)]
    managers = [
        TrafficManager([snic], clock=clock, node_limiters={snic.name: limiter})
        for limiter in limiters
    ]
    tickets = [m.start(snic.name, TrafficClass.KV, 300 * MB, timeout_s=5.0) for m in managers]
    clock.advance(0.3)
    assert [m.poll(t) for m, t in zip(managers, tickets, strict=True)] == [True, False]
    managers[1].wait(tickets[1])
    assert clock.now_s() == pytest.approx(0.6)  # 600 MB at 1e9 bytes/s, one after the other
    for manager in managers:
        assert manager.stats().link(snic.name).class_to_moved_bytes[TrafficClass.KV] == 300 * MB
    with pytest.raises(ValueError, match="share the cap"):
        TrafficManager(
            [LinkSpec("node0.snic", LinkKind.SNIC, 2 * GBPS_8)],
            clock=clock,
            node_limiters={snic.name: limiters[0]},
        )
    for limiter in limiters:
        limiter.close()


def test_engine_wiring_reads_a_full_block_and_sends_its_layer_blocks(tmp_path: Path) -> None:
    # How an engine uses this package: storage reads of Full Blocks through the node's SNIC
    # limiter, PE->DE sends of Layer Blocks on the engine's CNIC (SPEC §3, §4).
    clock = VirtualClock()
    config = TrafficConfig(snic_bandwidth_gbps=1e-6, cnic_bandwidth_gbps=2e-6)  # 125, 250 B/s
    links = engine_link_specs(config, node_id=0, engine_id=0)
    snic_limiter = NodeLimiter.for_node(
        0, config.snic_bandwidth_gbps, directory=tmp_path, clock=clock
    )
    manager = TrafficManager.from_config(
        links.all(), config, clock=clock, node_limiters={links.snic.name: snic_limiter}
    )
    layout = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
    fingerprint = model_fingerprint(
        weights_digest="w", architecture={}, kv_dtype="uint8", block_size_tokens=4
    )
    [key] = block_keys(list(range(4)), 4, fingerprint)
    store = MemoryKVStore(layout, fingerprint)
    store.write(key, layout.empty_full_block() + 7)

    host_block = layout.empty_full_block()
    full_block = manager.move(
        links.snic.name,
        TrafficClass.KV,
        layout.full_block_bytes,
        lambda: store.read(key, out=host_block),
        timeout_s=5.0,
    )
    assert clock.now_s() == pytest.approx(layout.full_block_bytes / 125)  # 64 B at 125 B/s
    sent: list[bytes] = []
    for layer_block in full_block:  # a Full Block is its Layer Blocks concatenated
        manager.move(
            links.cnic.name,
            TrafficClass.KV,
            layout.layer_block_bytes,
            lambda block=layer_block: sent.append(block.tobytes()),
            timeout_s=5.0,
        )
    assert b"".join(sent) == host_block.tobytes()
    stats = manager.stats()
    assert stats.link(links.snic.name).class_to_moved_bytes[TrafficClass.KV] == 64
    assert stats.link(links.cnic.name).class_to_num_moves[TrafficClass.KV] == 2
    assert clock.now_s() == pytest.approx(64 / 125 + 64 / 250)
    snic_limiter.close()


def _pace_in_child(path: str, num_moves: int, move_bytes: int, barrier: Any, results: Any) -> None:
    """Child process: join the limiter, wait for the sibling, move; report when it started,
    when it ended, its bytes and the intervals it booked."""
    with NodeLimiter(Path(path), GBPS_8, clock=MonotonicClock()) as limiter:
        barrier.wait(timeout=20.0)
        first_s = time.monotonic()
        intervals = []
        for _ in range(num_moves):
            interval = limiter.reserve(move_bytes, timeout_s=10.0)
            intervals.append(interval)
            time.sleep(max(0.0, interval[1] - time.monotonic()))  # as NodeLimiter.move does
        results.put((first_s, time.monotonic(), num_moves * move_bytes, intervals))


def test_two_processes_together_stay_within_the_cap(tmp_path: Path) -> None:
    # Two spawned processes each move 100 MB through one 1e9 bytes/s limiter; alone each would
    # take 0.1 s. Together they must not beat the cap: combined bytes / elapsed <= cap, and
    # no two bookings overlap. Both checks are one-sided, so a loaded machine cannot fail them.
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    path = str(tmp_path / "node0.snic")
    children = [
        context.Process(target=_pace_in_child, args=(path, 25, 4 * MB, barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=20.0) for _ in children]
    for child in children:
        child.join(timeout=5.0)
        assert child.exitcode == 0
    elapsed_s = max(end for _, end, _, _ in outcomes) - min(start for start, _, _, _ in outcomes)
    ratio = sum(num_bytes for _, _, num_bytes, _ in outcomes) / elapsed_s / 1e9
    assert ratio <= 1.02, f"combined rate {ratio:.3f} x cap"
    intervals = sorted(interval for *_, booked in outcomes for interval in booked)
    for (_, end_s), (next_start_s, _) in itertools.pairwise(intervals):
        assert next_start_s >= end_s - 1e-9, "two bookings of one link overlap"
    assert not Path(path).exists()  # the last user removed the file


def test_clusters_on_one_host_get_separate_limiter_files(tmp_path) -> None:
    a = NodeLimiter.for_node(3, 1.0, directory=tmp_path, cluster_id="aaaa")
    b = NodeLimiter.for_node(3, 2.0, directory=tmp_path, cluster_id="bbbb")  # another cap: fine
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "dualpath-aaaa-node3.snic",
            "dualpath-bbbb-node3.snic",
        ]
    finally:
        a.close()
        b.close()
    assert list(tmp_path.iterdir()) == []
