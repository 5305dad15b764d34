"""Transports: region math, the fake in one process, NIXL and shared memory across processes."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.errors import PeerUnavailable, TransferError, TransferTimeout
from dualpath.kv.layout import KVLayout
from dualpath.transfer.transport import (
    BufferDescriptor,
    FakeNetwork,
    FakeTransport,
    Region,
    SlotLayout,
    TransferOp,
    Transport,
    coalesce_regions,
    copy_regions,
    create_transport,
    layer_block_regions,
)
from tests.transfer.transport_peer import PeerProcess, start_peer

pytestmark = pytest.mark.timeout(180)  # a hang guard: the slowest test takes ~15 s when loaded

HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None
REAL_KINDS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="nixl-cu12 missing")),
    "shm",
]
# 4 layers x 16 tokens x 256 bytes: 4 KiB Layer Blocks, 16 KiB Full Blocks.
LAYOUT = KVLayout(num_layers=4, block_size_tokens=16, bytes_per_token_per_layer=256)
NUM_SLOTS = 12
FULL = SlotLayout.full_blocks(LAYOUT)
LAYER = SlotLayout.layer_blocks(LAYOUT)
TIMEOUT_S = 10.0
# For what must happen but comes from another thread or process (a closed or killed peer is
# noticed): far above what it takes on a loaded machine; spending it means a real hang.
NOTICE_BUDGET_S = 30.0


def random_bytes(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def full_blocks(data: np.ndarray) -> np.ndarray:
    return data.reshape(-1, *LAYOUT.full_block_shape)


# --- regions ------------------------------------------------------------------------------------


def test_layer_block_regions_full_to_full_is_one_region_per_layer_block() -> None:
    regions = layer_block_regions(2, FULL, [0, 1, 2], FULL, [9, 4, 5])
    lb, fb = LAYOUT.layer_block_bytes, LAYOUT.full_block_bytes
    assert regions == [
        Region(0 * fb + 2 * lb, 9 * fb + 2 * lb, lb),
        Region(1 * fb + 2 * lb, 4 * fb + 2 * lb, lb),
        Region(2 * fb + 2 * lb, 5 * fb + 2 * lb, lb),
    ]


def test_layer_block_regions_coalesce_runs_adjacent_on_both_sides() -> None:
    lb = LAYOUT.layer_block_bytes
    # Layer staging slots 0..3 <- DE slots 5,6 then 8,9: two runs, the layer index is ignored.
    regions = layer_block_regions(3, LAYER, [0, 1, 2, 3], LAYER, [5, 6, 8, 9])
    assert regions == [Region(0, 5 * lb, 2 * lb), Region(2 * lb, 8 * lb, 2 * lb)]
    one_layer = KVLayout(num_layers=1, block_size_tokens=16, bytes_per_token_per_layer=256)
    single = SlotLayout.full_blocks(one_layer)
    assert layer_block_regions(0, single, [4, 5, 6], single, [0, 1, 2]) == [
        Region(4 * lb, 0, 3 * lb)
    ]


def test_layer_block_regions_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="2 local slots but 1 remote"):
        layer_block_regions(0, FULL, [0, 1], FULL, [0])
    other = KVLayout(num_layers=4, block_size_tokens=8, bytes_per_token_per_layer=256)
    with pytest.raises(ValueError, match="layer blocks differ"):
        layer_block_regions(0, FULL, [0], SlotLayout.full_blocks(other), [0])
    with pytest.raises(ValueError, match=">= 0"):
        layer_block_regions(0, FULL, [-1], FULL, [0])


def test_coalesce_keeps_order_and_only_merges_continuations() -> None:
    regions = [Region(0, 100, 10), Region(10, 110, 5), Region(15, 200, 5), Region(0, 205, 1)]
    assert coalesce_regions(regions) == [
        Region(0, 100, 15),
        Region(15, 200, 5),
        Region(0, 205, 1),
    ]


@given(
    layer=st.integers(0, LAYOUT.num_layers - 1),
    slot_pairs=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 5)),
        max_size=6,
        unique_by=(lambda pair: pair[0], lambda pair: pair[1]),
    ),
    is_local_full=st.booleans(),
    is_remote_full=st.booleans(),
)
def test_regions_move_exactly_the_layer_blocks(
    layer: int, slot_pairs: list[tuple[int, int]], is_local_full: bool, is_remote_full: bool
) -> None:
    """Copying by (coalesced) regions equals copying each Layer Block by hand, both ways."""
    local_layout = FULL if is_local_full else LAYER
    remote_layout = FULL if is_remote_full else LAYER
    local_slots = [local_slot for local_slot, _ in slot_pairs]
    remote_slots = [remote_slot for _, remote_slot in slot_pairs]
    regions = np.asarray(
        layer_block_regions(layer, local_layout, local_slots, remote_layout, remote_slots),
        dtype=np.int64,
    ).reshape(-1, 3)
    local = random_bytes(6 * LAYOUT.full_block_bytes, seed=1)
    remote = random_bytes(6 * LAYOUT.full_block_bytes, seed=2)
    expected_remote, expected_local = remote.copy(), np.zeros_like(local)
    for local_slot, remote_slot in slot_pairs:
        at_local = slice(local_layout.offset_bytes(local_slot, layer), None)
        at_remote = slice(remote_layout.offset_bytes(remote_slot, layer), None)
        layer_block = local[at_local][: LAYOUT.layer_block_bytes]
        expected_remote[at_remote][: LAYOUT.layer_block_bytes] = layer_block
        expected_local[at_local][: LAYOUT.layer_block_bytes] = layer_block
    copy_regions(TransferOp.WRITE, local, remote, regions)
    np.testing.assert_array_equal(remote, expected_remote)
    local_after_read = np.zeros_like(local)
    copy_regions(TransferOp.READ, local_after_read, remote, regions)
    np.testing.assert_array_equal(local_after_read, expected_local)


def test_buffer_descriptor_round_trips_through_msgpack() -> None:
    descriptor = BufferDescriptor("de-0", "de-buffer", 0x7F00_0000_1000, 1 << 30, "VRAM", 3)
    data = msgpack.unpackb(msgpack.packb(descriptor.to_dict()))
    assert BufferDescriptor.from_dict(data) == descriptor
    with pytest.raises(ValueError, match="needs keys"):
        BufferDescriptor.from_dict({**data, "extra": 1})


# --- the fake, in one process -------------------------------------------------------------------


@pytest.fixture
def fake_pair() -> Iterator[tuple[FakeTransport, FakeTransport]]:
    network = FakeNetwork()
    with FakeTransport("pe", network) as pe, FakeTransport("de", network) as de:
        yield pe, de


def connect_pair(pe: Transport, de: Transport) -> tuple[np.ndarray, np.ndarray, tuple]:
    """PE and DE buffers of NUM_SLOTS Full Blocks, registered, PE connected to DE."""
    pe_data = pe.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    de_data = de.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    pe_data[:] = random_bytes(pe_data.size, seed=3)
    descriptors = (pe.register("pe-buffer", pe_data), de.register("de-buffer", de_data))
    pe.connect(de.name, de.metadata())
    return pe_data, de_data, descriptors


def test_fake_writes_and_reads_layer_blocks(fake_pair: tuple[FakeTransport, FakeTransport]) -> None:
    pe, de = fake_pair
    pe_data, de_data, (pe_buffer, de_buffer) = connect_pair(pe, de)
    for layer in range(LAYOUT.num_layers):
        regions = layer_block_regions(layer, FULL, [0, 1, 2], FULL, [9, 4, 5])
        handle = pe.write("de", pe_buffer, de_buffer, regions)
        pe.wait(handle, timeout_s=TIMEOUT_S)
        assert handle.num_bytes == 3 * LAYOUT.layer_block_bytes
    np.testing.assert_array_equal(full_blocks(de_data)[[9, 4, 5]], full_blocks(pe_data)[:3])
    de_data[:] = random_bytes(de_data.size, seed=4)
    handle = pe.read(
        "de", pe_buffer, de_buffer, layer_block_regions(1, LAYER, [0, 1], FULL, [7, 2])
    )
    assert pe.is_done(handle)
    pe.wait(handle, timeout_s=0)  # a finished handle may be waited on again
    np.testing.assert_array_equal(
        pe_data[: 2 * LAYOUT.layer_block_bytes].reshape(2, *LAYOUT.layer_block_shape),
        full_blocks(de_data)[[7, 2], 1],
    )


def test_fake_held_transfer_times_out_and_stays_unmoved() -> None:
    network = FakeNetwork()
    pe = FakeTransport("pe", network, holds_transfers=True)
    de = FakeTransport("de", network)
    _, de_data, (pe_buffer, de_buffer) = connect_pair(pe, de)
    regions = layer_block_regions(0, FULL, [0], FULL, [0])
    timed_out = pe.write("de", pe_buffer, de_buffer, regions)
    completed = pe.write("de", pe_buffer, de_buffer, layer_block_regions(1, FULL, [0], FULL, [1]))
    with pytest.raises(TransferTimeout, match="WRITE of 4096 bytes in 1 regions"):
        pe.wait(timed_out, timeout_s=5.0)  # no clock in the fake: raises at once
    with pytest.raises(TransferTimeout):
        pe.is_done(timed_out)  # a failed handle re-raises
    assert pe.complete_held_transfers() == 1  # the timed-out one was cancelled
    pe.wait(completed, timeout_s=0)
    assert not full_blocks(de_data)[0, 0].any()
    assert full_blocks(de_data)[1, 1].any()


def test_fake_closed_peer_is_unavailable() -> None:
    network = FakeNetwork()
    pe = FakeTransport("pe", network, holds_transfers=True)
    de = FakeTransport("de", network)
    _, _, (pe_buffer, de_buffer) = connect_pair(pe, de)
    held = pe.write("de", pe_buffer, de_buffer, [Region(0, 0, 1)])
    de.close()
    pe.complete_held_transfers()
    with pytest.raises(PeerUnavailable, match="closed"):
        pe.wait(held, timeout_s=1.0)
    with pytest.raises(PeerUnavailable):
        pe.write("de", pe_buffer, de_buffer, [Region(0, 0, 1)])


def test_caller_errors_are_reported(fake_pair: tuple[FakeTransport, FakeTransport]) -> None:
    pe, de = fake_pair
    _, _, (pe_buffer, de_buffer) = connect_pair(pe, de)
    with pytest.raises(ValueError, match="already registered"):
        pe.register("pe-buffer", np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match=r"region 1 \(0, 196604, 8\)"):
        regions = [Region(0, 0, 8), Region(0, de_buffer.num_bytes - 4, 8)]
        pe.write("de", pe_buffer, de_buffer, regions)
    with pytest.raises(ValueError, match="is empty"):
        pe.write("de", pe_buffer, de_buffer, [Region(0, 0, 0)])
    with pytest.raises(RuntimeError, match="never connected"):
        de.write("pe", de_buffer, pe_buffer, [Region(0, 0, 8)])
    with pytest.raises(ValueError, match="does not belong"):
        pe.write("de", pe_buffer, pe_buffer, [Region(0, 0, 8)])
    handle = pe.write("de", pe_buffer, de_buffer, [])  # an empty batch is done at once
    assert handle.num_bytes == 0 and pe.is_done(handle)
    with pytest.raises(RuntimeError, match="not returned by 'de'"):
        de.is_done(handle)


def test_buffers_registered_after_connect_need_fresh_metadata(
    fake_pair: tuple[FakeTransport, FakeTransport],
) -> None:
    pe, de = fake_pair
    _, _, (pe_buffer, _) = connect_pair(pe, de)
    late = de.register("late", de.allocate_host_buffer(64))
    with pytest.raises(TransferError, match="no buffer 'late'"):
        pe.write("de", pe_buffer, late, [Region(0, 0, 8)])
    pe.connect("de", de.metadata())
    pe.wait(pe.write("de", pe_buffer, late, [Region(0, 0, 8)]), timeout_s=TIMEOUT_S)


# --- real transports, in one process ------------------------------------------------------------


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_real_transport_in_one_process_and_closed_peer(kind: str) -> None:
    pe, de = create_transport(kind, f"{kind}-pe"), create_transport(kind, f"{kind}-de")
    pe_data, de_data, (pe_buffer, de_buffer) = connect_pair(pe, de)
    regions = layer_block_regions(3, FULL, [0, 1], FULL, [2, 3])
    pe.wait(pe.write(de.name, pe_buffer, de_buffer, regions), timeout_s=TIMEOUT_S)
    np.testing.assert_array_equal(full_blocks(de_data)[[2, 3], 3], full_blocks(pe_data)[:2, 3])
    de.close()
    # NIXL learns of the closed agent from UCX's progress thread, a few ms later; the
    # shared-memory transport at once. The budget only stops a transport that never notices.
    deadline_s = time.monotonic() + NOTICE_BUDGET_S
    with pytest.raises(PeerUnavailable):
        while time.monotonic() < deadline_s:
            pe.wait(pe.write(de.name, pe_buffer, de_buffer, regions), timeout_s=TIMEOUT_S)
            time.sleep(0.01)
    pe.close()
    pe.close()  # close may repeat


def test_shm_registers_only_its_shared_memory() -> None:
    with create_transport("shm", "shm-only") as transport:
        with pytest.raises(ValueError, match="not in shared memory"):
            transport.register("private", np.zeros(64, np.uint8))
        shared = transport.allocate_host_buffer(4096)
        descriptor = transport.register("view", shared[1024:2048])  # a view inside a segment
        assert descriptor.num_bytes == 1024


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_NIXL, reason="nixl-cu12 missing")
def test_nixl_moves_cuda_tensors_to_host_buffers() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with create_transport("nixl", "gpu-pe") as pe, create_transport("nixl", "gpu-de") as de:
        layer_tensor = torch.arange(4096, dtype=torch.int32, device="cuda").view(torch.uint8)
        pe_buffer = pe.register("pe-layer", layer_tensor)
        assert (pe_buffer.mem_type, pe_buffer.device_id) == ("VRAM", layer_tensor.device.index)
        de_data = de.allocate_host_buffer(layer_tensor.numel())
        de_buffer = de.register("de-buffer", de_data)
        pe.connect("gpu-de", de.metadata())
        pe.wait(pe.write("gpu-de", pe_buffer, de_buffer, [Region(0, 0, 16384)]), TIMEOUT_S)
        np.testing.assert_array_equal(de_data, layer_tensor.cpu().numpy())


# --- real transports, two processes -------------------------------------------------------------


@pytest.fixture(scope="module", params=REAL_KINDS)
def peer(request: pytest.FixtureRequest) -> Iterator[PeerProcess]:
    """A DE-like peer process, shared by this module's tests of one transport kind."""
    kind = request.param
    peer = start_peer(kind, f"{kind}-peer", NUM_SLOTS * LAYOUT.full_block_bytes)
    yield peer
    peer.stop()


@pytest.fixture
def local(peer: PeerProcess, request: pytest.FixtureRequest) -> Iterator[Transport]:
    with create_transport(peer.kind, f"local-{request.node.name}") as transport:
        transport.connect(peer.descriptor.owner_name, peer.metadata)
        yield transport


def test_cross_process_write_and_read_per_layer(peer: PeerProcess, local: Transport) -> None:
    name = peer.descriptor.owner_name
    data = local.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    data[:] = random_bytes(data.size, seed=5)
    buffer = local.register("pe-buffer", data)
    expected = full_blocks(peer.fill(seed=6)).copy()
    # WRITE: after each layer, the PE pushes that layer of 3 Full Blocks into DE slots 9, 4, 5.
    for layer in range(LAYOUT.num_layers):
        regions = layer_block_regions(layer, FULL, [0, 1, 2], FULL, [9, 4, 5])
        assert len(regions) == 3
        local.wait(local.write(name, buffer, peer.descriptor, regions), timeout_s=TIMEOUT_S)
    expected[[9, 4, 5]] = full_blocks(data)[:3]
    np.testing.assert_array_equal(full_blocks(peer.get()), expected)
    # READ: the PE pulls one layer of hit blocks (DE slots 1, 2, 3, 8) into a layer staging area.
    remote = full_blocks(peer.fill(seed=7))
    for layer in range(LAYOUT.num_layers):
        regions = layer_block_regions(layer, LAYER, [0, 1, 2, 3], FULL, [1, 2, 3, 8])
        local.wait(local.read(name, buffer, peer.descriptor, regions), timeout_s=TIMEOUT_S)
        staged = data[: 4 * LAYOUT.layer_block_bytes].reshape(4, *LAYOUT.layer_block_shape)
        np.testing.assert_array_equal(staged, remote[[1, 2, 3, 8], layer])


def test_cross_process_register_once_many_transfers(peer: PeerProcess, local: Transport) -> None:
    name = peer.descriptor.owner_name
    data = local.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    buffer = local.register("pe-buffer", data)
    peer.fill(seed=8)
    rng = np.random.default_rng(9)
    for step in range(40):
        slots = rng.permutation(NUM_SLOTS)[:3].tolist()
        regions = layer_block_regions(step % LAYOUT.num_layers, FULL, slots, FULL, slots)
        if step % 2 == 0:
            data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
            handle = local.write(name, buffer, peer.descriptor, regions)
        else:
            handle = local.read(name, buffer, peer.descriptor, regions)
        local.wait(handle, timeout_s=TIMEOUT_S)
    assert local.num_registrations == 1
    assert handle.transfer_id == 39
    # The last transfer was a READ of what the peer holds: both sides agree on those bytes.
    remote = peer.get()
    for region in regions:
        start, remote_start, num_bytes = region
        np.testing.assert_array_equal(
            data[start : start + num_bytes], remote[remote_start : remote_start + num_bytes]
        )


def test_cross_process_torch_tensor_buffer(peer: PeerProcess, local: Transport) -> None:
    torch = pytest.importorskip("torch")
    data = local.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    tensor = torch.from_numpy(data).view(torch.float16)  # KV as the model sees it
    tensor.copy_(torch.linspace(-1, 1, tensor.numel(), dtype=torch.float16))
    buffer = local.register("pe-kv", tensor)
    assert buffer.num_bytes == data.size and buffer.mem_type == "DRAM"
    regions = layer_block_regions(2, FULL, [0, 1], FULL, [10, 11])
    local.wait(local.write(peer.descriptor.owner_name, buffer, peer.descriptor, regions), TIMEOUT_S)
    np.testing.assert_array_equal(full_blocks(peer.get())[[10, 11], 2], full_blocks(data)[:2, 2])


def test_cross_process_peer_writes_to_us(peer: PeerProcess, local: Transport) -> None:
    """Metadata flows both ways: the peer connects to us and writes into our buffer."""
    data = local.allocate_host_buffer(NUM_SLOTS * LAYOUT.full_block_bytes)
    buffer = local.register("pe-buffer", data)
    expected = peer.fill(seed=10)
    regions = layer_block_regions(0, FULL, [3], LAYER, [0])
    peer.call("write", local.metadata(), buffer.to_dict(), [list(region) for region in regions])
    np.testing.assert_array_equal(
        data[: LAYOUT.layer_block_bytes].reshape(LAYOUT.layer_block_shape),
        full_blocks(expected)[3, 0],
    )


def test_cross_process_unknown_remote_buffer(peer: PeerProcess, local: Transport) -> None:
    buffer = local.register("pe-buffer", local.allocate_host_buffer(4096))
    never_registered = dataclasses.replace(
        peer.descriptor, buffer_id="never-registered", address=4096
    )
    with pytest.raises(TransferError) as error:
        local.write(peer.descriptor.owner_name, buffer, never_registered, [Region(0, 0, 8)])
    assert not isinstance(error.value, PeerUnavailable)


@pytest.mark.parametrize("kind", REAL_KINDS)
def test_killed_peer_fails_fast_and_a_restarted_one_reconnects(kind: str) -> None:
    num_bytes = NUM_SLOTS * LAYOUT.full_block_bytes
    peer = start_peer(kind, f"{kind}-doomed", num_bytes)
    with create_transport(kind, f"{kind}-survivor") as local:
        local.connect(peer.descriptor.owner_name, peer.metadata)
        buffer = local.register("pe-buffer", local.allocate_host_buffer(num_bytes))
        regions = layer_block_regions(0, FULL, [0], FULL, [0])
        local.wait(
            local.write(peer.descriptor.owner_name, buffer, peer.descriptor, regions), TIMEOUT_S
        )
        peer.kill()
        # PeerUnavailable; NIXL may say TransferError if the post beats UCX's disconnect.
        # Failing fast means failing on the death, not on the wait's timeout.
        with pytest.raises(TransferError) as error:
            handle = local.write(peer.descriptor.owner_name, buffer, peer.descriptor, regions)
            local.wait(handle, timeout_s=NOTICE_BUDGET_S)
        assert not isinstance(error.value, TransferTimeout), error.value
        # The engine restarts under the same name: connecting again with its metadata works.
        restarted = start_peer(kind, f"{kind}-doomed", num_bytes)
        try:
            local.connect(restarted.descriptor.owner_name, restarted.metadata)
            expected = full_blocks(restarted.fill(seed=11)).copy()
            handle = local.write(
                restarted.descriptor.owner_name, buffer, restarted.descriptor, regions
            )
            local.wait(handle, timeout_s=TIMEOUT_S)
            expected[0, 0] = 0  # our buffer is zeros
            np.testing.assert_array_equal(full_blocks(restarted.get()), expected)
        finally:
            restarted.stop()


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped: the signal is
    delivered asynchronously, and a thread still running could serve a request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: thread states {states}"
        time.sleep(0.001)


@pytest.mark.skipif(not HAS_NIXL, reason="nixl-cu12 missing")
def test_nixl_wait_times_out_and_cancels(monkeypatch: pytest.MonkeyPatch) -> None:
    # A READ from a peer whose process is stopped (SIGSTOP) cannot finish, however fast the
    # machine: over TCP only the peer's UCX worker can send its bytes. (CMA, UCX's default on
    # one host, would copy a stopped process's memory inside the post: TCP only, both sides.)
    tcp_only = {"UCX_TLS": "tcp,self"}
    monkeypatch.setenv("UCX_TLS", tcp_only["UCX_TLS"])
    num_bytes = NUM_SLOTS * LAYOUT.full_block_bytes
    peer = start_peer("nixl", "nixl-stopped", num_bytes, env=tcp_only)
    name = peer.descriptor.owner_name
    try:
        with create_transport("nixl", "nixl-waiter") as local:
            local.connect(name, peer.metadata)
            expected = peer.fill(seed=12)
            data = local.allocate_host_buffer(num_bytes)
            buffer = local.register("pe-buffer", data)
            # One transfer while the peer runs: UCX has wired up both sides before the stop.
            local.wait(local.read(name, buffer, peer.descriptor, [Region(0, 0, 64)]), TIMEOUT_S)
            stop_process(peer.process.pid)
            try:
                handle = local.read(name, buffer, peer.descriptor, [Region(0, 0, num_bytes)])
                with pytest.raises(TransferTimeout, match="not done in 0.05s"):
                    local.wait(handle, timeout_s=0.05)
                with pytest.raises(TransferTimeout):
                    local.wait(handle, timeout_s=TIMEOUT_S)  # a cancelled handle stays failed
            finally:
                os.kill(peer.process.pid, signal.SIGCONT)
            # The agent is still usable after the cancel, with the same peer.
            small = local.allocate_host_buffer(4096)
            small_buffer = local.register("small", small)
            regions = [Region(0, 4096, 4096)]
            local.wait(local.read(name, small_buffer, peer.descriptor, regions), TIMEOUT_S)
            np.testing.assert_array_equal(small, expected[4096:8192])
    finally:
        peer.stop()


@pytest.mark.skipif(not HAS_NIXL, reason="nixl-cu12 missing")
def test_an_idle_nixl_agent_does_not_spin() -> None:
    # NIXL's Python wrapper sets its progress thread's poll() timeout to 0: one core busy per
    # idle agent. Ours sleeps until an event or 1 ms: ~2% of a core. Process CPU time, not
    # wall time, so other load on the machine does not matter.
    with create_transport("nixl", "idle"):
        start_cpu_s = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - start_cpu_s < 0.3
