"""Test hosts: network namespaces on one machine, each with its own address, on one bridge.

    python scripts/testhosts.py up      # 4 hosts: dp-h0 10.77.0.1 ... dp-h3 10.77.0.4
    python scripts/testhosts.py status
    python scripts/testhosts.py down    # idempotent; also cleans up after a crashed run

Layout (root namespace on the left, one namespace per host on the right)::

    dpbr0 10.77.0.254 ─┬─ dpv-h0 ══ veth ══ dp0 10.77.0.1   (netns dp-h0)
                       ├─ dpv-h1 ══ veth ══ dp0 10.77.0.2   (netns dp-h1)
                       └─ ...

Every host's interface is called ``dp0``, so ``UCX_NET_DEVICES=dp0`` fits all of them. The root
namespace has an address on the bridge, so tests can talk to any host directly. A link can be
cut (``set_link_up``) and shaped on both directions (``shape``: a ``tbf`` rate cap; ``netem``
delay only where the kernel has it). Needs root and ``ip``/``tc`` (iproute2).

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

PREFIX = "dp"
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.77.0"  # /24: host i is .(i+1), the bridge is .254
BRIDGE_ADDRESS = f"{SUBNET}.254"
HOST_DEVICE = f"{PREFIX}0"  # the interface's name inside every host
_KILL_GRACE_S = 3.0


class HostsUnavailable(RuntimeError):
    """This machine cannot build test hosts (not root, or no network namespaces)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One test host: a network namespace with one veth link to the bridge."""

    index: int

    @property
    def name(self) -> str:
        return f"{PREFIX}-h{self.index}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index + 1}"

    @property
    def root_device(self) -> str:
        """The link's end in the root namespace (on the bridge)."""
        return f"{PREFIX}v-h{self.index}"

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
    """``num_hosts`` hosts on one bridge. ``up`` first tears down leftovers of a crashed run."""

    __test__ = False  # not a pytest test class

    def __init__(self, num_hosts: int = 4) -> None:
        if not 1 <= num_hosts <= 16:
            raise ValueError(f"num_hosts must be in 1..16, got {num_hosts}")
        self.hosts = [Host(i) for i in range(num_hosts)]

    def up(self) -> TestHosts:
        down()
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for host in self.hosts:
            _run(["ip", "netns", "add", host.name])
            _run(["ip", "link", "add", host.root_device, "type", "veth",
                  "peer", "name", HOST_DEVICE, "netns", host.name])  # fmt: skip
            _run(["ip", "link", "set", host.root_device, "master", BRIDGE, "up"])
            _run(["ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", HOST_DEVICE])
            _run(["ip", "-n", host.name, "link", "set", HOST_DEVICE, "up"])
            _run(["ip", "-n", host.name, "link", "set", "lo", "up"])
        for host in self.hosts:
            wait_reachable(host.address)
        return self

    def down(self) -> None:
        down()

    def __enter__(self) -> TestHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def set_link_up(self, host: Host, is_up: bool) -> None:
        """Connect or cut ``host`` off the bridge (its link's root end)."""
        _run(["ip", "link", "set", host.root_device, "up" if is_up else "down"])

    def shape(self, host: Host, *, rate_mbit: float | None = None, delay_ms: float = 0.0) -> None:
        """Cap both directions of ``host``'s link at ``rate_mbit`` (``tbf``), or delay them by
        ``delay_ms`` (``netem``, which not every kernel has: ``RuntimeError`` then)."""
        for argv_prefix, device in _link_ends(host):
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

    def unshape(self, host: Host) -> None:
        for argv_prefix, device in _link_ends(host):
            subprocess.run([*argv_prefix, "qdisc", "del", "dev", device, "root"],
                           capture_output=True)  # fmt: skip

    def rate_caps_bytes_per_s(self, host: Host) -> list[float | None]:
        """The ``tbf`` rate of each end of ``host``'s link (root end first), as the kernel
        has it; None for an end without one."""
        caps: list[float | None] = []
        for argv_prefix, device in _link_ends(host):
            qdiscs = json.loads(_run([*argv_prefix, "-j", "qdisc", "show", "dev", device, "root"]))
            tbf = [q for q in qdiscs if q.get("kind") == "tbf"]
            caps.append(float(tbf[0]["options"]["rate"]) if tbf else None)
        return caps

    def status(self) -> list[dict[str, object]]:
        existing = set(list_namespaces())
        return [
            {
                "host": host.name,
                "address": host.address,
                "exists": host.name in existing,
                "pids": namespace_pids(host.name) if host.name in existing else [],
            }
            for host in self.hosts
        ]


def _link_ends(host: Host) -> tuple[tuple[list[str], str], ...]:
    """(the ``tc`` command, the device) for each end of ``host``'s link: root end, host end."""
    return (
        (["tc"], host.root_device),
        (["ip", "netns", "exec", host.name, "tc"], HOST_DEVICE),
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
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    deadline = time.monotonic() + 30
    while _our_root_devices():
        if time.monotonic() > deadline:
            raise RuntimeError(f"links {_our_root_devices()} survive their deletion")
        time.sleep(0.1)


def _our_root_devices() -> list[str]:
    prefix = f"{PREFIX}v-h"
    return [name for name in os.listdir("/sys/class/net") if name.startswith(prefix)]


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
    while not _is_refused(address):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not reachable in {timeout_s} s")
        time.sleep(0.05)


def _is_refused(address: str) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)  # one try; a loaded machine answers late, not never
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
