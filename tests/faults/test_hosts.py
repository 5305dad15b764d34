"""The test-hosts harness itself: two networks per host with their own addresses, hosts that
can be cut off, NICs capped one by one, and the kernel's counters of each NIC's bytes."""

from __future__ import annotations

import socket
import subprocess
import time

from dualpath.testbed import hosts
from dualpath.testbed.hosts import COMPUTE, NICS, STORAGE

WAIT_TIMEOUT_S = 120.0  # a hang guard: the echo server's start, the transfer
ECHO = (
    "import socket,sys; s=socket.create_server(('0.0.0.0', 7000)); c,_=s.accept(); "
    "n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nc.sendall(str(n).encode())"
)


def test_every_host_has_an_address_on_each_network_and_reaches_the_others(test_hosts) -> None:
    every = test_hosts.every_host
    assert [h.address for h in every] == [f"10.77.0.{i + 1}" for i in range(len(every))]
    assert [h.storage_address for h in every] == [f"10.78.0.{i + 1}" for i in range(len(every))]
    first = every[0]
    for nic in NICS:
        out = first.run(["ip", "-4", "-o", "addr", "show", hosts.NETWORKS[nic].host_device])
        assert first.address_on(nic) in out
        for host in every[1:]:
            assert host.address_on(nic) not in out
            hosts.wait_reachable(host.address_on(nic))


def test_a_cut_off_host_is_isolated_on_both_networks_until_restored(test_hosts) -> None:
    host = test_hosts.hosts[3]
    test_hosts.set_link_up(host, False)
    try:
        for nic in NICS:
            is_answered = hosts.answers(host.address_on(nic), timeout_s=0.5)
            assert not is_answered, f"{host.name} answered on its {nic} NIC"
    finally:
        test_hosts.set_link_up(host, True)
    for nic in NICS:
        hosts.wait_reachable(host.address_on(nic))


def test_a_rate_cap_holds_the_nic_to_its_rate_and_the_counters_see_its_bytes(test_hosts) -> None:
    """The cap is set on both ends of the storage NIC and nothing gets through faster; the
    bytes cross that NIC, not the compute one, by the kernel's counters. No lower bound on the
    measured rate: a loaded machine may move less than the cap."""
    host = test_hosts.hosts[2]
    num_bytes = 2_000_000  # 16 Mbit: ~2 s at 8 Mbit/s
    server = host.popen(["python3", "-c", ECHO], stdout=subprocess.PIPE)
    try:
        test_hosts.shape(host, rate_mbit=8, nic=STORAGE)
        assert test_hosts.rate_caps_bytes_per_s(host, STORAGE) == [8e6 / 8] * 2
        assert test_hosts.rate_caps_bytes_per_s(host, COMPUTE) == [None, None]
        sock = _connect(host.storage_address, 7000)
        before = {nic: hosts.nic_bytes(host, nic) for nic in NICS}
        start_s = time.monotonic()
        with sock:
            sock.sendall(bytes(num_bytes))
            sock.shutdown(socket.SHUT_WR)
            assert int(sock.recv(64)) == num_bytes
        elapsed_s = time.monotonic() - start_s
        after = {nic: hosts.nic_bytes(host, nic) for nic in NICS}
    finally:
        test_hosts.unshape(host, STORAGE)
        server.kill()
        server.wait()
    assert test_hosts.rate_caps_bytes_per_s(host, STORAGE) == [None, None]
    rate_mbit = num_bytes * 8 / elapsed_s / 1e6
    assert rate_mbit < 10, f"{rate_mbit:.1f} Mbit/s through an 8 Mbit/s cap"
    received = {nic: after[nic][1] - before[nic][1] for nic in NICS}
    # The payload plus its TCP/IP headers (about 3% at a 1500-byte MTU) on the storage NIC.
    assert num_bytes <= received[STORAGE] < num_bytes * 1.1, received
    assert received[COMPUTE] < num_bytes / 100, received


def _connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=10)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        sock.settimeout(WAIT_TIMEOUT_S)
        return sock
