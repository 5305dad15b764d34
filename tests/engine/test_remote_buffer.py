"""A PE's writes to several DEs' buffers over one staging ring: a write that fails is raised to
its own DE's remote buffer only, never to a request whose DE answered."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
from dualpath.errors import PeerUnavailable
from dualpath.kv.layout import KVLayout
from dualpath.transfer.transport import FakeNetwork, FakeTransport

LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)


class Cluster:
    """A PE whose transport holds every transfer until told, and two DEs, ``a`` and ``b``."""

    def __init__(self, ring_blocks: int) -> None:
        network = FakeNetwork()
        self.pe = FakeTransport("pe", network, holds_transfers=True)
        self.des = {name: FakeTransport(name, network) for name in ("a", "b")}
        self.buffers = {name: KVBuffer(LAYOUT, 4 * LAYOUT.full_block_bytes) for name in self.des}
        staging = TransportStaging(self.pe, LAYOUT, max_read_blocks=2, ring_blocks=ring_blocks)
        self.remotes = {}
        for name, de in self.des.items():
            descriptor = de.register("buffer", self.buffers[name].array)
            self.pe.connect(name, de.metadata())
            self.remotes[name] = TransportRemoteBuffer(staging, name, descriptor, timeout_s=5.0)


def _blocks(num: int, value: int) -> np.ndarray:
    return np.full((num, *LAYOUT.layer_block_shape), value, np.uint8)


def test_a_failed_write_is_raised_to_its_own_de_only() -> None:
    cluster = Cluster(ring_blocks=4)
    cluster.remotes["a"].write_layer([1], 0, _blocks(1, 7))
    cluster.remotes["b"].write_layer([2], 0, _blocks(1, 9))
    cluster.des["b"].close()  # b dies with a write in flight
    cluster.pe.complete_held_transfers()
    cluster.remotes["a"].flush()  # a's write landed: nothing to raise here
    assert (cluster.buffers["a"].layer_block(1, 0) == 7).all()
    with pytest.raises(PeerUnavailable, match="'b'"):
        cluster.remotes["b"].flush()


def test_a_failure_found_while_the_ring_wraps_waits_for_its_own_de() -> None:
    cluster = Cluster(ring_blocks=2)
    cluster.remotes["b"].write_layer([0], 1, _blocks(1, 9))
    cluster.des["b"].close()
    cluster.pe.complete_held_transfers()
    # Two blocks for a do not fit after b's: the ring waits for every write, b's fails.
    cluster.remotes["a"].write_layer([2, 3], 1, _blocks(2, 5))
    cluster.pe.complete_held_transfers()
    cluster.remotes["a"].flush()
    assert (cluster.buffers["a"].array[[2, 3], 1] == 5).all()
    with pytest.raises(PeerUnavailable, match="'b'"):
        cluster.remotes["b"].write_layer([1], 1, _blocks(1, 9))
