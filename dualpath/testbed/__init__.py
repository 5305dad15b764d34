"""Test hosts on one machine: network namespaces, each with a storage NIC and a compute NIC on
bridges of their own, links the kernel shapes (``tc``), and a GlusterFS volume whose bricks sit
on storage hosts. Needs root; ``hosts.check_hosts_possible`` says why not in one line."""
