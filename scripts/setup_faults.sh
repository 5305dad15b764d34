#!/usr/bin/env bash
# What the fault tests need beyond the Python environment (Debian, as root): iproute2 for the
# test hosts, util-linux for nsenter, and GlusterFS for the shared KV store. Idempotent.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
    echo "setup_faults.sh: run as root (network namespaces, mounts, glusterd)" >&2
    exit 1
fi
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v nsenter >/dev/null || missing+=(util-linux)
command -v glusterd >/dev/null || missing+=(glusterfs-server)
command -v mount.glusterfs >/dev/null || missing+=(glusterfs-client)
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
