"""``bench offline --links kernel`` on the test hosts: every mode's cluster spread over them
(router and engines on hosts of their own), the NICs capped by ``tc``, our token buckets off,
and the kernel's counters witnessing where the KV went."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench.kernel_links import KernelTestbed
from dualpath.bench.offline import run_offline
from dualpath.bench.spec import EngineSpec, OutputSpec, RunSpec, WorkloadSpec

pytest.importorskip("nixl_cu12")


def test_the_ci_benchmark_on_kernel_shaped_links(
    test_hosts, gluster_volume, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = RunSpec(
        model_dir=tiny_model_dir,
        workload=WorkloadSpec(preset="ci"),
        engine=EngineSpec(links="kernel"),
        output=OutputSpec(progress=False, work_dir=tmp_path),
    )
    with KernelTestbed("1P2D", test_hosts=test_hosts, volume=gluster_volume) as testbed:
        report = run_offline(spec, testbed=testbed)
    # Every mode ran every turn, with the same tokens, its hit KV read exactly once.
    assert report["valid"], report["problems"]
    assert report["links"] == "kernel"
    modes = report["modes"]
    for mode, result in modes.items():
        assert result["links"] == "kernel", mode
        assert result["engine_exit_codes"] == {"engine-0": 0, "engine-1": 0, "engine-2": 0}
        assert set(result["nic_bytes"]) == {host.name for host in test_hosts.hosts}
        # The store's processes have cores of their own in the figures.
        storage_host = test_hosts.storage_hosts[0].name
        cores = result["process_cpu"]["cores"]
        assert {"store-client@prefill-0", f"store-server@{storage_host}"} <= set(cores), cores
    basic, dualpath, oracle = modes["basic"], modes["dualpath"], modes["oracle"]
    # Basic: the prefill host's storage NIC received every hit block the PE read.
    assert basic["path_bytes"]["de"] == 0 < basic["path_bytes"]["pe"]
    assert nic(basic, "prefill-0", "storage", "received") >= basic["path_bytes"]["pe"]
    # DualPath: the decode hosts' storage NICs received what the DEs read, and the prefill
    # host's compute NIC received it again (DE buffer -> PE over the compute network).
    de_read = dualpath["path_bytes"]["de"]
    assert de_read > 0
    decode_storage = sum(nic(dualpath, f"decode-{i}", "storage", "received") for i in (1, 2))
    assert decode_storage >= de_read
    assert nic(dualpath, "prefill-0", "compute", "received") >= de_read
    # Oracle: the store in memory, no storage NIC moved a block.
    for label in ("prefill-0", "decode-1", "decode-2"):
        assert nic(oracle, label, "storage", "received") < 1_000_000
    # The balance of the storage NICs is the counters', ours reported beside it.
    for result in (basic, dualpath):
        assert result["snic_load_balance"] is not None
        assert result["snic_load_balance_accounting"] is not None
        storage_rows = [k for k in result["nic_agreement"] if k.endswith(".storage")]
        assert len(storage_rows) == 3
    assert not [k for k in oracle["nic_agreement"] if k.endswith(".storage")]
    # Each mode's caps are lifted when its cluster stops.
    for host in test_hosts.every_host:
        for which in ("storage", "compute"):
            assert test_hosts.rate_caps_bytes_per_s(host, which) == [None, None]


def nic(result: dict, label: str, which: str, direction: str) -> int:
    """Bytes the NIC ``which`` of the host running ``label`` moved in ``direction``."""
    (per_host,) = [row for row in result["nic_bytes"].values() if row["label"] == label]
    return per_host[which][direction]
