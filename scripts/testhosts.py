"""Build or remove the test hosts (network namespaces on one bridge); needs root.

python scripts/testhosts.py up [--hosts 4] [--storage-hosts 2] [--gluster]
python scripts/testhosts.py status
python scripts/testhosts.py down     # also unmounts and stops the GlusterFS test volume
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dualpath.testbed import gluster, hosts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument(
        "--hosts", type=int, default=4, help="hosts for the cluster's processes (default 4)"
    )
    parser.add_argument(
        "--storage-hosts",
        type=int,
        default=2,
        help="hosts for the store's servers, the GlusterFS bricks (default 2)",
    )
    parser.add_argument(
        "--gluster",
        action="store_true",
        help="with up: a GlusterFS volume with a brick on every storage host, mounted on every "
        "other host over the storage network",
    )
    args = parser.parse_args()
    test_hosts = hosts.TestHosts(args.hosts, args.storage_hosts)
    if args.action == "up":
        hosts.check_hosts_possible()
        test_hosts.up()
        if args.gluster:
            gluster.check_gluster_possible()
            volume = gluster.GlusterVolume(
                brick_hosts=test_hosts.storage_hosts, client_hosts=test_hosts.hosts
            ).create()
            for host in test_hosts.hosts:
                print(f"{host.name}: {volume.mount_point(host)}")
    elif args.action == "down":
        gluster.cleanup()
        hosts.down()
    print(json.dumps(test_hosts.status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
