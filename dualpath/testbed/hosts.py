"""Test hosts: network namespaces on one machine, each with a storage NIC and a compute NIC,
on a bridge per network.

    python scripts/testhosts.py up      # 4 hosts dp-h0..dp-h3 and 2 storage hosts dp-h4, dp-h5
    python scripts/testhosts.py status
    python scripts/testhosts.py down    # idempotent; also cleans up after a crashed run

Layout (root namespace on the left, one namespace per host on the right)::

    dpbr0 10.77.0.254 ─┬─ dpv-h0 ══ veth ══ dp0 10.77.0.1   (netns dp-h0: compute NIC)
    (compute)          ├─ dpv-h1 ══ veth ══ dp0 10.77.0.2   (netns dp-h1)
                       └─ ...
    dpbr1 10.78.0.254 ─┬─ dps-h0 ══ veth ══ dp1 10.78.0.1   (netns dp-h0: storage NIC)
    (storage)          ├─ dps-h1 ══ veth ══ dp1 10.78.0.2   (netns dp-h1)
                       └─ ...

As in the paper's clusters, each host has two networks: the compute network carries the
scheduler's messages, the API and the KV that moves between engines (NIXL/UCX on ``dp0``), the
storage network carries what the hosts read from and write to the store (the GlusterFS bricks
sit on storage hosts, reached at their storage addresses). Every host's NICs have the same
names, so ``UCX_NET_DEVICES=dp0`` fits all of them. The root namespace has an address on each
bridge, so tests can talk to any host directly. A host can be cut off (``set_link_up``: both
NICs) and each NIC shaped in both directions (``shape``: a ``tbf`` rate cap; ``netem`` delay
only where the kernel has it); each NIC's bytes are read from the kernel's counters
(``nic_bytes``). Needs root and ``ip``/``tc`` (iproute2).

Commands run in a host through ``ip netns exec``, which also gives them a private copy of the
mount table taken at start: a mount made in the root namespace afterwards is not seen by
processes already running in a host (the root mount is ``private`` here).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dp"
COMPUTE = "compute"
STORAGE = "storage"
NICS = (COMPUTE, STORAGE)


@dataclass(frozen=True, slots=True)
class Network:
    """One network: a bridge in the root namespace, one NIC (veth) per host on it."""

    bridge: str
    subnet: str  # /24: host i is .(i+1), the bridge is .254
    host_device: str  # the NIC's name inside every host
    root_prefix: str  # the NIC's peer in the root namespace: <root_prefix><host name suffix>

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.254"


NETWORKS = {
    COMPUTE: Network(f"{PREFIX}br0", "10.77.0", f"{PREFIX}0", f"{PREFIX}v-h"),
    STORAGE: Network(f"{PREFIX}br1", "10.78.0", f"{PREFIX}1", f"{PREFIX}s-h"),
}
HOST_DEVICE = NETWORKS[COMPUTE].host_device  # the compute NIC: UCX_NET_DEVICES
_KILL_GRACE_S = 3.0
MAX_HOSTS = 16


class HostsUnavailable(RuntimeError):
    """This machine cannot build test hosts (not root, or no network namespaces)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One test host: a network namespace with a veth link to each network's bridge."""

    index: int

    @property
    def name(self) -> str:
        return f"{PREFIX}-h{self.index}"

    @property
    def address(self) -> str:
        """The compute NIC's address: the host's name on the cluster's network."""
        return self.address_on(COMPUTE)

    @property
    def storage_address(self) -> str:
        return self.address_on(STORAGE)

    def address_on(self, nic: str) -> str:
        return f"{NETWORKS[nic].subnet}.{self.index + 1}"

    def root_device(self, nic: str) -> str:
        """The end in the root namespace (on the network's bridge) of the host's ``nic``."""
        return f"{NETWORKS[nic].root_prefix}{self.index}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (network namespace)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def net_only_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` in this host's network but the root mount table: for mounts the other
        hosts' processes started later must see (a FUSE client)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", *argv]

    def run(self, argv: Sequence[str], *, timeout_s: float = 60.0) -> str:
        return _run(self.argv(argv), timeout_s=timeout_s)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kwargs)


def check_hosts_possible() -> None:
    """Raise ``HostsUnavailable`` with the reason if test hosts cannot be built here."""
    if os.geteuid() != 0:
        raise HostsUnavailable("test hosts need root (network namespaces, veth, bridge)")
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            raise HostsUnavailable(f"test hosts need {tool!r} on PATH")
    probe = f"{PREFIX}-probe"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise HostsUnavailable(f"no network namespaces: {result.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


class TestHosts:
    """``num_hosts`` hosts for the cluster's processes and ``num_storage_hosts`` more for the
    store's servers, each on both networks. ``up`` first tears down leftovers of a crashed run."""

    __test__ = False  # not a pytest test class

    def __init__(self, num_hosts: int = 4, num_storage_hosts: int = 2) -> None:
        if (
            not 1 <= num_hosts + num_storage_hosts <= MAX_HOSTS
            or min(num_hosts, num_storage_hosts) < 0
        ):
            raise ValueError(
                f"hosts and storage hosts must number 1..{MAX_HOSTS} together, "
                f"got {num_hosts} and {num_storage_hosts}"
            )
        every = [Host(i) for i in range(num_hosts + num_storage_hosts)]
        self.hosts = every[:num_hosts]
        self.storage_hosts = every[num_hosts:]

    @property
    def every_host(self) -> list[Host]:
        return self.hosts + self.storage_hosts

    def up(self) -> TestHosts:
        down()
        for network in NETWORKS.values():
            _run(["ip", "link", "add", network.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{network.bridge_address}/24", "dev", network.bridge])
            _run(["ip", "link", "set", network.bridge, "up"])
        for host in self.every_host:
            _run(["ip", "netns", "add", host.name])
            _run(["ip", "-n", host.name, "link", "set", "lo", "up"])
            for nic, network in NETWORKS.items():
                device = network.host_device
                _run(["ip", "link", "add", host.root_device(nic), "type", "veth",
                      "peer", "name", device, "netns", host.name])  # fmt: skip
                _run(["ip", "link", "set", host.root_device(nic), "master", network.bridge, "up"])
                _run(["ip", "-n", host.name, "addr", "add", f"{host.address_on(nic)}/24",
                      "dev", device])  # fmt: skip
                _run(["ip", "-n", host.name, "link", "set", device, "up"])
        for host in self.every_host:
            for nic in NICS:
                wait_reachable(host.address_on(nic))
        return self

    def down(self) -> None:
        down()

    def __enter__(self) -> TestHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def set_link_up(self, host: Host, is_up: bool) -> None:
        """Connect or cut ``host`` off both networks (its NICs' root ends)."""
        for nic in NICS:
            _run(["ip", "link", "set", host.root_device(nic), "up" if is_up else "down"])

    def shape(
        self,
        host: Host,
        *,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        nic: str = COMPUTE,
    ) -> None:
        """Cap both directions of ``host``'s ``nic`` at ``rate_mbit`` (``tbf``), or delay them
        by ``delay_ms`` (``netem``, which not every kernel has: ``RuntimeError`` then)."""
        for argv_prefix, device in _link_ends(host, nic):
            if delay_ms > 0:
                qdisc = ["netem", "delay", f"{delay_ms}ms"]
                if rate_mbit:
                    qdisc += ["rate", f"{rate_mbit}mbit"]
            elif rate_mbit:
                # burst: one 10 ms worth of bytes (at least 64 KiB, a TSO segment); latency:
                # how long a packet may queue before tbf drops it.
                burst_bytes = max(65536, int(rate_mbit * 1e6 / 8 * 0.01))
                qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes),
                         "latency", "2s"]  # fmt: skip
            else:
                raise ValueError("shape needs rate_mbit or delay_ms")
            _run([*argv_prefix, "qdisc", "replace", "dev", device, "root", *qdisc])

    def unshape(self, host: Host, nic: str = COMPUTE) -> None:
        for argv_prefix, device in _link_ends(host, nic):
            subprocess.run([*argv_prefix, "qdisc", "del", "dev", device, "root"],
                           capture_output=True)  # fmt: skip

    def rate_caps_bytes_per_s(self, host: Host, nic: str = COMPUTE) -> list[float | None]:
        """The ``tbf`` rate of each end of ``host``'s ``nic`` (root end first), as the kernel
        has it; None for an end without one."""
        caps: list[float | None] = []
        for argv_prefix, device in _link_ends(host, nic):
            qdiscs = json.loads(_run([*argv_prefix, "-j", "qdisc", "show", "dev", device, "root"]))
            tbf = [q for q in qdiscs if q.get("kind") == "tbf"]
            caps.append(float(tbf[0]["options"]["rate"]) if tbf else None)
        return caps

    def status(self) -> list[dict[str, object]]:
        existing = set(list_namespaces())
        storage = set(self.storage_hosts)
        return [
            {
                "host": host.name,
                "role": "storage" if host in storage else "cluster",
                "addresses": {nic: host.address_on(nic) for nic in NICS},
                "exists": host.name in existing,
                "pids": namespace_pids(host.name) if host.name in existing else [],
            }
            for host in self.every_host
        ]


def nic_bytes(host: Host, nic: str) -> tuple[int, int]:
    """(sent, received) bytes of ``host``'s ``nic`` since it was made, from the kernel's
    counters: read at the NIC's peer in the root namespace, whose received bytes are what the
    host sent (a veth pair hands each frame to its peer whole), so no process enters the host."""
    statistics = Path("/sys/class/net") / host.root_device(nic) / "statistics"
    received_by_peer = int((statistics / "rx_bytes").read_text())
    sent_by_peer = int((statistics / "tx_bytes").read_text())
    return received_by_peer, sent_by_peer


def _link_ends(host: Host, nic: str) -> tuple[tuple[list[str], str], ...]:
    """(the ``tc`` command, the device) for each end of ``host``'s ``nic``: root end, host end."""
    return (
        (["tc"], host.root_device(nic)),
        (["ip", "netns", "exec", host.name, "tc"], NETWORKS[nic].host_device),
    )


def list_namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()]


def down() -> None:
    """Remove every test host (ours by name), killing what still runs in them, and the bridge.

    Safe to call at any time, repeatedly, and after a crash. FUSE mounts and glusterd are not
    this module's business (``gluster.py`` cleans those up first).
    """
    ours = [name for name in list_namespaces() if name.startswith(f"{PREFIX}-h")]
    for name in ours:
        _kill_all(namespace_pids(name))
    # Delete the links explicitly: a deleted namespace is destroyed asynchronously, and its
    # veth pair would linger in the root namespace meanwhile (blocking the next ``up``).
    for device in _our_root_devices():
        subprocess.run(["ip", "link", "del", device], capture_output=True)
    for name in ours:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for network in NETWORKS.values():
        subprocess.run(["ip", "link", "del", network.bridge], capture_output=True)
    deadline = time.monotonic() + 30
    while _our_root_devices():
        if time.monotonic() > deadline:
            raise RuntimeError(f"links {_our_root_devices()} survive their deletion")
        time.sleep(0.1)


def _our_root_devices() -> list[str]:
    prefixes = tuple(network.root_prefix for network in NETWORKS.values())
    return [name for name in os.listdir("/sys/class/net") if name.startswith(prefixes)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    while time.monotonic() < deadline and any(_is_running(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_reachable(address: str, *, timeout_s: float = 120.0) -> None:
    """Wait until ``address`` answers from the root namespace: a TCP connect to a closed port
    is refused (RST) once the link is up, and times out while it is not. ``timeout_s`` is a
    hang guard: a new link answers within a second on an idle machine."""
    deadline = time.monotonic() + timeout_s
    while not answers(address):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not reachable in {timeout_s} s")
        time.sleep(0.05)


def answers(address: str, *, timeout_s: float = 1.0) -> bool:
    """Whether ``address`` answers one TCP connect from the root namespace within
    ``timeout_s`` (refused counts: something answered); a cut link does not."""
    with socket.socket() as sock:
        sock.settimeout(timeout_s)  # one try; a loaded machine answers late, not never
        try:
            sock.connect((address, 9))  # discard: nothing listens there
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return True  # something listens: reachable all the same


def _run(argv: Sequence[str], *, timeout_s: float = 60.0) -> str:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}"
        )
    return result.stdout
