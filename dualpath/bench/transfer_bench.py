"""Transport benchmark: PE<->DE bytes per second between two processes, against ``np.copyto``.

Run: ``dualpath bench transfer --transport nixl --direction write --json transfer.json`` (or
``python -m dualpath.bench.transfer_bench`` with the same flags).

A peer process (the "DE") registers a buffer of ``total_bytes``; this process (the "PE")
registers one of the same size and moves all of it per repeat, as ``total_bytes /
block_bytes`` Layer Block regions posted in batches of ``blocks_per_transfer`` (one batch is
one ``write``/``read``, like one layer of a prefill batch), all batches posted before any is
waited on. The peer's slots are a seeded permutation, so no two regions merge. One untimed
warm-up repeat pays for connection setup and first-touch page faults; medians of the timed
repeats are reported, next to an in-process ``np.copyto`` of the same number of bytes (one
contiguous copy: the host-memory ceiling). The moved bytes are checked exactly at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import multiprocessing
import statistics
import time

import msgpack
import numpy as np

from dualpath.bench.hardware import hardware_info
from dualpath.cluster_options import add_transport_argument
from dualpath.flags import positive_int
from dualpath.options import add_json_argument, add_repeats_argument, add_seed_argument
from dualpath.transfer.transport import (
    TRANSPORT_KINDS,
    BufferDescriptor,
    Region,
    TransferOp,
    Transport,
    create_transport,
)
from dualpath.units import GB, MIB

logger = logging.getLogger(__name__)

_DIRECTIONS = ("write", "read")
_PEER_TIMEOUT_S = 60.0  # to start (imports, agent) or to hash 256 MiB; a hung peer fails
_TRANSFER_TIMEOUT_S = 60.0
_PEER_BUFFER_ID = "bench-de-buffer"


def run_transfer_bench(
    *,
    transport: str = "nixl",
    total_bytes: int = 256 * MIB,
    block_bytes: int = 256 << 10,  # a 64-token Layer Block of Qwen2.5-32B (4 KiB/token/layer)
    blocks_per_transfer: int = 128,  # 32 MiB per batch with the defaults
    direction: str = "write",
    seed: int = 0,
    num_repeats: int = 5,
) -> dict:
    """Time moving ``total_bytes`` between two processes over ``transport``; a JSON-able dict.

    ``transport_gb_per_s`` and ``copyto_gb_per_s`` are medians in 1e9 bytes/s of payload;
    ``ratio`` = transport / copyto. ``samples_s`` holds every timing.
    """
    _check_arguments(
        transport, direction, total_bytes, block_bytes, blocks_per_transfer, num_repeats
    )
    num_blocks = total_bytes // block_bytes
    rng = np.random.default_rng(seed)
    remote_slots = rng.permutation(num_blocks)
    data_seeds = tuple(int(value) for value in rng.integers(0, 2**31, size=2))
    op = TransferOp(direction.upper())
    batches = _batched_regions(remote_slots, block_bytes, blocks_per_transfer)
    samples_s, is_verified = _timed_transfers(
        transport, op, batches, remote_slots, block_bytes, data_seeds, num_repeats
    )
    copyto_samples_s = _time_copyto(total_bytes, num_repeats)
    transport_gb_per_s = total_bytes / statistics.median(samples_s) / GB
    copyto_gb_per_s = total_bytes / statistics.median(copyto_samples_s) / GB
    result = {
        "transport": transport,
        "direction": direction,
        "total_bytes": total_bytes,
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "blocks_per_transfer": blocks_per_transfer,
        "num_transfers_per_repeat": len(batches),
        "seed": seed,
        "num_repeats": num_repeats,
        "transport_gb_per_s": transport_gb_per_s,
        "copyto_gb_per_s": copyto_gb_per_s,
        "ratio": transport_gb_per_s / copyto_gb_per_s,
        "is_verified": is_verified,
        "samples_s": {"transport": samples_s, "copyto": copyto_samples_s},
        "hardware": hardware_info(numpy=np.__version__, **_library_versions()),
    }
    logger.info("transfer bench: %s", {key: result[key] for key in ("transport_gb_per_s", "ratio")})
    return result


def _check_arguments(
    transport: str,
    direction: str,
    total_bytes: int,
    block_bytes: int,
    blocks_per_transfer: int,
    num_repeats: int,
) -> None:
    """``ValueError`` naming the arguments ``run_transfer_bench`` cannot run with."""
    if transport not in TRANSPORT_KINDS or direction not in _DIRECTIONS:
        raise ValueError(
            f"transport must be in {TRANSPORT_KINDS} and direction in {_DIRECTIONS}, "
            f"got {transport!r}, {direction!r}"
        )
    if block_bytes <= 0 or total_bytes <= 0 or total_bytes % block_bytes != 0:
        raise ValueError(
            f"total_bytes {total_bytes} must be a multiple > 0 of block_bytes {block_bytes} > 0"
        )
    if blocks_per_transfer <= 0 or num_repeats <= 0:
        raise ValueError(
            "blocks_per_transfer and num_repeats must be > 0, "
            f"got {blocks_per_transfer}, {num_repeats}"
        )


def _timed_transfers(
    transport: str,
    op: TransferOp,
    batches: list[list[Region]],
    remote_slots: np.ndarray,
    block_bytes: int,
    data_seeds: tuple[int, int],
    num_repeats: int,
) -> tuple[list[float], bool]:
    """Start the peer process, move every batch ``num_repeats`` times after one warm-up (the
    seconds of each repeat), verify the bytes that arrived, and stop the peer."""
    local_data_seed, remote_data_seed = data_seeds
    total_bytes = len(remote_slots) * block_bytes
    peer_conn, peer_process = _start_peer(transport, total_bytes, remote_data_seed)
    try:
        peer_metadata, peer_descriptor_dict = _receive(peer_conn)
        peer_descriptor = BufferDescriptor.from_dict(peer_descriptor_dict)
        with create_transport(transport, "bench-pe") as local:
            local_data = local.allocate_host_buffer(total_bytes)
            local_data[:] = _seeded_bytes(total_bytes, local_data_seed)
            local_buffer = local.register("bench-pe-buffer", local_data)
            local.connect(peer_descriptor.owner_name, peer_metadata)
            samples_s = [
                _move_all(local, op, local_buffer, peer_descriptor, batches)
                for _ in range(num_repeats + 1)
            ][1:]  # the first is the warm-up
            is_verified = _verify(
                op,
                local_data,
                peer_conn,
                remote_slots,
                block_bytes,
                local_data_seed,
                remote_data_seed,
            )
        peer_conn.send_bytes(msgpack.packb("close"))
        _receive(peer_conn)
    finally:
        peer_conn.close()  # a peer still waiting for a command sees EOF and exits
        peer_process.join(timeout=_PEER_TIMEOUT_S)
        if peer_process.is_alive():
            peer_process.kill()
    return samples_s, is_verified


def _batched_regions(
    remote_slots: np.ndarray, block_bytes: int, blocks_per_transfer: int
) -> list[list[Region]]:
    """Local block i <-> remote slot ``remote_slots[i]``, in batches of one transfer each."""
    regions = [
        Region(local_slot * block_bytes, int(remote_slot) * block_bytes, block_bytes)
        for local_slot, remote_slot in enumerate(remote_slots)
    ]
    return [
        regions[start : start + blocks_per_transfer]
        for start in range(0, len(regions), blocks_per_transfer)
    ]


def _move_all(
    local: Transport,
    op: TransferOp,
    local_buffer: BufferDescriptor,
    remote_buffer: BufferDescriptor,
    batches: list[list[Region]],
) -> float:
    move = local.write if op is TransferOp.WRITE else local.read
    start_s = time.perf_counter()
    handles = [
        move(remote_buffer.owner_name, local_buffer, remote_buffer, batch) for batch in batches
    ]
    for handle in handles:
        local.wait(handle, timeout_s=_TRANSFER_TIMEOUT_S)
    return time.perf_counter() - start_s


def _verify(
    op: TransferOp,
    local_data: np.ndarray,
    peer_conn: multiprocessing.connection.Connection,
    remote_slots: np.ndarray,
    block_bytes: int,
    local_data_seed: int,
    remote_data_seed: int,
) -> bool:
    """Whether the destination holds exactly the source's blocks at the permuted slots."""
    if op is TransferOp.WRITE:
        expected = np.empty_like(local_data).reshape(-1, block_bytes)
        expected[remote_slots] = _seeded_bytes(local_data.size, local_data_seed).reshape(
            -1, block_bytes
        )
        peer_conn.send_bytes(msgpack.packb("digest"))
        return _receive(peer_conn) == hashlib.blake2b(expected).digest()
    remote = _seeded_bytes(local_data.size, remote_data_seed).reshape(-1, block_bytes)
    return bool(np.array_equal(local_data.reshape(-1, block_bytes), remote[remote_slots]))


def _time_copyto(total_bytes: int, num_repeats: int) -> list[float]:
    source = np.ones(total_bytes, dtype=np.uint8)
    destination = np.zeros(total_bytes, dtype=np.uint8)
    np.copyto(destination, source)  # warm-up: first-touch page faults
    samples_s = []
    for _ in range(num_repeats):
        start_s = time.perf_counter()
        np.copyto(destination, source)
        samples_s.append(time.perf_counter() - start_s)
    return samples_s


def _seeded_bytes(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def _library_versions() -> dict[str, str]:
    try:
        return {"nixl-cu12": importlib.metadata.version("nixl-cu12")}
    except importlib.metadata.PackageNotFoundError:
        return {}


# --- the peer process ---------------------------------------------------------------------------


def _start_peer(
    transport: str, num_bytes: int, data_seed: int
) -> tuple[multiprocessing.connection.Connection, multiprocessing.process.BaseProcess]:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited agent
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=_serve_peer, args=(child_conn, transport, num_bytes, data_seed), daemon=True
    )
    process.start()
    child_conn.close()
    return conn, process


def _serve_peer(
    conn: multiprocessing.connection.Connection, transport: str, num_bytes: int, data_seed: int
) -> None:
    """The DE side: fill, register and publish one buffer; answer ``digest``, ``close``."""
    with create_transport(transport, "bench-de") as peer:
        data = peer.allocate_host_buffer(num_bytes)
        data[:] = _seeded_bytes(num_bytes, data_seed)
        descriptor = peer.register(_PEER_BUFFER_ID, data)
        conn.send_bytes(msgpack.packb([peer.metadata(), descriptor.to_dict()]))
        while (command := msgpack.unpackb(conn.recv_bytes())) != "close":
            assert command == "digest", f"unknown bench peer command {command!r}"
            conn.send_bytes(msgpack.packb(hashlib.blake2b(data).digest()))
    conn.send_bytes(msgpack.packb(None))


def _receive(conn: multiprocessing.connection.Connection) -> object:
    if not conn.poll(_PEER_TIMEOUT_S):
        raise TimeoutError(f"the bench peer did not answer within {_PEER_TIMEOUT_S}s")
    return msgpack.unpackb(conn.recv_bytes())


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_transport_argument(parser)
    parser.add_argument(
        "--direction",
        choices=_DIRECTIONS,
        default="write",
        help="write: push to the peer (PE -> DE); read: pull from it",
    )
    parser.add_argument(
        "--total-mib", type=positive_int, default=256, help="bytes moved per repeat"
    )
    # 256 KiB: one 64-token Layer Block of Qwen2.5-32B; DeepSeek-V3.2's is ~41 KiB.
    parser.add_argument("--block-bytes", type=positive_int, default=256 << 10)
    parser.add_argument(
        "--blocks-per-transfer",
        type=positive_int,
        default=128,
        help="regions per write/read call (one layer's batch)",
    )
    add_seed_argument(parser, what="random bytes moved")
    add_repeats_argument(parser, default=5)
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    result = run_transfer_bench(
        transport=args.transport,
        total_bytes=args.total_mib * MIB,
        block_bytes=args.block_bytes,
        blocks_per_transfer=args.blocks_per_transfer,
        direction=args.direction,
        seed=args.seed,
        num_repeats=args.repeats,
    )
    print(
        f"{result['transport']} {result['direction']}: {result['total_bytes'] / GB:.3f} GB as "
        f"{result['num_blocks']} blocks of {result['block_bytes']} bytes in "
        f"{result['num_transfers_per_repeat']} transfers, seed {result['seed']}, "
        f"median of {result['num_repeats']}"
    )
    print(f"{'transport GB/s':>15} {'np.copyto GB/s':>15} {'ratio':>7} {'verified':>9}")
    print(
        f"{result['transport_gb_per_s']:15.3f} {result['copyto_gb_per_s']:15.3f} "
        f"{result['ratio']:7.3f} {result['is_verified']!s:>9}"
    )
    print(f"hardware: {result['hardware']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["is_verified"] else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
