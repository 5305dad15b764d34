"""A GlusterFS volume on the test hosts: bricks on the storage hosts, a FUSE mount on every
host, all of it spoken over the storage network (the hosts' storage addresses).

    volume = GlusterVolume(brick_hosts=[h4, h5], client_hosts=[h0, h1, h2, h3]).create()
    store_dir = volume.mount_point(h2)      # any POSIX path: give it to --kv-store
    volume.stop_brick(h1); volume.restore_bricks()
    volume.close()                          # or cleanup() after a crashed run

Needs Debian's ``glusterfs-server`` (``scripts/setup_faults.sh`` installs it). Each brick host
runs its own ``glusterd`` inside its network namespace, with a private ``/run``,
``/var/lib/glusterd`` and ``/var/log/glusterfs`` (bind mounts under ``STATE_DIR``), so several
"machines" share one file system without sharing gluster state. The volume is plain
distribute: each file lives on one brick, so a stopped brick takes its files away (the fault
the tests want to see) until it is restored.

The FUSE clients run in their host's network but mount into the root mount table, so processes
started in a host afterwards (``ip netns exec``) see the mount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree

from dualpath.testbed.hosts import Host, list_namespaces, namespace_pids

STATE_DIR = Path("/var/tmp/dualpath-gluster")  # per brick host: lib/, log/, brick/
MOUNT_DIR = Path("/mnt/dualpath-gluster")  # per host: <host name>/
VOLUME = "dpkv"
PING_TIMEOUT_S = 5
# The client's caching translators, turned off: each would answer some reads from the host.
CLIENT_CACHES = (
    "performance.io-cache",
    "performance.quick-read",
    "performance.read-ahead",
    "performance.stat-prefetch",
    "performance.open-behind",
)
_START_TIMEOUT_S = 120.0  # a hang guard for every wait here: each ends on what it waits for
# glusterd's parent: a child subreaper that reaps the bricks glusterd daemonizes. Without it they
# reparent to PID 1, which need not reap them, and glusterd takes a zombie brick for a live one
# (so `volume start force` would not restart it).
_REAPER = """
import ctypes, os, signal, subprocess, sys
ctypes.CDLL("libc.so.6").prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
while os.wait()[0] != child.pid:
    pass
"""


class GlusterUnavailable(RuntimeError):
    """GlusterFS is not installed, or FUSE is missing."""


def check_gluster_possible() -> None:
    for tool in ("glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None:
            raise GlusterUnavailable(
                f"{tool} not found: install glusterfs-server (scripts/setup_faults.sh)"
            )
    if not os.path.exists("/dev/fuse"):
        raise GlusterUnavailable("/dev/fuse is missing: no FUSE mounts possible")


class GlusterVolume:
    def __init__(self, brick_hosts: Sequence[Host], client_hosts: Sequence[Host]) -> None:
        if not brick_hosts:
            raise ValueError("a volume needs at least one brick host")
        self.brick_hosts = list(brick_hosts)
        self.client_hosts = list(client_hosts)
        self._host_name_to_glusterd: dict[str, subprocess.Popen] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def create(self) -> GlusterVolume:
        """Start glusterd on each brick host, make and start the volume, mount it everywhere."""
        cleanup()
        try:
            for host in self.brick_hosts:
                self._start_glusterd(host)
            first = self.brick_hosts[0]
            for host in self.brick_hosts[1:]:
                self.gluster("peer", "probe", host.storage_address)
                _wait_for(lambda h=host: self._is_peer_connected(h), "peer connected")
            bricks = [f"{h.storage_address}:{self.brick_dir(h)}" for h in self.brick_hosts]
            # force: the bricks sit on the root file system, which gluster warns about.
            self.gluster("volume", "create", VOLUME, *bricks, "force")
            # A client notices a dead server after this many seconds of silence; until then
            # its calls on the mount block (42 s by default: too long for serving).
            self.gluster("volume", "set", VOLUME, "network.ping-timeout", str(PING_TIMEOUT_S))
            # A store's reads cross the storage network, as on a cluster's file system: no
            # client-side cache may answer them (nor the kernel's page cache: ``_mount``).
            for cache in CLIENT_CACHES:
                self.gluster("volume", "set", VOLUME, cache, "off")
            self.gluster("volume", "start", VOLUME)
            for host in self.client_hosts:
                self._mount(host, first.storage_address)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        cleanup()
        for process in self._host_name_to_glusterd.values():
            process.wait(10)
        self._host_name_to_glusterd.clear()

    def __enter__(self) -> GlusterVolume:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths and commands --------------------------------------------------------------------

    def mount_point(self, host: Host) -> Path:
        return MOUNT_DIR / host.name

    def brick_dir(self, host: Host) -> Path:
        return STATE_DIR / host.name / "brick"

    def gluster(self, *args: str, timeout_s: float = 60.0) -> str:
        """Run the gluster CLI against the first brick host's glusterd (its namespaces)."""
        pid = self._host_name_to_glusterd[self.brick_hosts[0].name].pid
        argv = ["nsenter", "-t", str(pid), "-m", "-n", "gluster", "--mode=script", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(
                f"gluster {' '.join(args)} exited with {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()}"
            )
        return result.stdout

    # -- faults --------------------------------------------------------------------------------

    def brick_pid(self, host: Host) -> int | None:
        """The brick process on ``host``, or ``None`` if it is not online."""
        status = ElementTree.fromstring(self.gluster("volume", "status", VOLUME, "--xml"))
        for node in status.iter("node"):
            is_ours = node.findtext("hostname") == host.storage_address and node.findtext(
                "path"
            ) == str(self.brick_dir(host))
            if is_ours and node.findtext("status") == "1":
                return int(node.findtext("pid") or 0) or None
        return None

    def stop_brick(self, host: Host) -> None:
        """Kill ``host``'s brick process (as a crashed disk server would vanish)."""
        pid = self.brick_pid(host)
        if pid is None:
            raise RuntimeError(f"brick on {host.name} is not online")
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: self.brick_pid(host) is None, f"brick on {host.name} down")

    def restore_bricks(self) -> None:
        """Restart every dead brick and wait until all are online."""
        self.gluster("volume", "start", VOLUME, "force")
        _wait_for(
            lambda: all(self.brick_pid(h) is not None for h in self.brick_hosts), "bricks online"
        )

    # -- helpers -------------------------------------------------------------------------------

    def _start_glusterd(self, host: Host) -> None:
        state = STATE_DIR / host.name
        for name in ("lib", "log", "brick"):
            (state / name).mkdir(parents=True, exist_ok=True)
        script = (
            "mount -t tmpfs tmpfs /run && mkdir -p /run/gluster"
            f" && mount --bind {state / 'lib'} /var/lib/glusterd"
            f" && mount --bind {state / 'log'} /var/log/glusterfs"
            ' && exec "$0" -c "$1" glusterd -N'
        )
        argv = ["sh", "-c", script, sys.executable, _REAPER]
        with open(state / "glusterd.out", "ab") as out:
            process = host.popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self._host_name_to_glusterd[host.name] = process
        _wait_for(lambda: self._is_glusterd_answering(host, process), f"glusterd on {host.name}")

    def _is_glusterd_answering(self, host: Host, process: subprocess.Popen) -> bool:
        if process.poll() is not None:
            log = (STATE_DIR / host.name / "glusterd.out").read_text(errors="replace")
            raise RuntimeError(f"glusterd on {host.name} exited with {process.returncode}: {log}")
        argv = ["nsenter", "-t", str(process.pid), "-m", "-n", "gluster", "--mode=script",
                "pool", "list"]  # fmt: skip
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    def _is_peer_connected(self, host: Host) -> bool:
        status = self.gluster("peer", "status")
        return f"Hostname: {host.storage_address}" in status and "(Connected)" in status

    def _mount(self, host: Host, server_address: str) -> None:
        mount_point = self.mount_point(host)
        mount_point.mkdir(parents=True, exist_ok=True)
        # direct-io-mode: every read goes to the bricks, none to the kernel's page cache.
        options = ["-o", "direct-io-mode=enable"]
        source = f"{server_address}:/{VOLUME}"
        argv = host.net_only_argv(["mount", "-t", "glusterfs", *options, source, str(mount_point)])
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if result.returncode != 0 or not os.path.ismount(mount_point):
            raise RuntimeError(f"mounting {VOLUME} on {host.name} failed: {result.stderr.strip()}")


def cleanup() -> None:
    """Unmount every test mount and stop every gluster process in the test hosts; idempotent."""
    for mount_point in _our_mounts():
        subprocess.run(["umount", "-l", mount_point], capture_output=True)
    for name in list_namespaces():
        if name.startswith("dp-h"):
            _kill_gluster_processes(namespace_pids(name))
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(STATE_DIR)


def _our_mounts() -> list[str]:
    prefix = str(MOUNT_DIR) + "/"
    with open("/proc/mounts") as mounts:
        targets = [line.split()[1] for line in mounts]
    return sorted((t for t in targets if t.startswith(prefix)), reverse=True)


def _kill_gluster_processes(pids: list[int]) -> None:
    doomed = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("gluster"):
            doomed.append(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: not any(_is_alive(p) for p in doomed), "gluster stopped")


def _is_alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(condition, what: str, timeout_s: float = _START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached in {timeout_s} s")
        time.sleep(0.1)
