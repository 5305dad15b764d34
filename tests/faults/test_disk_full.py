"""The store's disk full under a multi-host cluster: serving goes on without persisting.

The store is a small tmpfs that every host sees (mounted before the hosts' processes start),
filled up while the cluster runs. Expected: every request answers 200 with the single-node
engine's tokens, nothing is persisted (no hits), /health stays 200 and counts the failed
writes (as /metrics does); once space is freed, blocks are written and hit again.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.cluster import MultiHostCluster, random_ids
from tests.faults.test_store_faults import (
    HITS_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    ask,
    wait_for_full_hits,
)

pytest.importorskip("nixl_cu12")


@pytest.fixture
def full_disk_cluster(test_hosts, tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    """A cluster whose store is a 16 MB tmpfs (seen by every host: mounted before they start)."""
    mount_point = Path("/mnt/dualpath-full-store")
    mount_point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)],
                   check=True)  # fmt: skip
    try:
        with MultiHostCluster(
            test_hosts.hosts,
            model_dir=tiny_model_dir,
            log_dir=tmp_path,
            store_dir_of=lambda host: mount_point / "kv",
        ) as started:
            yield started, mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_a_full_disk_stops_persisting_not_serving(full_disk_cluster) -> None:
    cluster, mount_point = full_disk_cluster
    filler = mount_point / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(1 << 20)):
            pass
    except OSError:
        pass  # ENOSPC: the disk is full
    finally:
        os.close(fd)
    prompts = [random_ids(600, seed=50 + i) for i in range(3)]
    assert ask(cluster, prompts) == [0, 0, 0]
    assert ask(cluster, prompts) == [0, 0, 0]  # nothing could be persisted
    health = cluster.http.get("/health", timeout=REQUEST_TIMEOUT_S)
    assert health.status_code == 200 and health.json()["store"]["write_errors"] > 0
    assert cluster.metric("dualpath_store_write_errors_total") > 0
    filler.unlink()
    recovery_s = wait_for_full_hits(cluster, prompts, timeout_s=HITS_TIMEOUT_S)
    print(f"disk freed: full hits again {recovery_s:.1f} s later")
