"""The one place where units are converted (see STYLE.md, "Units live in names").

Names carry units: ``_bytes``, ``_s``, ``_gbps`` (1e9 bit/s, how NICs are rated), ``_gb``
(1e9 bytes), ``_gib`` (2**30 bytes), ``_bytes_per_s``.
"""

from __future__ import annotations

BITS_PER_BYTE = 8
GB = 1_000_000_000
GIB = 1 << 30
MIB = 1 << 20


def gbps_to_bytes_per_s(rate_gbps: float) -> float:
    """A link rate in 1e9 bit/s as bytes per second."""
    return rate_gbps * 1e9 / BITS_PER_BYTE


def bytes_per_s_to_gbps(rate_bytes_per_s: float) -> float:
    return rate_bytes_per_s * BITS_PER_BYTE / 1e9


def gb_to_bytes(size_gb: float) -> int:
    return int(size_gb * GB)
