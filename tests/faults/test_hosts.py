"""The test-hosts harness itself: separate addresses, links that can be cut and capped."""

from __future__ import annotations

import socket
import subprocess
import time

from tests.faults import hosts

WAIT_TIMEOUT_S = 120.0  # a hang guard: the echo server's start, the transfer
ECHO = (
    "import socket,sys; s=socket.create_server(('0.0.0.0', 7000)); c,_=s.accept(); "
    "n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nc.sendall(str(n).encode())"
)


def test_every_host_has_its_own_address_and_reaches_the_others(test_hosts) -> None:
    first, *others = test_hosts.hosts
    assert [h.address for h in test_hosts.hosts] == [
        f"10.77.0.{i + 1}" for i in range(len(test_hosts.hosts))
    ]
    for host in others:
        out = first.run(["ip", "-4", "-o", "addr", "show", hosts.HOST_DEVICE])
        assert first.address in out and host.address not in out
        hosts.wait_reachable(host.address)


def test_a_cut_link_isolates_the_host_until_restored(test_hosts) -> None:
    host = test_hosts.hosts[3]
    test_hosts.set_link_up(host, False)
    try:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            try:
                sock.connect((host.address, 9))
                reached = True
            except ConnectionRefusedError:
                reached = True
            except OSError:
                reached = False
        assert not reached, f"{host.name} answered with its link down"
    finally:
        test_hosts.set_link_up(host, True)
    hosts.wait_reachable(host.address)


def test_a_rate_cap_holds_the_link_to_its_rate(test_hosts) -> None:
    """The cap is set on both ends of the link and nothing gets through faster. No lower bound
    on the measured rate: a loaded machine may move less than the cap."""
    host = test_hosts.hosts[2]
    num_bytes = 2_000_000  # 16 Mbit: ~2 s at 8 Mbit/s
    server = host.popen(["python3", "-c", ECHO], stdout=subprocess.PIPE)
    try:
        test_hosts.shape(host, rate_mbit=8)
        assert test_hosts.rate_caps_bytes_per_s(host) == [8e6 / 8] * 2
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection((host.address, 7000), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        sock.settimeout(WAIT_TIMEOUT_S)
        start_s = time.monotonic()
        with sock:
            sock.sendall(bytes(num_bytes))
            sock.shutdown(socket.SHUT_WR)
            assert int(sock.recv(64)) == num_bytes
        elapsed_s = time.monotonic() - start_s
    finally:
        test_hosts.unshape(host)
        server.kill()
        server.wait()
    assert test_hosts.rate_caps_bytes_per_s(host) == [None, None]
    rate_mbit = num_bytes * 8 / elapsed_s / 1e6
    assert rate_mbit < 10, f"{rate_mbit:.1f} Mbit/s through an 8 Mbit/s cap"
