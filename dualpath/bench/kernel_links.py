"""``bench offline|online --links kernel``: every mode's cluster on test hosts whose NICs the
kernel shapes, the kernel's counters as the witness of our own byte accounting.

    with KernelTestbed("1P2D") as testbed:           # hosts, GlusterFS, before the first mode
        run = replace(run, testbed=testbed)          # harness.run_mode then starts ...
        servers = testbed.start(run, store_name, log_dir, memory_dir)   # ... one mode's cluster

One host per engine and one for the router (``dualpath serve --external-engines``: scheduler
and API), each with a compute NIC and a storage NIC, and two storage hosts holding the
GlusterFS bricks (``dualpath.testbed``). Each engine host's storage NIC is capped with ``tc
tbf`` at the node's SNIC cap and its compute NIC at the engine's CNIC cap, in each direction
(a real NIC is full duplex; our token buckets share one budget between a link's reads and
writes). Our own token buckets are off (the engines run uncapped and only count); the router
is told the SNIC cap, which sets the scheduler's alpha (SPEC §6) as it does with emulated
caps. ``oracle`` runs uncapped with its store in memory (/dev/shm, seen by every host), as
with emulated links. Every mode's store is a fresh directory of the volume.

The counters (``/sys/class/net/*/statistics`` of each NIC's root-namespace peer) are sampled
through the run (``NicSampler``); ``nic_figures`` sets them against our accounting per NIC
(``dualpath_link_bytes_total``) and computes SPEC §7's SNIC load balance from them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from dualpath.bench.mode_flags import (
    SERVED_MODEL_NAME,
    engine_kind_flags,
    scheduler_flags,
    vllm_arg_flags,
)
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.server_process import metric_sum, snic_read_totals
from dualpath.bench.spec import BLOCK_SIZE_TOKENS, KV_DTYPE
from dualpath.bench.stats import LinkSample, snic_load_balance
from dualpath.config import mode_settings, parse_node_shape
from dualpath.kv.layout import KVLayout
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.options import SERVE_ENGINE_THREADS
from dualpath.testbed import gluster, hosts
from dualpath.testbed.cluster import MultiHostCluster
from dualpath.testbed.hosts import COMPUTE, NICS, STORAGE, Host, namespace_pids, nic_bytes
from dualpath.testbed.store_probe import BlockWireCost, measure_block_cost
from dualpath.units import bytes_per_s_to_gbps

if TYPE_CHECKING:
    from dualpath.bench.harness import ModeRun

LINKS = ("emulated", "kernel")
NUM_STORAGE_HOSTS = 2  # the GlusterFS bricks' hosts
LINK_BYTES = "dualpath_link_bytes_total"  # our accounting, per link and traffic class
START_TIMEOUT_S = 600.0  # a hang guard: vLLM engines take minutes to start on 2 cores
HEARTBEAT_TIMEOUT_S = 10.0  # serve's default, as the emulated runs have it


def num_engines(nodes: str) -> int:
    num_prefill, num_decode = parse_node_shape(nodes)
    return num_prefill + num_decode


def check_kernel_links_possible() -> None:
    """``ValueError`` in one line where this machine cannot build the hosts (no root, no
    network namespaces, no GlusterFS: ``make test-faults`` installs it)."""
    try:
        hosts.check_hosts_possible()
        gluster.check_gluster_possible()
    except (hosts.HostsUnavailable, gluster.GlusterUnavailable) as exc:
        raise ValueError(f"--links kernel: {exc}") from None


class KernelTestbed:
    """The hosts and the GlusterFS volume of every mode of one benchmark run: built on entry
    and torn down on exit, or, given ``test_hosts`` and ``volume`` already up (the fault
    tests'), used as they are and left up."""

    def __init__(
        self,
        nodes: str,
        *,
        test_hosts: hosts.TestHosts | None = None,
        volume: gluster.GlusterVolume | None = None,
    ) -> None:
        if (test_hosts is None) != (volume is None):
            raise ValueError("caller bug: give both the test hosts and their volume, or neither")
        self.nodes = nodes
        self.owns = test_hosts is None
        self.test_hosts = test_hosts or hosts.TestHosts(1 + num_engines(nodes), NUM_STORAGE_HOSTS)
        self.volume = volume
        self._block_costs: dict[KVLayout, BlockWireCost] = {}
        if len(self.test_hosts.hosts) < 1 + num_engines(nodes):
            raise ValueError(f"a {nodes} testbed needs {1 + num_engines(nodes)} hosts")

    def __enter__(self) -> KernelTestbed:
        if not self.owns:
            return self
        check_kernel_links_possible()
        self.test_hosts.up()
        try:
            self.volume = gluster.GlusterVolume(
                brick_hosts=self.test_hosts.storage_hosts, client_hosts=self.test_hosts.hosts
            ).create()
        except BaseException:
            self.test_hosts.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.owns:
            return
        if self.volume is not None:
            self.volume.close()
        self.test_hosts.down()

    def start(
        self, run: ModeRun, store_name: str, log_dir: Path, memory_dir: Path | None
    ) -> HostServers:
        """``run``'s cluster over the hosts, its NICs capped for its mode; returns once it
        serves. Its store: ``store_name`` in ``memory_dir`` (oracle), else a fresh directory of
        the volume."""
        if run.extra_serve_args:
            raise ValueError(
                f"--links kernel: serve arguments {list(run.extra_serve_args)} cannot be split "
                "between the router and the engines"
            )
        if self.volume is None:
            raise RuntimeError("caller bug: the testbed is not up")
        volume = self.volume
        namespace = f"{store_name}-{uuid.uuid4().hex[:8]}"

        def store_dir_of(host: Host) -> Path:
            if memory_dir is not None:
                return memory_dir / namespace
            return volume.mount_point(host) / namespace

        cluster = MultiHostCluster(
            self.test_hosts.hosts,
            model_dir=run.model_dir,
            log_dir=log_dir,
            store_dir_of=store_dir_of,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            extra_serve_args=router_args(run),
            engine_args=engine_args(run),
            common_args=common_args(run),
            nodes=run.nodes,
            threads=SERVE_ENGINE_THREADS,  # as the emulated runs' serve gives its engines
            served_model_name=SERVED_MODEL_NAME,
            start_timeout_s=START_TIMEOUT_S,
        )
        engine_hosts = [spec.host for spec in cluster.engines]
        block_cost = self.block_cost(run.model_dir, engine_hosts[0])
        self.shape(run, engine_hosts)
        return HostServers(cluster.start(), self.test_hosts, block_cost)

    def block_cost(self, model_dir: Path, host: Host) -> BlockWireCost:
        """The store's cost per block on a storage NIC beyond its KV, measured once per block
        layout on ``host``'s mount, uncapped (``store_probe.py``)."""
        assert self.volume is not None, "caller bug: the testbed is not up"
        config = read_config(Path(model_dir) / "config.json")
        layout = kv_layout(config, KV_DTYPE, BLOCK_SIZE_TOKENS)
        if layout not in self._block_costs:
            for nic in NICS:
                self.test_hosts.unshape(host, nic)
            probe_dir = self.volume.mount_point(host) / f"probe-{uuid.uuid4().hex[:8]}"
            self._block_costs[layout] = measure_block_cost(host, probe_dir, layout)
        return self._block_costs[layout]

    def shape(self, run: ModeRun, engine_hosts: list[Host]) -> None:
        """Cap each engine host's NICs at ``run``'s caps (none for ``oracle``); the router's
        and the storage hosts' stay uncapped."""
        is_io_free = mode_settings(run.mode).is_io_free
        caps = {STORAGE: run.snic_bandwidth_gbps, COMPUTE: run.cnic_bandwidth_gbps}
        for host in engine_hosts:
            for nic, gbps in caps.items():
                if gbps > 0 and not is_io_free:
                    self.test_hosts.shape(host, rate_mbit=gbps * 1000, nic=nic)  # replaces
                else:
                    self.test_hosts.unshape(host, nic)


def common_args(run: ModeRun) -> list[str]:
    """The router's and every engine's: the mode, the transport and what runs the model."""
    return ["--mode", run.mode, "--transport", run.transport, *engine_kind_flags(run)]


def router_args(run: ModeRun) -> list[str]:
    """The router's: the caps it schedules by (the engines do not enforce them) and the
    scheduler's flags."""
    return [
        "--snic-gbps", str(run.snic_bandwidth_gbps),
        "--cnic-gbps", str(run.cnic_bandwidth_gbps),
        *scheduler_flags(run),
    ]  # fmt: skip


def engine_args(run: ModeRun) -> list[str]:
    """Every engine's: no cap of ours (the kernel's alone), vLLM's engine arguments."""
    return ["--snic-gbps", "0", "--cnic-gbps", "0", *vllm_arg_flags(run)]


@dataclass(frozen=True, slots=True)
class HostServers:
    """A mode's cluster on the test hosts, as ``harness.run_mode`` drives it."""

    cluster: MultiHostCluster
    test_hosts: hosts.TestHosts
    block_cost: BlockWireCost
    served_model_name: str = SERVED_MODEL_NAME

    @property
    def url(self) -> str:
        return self.cluster.url

    def process_cpu(self) -> ProcessCpu:
        """The router's and every engine's cores, and the store's file system's: each cluster
        host's client (``store-client@prefill-0``: its GlusterFS mount) and each storage host's
        servers (``store-server@dp-h4``), every process below them counted with them."""
        roots = {"serve": self.cluster.server.pid} if self.cluster.server else {}
        for spec in self.cluster.engines:
            process = self.cluster.engine_id_to_process[spec.engine_id]
            roots[f"{spec.role}-{spec.engine_id}"] = process.pid
        ours = set(roots.values())
        labels = self.host_labels()
        storage_hosts = set(self.test_hosts.storage_hosts)
        for host in self.test_hosts.every_host:
            pids = set(namespace_pids(host.name))
            kind = "store-server" if host in storage_hosts else "store-client"
            for pid in sorted(pids):  # the trees' roots in the host
                if not _is_below(pid, ours | (pids - {pid})):
                    label = f"{kind}@{labels.get(host, host.name)}"
                    roots[label if label not in roots else f"{label}-{pid}"] = pid
        return ProcessCpu(roots)

    def host_labels(self) -> dict[Host, str]:
        """Each cluster host -> what runs there: ``router``, ``prefill-0``, ``decode-1``, ..."""
        return {self.cluster.api_host: "router"} | {
            spec.host: f"{spec.role}-{spec.engine_id}" for spec in self.cluster.engines
        }

    def nic_sampler(self) -> NicSampler:
        labels = self.host_labels()
        engine_nodes = {f"{s.role}-{s.engine_id}": s.node_id for s in self.cluster.engines}
        return NicSampler(labels, engine_nodes, self.block_cost)

    def stop(self) -> dict:
        """Stop the cluster and lift its caps; the result's exit-code keys."""
        codes = self.cluster.close()
        for spec in self.cluster.engines:
            for nic in NICS:
                self.test_hosts.unshape(spec.host, nic)
        return {
            "server_exit_code": codes.pop("server"),
            "engine_exit_codes": codes,
        }


@dataclass(frozen=True, slots=True)
class NicSample:
    time_s: float
    # "<host>.<nic>" -> (sent, received) bytes since the NIC was made
    counters: dict[str, tuple[int, int]]


class NicSampler:
    """Reads every host's NIC counters every ``period_s`` on a thread, and once more at the
    end; ``labels``: host -> what runs there (``router``, ``prefill-0``, ...), ``engine_nodes``:
    an engine's label -> its node id; ``block_cost``: the store's protocol bytes per block on
    these hosts (None: not measured)."""

    def __init__(
        self,
        labels: dict[Host, str],
        engine_nodes: dict[str, int],
        block_cost: BlockWireCost | None = None,
        *,
        period_s: float = 0.5,
    ) -> None:
        self.labels = labels
        self.engine_nodes = engine_nodes
        self.block_cost = block_cost
        self.period_s = period_s
        self.samples: list[NicSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nic-sampler", daemon=True)

    def sample(self) -> None:
        counters = {
            f"{host.name}.{nic}": nic_bytes(host, nic) for host in self.labels for nic in NICS
        }
        self.samples.append(NicSample(time.monotonic(), counters))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> NicSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def nic_figures(
    sampler: NicSampler,
    scraped: dict[str, list[tuple[dict[str, str], float]]],
    *,
    store_on_network: bool,
) -> dict:
    """The run's counters per host and NIC (``nic_bytes``), set against our accounting of the
    same NIC (``nic_agreement``), each NIC's rate over time (``nic_timeline``), and SPEC §7's
    SNIC load balance from the storage NICs' counters (one engine per node).

    Our accounting of a storage NIC is its node's SNIC (``node<id>.snic``: store reads and
    writes). Of a compute NIC it is what crossed the network: the KV its engine moved over the
    transport with any peer and what peers moved with it (``dualpath_transport_bytes_total``,
    both ends), and the control messages it sent (the inference class of ``engine<id>.cnic``);
    not the host<->device copies our CNIC links also count (the paper routes those through the
    CNIC; here they are memory copies). Without ``store_on_network`` (oracle: the store in
    memory) no NIC carries the store's bytes, and the storage NICs are not set against ours.

    A storage NIC also carries the file system's protocol: per block, the round trips the
    probe measured on these hosts (``sampler.block_cost``, ``store_probe.py``). Its
    ``ratio`` is the counters over our bytes plus that (``protocol_bytes``: our accounting's
    blocks, each at the measured cost); ``ratio_to_our_bytes`` leaves it out."""
    engine_nodes = sampler.engine_nodes
    first, last = sampler.samples[0], sampler.samples[-1]
    wire = _transport_totals(scraped)
    reads = snic_read_totals(scraped)
    nic_bytes_out: dict[str, dict] = {}
    agreement: dict[str, dict] = {}
    for host, label in sampler.labels.items():
        per_nic: dict[str, dict] = {"label": label}
        for nic in NICS:
            key = f"{host.name}.{nic}"
            sent = last.counters[key][0] - first.counters[key][0]
            received = last.counters[key][1] - first.counters[key][1]
            per_nic[nic] = {"sent": sent, "received": received}
            if label in engine_nodes and (nic == COMPUTE or store_on_network):
                node = engine_nodes[label]
                protocol_bytes = 0
                if nic == STORAGE:
                    link = f"node{node}.snic"
                    our_bytes = int(metric_sum(scraped, LINK_BYTES, link=link))
                    protocol_bytes = _protocol_bytes(
                        sampler.block_cost, our_bytes, reads.get(link, 0)
                    )
                else:
                    link = f"engine{node}.cnic"
                    control = metric_sum(scraped, LINK_BYTES, link=link, traffic_class="inference")
                    our_bytes = wire.get(node, 0) + int(control)
                counted = sent + received
                expected = our_bytes + protocol_bytes
                agreement[f"{label}.{nic}"] = {
                    "link": link,
                    "counters_bytes": counted,
                    "our_bytes": our_bytes,
                    "protocol_bytes": protocol_bytes,
                    "ratio": round(counted / expected, 4) if expected else None,
                    "ratio_to_our_bytes": round(counted / our_bytes, 4) if our_bytes else None,
                }
        nic_bytes_out[host.name] = per_nic
    storage_samples = [
        LinkSample(
            sample.time_s,
            {
                label: sum(sample.counters[f"{host.name}.{STORAGE}"])
                for host, label in sampler.labels.items()
                if label in engine_nodes
            },
            {},
        )
        for sample in sampler.samples
    ]
    return {
        "nic_bytes": nic_bytes_out,
        "nic_agreement": agreement,
        "store_block_cost": asdict(sampler.block_cost) if sampler.block_cost else None,
        "snic_load_balance": snic_load_balance(storage_samples) if store_on_network else None,
        "nic_timeline": nic_timeline(sampler),
    }


def nic_timeline(sampler: NicSampler) -> dict:
    """Each NIC's rate (Gbps, sent + received) between consecutive samples, at the interval's
    end (seconds from the first sample): the data of the per-NIC plot."""
    samples = sampler.samples
    names = {
        f"{host.name}.{nic}": f"{label} {nic}"
        for host, label in sampler.labels.items()
        for nic in NICS
    }
    times_s: list[float] = []
    gbps: dict[str, list[float]] = {name: [] for name in names.values()}
    for before, after in zip(samples[:-1], samples[1:], strict=True):
        span_s = after.time_s - before.time_s
        if span_s <= 0:
            continue
        times_s.append(after.time_s - samples[0].time_s)
        for key, name in names.items():
            moved = sum(after.counters[key]) - sum(before.counters[key])
            gbps[name].append(bytes_per_s_to_gbps(moved / span_s))
    return {"time_s": times_s, "gbps": gbps}


def _protocol_bytes(cost: BlockWireCost | None, snic_bytes: int, read_bytes: int) -> int:
    """The file system's bytes around the blocks of a SNIC that moved ``snic_bytes`` of KV,
    ``read_bytes`` of them reads: each block at the measured cost (0 unmeasured)."""
    if cost is None:
        return 0
    num_read = read_bytes / cost.payload_bytes
    num_written = (snic_bytes - read_bytes) / cost.payload_bytes
    return round(num_read * cost.read_extra_bytes + num_written * cost.write_extra_bytes)


def _transport_totals(scraped: dict[str, list[tuple[dict[str, str], float]]]) -> dict[int, int]:
    """Engine id -> KV bytes that crossed its NIC over the transport: the transfers it started
    and those its peers started with it."""
    totals: dict[int, int] = {}
    for labels, value in scraped.get("dualpath_transport_bytes_total", ()):
        for end in (int(labels["engine"]), int(labels["peer"])):
            totals[end] = totals.get(end, 0) + int(value)
    return totals


def _is_below(pid: int, roots: set[int]) -> bool:
    """Whether ``pid`` is one of ``roots`` or runs below one (a vLLM engine's core, a brick
    below its reaper)."""
    try:
        process = psutil.Process(pid)
        return pid in roots or any(parent.pid in roots for parent in process.parents())
    except psutil.NoSuchProcess:
        return True  # gone: nothing to count


def links_testbed(
    links: str, nodes: str, *, given: KernelTestbed | None = None
) -> contextlib.AbstractContextManager[KernelTestbed | None]:
    """The test hosts of a run whose ``--links`` is "kernel", up for its whole run; nothing for
    "emulated"; ``given`` as it is (its caller's to take down)."""
    if given is not None:
        return contextlib.nullcontext(given)
    if links not in LINKS:
        raise ValueError(f"--links must be one of {', '.join(LINKS)}, got {links!r}")
    if links == "emulated":
        return contextlib.nullcontext()
    check_kernel_links_possible()  # before a testbed is built: one line
    return KernelTestbed(nodes)


def no_nic_sampler() -> contextlib.nullcontext[None]:
    """What a cluster without test hosts samples: nothing."""
    return contextlib.nullcontext()
