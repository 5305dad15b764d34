"""What one KV block costs a storage NIC beyond its own bytes: the store's file-system round trips
(a write's lookup, create, write, close and rename; a read's open, read, close and the touch of
its mtime), as the kernel's counters see them on a test host.

    cost = measure_block_cost(test_host, store_dir, layout, num_blocks=64)
    cost.write_extra_bytes, cost.read_extra_bytes  # per block, sent + received, beyond its payload

The blocks go through our own store (``FileKVStore``) in a process inside the host, into a new
namespace of ``store_dir`` (its fan-out directories made before anything is counted, as a
store's are), written then read back, with the host's storage NIC counters read around each
phase. On the tiny model's 128 KiB blocks GlusterFS costs ~12% on a write and ~3% on a read:
a fixed cost per file that a large model's MB-sized blocks make small.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dualpath.kv.layout import KVLayout
from dualpath.testbed.hosts import STORAGE, Host, nic_bytes

_TIMEOUT_S = 120.0  # a hang guard: 64 blocks of a small model take a second on the test hosts

# Run inside the host: open a store, then write and read the blocks when told (a line on
# stdin), saying when each phase is done (a line on stdout).
_CHILD = """
import secrets, sys
from pathlib import Path
import numpy as np
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.layout import KVLayout
store_dir, num_blocks, num_layers, block_size, bytes_per_token_per_layer = sys.argv[1:]
layout = KVLayout(int(num_layers), int(block_size), int(bytes_per_token_per_layer))
store = FileKVStore(Path(store_dir), layout, secrets.token_hex(16))
rng = np.random.default_rng(0)
keys = [secrets.token_hex(16) for _ in range(int(num_blocks))]
blocks = [rng.integers(0, 256, layout.full_block_shape, dtype=np.uint8) for _ in keys]
print("ready", flush=True)
sys.stdin.readline()
for key, block in zip(keys, blocks):
    store.write(key, block)
print("written", flush=True)
sys.stdin.readline()
for key in keys:
    store.read(key)
print("read", flush=True)
"""


@dataclass(frozen=True, slots=True)
class BlockWireCost:
    """Bytes a storage NIC carries per block beyond the block's payload, sent + received."""

    payload_bytes: int  # a Full Block's KV (what our accounting counts per block)
    write_extra_bytes: float
    read_extra_bytes: float
    num_blocks: int  # blocks the figures are the mean of


def measure_block_cost(
    host: Host, store_dir: Path, layout: KVLayout, *, num_blocks: int = 64
) -> BlockWireCost:
    """Write ``num_blocks`` blocks of ``layout`` through the store on ``host``'s mount of
    ``store_dir`` and read them back, counting the host's storage NIC (module docstring)."""
    argv = [
        sys.executable, "-c", _CHILD, str(store_dir), str(num_blocks),
        str(layout.num_layers), str(layout.block_size_tokens),
        str(layout.bytes_per_token_per_layer),
    ]  # fmt: skip
    child = subprocess.Popen(
        host.argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    moved: list[int] = []
    try:
        for phase in ("ready", "written", "read"):
            line = child.stdout.readline().strip()
            if line != phase:
                raise RuntimeError(f"the store probe on {host.name} said {line!r}, not {phase!r}")
            sent, received = nic_bytes(host, STORAGE)
            moved.append(sent + received)
            if phase != "read":
                child.stdin.write("go\n")
                child.stdin.flush()
        if child.wait(_TIMEOUT_S) != 0:
            raise RuntimeError(f"the store probe on {host.name} exited with {child.returncode}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    payload = layout.full_block_bytes
    return BlockWireCost(
        payload_bytes=payload,
        write_extra_bytes=(moved[1] - moved[0]) / num_blocks - payload,
        read_extra_bytes=(moved[2] - moved[1]) / num_blocks - payload,
        num_blocks=num_blocks,
    )
