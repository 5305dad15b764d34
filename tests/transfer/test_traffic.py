"""The weighted arbiter (pure) and the traffic manager (accounting, pacing, threads), SPEC §4.

Pacing is checked on a VirtualClock with single-threaded drivers (``start``/``poll``), so no
test here depends on wall-clock timing; the one real-clock test asserts only on counts.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.errors import StorageTimeout, TransferTimeout
from dualpath.transfer.arbiter import WeightedArbiter
from dualpath.transfer.clock import MonotonicClock, VirtualClock
from dualpath.transfer.links import LinkKind, LinkSpec, TrafficClass
from dualpath.transfer.traffic import MoveTicket, TrafficManager

INFERENCE, KV = TrafficClass.INFERENCE, TrafficClass.KV
MB = 1_000_000
CNIC_1GBPS = LinkSpec("engine0.cnic", LinkKind.CNIC, bandwidth_gbps=1.0)  # 125 MB/s
SNIC_4GBPS = LinkSpec("node0.snic", LinkKind.SNIC, bandwidth_gbps=4.0)
UNCAPPED = LinkSpec("engine0.uncapped", LinkKind.CNIC)
SNIC_1GBPS = LinkSpec("node0.snic", LinkKind.SNIC, bandwidth_gbps=1.0)


def make_manager(*links: LinkSpec) -> tuple[TrafficManager, VirtualClock]:
    clock = VirtualClock()
    return TrafficManager(links or (CNIC_1GBPS,), clock=clock), clock


# --- WeightedArbiter: the pure policy --------------------------------------------------------


def served_bytes_by_class(arbiter: WeightedArbiter, duration_s: float) -> dict[TrafficClass, float]:
    served = dict.fromkeys(TrafficClass, 0.0)
    for segment in arbiter.advance(duration_s).segments:
        served[segment.traffic_class] += segment.num_bytes
    return served


def test_backlogged_classes_share_the_rate_99_to_1() -> None:
    arbiter = WeightedArbiter(rate_bytes_per_s=1000.0)
    arbiter.enqueue(0, INFERENCE, 10_000)
    arbiter.enqueue(1, KV, 10_000)
    assert arbiter.class_rates() == {INFERENCE: 990.0, KV: 10.0}
    served = served_bytes_by_class(arbiter, 2.0)
    assert served[INFERENCE] == pytest.approx(1980.0)
    assert served[KV] == pytest.approx(20.0)


def test_a_class_alone_gets_the_whole_rate() -> None:
    arbiter = WeightedArbiter(rate_bytes_per_s=1000.0)
    arbiter.enqueue(0, KV, 10_000)
    assert served_bytes_by_class(arbiter, 3.0)[KV] == pytest.approx(3000.0)


def test_the_rest_goes_to_kv_when_inference_finishes() -> None:
    # Inference (990 B/s) finishes 990 bytes at t = 1 s; KV then gets all 1000 B/s.
    arbiter = WeightedArbiter(rate_bytes_per_s=1000.0)
    arbiter.enqueue(0, INFERENCE, 990)
    arbiter.enqueue(1, KV, 1010)
    assert arbiter.finish_offset_s(0) == pytest.approx(1.0)
    assert arbiter.finish_offset_s(1) == pytest.approx(2.0)  # 10 bytes by t=1, 1000 more
    step = arbiter.advance(1.5)
    assert step.finished_transfer_ids == (0,)
    assert arbiter.queued_bytes(KV) == pytest.approx(500.0)
    assert arbiter.advance(0.5).finished_transfer_ids == (1,)
    assert arbiter.is_idle


def test_one_class_is_first_come_first_served() -> None:
    arbiter = WeightedArbiter(rate_bytes_per_s=100.0)
    for transfer_id in (7, 3, 5):
        arbiter.enqueue(transfer_id, KV, 100)
    finished = [arbiter.advance(1.0).finished_transfer_ids for _ in range(3)]
    assert finished == [(7,), (3,), (5,)]


def test_cancel_and_empty_transfers() -> None:
    arbiter = WeightedArbiter(rate_bytes_per_s=100.0)
    arbiter.enqueue(0, KV, 0)
    arbiter.enqueue(1, INFERENCE, 50)
    assert arbiter.advance(0.0).finished_transfer_ids == (0,)  # no time needed
    assert arbiter.cancel(1) == 50.0
    assert arbiter.is_idle and arbiter.advance(1.0).segments == ()
    with pytest.raises(ValueError, match="weight > 0"):
        WeightedArbiter(100.0, {INFERENCE: 1, KV: 0})


# --- TrafficManager on a VirtualClock --------------------------------------------------------


def keep_backlogged(
    manager: TrafficManager,
    link: LinkSpec,
    open_tickets: list[MoveTicket],
    class_to_size_bytes: dict[TrafficClass, int],
) -> int:
    """Settle finished tickets and start new ones so each class has two queued; return the
    bytes of the tickets that finished."""
    finished_bytes = 0
    for ticket in list(open_tickets):
        if manager.poll(ticket):
            open_tickets.remove(ticket)
            finished_bytes += ticket.num_bytes
    for traffic_class, size_bytes in class_to_size_bytes.items():
        while sum(t.traffic_class == traffic_class for t in open_tickets) < 2:
            open_tickets.append(manager.start(link.name, traffic_class, size_bytes, timeout_s=1e6))
    return finished_bytes


def test_both_classes_backlogged_inference_gets_99_percent_in_every_window() -> None:
    # SPEC §4, the "Must show": a 20 s run, checked in each 1 s window of each link.
    links = (CNIC_1GBPS, SNIC_4GBPS)
    manager, clock = make_manager(*links)
    class_to_size_bytes = {INFERENCE: 8 * MB, KV: 2 * MB}
    link_to_tickets: dict[str, list[MoveTicket]] = {link.name: [] for link in links}
    link_to_finished_bytes = dict.fromkeys(link_to_tickets, 0)
    previous = manager.stats()
    for second in range(1, 21):
        for step in range(100):  # poll every 10 ms
            clock.advance_to(second - 1 + step / 100)
            for link in links:
                link_to_finished_bytes[link.name] += keep_backlogged(
                    manager, link, link_to_tickets[link.name], class_to_size_bytes
                )
        clock.advance_to(float(second))
        stats = manager.stats()
        for link in links:
            now, before = stats.link(link.name), previous.link(link.name)
            window = {
                c: now.class_to_carried_bytes[c] - before.class_to_carried_bytes[c]
                for c in TrafficClass
            }
            total = sum(window.values())
            cap_bytes = link.bandwidth_bytes_per_s * 1.0
            assert window[INFERENCE] >= 0.98 * total, (link.name, second, window)
            assert window[KV] > 0, (link.name, second, window)
            assert total <= cap_bytes + 1.0, (link.name, second, total)  # never above the cap
            assert total >= 0.99 * cap_bytes, (link.name, second, total)  # work-conserving
            assert now.utilisation == pytest.approx(total / cap_bytes)
        previous = stats
    for link in links:
        # Moved bytes are exactly the finished movements' sizes.
        assert stats.link(link.name).moved_bytes == link_to_finished_bytes[link.name]


@pytest.mark.parametrize("traffic_class", list(TrafficClass))
def test_one_class_alone_gets_the_full_cap(traffic_class: TrafficClass) -> None:
    manager, clock = make_manager(CNIC_1GBPS)
    num_bytes = 100 * MB
    manager.move(CNIC_1GBPS.name, traffic_class, num_bytes, lambda: None, timeout_s=10.0)
    achieved_bytes_per_s = num_bytes / clock.now_s()
    assert achieved_bytes_per_s >= 0.99 * CNIC_1GBPS.bandwidth_bytes_per_s
    assert achieved_bytes_per_s <= CNIC_1GBPS.bandwidth_bytes_per_s * (1 + 1e-9)


def test_uncapped_links_never_sleep_and_count_real_time() -> None:
    manager, clock = make_manager(UNCAPPED)

    def real_move() -> str:
        clock.advance(0.5)  # the real transport's own time
        return "done"

    for traffic_class in (KV, INFERENCE, KV):
        result = manager.move(UNCAPPED.name, traffic_class, 10 * MB, real_move, timeout_s=1.0)
        assert result == "done"
    assert clock.num_sleeps == 0
    stats = manager.stats().link(UNCAPPED.name)
    assert stats.class_to_moved_bytes == {INFERENCE: 10 * MB, KV: 20 * MB}
    assert stats.class_to_num_moves == {INFERENCE: 1, KV: 2}
    assert stats.window_bytes_per_s == pytest.approx(20 * MB)  # 10 MB per 0.5 s
    assert stats.utilisation is None


def test_the_real_movement_time_counts_towards_the_emulated_time() -> None:
    manager, clock = make_manager(CNIC_1GBPS)
    link_time_s = 125 * MB / CNIC_1GBPS.bandwidth_bytes_per_s  # 1 s
    manager.move(CNIC_1GBPS.name, KV, 125 * MB, lambda: clock.advance(0.25), timeout_s=5.0)
    assert clock.slept_s == pytest.approx(link_time_s - 0.25)
    # A real movement slower than the cap is not slowed further.
    manager.move(CNIC_1GBPS.name, KV, 125 * MB, lambda: clock.advance(2.0), timeout_s=5.0)
    assert clock.now_s() == pytest.approx(1.0 + 2.0)


def test_a_short_idle_gap_between_moves_counts_as_busy() -> None:
    # A caller moving back to back loses a sleep's overshoot between movements; a gap up to
    # gap_fill_s (1 ms) is served as if the link had stayed busy, a longer one is a real pause.
    manager, clock = make_manager(CNIC_1GBPS)
    one_ms_bytes = 125_000
    manager.move(CNIC_1GBPS.name, KV, one_ms_bytes, lambda: None, timeout_s=1.0)
    clock.advance(0.0005)  # the caller's overhead
    manager.move(CNIC_1GBPS.name, KV, one_ms_bytes, lambda: None, timeout_s=1.0)
    assert clock.now_s() == pytest.approx(0.002)  # not 0.0025
    clock.advance(0.002)  # a real pause
    manager.move(CNIC_1GBPS.name, KV, one_ms_bytes, lambda: None, timeout_s=1.0)
    assert clock.now_s() == pytest.approx(0.005)
    carried_bytes = manager.stats().link(CNIC_1GBPS.name).carried_bytes
    assert carried_bytes <= CNIC_1GBPS.bandwidth_bytes_per_s * clock.now_s() + 1.0
    strict = VirtualClock()
    strict_manager = TrafficManager([CNIC_1GBPS], clock=strict, gap_fill_s=0.0)
    strict_manager.move(CNIC_1GBPS.name, KV, one_ms_bytes, lambda: None, timeout_s=1.0)
    strict.advance(0.0005)
    strict_manager.move(CNIC_1GBPS.name, KV, one_ms_bytes, lambda: None, timeout_s=1.0)
    assert strict.now_s() == pytest.approx(0.0025)


def test_a_movement_that_cannot_meet_its_timeout_fails_fast() -> None:
    manager, clock = make_manager(CNIC_1GBPS, SNIC_1GBPS)
    with pytest.raises(TransferTimeout, match="engine0.cnic"):
        manager.move(CNIC_1GBPS.name, KV, 250 * MB, lambda: None, timeout_s=1.0)  # needs 2 s
    with pytest.raises(StorageTimeout, match="node0.snic"):  # storage links: a store error
        manager.move(SNIC_1GBPS.name, KV, 250 * MB, lambda: None, timeout_s=1.0)
    assert clock.now_s() == 0.0  # nothing slept, nothing left on the link
    assert manager.stats().link(CNIC_1GBPS.name).carried_bytes == 0.0
    manager.move(CNIC_1GBPS.name, KV, 125 * MB, lambda: None, timeout_s=1.5)
    assert clock.now_s() == pytest.approx(1.0)


def test_a_later_inference_burst_can_time_out_a_waiting_kv_movement() -> None:
    manager, clock = make_manager(CNIC_1GBPS)
    kv = manager.start(CNIC_1GBPS.name, KV, 125 * MB, timeout_s=1.5)  # alone: 1 s
    manager.start(CNIC_1GBPS.name, INFERENCE, 250 * MB, timeout_s=10.0)  # takes 99%
    with pytest.raises(TransferTimeout, match="1.500 s timeout"):
        manager.wait(kv)
    assert clock.num_sleeps == 0
    with pytest.raises(RuntimeError, match="caller bug"):
        manager.poll(kv)  # dropped


def test_a_failed_real_movement_is_dropped_and_not_counted() -> None:
    manager, clock = make_manager(CNIC_1GBPS)

    def failing_move() -> None:
        clock.advance(0.5)
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        manager.move(CNIC_1GBPS.name, KV, 125 * MB, failing_move, timeout_s=5.0)
    stats = manager.stats().link(CNIC_1GBPS.name)
    assert stats.moved_bytes == 0
    assert stats.carried_bytes == pytest.approx(62.5 * MB)  # it did use the link for 0.5 s


def test_unknown_links_and_bad_sizes_are_rejected() -> None:
    manager, _ = make_manager(CNIC_1GBPS)
    with pytest.raises(ValueError, match="no link named"):
        manager.start("engine9.cnic", KV, 1, timeout_s=1.0)
    with pytest.raises(ValueError, match="num_bytes"):
        manager.start(CNIC_1GBPS.name, KV, -1, timeout_s=1.0)
    with pytest.raises(ValueError, match="unique"):
        TrafficManager([CNIC_1GBPS, CNIC_1GBPS], clock=VirtualClock())


@settings(max_examples=60, deadline=None)
@given(
    moves=st.lists(
        st.tuples(
            st.sampled_from([CNIC_1GBPS, SNIC_4GBPS, UNCAPPED]),
            st.sampled_from(list(TrafficClass)),
            st.integers(min_value=0, max_value=50 * MB),
            st.booleans(),  # True: start it and leave it queued while later moves run
        ),
        max_size=30,
    )
)
def test_accounting_equals_the_moved_bytes_exactly(
    moves: list[tuple[LinkSpec, TrafficClass, int, bool]],
) -> None:
    manager, _ = make_manager(CNIC_1GBPS, SNIC_4GBPS, UNCAPPED)
    expected = {
        (link.name, c): 0 for link in (CNIC_1GBPS, SNIC_4GBPS, UNCAPPED) for c in TrafficClass
    }
    in_flight = []
    for link, traffic_class, num_bytes, is_left_queued in moves:
        if is_left_queued:
            in_flight.append(manager.start(link.name, traffic_class, num_bytes, timeout_s=1e6))
        else:
            manager.move(link.name, traffic_class, num_bytes, lambda: None, timeout_s=1e6)
        expected[link.name, traffic_class] += num_bytes
    for ticket in in_flight:
        manager.wait(ticket)
    stats = manager.stats()
    for (link_name, traffic_class), num_bytes in expected.items():
        link_stats = stats.link(link_name)
        assert link_stats.class_to_moved_bytes[traffic_class] == num_bytes
        assert link_stats.class_to_carried_bytes[traffic_class] == pytest.approx(num_bytes)


# --- TrafficManager with real threads ---------------------------------------------------------


def test_concurrent_moves_on_a_capped_link_are_counted_exactly() -> None:
    # Real clock, tiny sizes: 8 threads x 40 moves of <= 2 KB on a 1 GB/s link (< 1 ms of
    # emulated time). Assert only on counts: every move returns and every byte is counted.
    link = LinkSpec("engine0.cnic", LinkKind.CNIC, bandwidth_gbps=8.0)
    manager = TrafficManager([link, UNCAPPED], clock=MonotonicClock())
    num_threads, num_moves = 8, 40
    moved_by_thread = [0] * num_threads
    errors: list[BaseException] = []

    def run(thread_index: int) -> None:
        try:
            for i in range(num_moves):
                traffic_class = (INFERENCE, KV)[(thread_index + i) % 2]
                num_bytes = 1 + (thread_index * 131 + i * 17) % 2000
                target = link if i % 4 else UNCAPPED
                manager.move(target.name, traffic_class, num_bytes, lambda: None, timeout_s=5.0)
                moved_by_thread[thread_index] += num_bytes
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10.0)
    assert not any(thread.is_alive() for thread in threads), "a move deadlocked"
    assert errors == []
    stats = manager.stats()
    total_moves = sum(sum(s.class_to_num_moves.values()) for s in stats.links)
    assert total_moves == num_threads * num_moves
    assert sum(s.moved_bytes for s in stats.links) == sum(moved_by_thread)
