"""``--links kernel`` without building anything: how a mode's flags split between the router and
its engines, what is refused before a host is built, and how the NICs' counters become the
JSON's figures. The runs themselves are in ``tests/faults/test_kernel_links.py`` (root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench import kernel_links
from dualpath.bench.harness import ModeRun
from dualpath.bench.kernel_links import NicSample, NicSampler, nic_figures
from dualpath.bench.offline import main as offline_main
from dualpath.bench.offline import run_preset, run_spec
from dualpath.cli import build_parser
from dualpath.testbed.hosts import Host
from dualpath.testbed.store_probe import BlockWireCost


def _run(model_dir: Path, **fields) -> ModeRun:
    return ModeRun(
        mode="dualpath",
        model_dir=model_dir,
        nodes="1P2D",
        snic_bandwidth_gbps=0.25,
        cnic_bandwidth_gbps=2.0,
        read_path="de",
        engine="vllm",
        vllm_args=(("max_num_seqs", 8),),
        kv_cache_gb=0.04,
        prefill_tokens_per_s=1234.5,
        **fields,
    )


def test_the_router_schedules_by_the_caps_and_the_engines_enforce_none(tmp_path: Path) -> None:
    run = _run(tmp_path)
    router = kernel_links.router_args(run)
    engines = kernel_links.engine_args(run)
    common = kernel_links.common_args(run)
    assert router[:4] == ["--snic-gbps", "0.25", "--cnic-gbps", "2.0"]
    assert "--read-path" in router and "--prefill-tokens-per-s" in router
    assert engines[:4] == ["--snic-gbps", "0", "--cnic-gbps", "0"]
    assert engines[4:] == ["--vllm-arg", "max_num_seqs=8"]
    assert common == ["--mode", "dualpath", "--transport", "nixl", "--engine", "vllm",
                      "--kv-cache-gb", "0.04"]  # fmt: skip
    assert run.links == "emulated"


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--links", "kernel", "--vllm-servers"], "not --vllm-servers"),
        (["--links", "kernel", "--url", "http://x"], "--links"),
        (["--links", "fibre"], None),  # argparse's own refusal
    ],
)
def test_what_kernel_links_cannot_run_is_refused_before_any_host_is_built(
    tiny_model_dir: Path, flags: list[str], refusal: str | None
) -> None:
    argv = ["bench", "offline", "--model", str(tiny_model_dir), *flags]
    if refusal is None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        return
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=refusal):
        if args.url is not None:
            offline_main(args)
        run_preset(run_spec(args, tiny_model_dir))


def test_a_machine_without_root_is_told_so_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ValueError) as refused:
        kernel_links.check_kernel_links_possible()
    assert str(refused.value) == "--links kernel: test hosts need root (network namespaces, " \
        "veth, bridge)"  # fmt: skip


def test_the_counters_become_per_nic_bytes_their_agreement_and_the_balance() -> None:
    router, prefill, decode = Host(0), Host(1), Host(2)
    # Each block read costs 1 KB of the file system's protocol, each written 10 KB.
    cost = BlockWireCost(
        payload_bytes=10**6, write_extra_bytes=10**4, read_extra_bytes=10**3, num_blocks=64
    )
    sampler = NicSampler(
        {router: "router", prefill: "prefill-0", decode: "decode-1"},
        {"prefill-0": 0, "decode-1": 1},
        cost,
    )
    # (sent, received) per NIC: 1 s apart, the PE's storage NIC receiving 100 MB, the DE's
    # 50 MB, the DE's compute NIC receiving 80 MB from the PE.
    start = {f"{h.name}.{n}": (1000, 2000) for h in sampler.labels for n in ("compute", "storage")}
    end = dict(start)
    end[f"{prefill.name}.storage"] = (1000 + 10**6, 2000 + 100 * 10**6)
    end[f"{decode.name}.storage"] = (1000, 2000 + 50 * 10**6)
    end[f"{prefill.name}.compute"] = (1000 + 80 * 10**6, 2000)
    end[f"{decode.name}.compute"] = (1000, 2000 + 80 * 10**6)
    sampler.samples = [NicSample(0.0, start), NicSample(1.0, end)]
    scraped = {
        "dualpath_snic_read_bytes_total": [({"link": "node0.snic"}, 100e6)],
        "dualpath_link_bytes_total": [
            ({"link": "node0.snic", "traffic_class": "kv"}, 100e6),
            ({"link": "node1.snic", "traffic_class": "kv"}, 40e6),
            # Host<->device copies: counted on our CNIC, carried by no NIC.
            ({"link": "engine0.cnic", "traffic_class": "kv"}, 120e6),
            ({"link": "engine0.cnic", "traffic_class": "inference"}, 1e6),
        ],
        # The PE wrote 79 MB into the DE and read 1 MB from it: both NICs carried 80 MB.
        "dualpath_transport_bytes_total": [
            ({"engine": "0", "peer": "1", "op": "written"}, 79e6),
            ({"engine": "0", "peer": "1", "op": "read"}, 1e6),
        ],
    }
    figures = nic_figures(sampler, scraped, store_on_network=True)
    assert figures["nic_bytes"][prefill.name]["storage"] == {"sent": 10**6, "received": 100 * 10**6}
    assert figures["nic_bytes"][router.name]["label"] == "router"
    agreement = figures["nic_agreement"]
    # The PE's node read 100 blocks (100 KB of protocol), the DE's wrote 40 (400 KB).
    assert agreement["prefill-0.storage"]["protocol_bytes"] == 100_000
    assert agreement["prefill-0.storage"]["ratio"] == pytest.approx(101 / 100.1, abs=1e-4)
    assert agreement["prefill-0.storage"]["ratio_to_our_bytes"] == pytest.approx(1.01)
    assert agreement["decode-1.storage"]["protocol_bytes"] == 400_000
    assert agreement["decode-1.storage"]["ratio"] == pytest.approx(50 / 40.4, abs=1e-4)
    assert figures["store_block_cost"]["write_extra_bytes"] == 10**4
    assert agreement["prefill-0.compute"] == {
        "link": "engine0.cnic",
        "counters_bytes": 80 * 10**6,
        "our_bytes": 81 * 10**6,  # the transport's 80 MB and the control messages' 1 MB
        "protocol_bytes": 0,
        "ratio": pytest.approx(80 / 81, abs=1e-4),
        "ratio_to_our_bytes": pytest.approx(80 / 81, abs=1e-4),
    }
    assert agreement["decode-1.compute"]["our_bytes"] == 80 * 10**6
    assert "router.compute" not in agreement
    # One window, storage NICs at 101 MB and 50 MB: max / mean.
    assert figures["snic_load_balance"] == pytest.approx(101 / 75.5)
    assert figures["nic_timeline"]["time_s"] == [1.0]
    assert figures["nic_timeline"]["gbps"]["decode-1 storage"] == [pytest.approx(0.4)]
    # The store in memory (oracle): no storage NIC is set against our SNICs.
    in_memory = nic_figures(sampler, scraped, store_on_network=False)["nic_agreement"]
    assert sorted(in_memory) == ["decode-1.compute", "prefill-0.compute"]
