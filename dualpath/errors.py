"""One exception tree for dualpath, grouped by failure domain.

Library code raises the most specific class; I/O errors from lower libraries are translated
once, where the call happens (``raise ... from exc``). The server maps these classes to HTTP
statuses in one place. Plain bad input raises ``ValueError`` (not a ``DualPathError``), and a
caller bug raises ``RuntimeError`` that says so.
"""

from __future__ import annotations

import errno


class DualPathError(Exception):
    """Base of every error dualpath raises on purpose."""


class CheckpointError(DualPathError):
    """A model checkpoint directory is missing, incomplete or malformed."""


class KVStoreError(DualPathError):
    """The KV-cache store could not serve or accept a block."""


class BlockNotFound(KVStoreError):
    """The block is not in the store (never written, evicted, or removed)."""


class CorruptBlock(KVStoreError):
    """The block file exists but fails its header or checksum check; it has been dropped."""


class StorageTimeout(KVStoreError):
    """A store operation did not finish within its timeout."""


class StoreWriteError(KVStoreError):
    """A block could not be written (disk full, permissions, I/O error); nothing was stored."""


class TransferError(DualPathError):
    """Moving KV between engines failed. ``peer_name``: the engine the transfer was with,
    where the transport knows it."""

    peer_name: str | None = None


class PeerUnavailable(TransferError):
    """The peer engine is gone or does not answer."""


class TransferTimeout(TransferError):
    """A transfer did not complete within its timeout."""


class ClusterUnavailable(DualPathError):
    """The cluster cannot serve a request now: no live engine of a role, or no scheduler."""


class CalibrationError(DualPathError):
    """A benchmark's calibration run could not fix its link caps: the settings it ran with
    (the engines' KV memory, the workload) do not give the regime it calibrates for."""


# A file system (a network mount) whose servers this host cannot reach now: it may come back.
OUT_OF_REACH_ERRNOS = frozenset(
    {
        errno.ENOTCONN,  # a FUSE mount (GlusterFS) that lost its servers
        errno.ESTALE,  # NFS
        errno.ETIMEDOUT,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
    }
)


def is_out_of_reach(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is an ``OSError`` whose errno says
    the storage is out of reach rather than refused (permissions, a missing path, a full disk)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in OUT_OF_REACH_ERRNOS:
            return True
        exc = exc.__cause__
    return False
