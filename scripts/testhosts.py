"""Build or remove the test hosts (network namespaces on one bridge); needs root.

python scripts/testhosts.py up [--hosts 4]
python scripts/testhosts.py status
python scripts/testhosts.py down     # also unmounts and stops the GlusterFS test volume
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults import gluster, hosts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--hosts", type=int, default=4, help="number of hosts (default 4)")
    parser.add_argument(
        "--gluster",
        action="store_true",
        help="with up: a GlusterFS volume with bricks on hosts 1 and 2, mounted on every host",
    )
    args = parser.parse_args()
    test_hosts = hosts.TestHosts(args.hosts)
    if args.action == "up":
        hosts.check_hosts_possible()
        test_hosts.up()
        if args.gluster:
            gluster.check_gluster_possible()
            every = test_hosts.hosts
            volume = gluster.GlusterVolume(brick_hosts=every[1:3], client_hosts=every).create()
            for host in every:
                print(f"{host.name}: {volume.mount_point(host)}")
    elif args.action == "down":
        gluster.cleanup()
        hosts.down()
    print(json.dumps(test_hosts.status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
