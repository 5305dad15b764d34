"""Fixtures for the fault tests: test hosts (network namespaces), a GlusterFS volume on them
(bricks on two storage hosts, mounted on the four hosts the clusters run on).

Run with ``make test-faults`` (root; installs glusterfs-server). The default ``make test``
excludes these tests (the ``faults`` marker). Without root or network namespaces they skip,
saying why; a missing GlusterFS install is an error, not a skip.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dualpath.testbed import gluster, hosts


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in item.nodeid:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def test_hosts() -> Iterator[hosts.TestHosts]:
    try:
        hosts.check_hosts_possible()
    except hosts.HostsUnavailable as exc:
        pytest.skip(str(exc))
    with hosts.TestHosts(4) as built:
        yield built


@pytest.fixture(scope="session")
def gluster_volume(test_hosts: hosts.TestHosts) -> Iterator[gluster.GlusterVolume]:
    gluster.check_gluster_possible()
    with gluster.GlusterVolume(
        brick_hosts=test_hosts.storage_hosts, client_hosts=test_hosts.hosts
    ) as volume:
        yield volume
