"""KVStore semantics (FileKVStore and MemoryKVStore alike), file damage, sharing, and the bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.bench.store_bench import run_store_read_bench
from dualpath.config import KVStoreConfig
from dualpath.errors import BlockNotFound, CorruptBlock, StoreWriteError
from dualpath.kv.block_file import (
    HEADER_BYTES,
    NAMESPACE_FILE,
    block_file_path,
    is_temp_name,
    temp_path,
)
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore, MemoryKVStore
from tests.kv.conftest import (
    TINY_FINGERPRINT,
    TINY_LAYOUT,
    StoreFactory,
    capacity_for,
    make_block,
    make_keys,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# -- semantics shared by both stores ------------------------------------------------------------


def test_write_then_read_round_trips_exact_bytes(make_store: StoreFactory) -> None:
    store = make_store()
    keys = make_keys(3)
    blocks = [make_block(seed) for seed in range(3)]
    assert store.write(keys[0], blocks[0]) is True
    assert store.write(keys[1], blocks[1].tobytes()) is True
    assert store.write(keys[2], memoryview(blocks[2].tobytes())) is True
    for key, block in zip(keys, blocks, strict=True):
        read = store.read(key)
        assert read.dtype == np.uint8 and read.shape == TINY_LAYOUT.full_block_shape
        assert np.array_equal(read, block)
    out = TINY_LAYOUT.empty_full_block()
    assert store.read(keys[1], out=out) is out
    assert np.array_equal(out, blocks[1])
    stats = store.stats()
    assert (stats.writes, stats.write_bytes) == (3, 3 * TINY_LAYOUT.full_block_bytes)
    assert (stats.reads, stats.read_bytes) == (4, 4 * TINY_LAYOUT.full_block_bytes)


def test_read_layers_lands_each_layer_block_in_its_own_array(make_store: StoreFactory) -> None:
    # As an engine's pages hold them: one array per layer, apart in memory.
    store = make_store()
    (key,) = make_keys(1)
    block = make_block(5)
    store.write(key, block)
    pages = np.zeros((TINY_LAYOUT.num_layers, 3, *TINY_LAYOUT.layer_block_shape), np.uint8)
    store.read_layers(key, [pages[layer, 1] for layer in range(TINY_LAYOUT.num_layers)])
    assert np.array_equal(pages[:, 1], block) and not pages[:, [0, 2]].any()
    with pytest.raises(ValueError, match="layer_blocks"):
        store.read_layers(key, [pages[layer, 1] for layer in range(TINY_LAYOUT.num_layers - 1)])
    with pytest.raises(ValueError, match="layer_blocks"):
        store.read_layers(key, [pages[layer, 1, ::2] for layer in range(TINY_LAYOUT.num_layers)])


def test_read_returns_a_private_copy(make_store: StoreFactory) -> None:
    store = make_store()
    (key,) = make_keys(1)
    block = make_block(0)
    store.write(key, block)
    block[:] = 0  # the caller reuses its buffer after write
    first = store.read(key)
    first[:] = 0  # and scribbles on what read returned
    assert np.array_equal(store.read(key), make_block(0))


def test_bad_sizes_and_out_buffers_raise_value_error(make_store: StoreFactory) -> None:
    store = make_store()
    (key,) = make_keys(1)
    with pytest.raises(ValueError, match="must be 64 bytes"):
        store.write(key, bytes(TINY_LAYOUT.full_block_bytes - 1))
    store.write(key, make_block(0))
    for bad_out in (
        np.zeros((2, 4, 9), dtype=np.uint8),
        np.zeros(TINY_LAYOUT.full_block_shape, dtype=np.int8),
        np.zeros((2, 4, 16), dtype=np.uint8)[:, :, ::2],
    ):
        with pytest.raises(ValueError, match="out must be"):
            store.read(key, out=bad_out)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        store.read("not-a-key")


def test_lookup_counts_the_longest_consecutive_prefix(make_store: StoreFactory) -> None:
    store = make_store()
    keys = make_keys(5)
    for index in (0, 1, 3, 4):  # a gap at block 2
        store.write(keys[index], make_block(index))
    assert store.lookup(keys) == 2
    assert store.lookup(keys[3:]) == 2
    assert store.lookup(keys[2:]) == 0
    assert store.lookup([]) == 0
    assert [store.contains(key) for key in keys] == [True, True, False, True, True]
    stats = store.stats()
    assert (stats.lookups, stats.hit_blocks, stats.miss_blocks) == (4, 2 + 2, 3 + 3)


def test_write_is_idempotent(make_store: StoreFactory) -> None:
    store = make_store()
    (key,) = make_keys(1)
    assert store.write(key, make_block(0)) is True
    assert store.write(key, make_block(1)) is False  # present: not rewritten
    assert np.array_equal(store.read(key), make_block(0))
    stats = store.stats()
    assert (stats.writes, stats.duplicate_writes) == (1, 1)


def test_read_of_an_absent_block_raises_block_not_found(make_store: StoreFactory) -> None:
    store = make_store()
    (key,) = make_keys(1)
    with pytest.raises(BlockNotFound, match=key):
        store.read(key)
    assert store.stats().missing_on_read == 1


def test_capacity_evicts_least_recently_used(make_store: StoreFactory) -> None:
    store = make_store(capacity_blocks=3.5)
    k0, k1, k2, k3, k4 = make_keys(5)
    for index, key in enumerate((k0, k1, k2)):
        store.write(key, make_block(index))
    assert store.lookup([k0]) == 1  # LRU order now k1, k2, k0
    store.write(k3, make_block(3))  # evicts k1 -> k2, k0, k3
    assert [store.contains(key) for key in (k0, k1, k2, k3)] == [True, False, True, True]
    store.read(k2)  # -> k0, k3, k2
    store.write(k4, make_block(4))  # evicts k0
    assert [store.contains(key) for key in (k0, k1, k2, k3, k4)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.stats().evictions == 2
    for index, key in ((2, k2), (3, k3), (4, k4)):
        assert np.array_equal(store.read(key), make_block(index))


def test_lookup_leaves_the_prefix_root_most_recently_used(make_store: StoreFactory) -> None:
    store = make_store(capacity_blocks=3.5)
    k0, k1, k2, k3 = make_keys(4)
    for index, key in enumerate((k0, k1, k2)):
        store.write(key, make_block(index))
    assert store.lookup([k0, k1, k2]) == 3  # the deepest block becomes the LRU one
    store.write(k3, make_block(3))
    assert [store.contains(key) for key in (k0, k1, k2, k3)] == [True, True, False, True]


def test_capacity_below_one_block_is_rejected(store_kind: str, tmp_path: Path) -> None:
    capacity_bytes = capacity_for(store_kind, 1) - 1
    with pytest.raises(ValueError, match="cannot hold one"):
        if store_kind == "file":
            FileKVStore(tmp_path, TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_bytes)
        else:
            MemoryKVStore(TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_bytes)


def test_use_after_close_is_a_caller_bug(make_store: StoreFactory) -> None:
    (key,) = make_keys(1)
    with make_store() as store:
        store.write(key, make_block(0))
    with pytest.raises(RuntimeError, match="caller bug"):
        store.read(key)
    store.close()  # may repeat
    assert store.stats().writes == 1


def test_concurrent_reads_and_writes_never_corrupt(make_store: StoreFactory) -> None:
    # Two writers and three readers over 40 keys, with eviction racing the reads: every read
    # returns the exact block or BlockNotFound, never anything else.
    store = make_store(capacity_blocks=10.5)
    keys = make_keys(40)
    failures: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for index in rng.permutation(len(keys)):
            store.write(keys[index], make_block(int(index)))

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = TINY_LAYOUT.empty_full_block()
        for index in rng.integers(0, len(keys), size=300):
            try:
                store.read(keys[index], out=out)
            except BlockNotFound:
                continue
            assert np.array_equal(out, make_block(int(index))), f"block {index} came back wrong"

    def run(target, seed: int) -> None:
        try:
            target(seed)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(writer, seed)) for seed in (1, 2)]
    threads += [threading.Thread(target=run, args=(reader, seed)) for seed in (3, 4, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    stats = store.stats()
    assert stats.corrupt_blocks == 0 and stats.write_errors == 0
    # Within capacity once quiet. An eviction racing a rewrite of the same key can leave the
    # index naming a deleted file: the read drops it, and then the index is exact again.
    readable = [key for key in keys if _is_readable(store, key)]
    assert 1 <= len(readable) <= 10
    assert [key for key in keys if store.contains(key)] == readable


def _is_readable(store: KVStore, key: str) -> bool:
    try:
        store.read(key)
    except BlockNotFound:
        return False
    return True


def test_memory_store_remove_acts_like_a_deletion_elsewhere() -> None:
    store = MemoryKVStore(TINY_LAYOUT, TINY_FINGERPRINT)
    keys = make_keys(3)
    for index, key in enumerate(keys):
        store.write(key, make_block(index))
    assert store.remove(keys[1]) is True
    assert store.remove(keys[1]) is False
    assert store.lookup(keys) == 1
    with pytest.raises(BlockNotFound):
        store.read(keys[1])


@settings(max_examples=25, deadline=None)
@given(
    operations=st.lists(
        st.tuples(st.sampled_from(["write", "read", "lookup"]), st.integers(0, 7)), max_size=40
    )
)
def test_file_store_matches_the_memory_oracle(operations: list[tuple[str, int]]) -> None:
    keys = make_keys(8)
    with tempfile.TemporaryDirectory() as root_dir:
        stores: list[KVStore] = [
            FileKVStore(
                Path(root_dir),
                TINY_LAYOUT,
                TINY_FINGERPRINT,
                capacity_bytes=capacity_for("file", 3.5),
            ),
            MemoryKVStore(
                TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_for("memory", 3.5)
            ),
        ]
        for name, index in operations:
            results = [_apply(store, name, keys, index) for store in stores]
            assert results[0] == results[1], f"{name} {index}"
        assert stores[0].stats() == stores[1].stats()


def _apply(store: KVStore, name: str, keys: list[str], index: int) -> object:
    if name == "write":
        return store.write(keys[index], make_block(index))
    if name == "lookup":
        return store.lookup(keys[index:])
    try:
        return store.read(keys[index]).tobytes()
    except BlockNotFound:
        return "BlockNotFound"


# -- FileKVStore: sharing a directory -----------------------------------------------------------


def _file_store(root_dir: Path, **kwargs: object) -> FileKVStore:
    return FileKVStore(root_dir, TINY_LAYOUT, TINY_FINGERPRINT, **kwargs)


def _path(root_dir: Path, key: str) -> Path:
    return block_file_path(root_dir, TINY_FINGERPRINT, key)


def _namespace_files(root_dir: Path) -> list[str]:
    """Names of every file under the namespace but namespace.json: blocks, temps, obstacles."""
    namespace_dir = root_dir / TINY_FINGERPRINT
    paths = namespace_dir.rglob("*")
    return sorted(path.name for path in paths if path.is_file() and path.name != NAMESPACE_FILE)


def test_file_layout_on_disk(tmp_path: Path) -> None:
    store = _file_store(tmp_path)
    (key,) = make_keys(1)
    store.write(key, make_block(0))
    path = tmp_path / TINY_FINGERPRINT / key[:2] / f"{key}.kvb"
    assert path == _path(tmp_path, key)
    data = path.read_bytes()
    assert len(data) == HEADER_BYTES + TINY_LAYOUT.full_block_bytes
    assert data[:4] == b"DPKV"
    assert data[HEADER_BYTES:] == make_block(0).tobytes()
    info = json.loads((tmp_path / TINY_FINGERPRINT / NAMESPACE_FILE).read_text())
    assert info["fingerprint"] == TINY_FINGERPRINT and info["num_layers"] == 2


def test_another_store_object_sees_blocks_written_by_the_first(tmp_path: Path) -> None:
    keys = make_keys(3)
    first = _file_store(tmp_path)
    first.write(keys[0], make_block(0))
    second = _file_store(tmp_path)  # indexes keys[0] at start-up
    first.write(keys[1], make_block(1))  # written after second's scan: found by os.stat
    assert second.lookup(keys) == 2
    assert np.array_equal(second.read(keys[1]), make_block(1))
    second.write(keys[2], make_block(2))
    assert first.contains(keys[2])
    assert first.write(keys[2], make_block(2)) is False


def test_another_process_writes_and_this_one_reads(tmp_path: Path) -> None:
    keys = make_keys(2)
    store = _file_store(tmp_path)
    script = (
        "import sys; from pathlib import Path\n"
        "from tests.kv.conftest import TINY_FINGERPRINT, TINY_LAYOUT, make_block, make_keys\n"
        "from dualpath.kv.file_store import FileKVStore\n"
        "store = FileKVStore(Path(sys.argv[1]), TINY_LAYOUT, TINY_FINGERPRINT)\n"
        "for index, key in enumerate(make_keys(2)):\n"
        "    store.write(key, make_block(index))\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], check=True, cwd=REPO_ROOT, timeout=60
    )
    assert store.lookup(keys) == 2
    assert np.array_equal(store.read(keys[1]), make_block(1))


def test_block_deleted_behind_the_stores_back(tmp_path: Path) -> None:
    keys = make_keys(2)
    store = _file_store(tmp_path)
    for index, key in enumerate(keys):
        store.write(key, make_block(index))
    _path(tmp_path, keys[0]).unlink()  # another process evicted it
    assert store.lookup(keys) == 2  # the index is a cache: it cannot know yet
    with pytest.raises(BlockNotFound, match=keys[0]):
        store.read(keys[0])
    assert store.lookup(keys) == 0  # dropped from the index by the failed read
    assert store.stats().missing_on_read == 1
    assert store.write(keys[0], make_block(0)) is True
    assert np.array_equal(store.read(keys[0]), make_block(0))


def test_startup_scan_orders_lru_by_mtime_and_enforces_capacity(tmp_path: Path) -> None:
    keys = make_keys(8)
    store = _file_store(tmp_path)
    for index, key in enumerate(keys[:6]):
        store.write(key, make_block(index))
    oldest_first = [3, 0, 5, 1, 4, 2]  # not the write order, nor (likely) the scan order
    now_s = time.time()
    for rank, index in enumerate(oldest_first):
        mtime_s = now_s - 1000 + rank
        os.utime(_path(tmp_path, keys[index]), (mtime_s, mtime_s))
    smaller = _file_store(tmp_path, capacity_bytes=capacity_for("file", 3.5))
    survivors = [index for index, key in enumerate(keys) if smaller.contains(key)]
    assert survivors == [1, 2, 4]
    assert not _path(tmp_path, keys[3]).exists()
    assert smaller.stats().evictions == 3
    smaller.write(keys[6], make_block(6))  # evicts keys[1], the oldest survivor
    smaller.write(keys[7], make_block(7))  # then keys[4]
    survivors = [index for index, key in enumerate(keys) if smaller.contains(key)]
    assert survivors == [2, 6, 7]


def test_used_blocks_get_a_fresh_mtime(tmp_path: Path) -> None:
    keys = make_keys(2)
    store = _file_store(tmp_path)
    for index, key in enumerate(keys):
        store.write(key, make_block(index))
    old_s = time.time() - 3600
    for key in keys:
        os.utime(_path(tmp_path, key), (old_s, old_s))
    reopened = _file_store(tmp_path)
    reopened.lookup(keys[:1])
    assert _path(tmp_path, keys[0]).stat().st_mtime > old_s + 3000
    assert _path(tmp_path, keys[1]).stat().st_mtime == pytest.approx(old_s)


def test_readers_never_see_a_block_being_written(tmp_path: Path) -> None:
    # 1 MiB blocks take long enough to write that a reader polling the key would catch a
    # non-atomic write part-way (as a short file, i.e. CorruptBlock).
    layout = KVLayout(num_layers=4, block_size_tokens=64, bytes_per_token_per_layer=4096)
    keys = make_keys(6)
    blocks = [np.full(layout.full_block_shape, index + 1, dtype=np.uint8) for index in range(6)]
    writer_store = FileKVStore(tmp_path, layout, TINY_FINGERPRINT)
    reader_store = FileKVStore(tmp_path, layout, TINY_FINGERPRINT)  # as if another process
    observed: list[str] = []

    def poll() -> None:
        out = layout.empty_full_block()
        for index, key in enumerate(keys):
            while True:
                try:
                    reader_store.read(key, out=out)
                except BlockNotFound:
                    continue
                except CorruptBlock as exc:
                    observed.append(str(exc))
                    return
                if not np.array_equal(out, blocks[index]):
                    observed.append(f"block {index} read back wrong")
                break

    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    for key, block in zip(keys, blocks, strict=True):
        writer_store.write(key, block)
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert observed == []
    assert reader_store.stats().reads == 6


def test_startup_removes_stale_temp_files_and_ignores_foreign_files(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    store = _file_store(tmp_path)
    store.write(key, make_block(0))
    fanout_dir = _path(tmp_path, key).parent
    stale = fanout_dir / f".{key}.kvb.tmp-123-abcd1234"
    stale_older_version = fanout_dir / f".{key}.123.abcd1234.tmp"
    fresh = Path(temp_path(str(_path(tmp_path, key))))
    foreign = fanout_dir / "README"
    for path in (stale, stale_older_version, fresh, foreign):
        path.write_bytes(b"partial")
    two_hours_ago_s = time.time() - 7200
    for path in (stale, stale_older_version):
        os.utime(path, (two_hours_ago_s, two_hours_ago_s))
    reopened = _file_store(tmp_path)
    assert not stale.exists() and not stale_older_version.exists()
    assert fresh.exists() and foreign.exists()  # a live writer's, and not ours
    assert reopened.lookup([key]) == 1


def test_a_temp_file_is_named_as_glusterfs_places_it_with_its_block_file() -> None:
    """GlusterFS's distribute layer hashes a name its default rsync-hash-regex matches by the
    regex's group: a block's temp file is created on the brick of the name it is renamed to."""
    (key,) = make_keys(1)
    final_name = _path(Path("/store"), key).name
    temp_name = os.path.basename(temp_path(str(_path(Path("/store"), key))))
    match = re.fullmatch(r"\.(.+)\.[^.]+", temp_name)
    assert match is not None and match.group(1) == final_name
    assert is_temp_name(temp_name) and not is_temp_name(final_name)


def test_from_config(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    config = KVStoreConfig(root_dir=tmp_path, capacity_bytes=capacity_for("file", 1))
    store = FileKVStore.from_config(config, TINY_LAYOUT, TINY_FINGERPRINT)
    store.write(key, make_block(0))
    assert np.array_equal(store.read(key), make_block(0))
    with pytest.raises(ValueError, match="disabled"):
        FileKVStore.from_config(KVStoreConfig(), TINY_LAYOUT, TINY_FINGERPRINT)


def test_bad_fingerprint_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        FileKVStore(tmp_path, TINY_LAYOUT, "not-hex")


# -- FileKVStore: damage ------------------------------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(kind: str, root_dir: Path, key: str, other_key: str) -> None:
    path = _path(root_dir, key)
    if kind == "flip_payload_byte":
        _flip_byte(path, HEADER_BYTES + 17)
    elif kind == "flip_header_byte":
        _flip_byte(path, 30)  # inside the block key
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:-1])
    elif kind == "zero_length":
        path.write_bytes(b"")
    elif kind == "replaced_by_other_block":
        os.replace(_path(root_dir, other_key), path)
    elif kind == "deleted":
        path.unlink()
    else:
        raise AssertionError(kind)


# (damage, error on the same store object, error on a fresh object that rebuilt its index)
DAMAGES = [
    ("flip_payload_byte", CorruptBlock, CorruptBlock),
    ("flip_header_byte", CorruptBlock, CorruptBlock),
    ("truncate", CorruptBlock, BlockNotFound),  # wrong size: the start-up scan deletes it
    ("zero_length", CorruptBlock, BlockNotFound),
    ("replaced_by_other_block", CorruptBlock, CorruptBlock),
    ("deleted", BlockNotFound, BlockNotFound),
]


@pytest.mark.parametrize("is_fresh_store", [False, True], ids=["same_store", "fresh_store"])
@pytest.mark.parametrize(("kind", "same_store_error", "fresh_store_error"), DAMAGES)
def test_damaged_block_is_detected_dropped_and_rewritable(
    tmp_path: Path,
    kind: str,
    same_store_error: type[Exception],
    fresh_store_error: type[Exception],
    is_fresh_store: bool,
) -> None:
    keys = make_keys(2)
    store = _file_store(tmp_path)
    for index, key in enumerate(keys):
        store.write(key, make_block(index))
    _damage(kind, tmp_path, keys[0], keys[1])
    if is_fresh_store:
        store = _file_store(tmp_path)
    expected_error = fresh_store_error if is_fresh_store else same_store_error
    with pytest.raises(expected_error, match=keys[0]):
        if kind == "flip_payload_byte":  # the checksum covers a read scattered into layers
            store.read_layers(keys[0], list(TINY_LAYOUT.empty_full_block()))
        else:
            store.read(keys[0])
    assert not _path(tmp_path, keys[0]).exists()
    assert store.lookup(keys[:1]) == 0
    stats = store.stats()
    assert stats.corrupt_blocks == (0 if kind == "deleted" else 1)
    assert stats.missing_on_read == (1 if expected_error is BlockNotFound else 0)
    assert store.write(keys[0], make_block(0)) is True
    assert np.array_equal(store.read(keys[0]), make_block(0))


def test_every_header_byte_is_checked(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    store = _file_store(tmp_path)
    for offset in range(HEADER_BYTES):
        store.write(key, make_block(0))
        _flip_byte(_path(tmp_path, key), offset)
        with pytest.raises(CorruptBlock):
            store.read(key)
    assert store.stats().corrupt_blocks == HEADER_BYTES


def test_a_block_from_another_fingerprint_is_corrupt(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    other_fingerprint = "f" * 32
    other = FileKVStore(tmp_path, TINY_LAYOUT, other_fingerprint)
    other.write(key, make_block(0))
    target = _path(tmp_path, key)
    target.parent.mkdir(parents=True)
    os.replace(block_file_path(tmp_path, other_fingerprint, key), target)
    with pytest.raises(CorruptBlock, match="fingerprint"):
        _file_store(tmp_path).read(key)


def test_unverified_reads_skip_only_the_payload_checksum(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    store = _file_store(tmp_path, verify_checksums=False)
    store.write(key, make_block(0))
    _flip_byte(_path(tmp_path, key), HEADER_BYTES)
    assert store.read(key)[0, 0, 0] == make_block(0)[0, 0, 0] ^ 0xFF
    _flip_byte(_path(tmp_path, key), 0)
    with pytest.raises(CorruptBlock, match="magic"):
        store.read(key)


@pytest.mark.parametrize("damage", ["garbage", "missing", "other_layout"])
def test_namespace_file_is_rewritten_and_never_trusted(tmp_path: Path, damage: str) -> None:
    (key,) = make_keys(1)
    _file_store(tmp_path).write(key, make_block(0))
    namespace_file = tmp_path / TINY_FINGERPRINT / NAMESPACE_FILE
    if damage == "garbage":
        namespace_file.write_bytes(b"\x00{not json")
    elif damage == "missing":
        namespace_file.unlink()
    else:
        namespace_file.write_text(json.dumps({"num_layers": 99}))
    store = _file_store(tmp_path)
    assert np.array_equal(store.read(key), make_block(0))
    info = json.loads(namespace_file.read_text())
    assert info["fingerprint"] == TINY_FINGERPRINT and info["num_layers"] == 2


def test_a_new_namespace_has_every_fan_out_directory_and_an_old_one_is_left_as_it_is(
    tmp_path: Path,
) -> None:
    _file_store(tmp_path)
    namespace_dir = tmp_path / TINY_FINGERPRINT
    assert sorted(p.name for p in namespace_dir.iterdir() if p.is_dir()) == [
        f"{i:02x}" for i in range(256)
    ]
    (namespace_dir / "00").rmdir()
    _file_store(tmp_path)  # opened again: nothing made
    assert not (namespace_dir / "00").exists()


def test_write_error_leaves_no_partial_block(tmp_path: Path) -> None:
    (key,) = make_keys(1)
    store = _file_store(tmp_path)
    fanout_dir = _path(tmp_path, key).parent
    fanout_dir.rmdir()  # made with the namespace
    fanout_dir.write_bytes(b"a regular file where the fan-out directory should be")
    with pytest.raises(StoreWriteError, match=key) as error:
        store.write(key, make_block(0))
    assert isinstance(error.value.__cause__, OSError)
    assert _namespace_files(tmp_path) == [key[:2]]  # only the obstacle itself
    assert not store.contains(key)
    assert store.stats().write_errors == 1
    fanout_dir.unlink()
    assert store.write(key, make_block(0)) is True
    assert np.array_equal(store.read(key), make_block(0))
    assert _namespace_files(tmp_path) == [f"{key}.kvb"]


def test_disk_full_mid_write_leaves_no_partial_block(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel stop the write part-way (EFBIG), like a full disk, in a
    # child process so the limit cannot leak into the test run.
    (key,) = make_keys(1)
    script = (
        "import resource, signal, sys; from pathlib import Path\n"
        "from tests.kv.conftest import TINY_FINGERPRINT, TINY_LAYOUT, make_block, make_keys\n"
        "from dualpath.errors import StoreWriteError\n"
        "from dualpath.kv.file_store import FileKVStore\n"
        "store = FileKVStore(Path(sys.argv[1]), TINY_LAYOUT, TINY_FINGERPRINT)\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    store.write(make_keys(1)[0], make_block(0))\n"
        "except StoreWriteError as exc:\n"
        "    assert 'File too large' in str(exc), exc\n"
        "    assert store.stats().write_errors == 1\n"
        "    sys.exit(0)\n"
        "sys.exit('the write did not fail')\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], check=True, cwd=REPO_ROOT, timeout=60
    )
    assert _namespace_files(tmp_path) == []  # neither the block nor its temp file
    store = _file_store(tmp_path)
    assert store.lookup([key]) == 0
    assert store.write(key, make_block(0)) is True


# -- boundaries ---------------------------------------------------------------------------------


def test_kv_modules_do_not_import_torch() -> None:
    script = (
        "import sys\n"
        "import dualpath.kv.store, dualpath.kv.hashing, dualpath.kv.layout\n"
        "import dualpath.bench.store_bench\n"
        "assert 'torch' not in sys.modules, 'dualpath.kv imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, timeout=60)


def test_store_read_bench_quick_run(tmp_path: Path) -> None:
    # 512 bytes per token per layer: one float32 K+V head of 64 in the vLLM-shaped cache.
    layout = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=512)
    result = run_store_read_bench(tmp_path, num_blocks=8, layout=layout, seed=0, num_repeats=1)
    assert result["num_blocks"] == 8
    assert result["full_block_bytes"] == 4096
    assert result["total_bytes"] == 8 * 4096
    for temperature in ("cold", "warm"):
        assert set(result[temperature]) == {
            "plain_gb_per_s", "store_gb_per_s", "ratio", "vllm_load_gb_per_s", "vllm_load_ratio",
            "vllm_direct_gb_per_s", "vllm_direct_ratio", "plain_to_memory_gb_per_s",
            "vllm_direct_vs_plain_to_memory",
        }  # fmt: skip
        assert all(value > 0 for value in result[temperature].values())
    assert result["page_cache_drop"] == "posix_fadvise"
    assert set(result["hardware"]) >= {"machine", "cpu_count", "platform", "python"}
    json.dumps(result)  # JSON-able
