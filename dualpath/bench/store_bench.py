"""Store read benchmark: ``FileKVStore.read``, and the vLLM connector's load, against plain
reads of the same block files.

Run: ``dualpath bench store --num-blocks 256 --layers 8 --json store_bench.json`` (or
``python -m dualpath.bench.store_bench`` with the same flags).

It writes ``num_blocks`` random Full Blocks (fsynced), then times two ways of reading all of
them: a plain ``open`` + ``readinto`` of each whole file into one preallocated buffer (the
floor any store on this file system pays), and ``FileKVStore.read`` into a preallocated Full
Block with checksum verification. Each is timed cold (page cache dropped for those files with
``posix_fadvise(POSIX_FADV_DONTNEED)``) and warm (right after, from the page cache), over a
few repeats in alternating order; medians are reported. A third way, ``vllm_load``, is what
``--engine vllm`` pays for a request's hits: the store reads of every block into a host buffer
(``FileKVStore.read``, as the PE's reads), then, layer by layer, each block's Layer Block copied
into its page of a vLLM-shaped CPU paged cache (``[blocks, kv_heads, block_size, 2 * head_dim]``
float32, 64-dim heads; a vLLM engine's Layer Block is its page, byte for byte:
``CpuAttentionPages.write_layer``, the copy the connector makes in ``wait_for_layer_load``).
``plain_to_memory`` is the plain read with each file landing in a place of its own, as any
load that keeps what it reads must (``plain`` reuses one buffer, which stays in the CPU's cache
when warm: a floor no load reaches). A fifth, ``vllm_direct``, lands each store read straight in those pages (``read_layers``: one
positioned read per block scatters its Layer Blocks into the layers' pages, no buffer and no
second copy), as ``KVStoreIO.load`` does for a block whose layers are host pages.
``page_cache_dropped_fraction`` says
how many files were verifiably out of the page cache before the cold runs (checked with
``preadv(RWF_NOWAIT)``); if it is not 1.0 the cold figures are partly warm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import xxhash
from tqdm import tqdm

from dualpath.bench.hardware import hardware_info
from dualpath.flags import positive_int
from dualpath.kv.block_file import block_file_path
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys, model_fingerprint
from dualpath.kv.layout import KVLayout
from dualpath.options import (
    add_block_size_argument,
    add_json_argument,
    add_repeats_argument,
    add_seed_argument,
)
from dualpath.units import GB

logger = logging.getLogger(__name__)

_METHODS = ("plain", "plain_to_memory", "store", "vllm_load", "vllm_direct")
VLLM_HEAD_DIM = 64  # the vLLM-shaped cache's head size (bytes_per_token_per_layer sets the heads)
_MAX_DROP_ATTEMPTS = 5


def run_store_read_bench(
    root_dir: Path,
    *,
    num_blocks: int,
    layout: KVLayout,
    seed: int,
    num_repeats: int = 3,
    show_progress: bool = False,
) -> dict:
    """Write ``num_blocks`` random Full Blocks under ``root_dir`` and time reading them back.

    Returns a JSON-able dict: sizes, ``cold`` and ``warm`` throughputs (``plain_gb_per_s``,
    ``store_gb_per_s``, ``ratio`` = store / plain, in 1e9 bytes/s of Full Block payload), how
    the page cache was dropped, the file system and the hardware.
    """
    if num_blocks <= 0 or num_repeats <= 0:
        raise ValueError(f"num_blocks and num_repeats must be > 0, got {num_blocks}, {num_repeats}")
    rng = np.random.default_rng(seed)
    fingerprint = model_fingerprint(
        weights_digest=f"store-bench-seed-{seed}",  # one namespace per seed: a reused dir stays exact
        architecture={"purpose": "store read benchmark"},
        kv_dtype="uint8",
        block_size_tokens=layout.block_size_tokens,
    )
    token_ids = rng.integers(0, 2**31, size=num_blocks * layout.block_size_tokens)
    keys = block_keys(token_ids, layout.block_size_tokens, fingerprint)
    store = FileKVStore(root_dir, layout, fingerprint, fsync_writes=True)
    for key in tqdm(keys, desc="writing blocks", unit="block", disable=not show_progress):
        store.write(key, rng.bytes(layout.full_block_bytes))
    paths = [block_file_path(root_dir, fingerprint, key) for key in keys]
    file_buffer = np.empty(os.path.getsize(paths[0]), dtype=np.uint8)
    files = np.zeros((num_blocks, file_buffer.size), dtype=np.uint8)
    full_block = layout.empty_full_block()
    buffer = np.empty((num_blocks, *layout.full_block_shape), dtype=np.uint8)
    cache = _vllm_shaped_cache(layout, num_blocks)
    direct = _vllm_shaped_cache(layout, num_blocks)
    method_to_read_all: dict[str, Callable[[], None]] = {
        "plain": lambda: _plain_read_all(paths, file_buffer),
        "plain_to_memory": lambda: _plain_read_all_to_memory(paths, files),
        "store": lambda: _store_read_all(store, keys, full_block),
        "vllm_load": lambda: _vllm_load_all(store, keys, buffer, cache),
        "vllm_direct": lambda: _vllm_direct_all(store, keys, direct),
    }
    samples_s, dropped_fractions = _time_reads(
        method_to_read_all, paths, num_repeats, show_progress
    )
    store.close()
    for block in range(num_blocks):  # the loads moved the bytes, not just the time
        for name, pages in (("vllm_load", cache), ("vllm_direct", direct)):
            if not np.array_equal(pages.copy_full_block(block), buffer[block]):
                raise RuntimeError(
                    f"{name}: block {block} in the paged cache is not the stored one"
                )
    total_bytes = num_blocks * layout.full_block_bytes
    result: dict = {
        "num_blocks": num_blocks,
        "full_block_bytes": layout.full_block_bytes,
        "total_bytes": total_bytes,
        "layout": {
            "num_layers": layout.num_layers,
            "block_size_tokens": layout.block_size_tokens,
            "bytes_per_token_per_layer": layout.bytes_per_token_per_layer,
        },
        "seed": seed,
        "num_repeats": num_repeats,
        "verify_checksums": True,
        **_throughputs(samples_s, total_bytes),
    }
    known_fractions = [fraction for fraction in dropped_fractions if fraction is not None]
    result["page_cache_drop"] = "posix_fadvise"
    result["page_cache_dropped_fraction"] = min(known_fractions) if known_fractions else None
    result["filesystem"] = _filesystem_type(Path(root_dir))
    result["hardware"] = hardware_info(numpy=np.__version__, xxhash=xxhash.VERSION)
    logger.info("store read bench: %s", {k: result[k] for k in ("cold", "warm")})
    return result


def _time_reads(
    method_to_read_all: dict[str, Callable[[], None]],
    paths: list[Path],
    num_repeats: int,
    show_progress: bool,
) -> tuple[dict[tuple[str, str], list[float]], list[float | None]]:
    """Every method timed cold (page cache dropped for ``paths``) then warm, ``num_repeats``
    times in alternating order: the seconds per (temperature, method), in run order, and the
    fraction of files verifiably dropped before each cold run."""
    samples_s: dict[tuple[str, str], list[float]] = {}
    dropped_fractions: list[float | None] = []
    for repeat in tqdm(range(num_repeats), desc="timing reads", disable=not show_progress):
        # Alternate the order: whichever runs second may find the disk or CPU warmer.
        methods = _METHODS if repeat % 2 == 0 else _METHODS[::-1]
        for method in methods:
            dropped_fractions.append(_drop_page_cache(paths))
            samples_s.setdefault(("cold", method), []).append(_time(method_to_read_all[method]))
            samples_s.setdefault(("warm", method), []).append(_time(method_to_read_all[method]))
    return samples_s, dropped_fractions


def _throughputs(samples_s: dict[tuple[str, str], list[float]], total_bytes: int) -> dict:
    """Each temperature's median throughputs and ratios, and every sample."""
    result: dict = {}
    for temperature in ("cold", "warm"):
        plain_gb_per_s = total_bytes / statistics.median(samples_s[temperature, "plain"]) / GB
        store_gb_per_s = total_bytes / statistics.median(samples_s[temperature, "store"]) / GB
        load_gb_per_s = total_bytes / statistics.median(samples_s[temperature, "vllm_load"]) / GB
        direct_gb_per_s = (
            total_bytes / statistics.median(samples_s[temperature, "vllm_direct"]) / GB
        )
        to_memory_gb_per_s = (
            total_bytes / statistics.median(samples_s[temperature, "plain_to_memory"]) / GB
        )
        result[temperature] = {
            "plain_gb_per_s": plain_gb_per_s,
            "store_gb_per_s": store_gb_per_s,
            "ratio": store_gb_per_s / plain_gb_per_s,
            "vllm_load_gb_per_s": load_gb_per_s,
            "vllm_load_ratio": load_gb_per_s / plain_gb_per_s,
            "vllm_direct_gb_per_s": direct_gb_per_s,
            "vllm_direct_ratio": direct_gb_per_s / plain_gb_per_s,
            "plain_to_memory_gb_per_s": to_memory_gb_per_s,
            "vllm_direct_vs_plain_to_memory": direct_gb_per_s / to_memory_gb_per_s,
        }
    # Every timing, in run order, so the spread behind each median is visible.
    result["samples_s"] = {
        f"{temperature}_{method}": times_s for (temperature, method), times_s in samples_s.items()
    }
    return result


def _time(read_all: Callable[[], None]) -> float:
    start_s = time.perf_counter()
    read_all()
    return time.perf_counter() - start_s


def _plain_read_all_to_memory(paths: Sequence[Path], files: np.ndarray) -> None:
    """Plain reads, each file into a place of its own: the floor of a load that keeps what it
    reads (``plain`` reuses one buffer, which stays in the CPU's cache when warm)."""
    for path, file_buffer in zip(paths, files, strict=True):
        with open(path, "rb", buffering=0) as file:
            num_read = file.readinto(file_buffer)
        assert num_read == file_buffer.size, f"{path}: read {num_read} of {file_buffer.size} bytes"


def _plain_read_all(paths: Sequence[Path], file_buffer: np.ndarray) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            num_read = file.readinto(file_buffer)
        assert num_read == file_buffer.size, f"{path}: read {num_read} of {file_buffer.size} bytes"


def _store_read_all(store: FileKVStore, keys: Sequence[str], full_block: np.ndarray) -> None:
    for key in keys:
        store.read(key, out=full_block)


def _vllm_shaped_cache(layout: KVLayout, num_blocks: int):  # -> CpuAttentionPages
    """A paged cache shaped as vLLM's CPU backend's, one page per block of the benchmark."""
    import torch

    from dualpath.vllm.layouts import CpuAttentionPages

    num_heads, rest = divmod(layout.bytes_per_token_per_layer, 2 * VLLM_HEAD_DIM * 4)
    if rest or not num_heads:
        raise ValueError(
            f"--bytes-per-token-per-layer {layout.bytes_per_token_per_layer} is no whole number "
            f"of float32 K+V heads of {VLLM_HEAD_DIM} (a multiple of {2 * VLLM_HEAD_DIM * 4})"
        )
    shape = (num_blocks, num_heads, layout.block_size_tokens, 2 * VLLM_HEAD_DIM)
    layers = [torch.zeros(shape, dtype=torch.float32) for _ in range(layout.num_layers)]
    return CpuAttentionPages(layers, layout)


def _vllm_load_all(store: FileKVStore, keys: Sequence[str], buffer: np.ndarray, cache) -> None:
    """The connector's load of every block: store reads into the buffer, then each layer of
    every block into vLLM's pages."""
    for slot, key in enumerate(keys):
        store.read(key, out=buffer[slot])
    for layer in range(cache.layout.num_layers):
        for block_id in range(len(keys)):
            cache.write_layer(layer, (block_id,), buffer[block_id, layer : layer + 1])


def _vllm_direct_all(store: FileKVStore, keys: Sequence[str], cache) -> None:
    """The store read straight into vLLM's pages, as ``KVStoreIO.load`` reads a block whose
    layers are host pages: one positioned read per block scatters its Layer Blocks into them."""
    layers = range(cache.layout.num_layers)
    for block_id, key in enumerate(keys):
        store.read_layers(key, [cache.layer_view(layer, (block_id,))[0] for layer in layers])


def _drop_page_cache(paths: Sequence[Path]) -> float | None:
    """Evict the files' pages; the fraction verifiably evicted (``None``: cannot tell).

    The files were fsynced when written, so their pages are clean and droppable, but a page
    the kernel still holds in a per-CPU batch survives one ``POSIX_FADV_DONTNEED``: retry.
    """
    uncached_fraction = None
    for _ in range(_MAX_DROP_ATTEMPTS):
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        uncached_fraction = _uncached_fraction(paths)
        if uncached_fraction is None or uncached_fraction == 1.0:
            break
        time.sleep(0.05)
    return uncached_fraction


def _uncached_fraction(paths: Sequence[Path]) -> float | None:
    """Fraction of files with neither first nor last page cached; ``None`` if unsupported.

    ``preadv(RWF_NOWAIT)`` fails with EAGAIN instead of reading from disk, so it does not warm
    the cache it measures.
    """
    if not hasattr(os, "RWF_NOWAIT"):
        return None
    num_uncached = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offsets = (0, os.fstat(fd).st_size - 1)
            num_uncached += not any(_is_cached(fd, offset) for offset in offsets)
        except OSError:
            return None  # e.g. EOPNOTSUPP: this file system cannot answer
        finally:
            os.close(fd)
    return num_uncached / len(paths)


def _is_cached(fd: int, offset: int) -> bool:
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    return True


def _filesystem_type(path: Path) -> str | None:
    """The type of the mount holding ``path`` (``ext4``, ``nfs4``, ``tmpfs``…), from /proc."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as file:
            mounts = [line.split() for line in file]
    except OSError:
        return None
    real_path = os.path.realpath(path)
    best_mount, best_type = "", None
    for _device, mount_point, fs_type, *_rest in mounts:
        is_parent = real_path == mount_point or real_path.startswith(mount_point.rstrip("/") + "/")
        if is_parent and len(mount_point) >= len(best_mount):
            best_mount, best_type = mount_point, fs_type
    return best_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=None, help="store root (default: a temp dir)")
    # 256 blocks of 8 x 64 x 512 bytes = 64 MiB: big enough that per-call overhead and
    # bandwidth both show; use --num-blocks 1024 or more to exceed a disk's own cache.
    parser.add_argument(
        "--num-blocks", type=positive_int, default=256, help="Full Blocks written and read back"
    )
    add_block_size_argument(parser, default=64, default_help="64")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers per Full Block")
    parser.add_argument(
        "--bytes-per-token-per-layer",
        type=positive_int,
        default=512,
        help="one token's KV in one layer (SmolLM2-135M in float32: 1536); the vLLM-shaped "
        "cache needs a multiple of 512 (float32 K+V heads of 64)",
    )
    add_seed_argument(parser, what="random blocks")
    add_repeats_argument(parser, default=3)
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    layout = KVLayout(
        num_layers=args.layers,
        block_size_tokens=args.block_size,
        bytes_per_token_per_layer=args.bytes_per_token_per_layer,
    )
    root_dir_context = (
        contextlib.nullcontext(args.dir)
        if args.dir is not None
        else tempfile.TemporaryDirectory(prefix="dualpath-store-bench-")
    )
    with root_dir_context as root_dir:
        result = run_store_read_bench(
            Path(root_dir),
            num_blocks=args.num_blocks,
            layout=layout,
            seed=args.seed,
            num_repeats=args.repeats,
            show_progress=True,
        )
    print(
        f"{result['num_blocks']} blocks x {result['full_block_bytes']} bytes "
        f"= {result['total_bytes'] / GB:.3f} GB on {result['filesystem']}, "
        f"seed {result['seed']}, median of {result['num_repeats']}"
    )
    print(
        f"{'':6} {'plain GB/s':>11} {'store GB/s':>11} {'store/plain':>12} "
        f"{'vLLM load GB/s':>15} {'load/plain':>11}"
    )
    for temperature in ("cold", "warm"):
        row = result[temperature]
        print(
            f"{temperature:6} {row['plain_gb_per_s']:11.3f} {row['store_gb_per_s']:11.3f} "
            f"{row['ratio']:12.3f} {row['vllm_load_gb_per_s']:15.3f} "
            f"{row['vllm_load_ratio']:11.3f}"
        )
    print(
        f"page cache dropped for {result['page_cache_dropped_fraction']} of files before cold runs"
    )
    print(f"hardware: {result['hardware']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
