"""A 1P2D cluster over four test hosts with its KV store on GlusterFS (bricks on two storage
hosts): the same tokens as the single-process engine, KV between engines crossing the compute
NICs and KV to and from the store the storage NICs (the kernel's counters), and the benchmark's
ci preset on it."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.model.identity import checkpoint_kv_identity
from dualpath.testbed.hosts import COMPUTE, STORAGE, Host, nic_bytes
from tests.faults.cluster import MultiHostCluster, random_ids, reference_tokens

pytest.importorskip("nixl_cu12")

MAX_TOKENS = 10
NAMESPACE = "multihost"  # the volume's directory for this module's store


@pytest.fixture(scope="module")
def cluster(test_hosts, gluster_volume, tiny_model_dir: Path, tmp_path_factory) -> Iterator:
    log_dir = tmp_path_factory.mktemp("multihost")
    with MultiHostCluster(
        test_hosts.hosts,
        model_dir=tiny_model_dir,
        log_dir=log_dir,
        store_dir_of=lambda host: gluster_volume.mount_point(host) / NAMESPACE,
    ) as started:
        yield started


def test_multi_turn_tokens_equal_the_single_node_engine_and_reuse_the_gluster_store(
    cluster: MultiHostCluster, gluster_volume, tiny_model_dir: Path
) -> None:
    contexts = [random_ids(n, seed=n) for n in (700, 830, 960)]
    decode_hosts = [spec.host for spec in cluster.engines if spec.role == "decode"]
    _, identity = checkpoint_kv_identity(tiny_model_dir, None, 64)
    kv_bytes_per_token = identity.layout.full_block_bytes // identity.layout.block_size_tokens
    engine_hosts = [spec.host for spec in cluster.engines]
    storage_at_start = nic_counts(engine_hosts, STORAGE)
    previous_lengths: list[int] = []
    for turn in range(2):
        storage_before = nic_counts(engine_hosts, STORAGE)
        into_decode_before = nic_counts(decode_hosts, COMPUTE)[1]
        bodies = [cluster.complete(c, MAX_TOKENS).json() for c in contexts]
        into_decode_bytes = nic_counts(decode_hosts, COMPUTE)[1] - into_decode_before
        storage_now = nic_counts(engine_hosts, STORAGE)
        expected = reference_tokens(tiny_model_dir, contexts, MAX_TOKENS)
        for body, want in zip(bodies, expected, strict=True):
            assert body["choices"][0]["token_ids"] == want, f"turn {turn}: {body}"
        cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
        if turn == 0:
            assert cached == [0, 0, 0]
            # Every prompt's KV ends on a DE; with no hit, all of it came PE -> DE over a link.
            num_prompt_tokens = sum(len(c) for c in contexts)
            assert into_decode_bytes >= num_prompt_tokens * kv_bytes_per_token
        else:
            # Turn 1 persisted every full block of its prompt and of its generation (all but
            # the last token have KV) to the volume; turn 2 finds them there.
            assert cached == [(n + MAX_TOKENS - 1) // 64 * 64 for n in previous_lengths]
            # They went to the bricks over the storage network, and came back over it.
            hit_bytes = sum(cached) * kv_bytes_per_token
            sent = storage_now[0] - storage_at_start[0]
            received = storage_now[1] - storage_before[1]
            print(f"\nstorage NICs: {sent / hit_bytes:.3f}x the persisted KV sent, "
                  f"{received / hit_bytes:.3f}x the hit KV received")  # fmt: skip
            assert sent >= hit_bytes and received >= hit_bytes, (sent, received, hit_bytes)
        previous_lengths = [len(c) for c in contexts]
        contexts = [
            c + t + random_ids(100, seed=turn) for c, t in zip(contexts, expected, strict=True)
        ]
    for host in gluster_volume.brick_hosts:  # the volume spreads files over its bricks
        blocks = list((gluster_volume.brick_dir(host) / NAMESPACE).rglob("*.kvb"))
        assert blocks, f"no block file on {host.name}'s brick"
        # Each written where its temp file was (block_file.temp_path): none is a link file
        # (sticky, empty) pointing at the other brick.
        links = [p for p in blocks if p.stat().st_mode & stat.S_ISVTX and not p.stat().st_size]
        assert not links, f"{len(links)} of {len(blocks)} on {host.name}'s brick are link files"


def nic_counts(hosts: list[Host], nic: str) -> tuple[int, int]:
    """(sent, received) bytes of ``nic`` summed over ``hosts``, from the kernel's counters."""
    counts = [nic_bytes(host, nic) for host in hosts]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def test_the_ci_benchmark_runs_against_the_cluster(cluster: MultiHostCluster, tmp_path) -> None:
    out = tmp_path / "offline.json"
    argv = [sys.executable, "-m", "dualpath.cli", "bench", "offline", "--preset", "ci",
            "--url", cluster.url, "--served-model-name", "tiny", "--json", str(out)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())["modes"]["url"]
    assert figures["num_requests"] > 0 and figures["num_failed"] == 0, figures
    assert figures["cached_tokens"] > 0, "multi-turn agents should hit the shared store"
    assert cluster.health()["num_live_engines"] == 3
